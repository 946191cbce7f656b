/* The decisions of one MoE layer call, in C: which expert goes in which device slot (the slot cache),
   which misses the CPU computes (the CPU share, fixed or chosen by the cost model).

   A line-by-line port of ggml_hybrid/moe/slot_cache.py and ggml_hybrid/moe/cpu_share.py, which stay
   the specification and the reference: the tests drive both with the same calls and compare every
   decision. No GGML here, no allocation after creation. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

/* ---- slot cache -------------------------------------------------------------------------------- */

/* The eviction orders (the expert_eviction option: Python's names are these, lower-cased, enum_names), the slot
   cache's and the host tier's alike; slot_cache.py's docstring states them. */
enum hy_policy { HY_POLICY_LRU, HY_POLICY_LFU, HY_POLICY_FREQ, HY_POLICY_N };

typedef struct hy_cache_counters {
    int64_t calls, distinct, hits, misses, evictions, rounds, invalidated;
} hy_cache_counters;

/* one planned call: every list in round order; loads and evictions carry their round */
typedef struct hy_plan {
    int n_rounds;
    int n_hits;
    int32_t * hit_expert;   /* [n_slots] */
    int32_t * hit_slot;
    int n_loads;
    int32_t * load_expert;  /* [n_experts]: a call loads each requested expert at most once */
    int32_t * load_slot;
    int32_t * load_round;
    int n_evicted;
    int32_t * evicted_expert; /* [n_experts] */
    int32_t * evicted_round;
} hy_plan;

typedef struct hy_slot_cache {
    int n_experts, n_slots, policy;
    int32_t * slot_expert;  /* [n_slots]: -1 empty */
    int32_t * where;        /* [n_experts]: -1 not resident */
    int64_t * recency;      /* [n_experts] */
    int64_t * uses;         /* [n_experts] */
    int64_t * requests;     /* [n_experts]: calls that requested the expert (device or CPU), kept across evictions */
    int64_t * last_request; /* [n_experts]: the tick of the last of them */
    int32_t * uncommitted;  /* [n_slots]: the expert whose planned load is not yet committed, -1 none */
    int n_uncommitted;
    int64_t tick;
    hy_cache_counters counters;
    hy_plan plan;           /* the last call's plan */
    /* scratch of plan() */
    int32_t * s_hit_slots;  /* [n_slots] */
    int32_t * s_miss;       /* [n_experts] */
    int32_t * s_miss_rows;  /* [n_experts] */
    int32_t * s_cand;       /* [n_slots] */
    uint8_t * s_protected;  /* [n_slots] */
} hy_slot_cache;

hy_slot_cache * hy_cache_new(int n_experts, int n_slots, int policy);
void hy_cache_free(hy_slot_cache * c);
void hy_cache_reset(hy_slot_cache * c);
/* plan a call over n distinct experts (valid by construction: in range, distinct, rows >= 1) */
const hy_plan * hy_cache_plan(hy_slot_cache * c, const int32_t * experts, const int32_t * rows, int n,
                              bool deferred_loads);
void hy_cache_commit(hy_slot_cache * c, int slot, int expert);
/* the experts the CPU computed in the call just planned: their requests recorded at its tick */
void hy_cache_note_cpu(hy_slot_cache * c, const int32_t * experts, int n);
/* the committed slot of an expert, or -1 */
int hy_cache_slot_of(const hy_slot_cache * c, int expert);

/* lookahead prefetch of one expert (keep: [n_experts], the experts not to evict); the slot or -1 */
int hy_cache_prefetch(hy_slot_cache * c, int expert, const uint8_t * keep, int * evicted);

/* ---- the CPU share ------------------------------------------------------------------------------ */

/* n_cpu = floor(num/den * n + 1/2), clipped to [0, n]: the share is the exact decimal num/den */
int hy_n_cpu_for_share(uint64_t num, uint64_t den, int n);

/* The cost model's coefficients (seconds), the index of each in every array of them: estimates, fixed
   coefficients, priors, the synthetic clock. The one list of their names: Python reads it through cffi
   (ggml_hybrid/moe/cpu_share.py: COEFFICIENTS is HY_COST_CPU_PER_BYTE... lower-cased, in this order). */
