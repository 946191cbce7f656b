// The decisions of a MoE layer call in C (src/moe_policy.h): the slot cache and the CPU share.
enum hy_policy { HY_POLICY_LRU, HY_POLICY_LFU, HY_POLICY_FREQ, HY_POLICY_N };

typedef struct hy_cache_counters {
    int64_t calls, distinct, hits, misses, evictions, rounds, invalidated;
} hy_cache_counters;

typedef struct hy_plan {
    int n_rounds;
    int n_hits;
    int32_t * hit_expert;
    int32_t * hit_slot;
    int n_loads;
    int32_t * load_expert;
    int32_t * load_slot;
    int32_t * load_round;
    int n_evicted;
    int32_t * evicted_expert;
    int32_t * evicted_round;
} hy_plan;

typedef struct hy_slot_cache {
    int n_experts, n_slots, policy;
    int32_t * slot_expert;  /* read by moe/residency.py: what each slot holds, */
    int64_t * requests;     /* the calls that asked for each expert, */
    int32_t * uncommitted;  /* and the loads not yet committed */
    hy_cache_counters counters;
    hy_plan plan;
    ...;
} hy_slot_cache;

hy_slot_cache * hy_cache_new(int n_experts, int n_slots, int policy);
void hy_cache_free(hy_slot_cache * c);
const hy_plan * hy_cache_plan(hy_slot_cache * c, const int32_t * experts, const int32_t * rows, int n,
        bool deferred_loads);
void hy_cache_commit(hy_slot_cache * c, int slot, int expert);
void hy_cache_note_cpu(hy_slot_cache * c, const int32_t * experts, int n);
int hy_cache_slot_of(const hy_slot_cache * c, int expert);
int hy_cache_prefetch(hy_slot_cache * c, int expert, const uint8_t * keep, int * evicted);

int hy_n_cpu_for_share(uint64_t num, uint64_t den, int n);

enum hy_cost_coef { HY_COST_CPU_PER_BYTE, HY_COST_CPU_PER_ROW, HY_COST_LOAD_PER_BYTE, HY_COST_DEVICE_PER_ROW,
                    HY_COST_CPU_PER_JOB, HY_COST_N };

typedef struct hy_cost_model {
    int64_t n_cpu, n_load, n_dev, n_job;
    bool has_share;
    int64_t share_num, share_den;
    double round_s;
    ...;
} hy_cost_model;

void hy_cost_init(hy_cost_model * m, double alpha, double hysteresis, const double prior[5]);
void hy_cost_init_fixed(hy_cost_model * m, double hysteresis, const double coef[]);
void hy_cost_observe_cpu(hy_cost_model * m, double bytes, double rows, double seconds);
void hy_cost_observe_job(hy_cost_model * m, double seconds);
void hy_cost_observe_load(hy_cost_model * m, double bytes, double seconds);
void hy_cost_observe_device(hy_cost_model * m, double rows, double seconds);
void hy_cost_estimate(const hy_cost_model * m, int64_t expert_bytes, double out[]);
double hy_cost_round(const hy_cost_model * m, int64_t expert_bytes);
int hy_cost_choose(hy_cost_model * m, int64_t expert_bytes, int64_t hit_rows, const int32_t * miss_rows, int n_miss);
int hy_cost_choose_rounds(hy_cost_model * m, int64_t expert_bytes, int64_t hit_rows, int n_hits, int n_slots,
        const int32_t * miss_rows, int n_miss);
int hy_cost_rounds(int n_hits, int n_loads, int n_slots);
int hy_split_misses(const hy_slot_cache * cache, const int32_t * experts, const int32_t * rows, int n,
        const int32_t * n_cpu_table, hy_cost_model * model, int64_t expert_bytes,
        int32_t * miss_expert, int32_t * miss_rows, int * n_miss);
