// Graph-region replacement, added to ggml-backend.h by vendor/patches/0002-sched-graph-regions.patch.
#define GGML_SCHED_REGION_DONE ...
#define GGML_SCHED_REGION_DECLINE ...

enum ggml_sched_region_status {
    GGML_SCHED_REGION_OK, GGML_SCHED_REGION_ERR_OPEN, GGML_SCHED_REGION_ERR_OVERLAP,
    GGML_SCHED_REGION_ERR_NOT_IN_GRAPH, GGML_SCHED_REGION_ERR_CONTIGUITY, GGML_SCHED_REGION_ERR_UNSUPPORTED,
    GGML_SCHED_REGION_ERR_EMPTY, GGML_SCHED_REGION_ERR_EXECUTOR, ...
};

typedef int (*ggml_backend_sched_region_exec_t)(int region_id, ggml_backend_t backend,
        struct ggml_tensor * const * inputs, int n_inputs, struct ggml_tensor * const * outputs, int n_outputs,
        void * user_data);

int ggml_backend_sched_add_region(ggml_backend_sched_t sched, struct ggml_tensor * const * inputs, int n_inputs,
        struct ggml_tensor * const * outputs, int n_outputs, ggml_backend_t backend,
        ggml_backend_sched_region_exec_t exec, void * user_data);
void ggml_backend_sched_clear_regions(ggml_backend_sched_t sched);
enum ggml_status ggml_backend_sched_compute_region_nodes(ggml_backend_sched_t sched, int region_id);
enum ggml_sched_region_status ggml_backend_sched_check_regions(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
enum ggml_sched_region_status ggml_backend_sched_get_region_status(ggml_backend_sched_t sched, int * region_id,
        const char ** message);
void ggml_backend_sched_get_split(ggml_backend_sched_t sched, int i_split, int * backend_id, int * region_id,
        int * n_nodes, int * n_inputs);
struct ggml_tensor * ggml_backend_sched_get_split_node(ggml_backend_sched_t sched, int i_split, int i_node);

extern "Python" int _hy_region_exec(int region_id, ggml_backend_t backend,
        struct ggml_tensor * const * inputs, int n_inputs, struct ggml_tensor * const * outputs, int n_outputs,
        void * user_data);
