// Declared in src/hybrid.h, defined in src/hybrid.c (compiled into the module with GGML).
#define GGML_HYBRID_SCHED_MAX_BACKENDS ...
#define GGML_HYBRID_MAX_INSTANCES ...

// What the module was built from.
const char * ggml_hybrid_ggml_version(void);
const char * ggml_hybrid_patch_hash(void);
const char * ggml_hybrid_source_hash(void);
const char * ggml_hybrid_abi(void);
// The ABI stamp of the ggml-base library actually loaded (vendor/CMakeLists.txt compiles it in).
const char * ggml_hybrid_base_abi(void);

// The CPU backend through GGML's registry: a portable build picks one of several CPU libraries at run time.
int ggml_hybrid_load_cpu(const char * lib_dir);
ggml_backend_t ggml_hybrid_cpu_init(void);
bool ggml_hybrid_is_cpu(ggml_backend_t backend);
void ggml_hybrid_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
ggml_threadpool_t ggml_hybrid_threadpool_new(struct ggml_threadpool_params * params);
void ggml_hybrid_threadpool_free(ggml_threadpool_t threadpool);
void ggml_hybrid_cpu_set_threadpool(ggml_backend_t backend, ggml_threadpool_t threadpool);
const char * ggml_hybrid_cpu_features(void);

// Optional backends (CUDA, ...): libraries loaded at run time if built against this ggml-base.
const char * ggml_hybrid_reg_path(ggml_backend_reg_t reg);
ggml_backend_reg_t ggml_hybrid_backend_load(const char * path, char * err, size_t n_err);
const char * ggml_hybrid_backend_load_log(void);

// Graph accessors over ggml-impl.h.
int ggml_hybrid_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * ggml_hybrid_graph_leaf(struct ggml_cgraph * g, int i);
bool ggml_hybrid_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int ggml_hybrid_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
        const uintptr_t * pools, int n_pools);

// A CPU backend with its own device and buffer-type identity: plays a separate device.
ggml_backend_t ggml_hybrid_cpu_instance(int index);

// GGML's log messages to stderr but for debug ones (GGML's default prints all).
void ggml_hybrid_log_quiet(void);

// GGML's CPU extra buffer types (weights repacked for faster kernels), NULL-terminated; whether a buffer's
// tensors can be read back (repacked ones cannot).
ggml_backend_buffer_type_t * ggml_hybrid_cpu_extra_bufts(void);
bool ggml_hybrid_buffer_readable(ggml_backend_buffer_t buf);

// One compute with every input set and one result read in the same call (a decode step).
struct ggml_hybrid_io {
    struct ggml_tensor * tensor;
    void * data;
    size_t size;
};
enum ggml_status ggml_hybrid_sched_step(ggml_backend_sched_t sched, struct ggml_cgraph * graph,
        const struct ggml_hybrid_io * in, int n_in, struct ggml_tensor * out, void * out_data, size_t out_size,
        int * bad);
