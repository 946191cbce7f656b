// The native MoE layer executor (src/moe_graphs.h, src/moe_worker.h, src/moe_exec.h).
typedef struct hy_experts {
    struct ggml_tensor * gate_up, * gate, * up, * down;
    struct ggml_tensor * gate_b, * up_b, * down_b;
} hy_experts;

int hy_row_bucket(int n);

typedef struct hy_scratch {
    size_t size;
    uint64_t epoch;
    ...;
} hy_scratch;
hy_scratch * hy_scratch_new(ggml_backend_buffer_type_t buft);
void hy_scratch_free(hy_scratch * s);

typedef struct hy_worker {
    int fail_next;
    int64_t jobs;
    ...;
} hy_worker;
hy_worker * hy_worker_new(int n_threads);
void hy_worker_free(hy_worker * w);
int64_t hy_worker_graph_builds(const hy_worker * w);
// One job handed to the worker directly (benchmarks and tests; the executor builds its own).
typedef struct hy_job {
    const hy_experts * w;
    const void * key;
    enum ggml_glu_op glu;
    int n_expert, n_embd;
    int n;
    const float * x;
    const int32_t * ids;
    float * out;
    int status;
    int64_t t_submit, t_start, t_end;
    ...;
} hy_job;
void hy_worker_submit(hy_worker * w, hy_job * job);
int hy_worker_wait(hy_worker * w);

enum { HY_OK, HY_ERR_FILE, HY_ERR_COMPUTE, HY_ERR_ALLOC, HY_ERR_WORKER, HY_ERR_INJECTED, HY_ERR_INPUT };
enum { HY_SHARE_NONE, HY_SHARE_FIXED, HY_SHARE_AUTO };
enum hy_load_mode { HY_LOAD_COPY, HY_LOAD_STAGED, HY_LOAD_QUEUED, HY_LOAD_N };
enum hy_exec_mode { HY_MODE_SLOTS, HY_MODE_TIER, HY_MODE_DIRECT, HY_MODE_N };
#define HY_STEP_N ...
int hy_moe_exec_steps(int mode, const uint8_t ** steps);
const char * hy_moe_exec_step_name(int step);

typedef struct hy_moe_counters {
    int64_t calls, routed, distinct, hits, misses, bytes_loaded, evictions, rounds;
    int64_t device_ns, load_ns, compute_ns;
    int64_t cpu_misses, cpu_rows, cpu_ns, overlap_ns, share_calls;
    double share_sum;
    int64_t bytes_staged, staging_wait_ns, invalidated;
    int64_t predicted, predicted_right, predicted_of, prefetched, prefetch_used, prefetch_wasted;
    int64_t bytes_prefetched, prefetch_ns;
} hy_moe_counters;

typedef struct hy_moe_config {
    int layer;
    int n_expert, n_used, n_embd;
    int n_slots, policy;
    int glu;
    hy_experts slots;
    hy_experts host;
    int n_kinds;
    struct ggml_tensor * slot_tensor[6];
    const uint8_t * src[6];
    size_t nbytes[6];
    ggml_backend_t device;
    hy_scratch * scratch;
    hy_worker * worker;
    int share_mode;
    const int32_t * n_cpu_table;
    double alpha, hysteresis;
    double round_s;
    int remote_cpu;
    double prior[5];
    int fixed_model;
    double coef[5];
    int synthetic_clock;
    double clock[5];
    int fd;
    int64_t file_id[4];
    int map_guard;
    int staging;
    int trace;
    int64_t * trace_seq;
    const int32_t * route;
    int64_t n_route;
    hy_tier * tier;
    int tier_layer;
    int tier_direct;
} hy_moe_config;

typedef struct hy_moe_exec hy_moe_exec;
hy_moe_exec * hy_moe_exec_new(const hy_moe_config * cfg);
void hy_moe_exec_free(hy_moe_exec * ex);
int hy_moe_exec_run(int region_id, ggml_backend_t backend, struct ggml_tensor * const * inputs, int n_inputs,
        struct ggml_tensor * const * outputs, int n_outputs, void * user_data);
const hy_moe_counters * hy_moe_exec_counters(const hy_moe_exec * ex);
hy_slot_cache * hy_moe_exec_cache(hy_moe_exec * ex);
hy_cost_model * hy_moe_exec_cost_model(hy_moe_exec * ex);
int hy_moe_exec_compacts(const hy_moe_exec * ex);
int hy_moe_exec_error(const hy_moe_exec * ex, const char ** message);
int hy_moe_exec_last_cpu(const hy_moe_exec * ex, const int32_t ** experts);
const int32_t * hy_moe_exec_trace(const hy_moe_exec * ex, int64_t * n_ints);
void hy_moe_exec_trace_take(hy_moe_exec * ex);
int64_t hy_moe_exec_graph_builds(const hy_moe_exec * ex);
int hy_moe_exec_load_mode(const hy_moe_exec * ex);
int hy_moe_exec_mode(const hy_moe_exec * ex);
void hy_moe_exec_plain_loads(hy_moe_exec * ex);
int hy_moe_exec_reserve(hy_moe_exec * ex, int n_tokens);
void hy_moe_exec_inject_load_failure(hy_moe_exec * ex, int after);
void hy_moe_exec_set_clock(hy_moe_exec * ex, const double clock[]);
void hy_moe_exec_set_prefetch(hy_moe_exec * ex, hy_moe_exec * next, const float * router, const float * router_bias,
        const float * select_bias, int max_experts, int max_tokens, int max_read_ahead);
int hy_moe_exec_predicted(const hy_moe_exec * ex, const int32_t ** experts);
