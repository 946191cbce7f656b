// Declared in src/hybrid.h, defined in src/hybrid.c (compiled into the module with GGML).
#define GGML_HYBRID_SCHED_MAX_BACKENDS ...
#define GGML_HYBRID_MAX_INSTANCES ...

// What the module was built from.
const char * ggml_hybrid_ggml_version(void);
const char * ggml_hybrid_patch_hash(void);
const char * ggml_hybrid_source_hash(void);
int ggml_hybrid_has_cuda(void);

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

// CUDA entry points: NULL / 0 when the CUDA backend is not compiled in.
ggml_backend_t ggml_hybrid_cuda_init(int device);
int ggml_hybrid_cuda_device_count(void);
