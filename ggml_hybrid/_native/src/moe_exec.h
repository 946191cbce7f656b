/* The expert-cache executor of one MoE layer, native: registered with the patched scheduler as the
   region's executor function, so a layer call runs no Python.

   A call runs the steps of its mode (enum hy_exec_mode) in the order moe_call.c: STEPS gives, the one list of
   them (hy_moe_exec_steps reads it; the Python executor, ggml_hybrid/moe/executor.py: ExpertCacheExecutor, runs
   the same list through cffi, each step a method of the same name). The Python executor is the reference: the
   tests compare their decisions and outputs call by call. moe_exec_state.h says which file holds which steps. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "file_id.h"
#include "host_tier.h"
#include "moe_graphs.h"
#include "moe_policy.h"
#include "moe_worker.h"

enum { HY_OK = 0, HY_ERR_FILE = 1, HY_ERR_COMPUTE = 2, HY_ERR_ALLOC = 3, HY_ERR_WORKER = 4, HY_ERR_INJECTED = 5,
       HY_ERR_INPUT = 6 };

enum { HY_SHARE_NONE = 0, HY_SHARE_FIXED = 1, HY_SHARE_AUTO = 2 };

/* How loads reach the slots: plain tensor_set; double-buffered pinned host staging and asynchronous uploads (a
   device whose memory is not host memory and which has a pinned host buffer type); queued uploads straight from
   the mapping (no pinned type, but the backend copies the data when it queues an upload, as GGML's RPC client
   does). Python's load_mode names are these, lower-cased. */
enum hy_load_mode { HY_LOAD_COPY, HY_LOAD_STAGED, HY_LOAD_QUEUED, HY_LOAD_N };

/* The executor's modes: the slots fed from the mapping; the slots fed from the host tier (host_tier.h); a CPU
   playing the device that computes every expert straight from the tier's frames (no slots, no loads). */
enum hy_exec_mode { HY_MODE_SLOTS, HY_MODE_TIER, HY_MODE_DIRECT, HY_MODE_N };

/* The steps a call can run, listed once: each X(NAME, name) is the enum member HY_STEP_NAME, the C executor's
   function `name` (moe_call.c builds its table of functions and names from this list) and the Python executor's
   method `_name`. Which of them a mode runs, and in which order: hy_moe_exec_steps. */
#define HY_STEPS(X)                                                                                             \
    X(READ_IDS, read_ids) X(COUNT_ROWS, count_rows) X(SETTLE_PREFETCH, settle_prefetch) X(CPU_SPLIT, cpu_split)  \
    X(FETCH_CPU, fetch_cpu) X(PLAN, plan) X(FETCH_LOADS, fetch_loads) X(SUBMIT_CPU, submit_cpu)                \
    X(PREDICT, predict) X(RUN_ROUNDS, run_rounds) X(MERGE, merge) X(WEIGHTED_SUM, weighted_sum)                \
    X(PREFETCH, prefetch) X(FETCH_DIRECT, fetch_direct) X(COMPUTE_DIRECT, compute_direct)                       \
    X(COUNT_CALL, count_call)
#define HY_STEP_MEMBER(NAME, name) HY_STEP_##NAME,
enum hy_step { HY_STEPS(HY_STEP_MEMBER) HY_STEP_N };

/* the steps of a call in `mode` (HY_MODE_*), in order: their number, the list in *steps */
int hy_moe_exec_steps(int mode, const uint8_t ** steps);
/* step `step`'s name (its function's), NULL outside 0..HY_STEP_N - 1 */
const char * hy_moe_exec_step_name(int step);

/* A layer's counters, summed over its calls. The one list of them: Python's LayerCounters (both executors')
   takes its fields from this struct through cffi, in this order. */
