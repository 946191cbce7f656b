/* The native executor's state and its steps, shared by the files that hold them (not part of the module's
   interface, moe_exec.h is):

     moe_exec.c       the executor made, freed and read (counters, errors, traces, graphs reserved)
     moe_call.c       the call: hy_moe_exec_run runs the steps of its mode (the one list: moe_call.c: STEPS), and
                      the steps of the routing, the plan, the rounds and the merge
     moe_loads.c      the loads: slots filled from the mapping or the host tier, through pinned staging or queued
                      uploads, the tier's reads started, its arena seen as expert tensors
     moe_lookahead.c  the lookahead (moe_prefetch): the next layer's experts predicted, read ahead, prefetched,
                      and the prediction judged

   Each step is a function named as the Python reference's method (ggml_hybrid/moe/executor.py:
   ExpertCacheExecutor._read_ids is read_ids here), taking the executor and the call's state. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "moe_exec.h"

/* how loads reach the slots (moe_loads.c), and what is in flight */
typedef struct hy_stage {
    ggml_backend_buffer_t buf;
    uint8_t * ptr;
    ggml_backend_event_t event; /* NULL: the backend has no events, synchronize instead */
    bool pending;
} hy_stage;

typedef struct hy_loads {
    enum hy_load_mode mode;
    bool pending;                  /* queued uploads not yet waited for (HY_LOAD_QUEUED, or from pinned frames) */
    hy_stage stage[2];             /* HY_LOAD_STAGED: two pinned buffers, one filling while the other uploads */
    int stage_i;
    ggml_backend_buffer_type_t pinned_buft; /* the device's pinned host buffer type (NULL: none) */
    bool from_frames;              /* a call's loads upload straight from the tier's frames when they are pinned */
    int fail_after;                /* loads until an injected failure, -1: none */
} hy_loads;

/* the host arrays of a call, grown by powers of two to the largest call seen */
typedef struct hy_call_arrays {
    int cap_tokens;
    int32_t * ids;           /* [T * k] the routed ids */
    uint8_t * raw_ids;       /* ids as stored, strides included */
    size_t cap_raw;
    float * x;               /* [T, E] */
    float * merged;          /* [T * k, E] */
    int32_t * slot_ids;      /* [T * k] */
    float * rows_x;          /* compacted rows: [bucket, E] */
    int32_t * rows_ids;      /* [bucket] */
    int32_t * rows_pos;      /* [T * k]: where each compacted row goes in merged */
    float * rows_out;        /* [T * k, E] */
    float * cpu_x;           /* the CPU's rows: [T * k, E] */
    int32_t * cpu_ids;
    int32_t * cpu_pos;
    float * cpu_out;
} hy_call_arrays;

/* per expert of the layer, [n_expert] each; experts / expert_rows: the call's distinct experts and their rows, in
   id order */
typedef struct hy_expert_arrays {
    int32_t * counts, * experts, * expert_rows;
    int32_t * dev_experts, * dev_rows;    /* those the device computes */
    int32_t * miss_e, * miss_r;           /* the misses, for the CPU share */
    int32_t * slot_of;                    /* each expert's slot (or frame) in this round */
    uint8_t * on_cpu;
    int32_t * last_cpu;                   /* the CPU's experts of the last call, in id order */
    int n_last_cpu;
    int32_t * n_cpu_table;                /* fixed share: misses the CPU takes out of n, n = 0..n_expert */
} hy_expert_arrays;

/* the routing trace: [seq low, seq high, layer, T, ids..., n_pred, predicted...] records for Python to drain */
typedef struct hy_trace_buf {
    int32_t * data;
    int64_t n, cap;
    int64_t route_pos;       /* moe_route_trace: the next token row of cfg.route */
} hy_trace_buf;

/* the lookahead, as the predicting layer: the next disk layer, its router, the bounds (moe_lookahead.c) */
typedef struct hy_lookahead {
    hy_moe_exec * next;
    const float * router, * router_bias, * select_bias;
    int max_experts, max_tokens;
    int max_read_ahead;      /* most predicted misses read ahead into the host tier (with one) */
    double * scores;         /* [next's n_expert] */
    int32_t * votes;         /* [next's n_expert]: the tokens that predict each expert */
    int32_t * cand;          /* [next's n_expert]: the predicted misses in load order; first, vote's taken marks */
} hy_lookahead;

