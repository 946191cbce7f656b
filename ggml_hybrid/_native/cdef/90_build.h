// Declared in src/buildinfo.h, cpu_backend.h, backend_loader.h, graph_access.h and sched_step.h, defined in the .c file
// of each name (compiled into the module with GGML).
#define HY_SCHED_MAX_BACKENDS ...
#define HY_MAX_INSTANCES ...

// What the module was built from.
const char * hy_ggml_version(void);
const char * hy_patch_hash(void);
const char * hy_source_hash(void);
const char * hy_abi(void);
// The ABI stamp of the ggml-base library actually loaded (vendor/CMakeLists.txt compiles it in).
const char * ggml_hybrid_base_abi(void);

// The CPU backend through GGML's registry: a portable build picks one of several CPU libraries at run time.
int hy_load_cpu(const char * lib_dir);
ggml_backend_t hy_cpu_init(void);
bool hy_is_cpu(ggml_backend_t backend);
void hy_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
ggml_threadpool_t hy_threadpool_new(struct ggml_threadpool_params * params);
void hy_threadpool_free(ggml_threadpool_t threadpool);
void hy_cpu_set_threadpool(ggml_backend_t backend, ggml_threadpool_t threadpool);
const char * hy_cpu_features(void);

// Optional backends (CUDA, ...): libraries loaded at run time if built against this ggml-base.
const char * hy_reg_path(ggml_backend_reg_t reg);
ggml_backend_reg_t hy_backend_load(const char * path, char * err, size_t n_err);
const char * hy_backend_load_log(void);

// Graph accessors over ggml-impl.h.
int hy_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i);
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int hy_graph_bare_leaf(struct ggml_cgraph * g);
void hy_sched_pin(ggml_backend_sched_t sched, struct ggml_tensor ** tensors, ggml_backend_t * backends, int n);
int hy_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
        const uintptr_t * pools, int n_pools);

// A CPU backend with its own device and buffer-type identity: plays a separate device.
ggml_backend_t hy_cpu_instance(int index);

// GGML's log messages to stderr but for debug ones (GGML's default prints all).
void hy_log_quiet(void);

// GGML's CPU extra buffer types (weights repacked for faster kernels), NULL-terminated; whether a buffer's
// tensors can be read back (repacked ones cannot).
ggml_backend_buffer_type_t * hy_cpu_extra_bufts(void);
bool hy_buffer_readable(ggml_backend_buffer_t buf);

// One compute with every input set and one result read in the same call (a decode step).
struct hy_io {
    struct ggml_tensor * tensor;
    void * data;
    size_t size;
};
enum ggml_status hy_sched_step(ggml_backend_sched_t sched, struct ggml_cgraph * graph,
        const struct hy_io * in, int n_in, struct ggml_tensor * out, void * out_data, size_t out_size,
        int * bad);