typedef struct hy_moe_counters {
    int64_t calls;
    int64_t routed;          /* (token, expert) pairs */
    int64_t distinct;        /* distinct experts, summed over calls */
    int64_t hits;
    int64_t misses;          /* experts loaded into slots */
    int64_t bytes_loaded;
    int64_t evictions;
    int64_t rounds;
    int64_t device_ns;       /* wall time spent in the executor */
    int64_t load_ns;         /* of which: copying missed experts into slots */
    int64_t compute_ns;      /* of which: GGML computing the experts and the weighted sum */
    int64_t cpu_misses;      /* misses computed by the CPU worker (not loaded) */
    int64_t cpu_rows;        /* (token, expert) rows the CPU computed */
    int64_t cpu_ns;          /* CPU worker compute time */
    int64_t overlap_ns;      /* time the CPU worker and the device path ran together */
    int64_t share_calls;     /* calls that had misses to place */
    double share_sum;        /* sum over those calls of the share of misses sent to the CPU */
    int64_t bytes_staged;    /* loaded bytes that went through pinned host staging (native executor) */
    int64_t staging_wait_ns; /* time loads waited for a staging buffer's upload to finish */
    int64_t invalidated;     /* slots emptied because their load never completed (a failed call) */
    /* lookahead prefetch (moe_prefetch), counted in the layer that was predicted (the next one) */
    int64_t predicted;       /* experts predicted for its calls, summed over the calls that had a prediction */
    int64_t predicted_right; /* of which the call routed to */
    int64_t predicted_of;    /* distinct experts of the calls that had a prediction (recall's denominator) */
    int64_t prefetched;      /* predicted misses loaded ahead of the call (not in misses / bytes_loaded) */
    int64_t prefetch_used;   /* of which the call routed to: a hit that would have been a load */
    int64_t prefetch_wasted; /* of which the call did not route to */
    int64_t bytes_prefetched;
    int64_t prefetch_ns;     /* time the previous layer's call spent predicting and issuing the loads */
} hy_moe_counters;

#define HY_MAX_KINDS 6 /* the matrices (2 or 3) and their biases (gpt-oss: 3) */

typedef struct hy_moe_config {
    int layer;
    int n_expert, n_used, n_embd;
    int n_slots, policy;
    int glu;                          /* enum ggml_glu_op */
    hy_experts slots;                 /* [n_slots + 1, ...] on the device; the last, zeroed, is the pad slot */
    hy_experts host;                  /* the experts on the mapped file (the CPU share) */
    int n_kinds;                      /* the expert tensors, matrices and biases: what a load copies */
    struct ggml_tensor * slot_tensor[HY_MAX_KINDS];
    const uint8_t * src[HY_MAX_KINDS];  /* expert 0's bytes of each kind in the mapping */
    size_t nbytes[HY_MAX_KINDS];        /* bytes of one expert of each kind */
    ggml_backend_t device;
    hy_scratch * scratch;             /* shared by the executors of one model on one device */
    hy_worker * worker;               /* NULL: no CPU share */
    int share_mode;
    const int32_t * n_cpu_table;      /* fixed share: misses the CPU takes out of n, for n = 0..n_expert */
    double alpha, hysteresis;
    double round_s;                   /* the cost model's fixed cost of a device round (0: none; moe_policy.h) */
    int remote_cpu;                   /* the device is an RPC server's that computes on a CPU: rounds compacted */
    double prior[HY_COST_N];          /* arrays of coefficients are indexed by HY_COST_* (moe_policy.h) */
    int fixed_model;                  /* auto with a fixed cost model (coef) */
    double coef[HY_COST_N];
    int synthetic_clock;              /* observations from the work, not the clock (repeatable decisions) */
    double clock[HY_COST_N];          /* the synthetic clock's cost of each unit of work */
    int fd;                           /* the open model file (-1: none), checked unchanged before the mapping is
                                         read (file_id.h) */
    int64_t file_id[HY_FILE_ID_N];
    int map_guard;                    /* the mapping's guard (map_guard.h) id + 1, 0 for none: reads past the end */
    int staging;                      /* loads through pinned host staging (devices whose memory is not host) */
    int trace;                        /* record every call's ids for Python to drain */
    int64_t * trace_seq;              /* the session's call counter: orders records across layers */
    const int32_t * route;            /* moe_route_trace (benchmarks): [n_route, n_used] ids that replace the
                                         router's, token by token, cycling; NULL: the router's own */
    int64_t n_route;
    hy_tier * tier;                   /* NULL: loads read the mapping; else the host tier (host_tier.h) */
    int tier_layer;                   /* this layer's index in the tier */
    int tier_direct;                  /* a CPU playing the device computes every expert straight from the tier's
                                         frames (no slots, no loads); the tier's buffers must be plain CPU ones */
} hy_moe_config;