enum hy_cost_coef { HY_COST_CPU_PER_BYTE, HY_COST_CPU_PER_ROW, HY_COST_LOAD_PER_BYTE, HY_COST_DEVICE_PER_ROW,
                    HY_COST_CPU_PER_JOB, HY_COST_N };

typedef struct hy_cost_model {
    double alpha, hysteresis;
    /* each coefficient's prior; the per-row ones per row and expert byte (cpu_share.py: PRIOR_KEYS) */
    double prior[HY_COST_N];
    double cpu[5];  /* EMAs: bytes^2, bytes*rows, rows^2, bytes*t, rows*t */
    double load[2]; /* seconds, bytes */
    double dev[2];  /* seconds, rows */
    double job[2];  /* seconds, weight */
    int64_t n_cpu, n_load, n_dev, n_job;
    bool has_share;
    int64_t share_num, share_den; /* the remembered share of the hysteresis, an exact fraction */
    bool fixed;     /* estimates are coef[] and never change */
    double coef[HY_COST_N];
    /* the prior of a device round's fixed cost, whatever its rows (0: none modeled, the device's time is per row
       only): an RPC device's round waits for its exchanges with the server (cpu_share.py: round_seconds). With
       it, rounds fit t = round + device_per_row * rows (dev_fit), and choices price each round. Set after init. */
    double round_s;
    double dev_fit[5]; /* EMAs: 1, rows, rows^2, t, rows*t */
} hy_cost_model;

void hy_cost_init(hy_cost_model * m, double alpha, double hysteresis, const double prior[HY_COST_N]);
void hy_cost_init_fixed(hy_cost_model * m, double hysteresis, const double coef[HY_COST_N]);
void hy_cost_observe_cpu(hy_cost_model * m, double bytes, double rows, double seconds);
void hy_cost_observe_job(hy_cost_model * m, double seconds);
void hy_cost_observe_load(hy_cost_model * m, double bytes, double seconds);
/* a device round: `rows` rows in `seconds` */
void hy_cost_observe_device(hy_cost_model * m, double rows, double seconds);
void hy_cost_estimate(const hy_cost_model * m, int64_t expert_bytes, double out[HY_COST_N]);
/* the estimated fixed cost of a device round (0 without a round_s prior; a fixed model: round_s) */
double hy_cost_round(const hy_cost_model * m, int64_t expert_bytes);
/* the number of misses the CPU takes; miss_rows are in the order the CPU takes them (fewest first) */
int hy_cost_choose(hy_cost_model * m, int64_t expert_bytes, int64_t hit_rows, const int32_t * miss_rows,
                   int n_miss);
/* the same with the device's rounds priced (hy_cost_round each): n_hits hit experts in a cache of n_slots
   slots; the rounds a split needs are those hy_cache_plan makes for its device experts */
int hy_cost_choose_rounds(hy_cost_model * m, int64_t expert_bytes, int64_t hit_rows, int n_hits, int n_slots,
                          const int32_t * miss_rows, int n_miss);
/* the rounds hy_cache_plan makes for n_hits hits and n_loads misses in a cache of n_slots slots (n_slots <= 0:
   unknown, one round when the device has any expert; hy_cost_choose prices rounds so) */
int hy_cost_rounds(int n_hits, int n_loads, int n_slots);

/* Which misses of one call the CPU computes (cpu_share.py: split_misses, CostModel.choose). `experts` are the
   call's n distinct experts, rows[i] the rows of experts[i]. Hits (committed in `cache`) stay on the device;
   the misses, written to miss_expert / miss_rows ([n] each) with their count in *n_miss, are ordered fewest
   rows first, ties by the cache's request history (fewest requests, then least recent), then by lower id,
   and the CPU takes the first n_cpu of them: n_cpu_table[*n_miss] with a fixed share (n_cpu_table != NULL),
   else the choice of `model`. Returns n_cpu. */
int hy_split_misses(const hy_slot_cache * cache, const int32_t * experts, const int32_t * rows, int n,
                    const int32_t * n_cpu_table, hy_cost_model * model, int64_t expert_bytes,
                    int32_t * miss_expert, int32_t * miss_rows, int * n_miss);