/* ... and as the predicted layer: what the previous layer's call wrote */
typedef struct hy_prediction {
    bool pending;            /* a prediction not yet judged by a call */
    uint8_t * marked;        /* [n_expert]: predicted */
    int32_t * list;          /* [n_expert]: the last prediction, most-voted first (ties: the lower id) */
    int n;
    uint8_t * prefetched;    /* [n_expert]: prefetched, not yet judged */
    int32_t * pf_expert, * pf_slot; /* [n_expert]: prefetch loads to commit when the call starts (<= n_slots) */
    int n_pf;
} hy_prediction;

/* the host tier's arena seen as this layer's expert tensors (host_tier.h): the expert index is the frame */
typedef struct hy_frames {
    struct ggml_context * ctx;
    hy_experts w;
    int n;
} hy_frames;

struct hy_moe_exec {
    hy_moe_config cfg;
    enum hy_exec_mode mode;
    int64_t expert_bytes;    /* one expert's bytes, every kind */
    hy_slot_cache * cache;
    hy_cost_model model;
    hy_graph_cache graphs;
    bool compact;            /* rounds compute compacted rows (a CPU backend, or an RPC server's CPU); else the
                                call's graph */
    hy_moe_counters counters;
    int err_code;            /* the last failure (HY_ERR_*), and its text */
    char err[320];
    hy_call_arrays buf;
    hy_expert_arrays per;    /* and pred's arrays: slices of the two blocks */
    int32_t * i32_block;
    uint8_t * u8_block;
    hy_loads loads;
    hy_trace_buf trace;
    hy_lookahead ahead;
    hy_prediction pred;
    hy_frames frames;
};

/* The state of one call, handed from step to step (Python's _Call). */
typedef struct hy_call {
    struct ggml_tensor * const * inputs; /* the region's: x [E, 1, T], ids [k, T], weights; its output */
    int n_inputs;
    struct ggml_tensor * const * outputs;
    int n_outputs;
    struct ggml_tensor * x, * ids, * w, * out;
    int T, n_rows;            /* tokens, (token, expert) rows */
    int n_experts;            /* distinct experts (per.experts, per.expert_rows) */
    int n_cpu, n_cpu_rows;    /* the misses the CPU computes (per.on_cpu), their rows */
    bool checked;             /* the model file was found unchanged in this call */
    bool x_read;              /* x is in buf.x */
    bool on_host;             /* rounds compute their own rows, compacted, merged on the host */
    bool job_out;             /* the worker has the CPU's rows */
    hy_job job;
    int64_t t0, t_submit;     /* the call's start, the job's hand-off */
    int64_t d0, d1;           /* the device rounds' start and end */
    const hy_plan * plan;     /* NULL: no plan (tier-direct) */
    int next_load, next_evicted; /* the plan's first load and eviction of the next round */
    hy_graph * full;          /* the layer's whole graph (one round, nothing on the CPU; tier-direct) */
    int round_rows;           /* the rows the last round computed, and in how long */
    int64_t round_ns;
    bool predicted;           /* this call predicted the next layer's experts (predict) */
    int n_cand;               /* of which misses of its slots (ahead.cand), to prefetch after the call */
} hy_call;

#define HY_INTERNAL __attribute__((visibility("hidden")))

/* failures: the call's error set, -1 returned */
HY_INTERNAL int hy_exec_fail(hy_moe_exec * ex, int code, const char * fmt, const char * detail);
HY_INTERNAL int hy_exec_fail_tier(hy_moe_exec * ex);
extern HY_INTERNAL const char * const HY_ERR_FILE_TEXT;

/* x into buf.x (once per call) */
HY_INTERNAL void hy_read_x(hy_moe_exec * ex, hy_call * call);
/* whether loads may read the mapping: no file, or the file unchanged */
HY_INTERNAL bool hy_mapping_unchanged(const hy_moe_exec * ex);

/* the loads (moe_loads.c) */
HY_INTERNAL int hy_loads_init(hy_moe_exec * ex);
HY_INTERNAL void hy_loads_free(hy_moe_exec * ex);
HY_INTERNAL int64_t load(hy_moe_exec * ex, int e, int slot, bool ahead);
HY_INTERNAL void wait_loads(hy_moe_exec * ex);
HY_INTERNAL void hy_loads_abandon(hy_moe_exec * ex);
HY_INTERNAL int tier_views(hy_moe_exec * ex);
HY_INTERNAL int fetch_cpu(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL int fetch_loads(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL int fetch_direct(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL int tier_frames(hy_moe_exec * ex, const int32_t * experts, int n);

/* the lookahead (moe_lookahead.c) */
HY_INTERNAL int settle_prefetch(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL int predict(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL int prefetch(hy_moe_exec * ex, hy_call * call);
HY_INTERNAL void withdraw_prediction(hy_moe_exec * nx);