typedef struct hy_moe_exec hy_moe_exec;

hy_moe_exec * hy_moe_exec_new(const hy_moe_config * cfg);
void hy_moe_exec_free(hy_moe_exec * ex);

/* the region executor (ggml_backend_sched_region_exec_t); user_data is the hy_moe_exec */
int hy_moe_exec_run(int region_id, ggml_backend_t backend, struct ggml_tensor * const * inputs, int n_inputs,
                    struct ggml_tensor * const * outputs, int n_outputs, void * user_data);

const hy_moe_counters * hy_moe_exec_counters(const hy_moe_exec * ex);
hy_slot_cache * hy_moe_exec_cache(hy_moe_exec * ex);
hy_cost_model * hy_moe_exec_cost_model(hy_moe_exec * ex);
/* whether rounds compute compacted rows (a CPU device, local or an RPC server's that computes on one) */
int hy_moe_exec_compacts(const hy_moe_exec * ex);
/* the last failure: its HY_ERR_* code (0: none) and text; cleared by the next call */
int hy_moe_exec_error(const hy_moe_exec * ex, const char ** message);
/* the CPU misses of the last call, in increasing id order */
int hy_moe_exec_last_cpu(const hy_moe_exec * ex, const int32_t ** experts);
/* trace records appended since the last take: [seq low, seq high, layer, T, T * n_used ids, n_pred, n_pred
   predicted ids] each (n_pred 0: no prediction for the call) */
const int32_t * hy_moe_exec_trace(const hy_moe_exec * ex, int64_t * n_ints);
void hy_moe_exec_trace_take(hy_moe_exec * ex);
int64_t hy_moe_exec_graph_builds(const hy_moe_exec * ex);
/* how loads reach the slots (HY_LOAD_*), and the executor's mode (HY_MODE_*) */
int hy_moe_exec_load_mode(const hy_moe_exec * ex);
int hy_moe_exec_mode(const hy_moe_exec * ex);
/* loads by plain tensor_set from now on (benchmarks compare the paths) */
void hy_moe_exec_plain_loads(hy_moe_exec * ex);
/* Build (and place) the graphs a call of n_tokens tokens can need, so that the shared scratch buffer is as
   large as any call will make it: the full graph, the compacted row graph of every (token, expert) row,
   and the weighted sum. HY_OK, or -1 with the error set. */
int hy_moe_exec_reserve(hy_moe_exec * ex, int n_tokens);
/* Lookahead prefetch (moe_prefetch): after each call of up to max_tokens tokens, predict the experts of `next`
   (the next disk layer) by its router applied to this call's input x (logits = router [n_expert of next, n_embd]
   . x + router_bias; with select_bias, sigmoid(logits) + select_bias; each token's top n_used of next), and load
   the predicted misses, most-voted first, at most max_experts, into next's empty or evictable slots (never one
   holding another prediction). next waits for the loads at the start of its call. NULL next: off. A NULL router
   with a next that follows a route trace (moe_route_trace, benchmarks) predicts the trace's coming rows of next:
   an oracle, the bound of what a prediction can give. The prediction is made as soon as the call's own loads are
   planned; the slot loads after the call. With a host tier (cfg.tier), the predicted misses it lacks, at most
   max_read_ahead, are read ahead into it right when predicted (hy_tier_read_ahead, no wait: the reads overlap the
   call), and only the predicted misses it holds by the call's end are loaded into slots (from the tier; the others
   load from it in next's call). */
void hy_moe_exec_set_prefetch(hy_moe_exec * ex, hy_moe_exec * next, const float * router, const float * router_bias,
                              const float * select_bias, int max_experts, int max_tokens, int max_read_ahead);
/* the last prediction of this layer's experts (by the previous layer's call), most-voted first, ties by id */
int hy_moe_exec_predicted(const hy_moe_exec * ex, const int32_t ** experts);
/* make the load after the next `after` loads fail (tests: a fault half way through a call) */
void hy_moe_exec_inject_load_failure(hy_moe_exec * ex, int after);
/* observe durations computed from the work (a cost per unit of work, indexed by HY_COST_*) instead of the
   clock: repeatable `auto` decisions */
void hy_moe_exec_set_clock(hy_moe_exec * ex, const double clock[HY_COST_N]);
