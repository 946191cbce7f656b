// Defined by build.py in the extension's C source: what the module was built from.
const char * ggml_hybrid_ggml_version(void);
const char * ggml_hybrid_patch_hash(void);
const char * ggml_hybrid_cdef_hash(void);
int ggml_hybrid_has_cuda(void);

// Graph accessors defined in the extension source over ggml-impl.h.
int ggml_hybrid_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * ggml_hybrid_graph_leaf(struct ggml_cgraph * g, int i);
bool ggml_hybrid_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int ggml_hybrid_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
        const uintptr_t * pools, int n_pools);

// A CPU backend with its own device and buffer-type identity (index 0..15): plays a separate device.
ggml_backend_t ggml_hybrid_cpu_instance(int index);
