#include "moe_exec.h"

#include "map_guard.h"
#include "sched_hooks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct hy_stage {
    ggml_backend_buffer_t buf;
    uint8_t * ptr;
    ggml_backend_event_t event; /* NULL: the backend has no events, synchronize instead */
    bool pending;
} hy_stage;

struct hy_moe_exec {
    hy_moe_config cfg;
    int32_t * n_cpu_table;
    int64_t expert_bytes;
    hy_slot_cache * cache;
    hy_cost_model model;
    hy_graph_cache graphs;
    hy_moe_counters counters;
    int err_code;
    char err[320];
    int fail_after;          /* loads until an injected failure, -1: none */
    /* staging */
    bool staged;
    bool compact;            /* rounds compute compacted rows (a CPU backend); else the call's graph (compute_rows) */
    bool async_loads;        /* no host buffer type, but uploads are queued (RPC): straight from the mapping */
    bool async_pending;
    hy_stage stage[2];
    int stage_i;
    /* host arrays, grown to the largest call seen */
    int cap_tokens;
    int32_t * ids;           /* [T * k] */
    uint8_t * raw_ids;       /* ids as stored, strides included */
    size_t cap_raw;
    float * x;               /* [T, E] */
    float * merged;          /* [T * k, E] */
    int32_t * slot_ids;      /* [T * k] */
    float * rows_x;          /* compacted rows: [T * k, E] */
    int32_t * rows_ids;      /* [T * k] */
    int32_t * rows_pos;      /* [T * k]: where each compacted row goes in merged */
    float * rows_out;        /* [T * k, E] */
    float * cpu_x;
    int32_t * cpu_ids;
    int32_t * cpu_pos;
    float * cpu_out;
    /* per expert; experts / expert_rows: the call's distinct experts and their rows, in id order */
    int32_t * counts, * experts, * expert_rows, * dev_experts, * dev_rows, * miss_e, * miss_r, * slot_of;
    uint8_t * on_cpu;
    int32_t * last_cpu;
    int n_last_cpu;
    /* trace: [layer, T, ids...] records */
    int32_t * trace;
    int64_t n_trace, cap_trace;
    int64_t route_pos;       /* moe_route_trace: the next token row of cfg.route */
    /* lookahead prefetch, as the predicting layer: the next disk layer, its router, the bounds */
    hy_moe_exec * next;
    const float * router, * router_bias, * select_bias;
    int pf_max, pf_max_tokens;
    int ahead_max;           /* most predicted misses read ahead into the host tier (with one) */
    double * scores;         /* [next's n_expert] */
    int32_t * votes;         /* [next's n_expert]: the tokens that predict each expert */
    int32_t * cand;          /* [next's n_expert]: the predicted misses in load order; first, the taken marks of vote */
    /* ... and as the predicted layer (the previous layer's call writes these) */
    bool has_prediction;     /* a prediction not yet judged by a call */
    uint8_t * predicted;     /* [n_expert] */
    int32_t * pred_list;     /* [n_expert]: the last prediction, most-voted first (ties: the lower id) */
    int n_pred;
    uint8_t * pf_mark;       /* [n_expert]: prefetched, not yet judged */
    int32_t * pf_expert, * pf_slot; /* [n_expert]: prefetch loads to commit when the call starts (<= n_slots) */
    int n_pf;
    /* the host tier's arena seen as this layer's expert tensors (host_tier.h): the expert index is the frame */
    struct ggml_context * tier_ctx;
    hy_experts tier_w;
    int n_frames;
    bool tier_pinned;        /* the tier's frames may be the device's pinned host buffer type (staged devices) */
    ggml_backend_buffer_type_t stage_buft; /* the device's pinned host buffer type (staging) */
};

static int fail(hy_moe_exec * ex, int code, const char * fmt, const char * detail) {
    ex->err_code = code;
    snprintf(ex->err, sizeof(ex->err), fmt, ex->cfg.layer, detail);
    return -1;
}

/* the host tier's failure as the call's (its message names the layer) */
static int fail_tier(hy_moe_exec * ex) {
    ex->err_code = HY_ERR_FILE;
    snprintf(ex->err, sizeof(ex->err), "%s", hy_tier_error(ex->cfg.tier));
    return -1;
}

/* realloc array `p` to `n` elements of its type; false (p unchanged) when out of memory */
#define GROW(p, n) ((tmp = realloc((p), sizeof(*(p)) * (n))) != NULL && ((p) = tmp, true))

/* the host arrays of a call of T tokens, grown by powers of two to the largest call seen */
static bool grow_tokens(hy_moe_exec * ex, int T) {
    if (T <= ex->cap_tokens) {
        return true;
    }
    int cap = 1;
    while (cap < T) {
        cap *= 2;
    }
    const size_t k = (size_t) ex->cfg.n_used, E = (size_t) ex->cfg.n_embd, rows = (size_t) cap * k;
    /* a round's compacted rows go up to their row bucket, which can exceed the call's rows */
    const size_t bucket = (size_t) hy_row_bucket((int) rows);
    void * tmp;
    if (!(GROW(ex->ids, rows) && GROW(ex->x, (size_t) cap * E) && GROW(ex->merged, rows * E) &&
          GROW(ex->slot_ids, rows) && GROW(ex->rows_x, bucket * E) && GROW(ex->rows_ids, bucket) &&
          GROW(ex->rows_pos, rows) && GROW(ex->rows_out, rows * E) && GROW(ex->cpu_x, rows * E) &&
          GROW(ex->cpu_ids, rows) && GROW(ex->cpu_pos, rows) && GROW(ex->cpu_out, rows * E))) {
        return false;
    }
    ex->cap_tokens = cap;
    return true;
}

hy_moe_exec * hy_moe_exec_new(const hy_moe_config * cfg) {
    if (cfg->n_kinds < 2 || cfg->n_kinds > HY_MAX_KINDS || cfg->n_used < 1 || cfg->n_expert < cfg->n_used ||
        cfg->device == NULL || cfg->scratch == NULL || cfg->slots.down == NULL) {
        return NULL;
    }
    hy_moe_exec * ex = calloc(1, sizeof(*ex));
    if (ex == NULL) {
        return NULL;
    }
    ex->cfg = *cfg;
    ex->fail_after = -1;
    ex->cache = hy_cache_new(cfg->n_expert, cfg->n_slots, cfg->policy);
    const size_t n = (size_t) cfg->n_expert;
    ex->n_cpu_table = malloc(sizeof(int32_t) * (n + 1));
    ex->counts = calloc(n, sizeof(int32_t));
    ex->experts = malloc(sizeof(int32_t) * n);
    ex->expert_rows = malloc(sizeof(int32_t) * n);
    ex->dev_experts = malloc(sizeof(int32_t) * n);
    ex->dev_rows = malloc(sizeof(int32_t) * n);
    ex->miss_e = malloc(sizeof(int32_t) * n);
    ex->miss_r = malloc(sizeof(int32_t) * n);
    ex->slot_of = malloc(sizeof(int32_t) * n);
    ex->on_cpu = calloc(n, 1);
    ex->last_cpu = malloc(sizeof(int32_t) * n);
    ex->predicted = calloc(n, 1);
    ex->pred_list = malloc(sizeof(int32_t) * n);
    ex->pf_mark = calloc(n, 1);
    ex->pf_expert = malloc(sizeof(int32_t) * n);
    ex->pf_slot = malloc(sizeof(int32_t) * n);
    if (!ex->predicted || !ex->pred_list || !ex->pf_mark || !ex->pf_expert || !ex->pf_slot) {
        hy_moe_exec_free(ex);
        return NULL;
    }
    if (ex->cache == NULL || !ex->n_cpu_table || !ex->counts || !ex->experts || !ex->expert_rows || !ex->dev_experts ||
        !ex->dev_rows || !ex->miss_e || !ex->miss_r || !ex->slot_of || !ex->on_cpu || !ex->last_cpu) {
        hy_moe_exec_free(ex);
        return NULL;
    }
    if (cfg->share_mode == HY_SHARE_FIXED) {
        memcpy(ex->n_cpu_table, cfg->n_cpu_table, sizeof(int32_t) * (n + 1));
    }
    ex->cfg.n_cpu_table = ex->n_cpu_table;
    for (int i = 0; i < cfg->n_kinds; i++) {
        ex->expert_bytes += (int64_t) cfg->nbytes[i];
    }
    if (cfg->fixed_model) {
        hy_cost_init_fixed(&ex->model, cfg->hysteresis, cfg->coef);
    } else {
        hy_cost_init(&ex->model, cfg->alpha, cfg->hysteresis, cfg->prior);
    }
    hy_graph_cache_init(&ex->graphs, cfg->scratch);
    ex->compact = hy_is_cpu(cfg->device);
    if (cfg->staging) {
        ggml_backend_dev_t dev = ggml_backend_get_device(cfg->device);
        ggml_backend_buffer_type_t host = dev != NULL ? ggml_backend_dev_host_buffer_type(dev) : NULL;
        size_t size = 0;
        for (int i = 0; i < cfg->n_kinds; i++) {
            size = cfg->nbytes[i] > size ? cfg->nbytes[i] : size;
        }
        for (int i = 0; i < 2 && host != NULL; i++) {
            ex->stage[i].buf = ggml_backend_buft_alloc_buffer(host, size);
            if (ex->stage[i].buf == NULL) {
                hy_moe_exec_free(ex);
                return NULL;
            }
            ex->stage[i].ptr = ggml_backend_buffer_get_base(ex->stage[i].buf);
            ex->stage[i].event = dev != NULL ? ggml_backend_event_new(dev) : NULL;
        }
        ex->staged = host != NULL;
        ex->stage_buft = host;
        ex->tier_pinned = ex->staged && cfg->tier != NULL;
        if (!ex->staged && dev != NULL) {
            /* the backend copies the data when it queues the upload (GGML's RPC client does), so the
               mapping can be the source and reading the next expert overlaps sending this one */
            struct ggml_backend_dev_props props;
            ggml_backend_dev_get_props(dev, &props);
            ex->async_loads = props.caps.async;
        }
    }
    return ex;
}

void hy_moe_exec_free(hy_moe_exec * ex) {
    if (ex == NULL) {
        return;
    }
    if (ex->n_pf > 0) { /* a prefetch's uploads may still read the staging buffers */
        ggml_backend_synchronize(ex->cfg.device);
    }
    for (int i = 0; i < 2; i++) {
        if (ex->stage[i].event != NULL) {
            ggml_backend_event_free(ex->stage[i].event);
        }
        if (ex->stage[i].buf != NULL) {
            ggml_backend_buffer_free(ex->stage[i].buf);
        }
    }
    hy_graph_cache_free(&ex->graphs);
    if (ex->tier_ctx != NULL) {
        ggml_free(ex->tier_ctx);
    }
    hy_cache_free(ex->cache);
    free(ex->n_cpu_table); free(ex->ids); free(ex->raw_ids); free(ex->x); free(ex->merged); free(ex->slot_ids);
    free(ex->rows_x); free(ex->rows_ids); free(ex->rows_pos); free(ex->rows_out); free(ex->cpu_x); free(ex->cpu_ids);
    free(ex->cpu_pos); free(ex->cpu_out); free(ex->counts); free(ex->experts); free(ex->expert_rows);
    free(ex->dev_experts);
    free(ex->dev_rows); free(ex->miss_e); free(ex->miss_r); free(ex->slot_of); free(ex->on_cpu); free(ex->last_cpu);
    free(ex->trace);
    free(ex->scores); free(ex->votes); free(ex->cand);
    free(ex->predicted); free(ex->pred_list); free(ex->pf_mark); free(ex->pf_expert); free(ex->pf_slot);
    free(ex);
}

/* ---- pieces of a call --------------------------------------------------------------------------- */

static bool is_host(const struct ggml_tensor * t) {
    const struct ggml_tensor * base = t->view_src != NULL ? t->view_src : t;
    return base->buffer != NULL && ggml_backend_buffer_is_host(base->buffer);
}

/* the routed ids [T, k] into ex->ids, from any backend, strides included (top-k ids can be a view) */
static bool read_rows(hy_moe_exec * ex, const struct ggml_tensor * t, int T) {
    const int k = ex->cfg.n_used;
    const size_t nb1 = t->nb[1], bytes = ggml_nbytes(t);
    const uint8_t * src;
    if (is_host(t)) {
        src = t->data;
    } else {
        if (bytes > ex->cap_raw) {
            uint8_t * p = realloc(ex->raw_ids, bytes);
            if (p == NULL) {
                return false;
            }
            ex->raw_ids = p;
            ex->cap_raw = bytes;
        }
        ggml_backend_tensor_get(t, ex->raw_ids, 0, bytes);
        src = ex->raw_ids;
    }
    for (int i = 0; i < T; i++) {
        memcpy(ex->ids + (size_t) i * k, src + (size_t) i * nb1, sizeof(int32_t) * k);
    }
    return true;
}

static bool file_unchanged(const hy_moe_exec * ex) {
    if (ex->cfg.fd < 0) {
        return true;
    }
    struct stat st;
    if (fstat(ex->cfg.fd, &st) != 0) {
        return false;
    }
    const int64_t mtime = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    return (int64_t) st.st_dev == ex->cfg.file_id[0] && (int64_t) st.st_ino == ex->cfg.file_id[1] &&
           (int64_t) st.st_size == ex->cfg.file_id[2] && mtime == ex->cfg.file_id[3];
}

static void stage_wait(hy_moe_exec * ex, hy_stage * st) {
    if (!st->pending) {
        return;
    }
    const int64_t t = hy_now_ns();
    if (st->event != NULL) {
        ggml_backend_event_synchronize(st->event);
        st->pending = false;
    } else {
        ggml_backend_synchronize(ex->cfg.device);
        ex->stage[0].pending = ex->stage[1].pending = false;
    }
    ex->counters.staging_wait_ns += hy_now_ns() - t;
}

/* where expert `e`'s bytes of each kind are: the mapping, or the host tier (which reads them first if they are
   not there yet); false with the error set when the tier's read failed */
static bool expert_source(hy_moe_exec * ex, int e, const uint8_t ** src) {
    if (ex->cfg.tier == NULL) {
        for (int i = 0; i < ex->cfg.n_kinds; i++) {
            src[i] = ex->cfg.src[i] + (size_t) e * ex->cfg.nbytes[i];
        }
        return true;
    }
    if (hy_tier_get(ex->cfg.tier, ex->cfg.tier_layer, e, src, NULL) != 0) {
        fail_tier(ex);
        return false;
    }
    return true;
}

/* The tier's arena as this layer's expert tensors, made once: kind k of the expert in frame f at
   base + pos[k] + f * frame_bytes, i.e. a 3-D tensor of n_frames experts with nb[2] = frame_bytes. The CPU's
   mul_mat_id reads expert i at data + i * nb[2], so a frame index is an expert index: the CPU computes
   straight from the tier. */
static int tier_views(hy_moe_exec * ex) {
    if (ex->tier_ctx != NULL) {
        return HY_OK;
    }
    hy_tier_arena_info a;
    if (hy_tier_arena(ex->cfg.tier, &a) != 0) {
        return fail_tier(ex);
    }
    struct ggml_init_params params = { ggml_tensor_overhead() * HY_MAX_KINDS, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    if (ctx == NULL) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory%s", "");
    }
    const hy_experts * s = &ex->cfg.slots;
    for (int k = 0; k < ex->cfg.n_kinds; k++) {
        const struct ggml_tensor * like = ex->cfg.slot_tensor[k];
        struct ggml_tensor * t = ggml_new_tensor_3d(ctx, like->type, like->ne[0], like->ne[1], a.n_frames);
        t->nb[2] = a.frame_bytes;
        t->nb[3] = a.frame_bytes * (size_t) a.n_frames;
        t->data = a.base + hy_tier_kind_pos(ex->cfg.tier, ex->cfg.tier_layer, k);
        t->buffer = a.buffer;
        ggml_format_name(t, "tier.%d.%d", ex->cfg.layer, k);
        if (like == s->gate_up) {
            ex->tier_w.gate_up = t;
        } else if (like == s->gate) {
            ex->tier_w.gate = t;
        } else if (like == s->up) {
            ex->tier_w.up = t;
        } else {
            ex->tier_w.down = t;
        }
    }
    ex->tier_ctx = ctx;
    ex->n_frames = a.n_frames;
    return HY_OK;
}

/* copy expert `e` from the mapping (or the host tier) into `slot` of every expert tensor; -1 on failure. A call's
   own load from a tier whose frames are the device's pinned host memory uploads straight from the frame (no
   staging copy): the frame stays the call's until its release, after the call's uploads are waited for. A prefetch
   load (`ahead`) stages as before: its upload may outlive the call that pinned its frame. */
static int64_t load(hy_moe_exec * ex, int e, int slot, bool ahead) {
    const uint8_t * srcs[HY_MAX_KINDS];
    if (!expert_source(ex, e, srcs)) {
        return -1;
    }
    int64_t n = 0;
    for (int i = 0; i < ex->cfg.n_kinds; i++) {
        const size_t nb = ex->cfg.nbytes[i];
        const uint8_t * src = srcs[i];
        /* the tier's arena is the pinned type unless that allocation failed (then it is the CPU's) */
        if (ex->async_loads || (ex->tier_pinned && !ahead && hy_tier_buffer_type(ex->cfg.tier) == ex->stage_buft)) {
            ggml_backend_tensor_set_async(ex->cfg.device, ex->cfg.slot_tensor[i], src, (size_t) slot * nb, nb);
            ex->async_pending = true;
        } else if (!ex->staged) {
            ggml_backend_tensor_set(ex->cfg.slot_tensor[i], src, (size_t) slot * nb, nb);
        } else {
            /* read expert N+1 from the mapping while expert N uploads from the other pinned buffer */
            hy_stage * st = &ex->stage[ex->stage_i];
            stage_wait(ex, st);
            memcpy(st->ptr, src, nb);
            ggml_backend_tensor_set_async(ex->cfg.device, ex->cfg.slot_tensor[i], st->ptr, (size_t) slot * nb, nb);
            if (st->event != NULL) {
                ggml_backend_event_record(st->event, ex->cfg.device);
            }
            st->pending = true;
            ex->stage_i ^= 1;
            ex->counters.bytes_staged += (int64_t) nb;
        }
        n += (int64_t) nb;
    }
    return n;
}

/* what the cost model observes of a piece of work: its measured time, or the synthetic clock's (executor.py:
   SyntheticClock.seconds) */
enum { HY_WORK_LOAD, HY_WORK_DEVICE, HY_WORK_CPU, HY_WORK_JOB };

static double seconds(const hy_moe_exec * ex, int work, double bytes, double rows, int64_t ns) {
    if (!ex->cfg.synthetic_clock) {
        return (double) ns / 1e9;
    }
    const double * c = ex->cfg.clock;
    switch (work) {
        case HY_WORK_LOAD: return c[HY_COST_LOAD_PER_BYTE] * bytes;
        case HY_WORK_DEVICE: return c[HY_COST_DEVICE_PER_ROW] * rows;
        case HY_WORK_CPU: return c[HY_COST_CPU_PER_BYTE] * bytes + c[HY_COST_CPU_PER_ROW] * rows;
        default: return c[HY_COST_CPU_PER_JOB];
    }
}

static bool trace_append(hy_moe_exec * ex, int T) {
    const int n_pred = ex->has_prediction ? ex->n_pred : 0;
    const int64_t need = ex->n_trace + 5 + (int64_t) T * ex->cfg.n_used + n_pred;
    if (need > ex->cap_trace) {
        int64_t cap = ex->cap_trace ? ex->cap_trace : 1024;
        while (cap < need) {
            cap *= 2;
        }
        int32_t * p = realloc(ex->trace, sizeof(int32_t) * cap);
        if (p == NULL) {
            return false;
        }
        ex->trace = p;
        ex->cap_trace = cap;
    }
    const int64_t seq = ex->cfg.trace_seq != NULL ? (*ex->cfg.trace_seq)++ : 0;
    ex->trace[ex->n_trace++] = (int32_t) (uint32_t) (seq & 0xffffffff);
    ex->trace[ex->n_trace++] = (int32_t) (uint32_t) ((uint64_t) seq >> 32);
    ex->trace[ex->n_trace++] = ex->cfg.layer;
    ex->trace[ex->n_trace++] = T;
    memcpy(ex->trace + ex->n_trace, ex->ids, sizeof(int32_t) * T * ex->cfg.n_used);
    ex->n_trace += (int64_t) T * ex->cfg.n_used;
    ex->trace[ex->n_trace++] = n_pred; /* the lookahead's prediction for this call, 0: none */
    memcpy(ex->trace + ex->n_trace, ex->pred_list, sizeof(int32_t) * n_pred);
    ex->n_trace += n_pred;
    return true;
}

/* ---- the call ------------------------------------------------------------------------------------
   One function per step, named as the Python reference's methods (ggml_hybrid/moe/executor.py:
   ExpertCacheExecutor._read_ids, ...), the call's state in one struct; hy_moe_exec_run lists the steps. */

typedef struct hy_call {
    struct ggml_tensor * x, * ids, * w, * out; /* the region's inputs x [E, 1, T], ids [k, T], weights; output */
    int T, n_rows;            /* tokens, (token, expert) rows */
    int n_experts;            /* distinct experts (ex->experts, ex->expert_rows) */
    int n_cpu, n_cpu_rows;    /* the misses the CPU computes (on_cpu), their rows */
    bool checked;             /* the model file was found unchanged in this call */
    bool x_read;              /* x is in ex->x */
    bool on_host;             /* rounds compute their own rows, compacted, merged on the host */
    bool job_out;             /* the worker has the CPU's rows */
    hy_job job;
    int64_t t0, t_submit;     /* the call's start, the job's hand-off */
    int64_t d0, d1;           /* the device rounds' start and end */
    const hy_plan * plan;
    int next_load, next_evicted; /* the plan's first load and eviction of the next round */
    hy_graph * full;          /* the layer's whole graph over the slots (one round, nothing on the CPU) */
    int round_rows;           /* the rows the last round computed, and in how long */
    int64_t round_ns;
    bool predicted;           /* this call predicted the next layer's experts (predict) */
    int n_cand;               /* of which misses of its slots (ex->cand), to prefetch after the call */
} hy_call;

static const char * ERR_FILE = "layer %d: the model file changed on disk while it was in use%s; reload the model";

static void read_x(hy_moe_exec * ex, hy_call * call) {
    ggml_backend_tensor_get(call->x, ex->x, 0, sizeof(float) * (size_t) call->T * ex->cfg.n_embd);
    call->x_read = true;
}

/* The region's tensors checked against the layer; the routed ids read, checked in range and traced. */
static int read_ids(hy_moe_exec * ex, hy_call * call, struct ggml_tensor * const * inputs, int n_inputs,
                    struct ggml_tensor * const * outputs, int n_outputs) {
    const hy_moe_config * cfg = &ex->cfg;
    if (n_inputs != 3 || n_outputs != 1) {
        return fail(ex, HY_ERR_INPUT, "layer %d: the region has the wrong inputs or outputs%s", "");
    }
    call->x = inputs[0];
    call->ids = inputs[1];
    call->w = inputs[2];
    call->out = outputs[0];
    const int T = (int) call->x->ne[2], k = cfg->n_used;
    if (call->x->ne[0] != cfg->n_embd || call->ids->ne[0] != k || call->ids->ne[1] != T ||
        !ggml_is_contiguous(call->x) || !ggml_is_contiguous(call->w) || !ggml_is_contiguous(call->out)) {
        return fail(ex, HY_ERR_INPUT, "layer %d: the region's inputs do not have the layer's shapes%s", "");
    }
    if (!grow_tokens(ex, T) || !read_rows(ex, call->ids, T)) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory%s", "");
    }
    call->T = T;
    call->n_rows = T * k;
    if (cfg->route != NULL) { /* moe_route_trace: the trace's routing, token by token, instead of the router's */
        for (int t = 0; t < T; t++) {
            memcpy(ex->ids + (size_t) t * k, cfg->route + (size_t) (ex->route_pos % cfg->n_route) * k,
                   sizeof(int32_t) * k);
            ex->route_pos++;
        }
    }
    for (int i = 0; i < call->n_rows; i++) {
        if (ex->ids[i] < 0 || ex->ids[i] >= cfg->n_expert) {
            return fail(ex, HY_ERR_INPUT, "layer %d: a routed expert id is out of range%s", "");
        }
    }
    if (cfg->trace && !trace_append(ex, T)) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory for the trace%s", "");
    }
    return HY_OK;
}

/* The distinct experts, in id order, and the rows of each. */
static void count_rows(hy_moe_exec * ex, hy_call * call) {
    for (int i = 0; i < call->n_rows; i++) {
        ex->counts[ex->ids[i]]++;
    }
    int n = 0;
    for (int e = 0; e < ex->cfg.n_expert; e++) {
        if (ex->counts[e] > 0) {
            ex->experts[n] = e;
            ex->expert_rows[n] = ex->counts[e];
            n++;
        }
    }
    call->n_experts = n;
}

/* Which misses the CPU computes (moe_policy.c: hy_split_misses), marked in on_cpu. */
static void cpu_split(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    if (cfg->worker == NULL || cfg->share_mode == HY_SHARE_NONE) {
        return;
    }
    const bool fixed = cfg->share_mode == HY_SHARE_FIXED;
    int n_miss = 0;
    const int n_cpu = hy_split_misses(ex->cache, ex->experts, ex->expert_rows, call->n_experts,
                                      fixed ? ex->n_cpu_table : NULL, fixed ? NULL : &ex->model, ex->expert_bytes,
                                      ex->miss_e, ex->miss_r, &n_miss);
    if (n_miss > 0) {
        ex->counters.share_calls++;
        ex->counters.share_sum += (double) n_cpu / (double) n_miss;
    }
    for (int i = 0; i < n_cpu; i++) {
        ex->on_cpu[ex->miss_e[i]] = 1;
    }
    for (int e = 0, j = 0; e < cfg->n_expert && j < n_cpu; e++) {
        if (ex->on_cpu[e]) {
            ex->last_cpu[j++] = e;
        }
    }
    ex->n_last_cpu = n_cpu;
    call->n_cpu = n_cpu;
}

/* The CPU's rows handed to the worker first, so that it computes them while the device works. */
static int submit_cpu(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    if (call->n_cpu == 0) {
        return HY_OK;
    }
    if (!file_unchanged(ex)) { /* the worker reads the mapping: a truncated file would kill us (SIGBUS) */
        return fail(ex, HY_ERR_FILE, ERR_FILE, "");
    }
    call->checked = true;
    /* fed by the host tier: each CPU expert's frame (its read started with the call's fetch), waited for here,
       is the expert index the worker's rows use in the arena's tensors */
    const bool tier = cfg->tier != NULL;
    if (tier) {
        if (tier_views(ex) != HY_OK) {
            return -1;
        }
        for (int i = 0; i < call->n_cpu; i++) {
            if (hy_tier_get(cfg->tier, cfg->tier_layer, ex->last_cpu[i], NULL, &ex->slot_of[ex->last_cpu[i]]) != 0) {
                return fail_tier(ex);
            }
        }
    }
    if (!call->x_read) {
        read_x(ex, call);
    }
    /* the CPU's rows in row-major (token, expert) order, as mul_mat_id groups them */
    const int k = cfg->n_used, E = cfg->n_embd;
    int n = 0;
    for (int t = 0; t < call->T; t++) {
        for (int j = 0; j < k; j++) {
            const int e = ex->ids[t * k + j];
            if (ex->on_cpu[e]) {
                memcpy(ex->cpu_x + (size_t) n * E, ex->x + (size_t) t * E, sizeof(float) * E);
                ex->cpu_ids[n] = tier ? ex->slot_of[e] : e;
                ex->cpu_pos[n] = t * k + j;
                n++;
            }
        }
    }
    call->n_cpu_rows = n;
    call->job = (hy_job) { .w = tier ? &ex->tier_w : &cfg->host, .key = tier ? ex->tier_w.down : cfg->host.down,
                           .glu = (enum ggml_glu_op) cfg->glu, .n_expert = tier ? ex->n_frames : cfg->n_expert,
                           .n_embd = E, .n = n, .x = ex->cpu_x, .ids = ex->cpu_ids, .out = ex->cpu_out };
    call->t_submit = hy_now_ns();
    hy_worker_submit(cfg->worker, &call->job);
    call->job_out = true;
    ex->counters.cpu_misses += call->n_cpu;
    ex->counters.cpu_rows += n;
    return HY_OK;
}

/* The device's experts (those the CPU does not take) planned in the slot cache: hits, then loads by round. */
static int plan(hy_moe_exec * ex, hy_call * call) {
    int n_dev = 0;
    for (int i = 0; i < call->n_experts; i++) {
        const int e = ex->experts[i];
        if (!ex->on_cpu[e]) {
            ex->dev_experts[n_dev] = e;
            ex->dev_rows[n_dev] = ex->expert_rows[i];
            n_dev++;
        }
    }
    call->plan = hy_cache_plan(ex->cache, ex->dev_experts, ex->dev_rows, n_dev, true);
    if (call->n_cpu > 0) {
        hy_cache_note_cpu(ex->cache, ex->last_cpu, call->n_cpu); /* the CPU's requests count in the history */
    }
    /* the host tier starts reading every round's misses now, several in flight; each load waits for its own */
    if (ex->cfg.tier != NULL && call->plan->n_loads > 0 &&
        hy_tier_fetch(ex->cfg.tier, ex->cfg.tier_layer, call->plan->load_expert, call->plan->n_loads) != 0) {
        return fail_tier(ex);
    }
    if (ex->cfg.tier == NULL && !call->checked && call->plan->n_loads > 0 && !file_unchanged(ex)) {
        /* loads read the mapping */
        return fail(ex, HY_ERR_FILE, ERR_FILE, "");
    }
    /* one round and no CPU rows: the full graph over the slots, nothing leaves the device; otherwise each
       round computes only its own rows (compacted) and the rows merge on the host */
    call->on_host = call->n_cpu > 0 || call->plan->n_rounds > 1;
    if (call->on_host && !call->x_read) {
        read_x(ex, call);
    }
    return HY_OK;
}

/* The host tier starts reading the CPU's experts first, before the device's loads (plan), so that the worker,
   which waits for them, starts as early as it can. */
static int fetch_cpu(hy_moe_exec * ex, hy_call * call) {
    if (ex->cfg.tier == NULL || call->n_cpu == 0) {
        return HY_OK;
    }
    if (hy_tier_fetch(ex->cfg.tier, ex->cfg.tier_layer, ex->last_cpu, call->n_cpu) != 0) {
        return fail_tier(ex);
    }
    return HY_OK;
}

static void predict(hy_moe_exec * ex, hy_call * call);
static int full_graph(hy_moe_exec * ex, hy_call * call, const hy_experts * w, int64_t * compute_ns);

/* A CPU playing the device with the host tier (tier_direct): every expert of the call computed straight from the
   tier's frames in the layer's whole graph, as the resident graph computes it; no slot, no copy. */

static int run_direct(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    if (tier_views(ex) != HY_OK) {
        return -1;
    }
    const int64_t t1 = hy_now_ns();
    if (hy_tier_fetch(cfg->tier, cfg->tier_layer, ex->experts, call->n_experts) != 0) {
        return fail_tier(ex);
    }
    predict(ex, call); /* with moe_prefetch: the next layer's predicted experts read ahead behind this call's */
    for (int i = 0; i < call->n_experts; i++) {
        if (hy_tier_get(cfg->tier, cfg->tier_layer, ex->experts[i], NULL, &ex->slot_of[ex->experts[i]]) != 0) {
            return fail_tier(ex);
        }
    }
    const int64_t t2 = hy_now_ns();
    int64_t compute_ns;
    const int rc = full_graph(ex, call, &ex->tier_w, &compute_ns); /* the frames' numbers are in slot_of */
    if (rc != HY_OK) {
        return rc;
    }
    ggml_backend_tensor_copy(call->full->out, call->out);
    hy_moe_counters * c = &ex->counters;
    c->load_ns += t2 - t1; /* waiting for the tier's reads */
    c->compute_ns += hy_now_ns() - t2;
    c->calls++;
    c->routed += call->n_rows;
    c->distinct += call->n_experts;
    c->hits += call->n_experts; /* none needed a load (hits + misses + cpu_misses = distinct still holds); the
                                   tier's own counters tell those in RAM from those read from the file */
    c->device_ns += hy_now_ns() - call->t0;
    return HY_OK;
}

/* Wait for the uploads in flight: only then are the slots they fill whole. */
static void wait_loads(hy_moe_exec * ex) {
    if (ex->staged) {
        stage_wait(ex, &ex->stage[0]);
        stage_wait(ex, &ex->stage[1]);
    }
    if (ex->async_pending) {
        const int64_t t = hy_now_ns();
        ggml_backend_synchronize(ex->cfg.device);
        ex->async_pending = false;
        ex->counters.staging_wait_ns += hy_now_ns() - t;
    }
}

/* The layer's whole graph over experts `w` (the slots, or the tier's frames): every row of the call, each id
   remapped through slot_of to its place in `w`; the graph is left in call->full, its compute's time in
   *compute_ns. */
static int full_graph(hy_moe_exec * ex, hy_call * call, const hy_experts * w, int64_t * compute_ns) {
    const hy_moe_config * cfg = &ex->cfg;
    call->full = hy_graph_get(&ex->graphs, HY_GRAPH_FULL, call->T, w, w->down, cfg->n_used, cfg->n_embd,
                              (enum ggml_glu_op) cfg->glu);
    if (call->full == NULL) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graph%s", "");
    }
    for (int i = 0; i < call->n_rows; i++) {
        ex->slot_ids[i] = ex->slot_of[ex->ids[i]];
    }
    ggml_backend_tensor_copy(call->x, call->full->x);
    ggml_backend_tensor_copy(call->w, call->full->w);
    ggml_backend_tensor_set(call->full->ids, ex->slot_ids, 0, sizeof(int32_t) * call->n_rows);
    const int64_t t = hy_now_ns();
    if (ggml_backend_graph_compute(cfg->device, call->full->gf) != GGML_STATUS_SUCCESS) {
        return fail(ex, HY_ERR_COMPUTE, "layer %d: the expert graph failed%s", "");
    }
    *compute_ns = hy_now_ns() - t;
    return HY_OK;
}

/* The layer's whole graph over the slots. */
static int compute_full(hy_moe_exec * ex, hy_call * call) {
    const int rc = full_graph(ex, call, &ex->cfg.slots, &call->round_ns);
    if (rc == HY_OK) {
        call->round_rows = call->n_rows;
    }
    return rc;
}

/* This round's rows on a device that is not a CPU backend: the call's own graph (every row, the ids remapped,
   the rows of other rounds on the pad slot), so that the backend picks the kernels the resident graph gets
   (GGML's Vulkan backend picks mul_mat_id's kernel by the call's token count: mat-vec up to 8 tokens, else
   tiled, which rounds F32 operands to F16); this round's rows go to their places in merged. */
static int compute_rows_call(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    const int E = cfg->n_embd, pad_slot = cfg->n_slots;
    int n = 0;
    for (int i = 0; i < call->n_rows; i++) {
        ex->slot_ids[i] = ex->slot_of[ex->ids[i]];
        n += ex->slot_ids[i] != pad_slot;
    }
    const int64_t t = hy_now_ns();
    if (n > 0) {
        hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_CALL, call->T, &cfg->slots, cfg->slots.down, cfg->n_used,
                                    E, (enum ggml_glu_op) cfg->glu);
        if (g == NULL) {
            return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graph%s", "");
        }
        ggml_backend_tensor_copy(call->x, g->x); /* device to device */
        ggml_backend_tensor_set(g->ids, ex->slot_ids, 0, sizeof(int32_t) * call->n_rows);
        if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
            return fail(ex, HY_ERR_COMPUTE, "layer %d: the expert graph failed%s", "");
        }
        ggml_backend_tensor_get(g->out, ex->rows_out, 0, sizeof(float) * (size_t) call->n_rows * E);
        for (int i = 0; i < call->n_rows; i++) {
            if (ex->slot_ids[i] != pad_slot) {
                memcpy(ex->merged + (size_t) i * E, ex->rows_out + (size_t) i * E, sizeof(float) * E);
            }
        }
    }
    call->round_ns = hy_now_ns() - t;
    call->round_rows = n;
    return HY_OK;
}

/* This round's rows only, compacted and padded to their row bucket (padding rows go to the zeroed pad
   slot); the results go to their places in merged. A CPU backend's mul_mat_id picks its kernel per expert
   from that expert's rows, which compaction keeps; other devices run the call's graph (compute_rows_call). */
static int compute_rows(hy_moe_exec * ex, hy_call * call) {
    if (!ex->compact) {
        return compute_rows_call(ex, call);
    }
    const hy_moe_config * cfg = &ex->cfg;
    const int k = cfg->n_used, E = cfg->n_embd, pad_slot = cfg->n_slots;
    int n = 0;
    for (int i = 0; i < call->n_rows; i++) {
        const int s = ex->slot_of[ex->ids[i]];
        if (s != pad_slot) {
            memcpy(ex->rows_x + (size_t) n * E, ex->x + (size_t) (i / k) * E, sizeof(float) * E);
            ex->rows_ids[n] = s;
            ex->rows_pos[n] = i;
            n++;
        }
    }
    const int rows = hy_row_bucket(n);
    const int64_t t = hy_now_ns();
    if (n > 0) {
        hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E,
                                    (enum ggml_glu_op) cfg->glu);
        if (g == NULL) {
            return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert row graph%s", "");
        }
        for (int i = n; i < rows; i++) {
            memset(ex->rows_x + (size_t) i * E, 0, sizeof(float) * E);
            ex->rows_ids[i] = pad_slot;
        }
        ggml_backend_tensor_set(g->x, ex->rows_x, 0, sizeof(float) * (size_t) rows * E);
        ggml_backend_tensor_set(g->ids, ex->rows_ids, 0, sizeof(int32_t) * rows);
        if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
            return fail(ex, HY_ERR_COMPUTE, "layer %d: the expert row graph failed%s", "");
        }
        ggml_backend_tensor_get(g->out, ex->rows_out, 0, sizeof(float) * (size_t) n * E);
        for (int i = 0; i < n; i++) {
            memcpy(ex->merged + (size_t) ex->rows_pos[i] * E, ex->rows_out + (size_t) i * E, sizeof(float) * E);
        }
    }
    call->round_ns = hy_now_ns() - t;
    call->round_rows = n;
    return HY_OK;
}

/* Round r of the plan: load its misses into their slots, then compute the experts it holds. */
static int run_round(hy_moe_exec * ex, hy_call * call, int r) {
    const hy_moe_config * cfg = &ex->cfg;
    const hy_plan * p = call->plan;
    hy_moe_counters * c = &ex->counters;
    const int first = call->next_load;
    const int64_t t1 = hy_now_ns();
    int64_t loaded = 0;
    for (int i = first; i < p->n_loads && p->load_round[i] == r; i++, call->next_load++) {
        if (ex->fail_after == 0) {
            ex->fail_after = -1;
            return fail(ex, HY_ERR_INJECTED, "layer %d: injected expert load failure%s", "");
        }
        if (ex->fail_after > 0) {
            ex->fail_after--;
        }
        const int64_t n = load(ex, p->load_expert[i], p->load_slot[i], false);
        if (n < 0) {
            return -1;
        }
        loaded += n;
        c->bytes_loaded += n;
    }
    wait_loads(ex);
    for (int i = first; i < call->next_load; i++) { /* only now are the round's slots whole */
        hy_cache_commit(ex->cache, p->load_slot[i], p->load_expert[i]);
    }
    const int64_t t2 = hy_now_ns();
    /* each expert's slot in this round; experts of other rounds (and the CPU's) read the pad slot */
    for (int e = 0; e < cfg->n_expert; e++) {
        ex->slot_of[e] = cfg->n_slots;
    }
    if (r == 0) {
        for (int i = 0; i < p->n_hits; i++) {
            ex->slot_of[p->hit_expert[i]] = p->hit_slot[i];
        }
    }
    for (int i = first; i < call->next_load; i++) {
        ex->slot_of[p->load_expert[i]] = p->load_slot[i];
    }
    const int rc = call->on_host ? compute_rows(ex, call) : compute_full(ex, call);
    if (rc != HY_OK) {
        return rc;
    }
    c->load_ns += t2 - t1;
    c->compute_ns += call->round_ns;
    c->hits += r == 0 ? p->n_hits : 0;
    c->misses += call->next_load - first;
    for (; call->next_evicted < p->n_evicted && p->evicted_round[call->next_evicted] == r; call->next_evicted++) {
        c->evictions++;
    }
    if (cfg->share_mode == HY_SHARE_AUTO && cfg->worker != NULL) {
        if (loaded) {
            hy_cost_observe_load(&ex->model, (double) loaded, seconds(ex, HY_WORK_LOAD, (double) loaded, 0, t2 - t1));
        }
        hy_cost_observe_device(&ex->model, (double) call->round_rows,
                               seconds(ex, HY_WORK_DEVICE, 0, (double) call->round_rows, call->round_ns));
    }
    return HY_OK;
}

/* The worker's rows, waited for, merged with the device's. */
static int merge(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    hy_moe_counters * c = &ex->counters;
    if (!call->job_out) {
        return HY_OK;
    }
    call->job_out = false;
    const hy_job * job = &call->job;
    if (hy_worker_wait(cfg->worker) != HY_OK) {
        ex->err_code = job->status == HY_ERR_INJECTED ? HY_ERR_INJECTED : HY_ERR_WORKER;
        snprintf(ex->err, sizeof(ex->err), "layer %d: %s", cfg->layer, cfg->worker->err);
        return -1;
    }
    const int E = cfg->n_embd;
    for (int i = 0; i < call->n_cpu_rows; i++) {
        memcpy(ex->merged + (size_t) ex->cpu_pos[i] * E, ex->cpu_out + (size_t) i * E, sizeof(float) * E);
    }
    c->cpu_ns += job->t_end - job->t_start;
    if (call->plan->n_rounds > 0) {
        const int64_t lo = call->d0 > job->t_start ? call->d0 : job->t_start;
        const int64_t hi = call->d1 < job->t_end ? call->d1 : job->t_end;
        c->overlap_ns += hi > lo ? hi - lo : 0;
    }
    if (cfg->share_mode == HY_SHARE_AUTO) {
        const double bytes = (double) call->n_cpu * (double) ex->expert_bytes, rows = (double) call->n_cpu_rows;
        hy_cost_observe_cpu(&ex->model, bytes, rows, seconds(ex, HY_WORK_CPU, bytes, rows, job->t_end - job->t_start));
        hy_cost_observe_job(&ex->model, seconds(ex, HY_WORK_JOB, 0, 0, job->t_start - call->t_submit));
    }
    return HY_OK;
}

/* The weighted sum over each token's experts into the region's output (the full graph computed it already). */
static int weighted_sum(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    /* the worker and the loads read the mapping: a read past the end of a file truncated meanwhile gave
       zeros (the mapping's guard), which must not reach the output */
    if (cfg->map_guard > 0 && hy_map_guard_faults(cfg->map_guard - 1) > 0) {
        return fail(ex, HY_ERR_FILE, ERR_FILE, " (truncated: a read went past its end)");
    }
    if (!call->on_host) {
        if (call->full != NULL) {
            ggml_backend_tensor_copy(call->full->out, call->out);
        }
        return HY_OK;
    }
    hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_SUM, call->T, NULL, NULL, cfg->n_used, cfg->n_embd,
                                (enum ggml_glu_op) cfg->glu);
    if (g == NULL) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the weighted-sum graph%s", "");
    }
    ggml_backend_tensor_set(g->experts_in, ex->merged, 0, sizeof(float) * (size_t) call->n_rows * cfg->n_embd);
    ggml_backend_tensor_copy(call->w, g->w);
    const int64_t t = hy_now_ns();
    if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
        return fail(ex, HY_ERR_COMPUTE, "layer %d: the weighted-sum graph failed%s", "");
    }
    ex->counters.compute_ns += hy_now_ns() - t;
    ggml_backend_tensor_copy(g->out, call->out);
    return HY_OK;
}

/* ---- lookahead prefetch ---------------------------------------------------------------------------
   ExpertCacheExecutor._settle_prefetch / _prefetch in Python. The previous layer's call predicted this layer's
   experts and loaded some of them (prefetch below); this call waits for those loads, commits them, and scores
   the prediction against its own experts. */
static void settle_prefetch(hy_moe_exec * ex, const hy_call * call) {
    if (ex->n_pf > 0) {
        wait_loads(ex);
        for (int i = 0; i < ex->n_pf; i++) {
            hy_cache_commit(ex->cache, ex->pf_slot[i], ex->pf_expert[i]);
        }
        ex->n_pf = 0;
    }
    if (!ex->has_prediction) {
        return;
    }
    if (ex->cfg.tier != NULL) { /* the host tier judges what it read ahead for this call */
        hy_tier_settle(ex->cfg.tier, ex->cfg.tier_layer, ex->experts, call->n_experts);
    }
    hy_moe_counters * c = &ex->counters;
    c->predicted += ex->n_pred;
    c->predicted_of += call->n_experts;
    for (int i = 0; i < call->n_experts; i++) {
        const int e = ex->experts[i];
        c->predicted_right += ex->predicted[e];
        if (ex->pf_mark[e]) {
            c->prefetch_used++;
            ex->pf_mark[e] = 0;
        }
    }
    for (int i = 0; i < ex->n_pred; i++) {
        const int e = ex->pred_list[i];
        if (ex->pf_mark[e]) {
            c->prefetch_wasted++;
            ex->pf_mark[e] = 0;
        }
        ex->predicted[e] = 0;
    }
    ex->has_prediction = false;
}

/* each token's top k of next by score (ties: the lower id), counted in ex->votes */
static void vote(hy_moe_exec * ex, const float * x) {
    const hy_moe_exec * nx = ex->next;
    const int E = ex->cfg.n_embd, X = nx->cfg.n_expert, k = nx->cfg.n_used;
    for (int e = 0; e < X; e++) {
        const float * w = ex->router + (size_t) e * E;
        double s = 0.0;
        for (int d = 0; d < E; d++) {
            s += (double) w[d] * (double) x[d];
        }
        if (ex->router_bias != NULL) {
            s += (double) ex->router_bias[e];
        }
        if (ex->select_bias != NULL) {
            s = 1.0 / (1.0 + exp(-s)) + (double) ex->select_bias[e];
        }
        ex->scores[e] = isnan(s) ? -INFINITY : s; /* a non-finite input predicts, it does not crash */
        ex->cand[e] = 0;
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < X; e++) {
            if (!ex->cand[e] && (best < 0 || ex->scores[e] > ex->scores[best])) {
                best = e;
            }
        }
        ex->votes[best]++;
        ex->cand[best] = 1;
    }
}

/* A prediction of nx's coming call withdrawn unjudged (nx's call never ran, or the predicting call failed): what
   it loaded or read ahead is wasted. */
static void withdraw_prediction(hy_moe_exec * nx) {
    if (!nx->has_prediction) {
        return;
    }
    if (nx->cfg.tier != NULL) {
        hy_tier_settle(nx->cfg.tier, nx->cfg.tier_layer, NULL, 0);
    }
    for (int i = 0; i < nx->n_pred; i++) {
        const int e = nx->pred_list[i];
        nx->counters.prefetch_wasted += nx->pf_mark[e];
        nx->pf_mark[e] = 0;
        nx->predicted[e] = 0;
    }
    nx->has_prediction = false;
}

/* As soon as the call's own loads are planned (their reads queued first): predict the next layer's experts from
   this call's x, and with a host tier start reading the predicted misses it lacks, so that the reads overlap this
   call's loads and compute as well as the next layer's dense part. */
static void predict(hy_moe_exec * ex, hy_call * call) {
    hy_moe_exec * nx = ex->next;
    if (nx == NULL || call->T > ex->pf_max_tokens) {
        return;
    }
    const int64_t t0 = hy_now_ns();
    if (!call->x_read && ex->router != NULL) {
        read_x(ex, call);
    }
    const int X = nx->cfg.n_expert;
    hy_tier * tier = nx->cfg.tier;
    withdraw_prediction(nx); /* never judged (the next layer's call did not run) */
    memset(ex->votes, 0, sizeof(int32_t) * X);
    for (int t = 0; t < call->T; t++) {
        if (ex->router != NULL) {
            vote(ex, ex->x + (size_t) t * ex->cfg.n_embd);
        } else { /* the oracle (benchmarks, moe_route_trace): the next layer's coming rows of its trace */
            const int32_t * row = nx->cfg.route + (size_t) ((nx->route_pos + t) % nx->cfg.n_route) * nx->cfg.n_used;
            for (int j = 0; j < nx->cfg.n_used; j++) {
                ex->votes[row[j]]++;
            }
        }
    }
    /* the prediction by decreasing votes, ties by increasing id: the order the misses among it load in */
    int n_pred = 0, n_cand = 0;
    for (int e = 0; e < X; e++) {
        if (ex->votes[e] == 0) {
            continue;
        }
        nx->predicted[e] = 1;
        int j = n_pred++;
        while (j > 0 && ex->votes[nx->pred_list[j - 1]] < ex->votes[e]) {
            nx->pred_list[j] = nx->pred_list[j - 1];
            j--;
        }
        nx->pred_list[j] = e;
    }
    for (int i = 0; i < n_pred; i++) {
        if (nx->cache->where[nx->pred_list[i]] < 0) {
            ex->cand[n_cand++] = nx->pred_list[i];
        }
    }
    nx->n_pred = n_pred;
    nx->has_prediction = true;
    call->predicted = true;
    call->n_cand = n_cand;
    /* with a host tier, the predicted misses it lacks are read ahead now, without waiting */
    if (tier != NULL && n_cand > 0 && ex->ahead_max > 0) {
        hy_tier_read_ahead(tier, nx->cfg.tier_layer, ex->cand, n_cand < ex->ahead_max ? n_cand : ex->ahead_max);
    }
    nx->counters.prefetch_ns += hy_now_ns() - t0;
}

/* After a call: load the predicted misses (predict above) into the next layer's free or evictable slots. */
static void prefetch(hy_moe_exec * ex, hy_call * call) {
    hy_moe_exec * nx = ex->next;
    const int n_cand = call->n_cand;
    if (nx == NULL || n_cand == 0 || ex->pf_max <= 0) {
        return;
    }
    const int64_t t0 = hy_now_ns();
    hy_tier * tier = nx->cfg.tier;
    /* loads read the mapping (or the tier): a changed file is left to the next call to report */
    if (tier != NULL || call->checked || file_unchanged(ex)) {
        for (int i = 0, n_loaded = 0; i < n_cand && n_loaded < ex->pf_max; i++) {
            int evicted;
            const int e = ex->cand[i];
            if (tier != NULL && !hy_tier_holds(tier, nx->cfg.tier_layer, e)) {
                continue; /* still being read: the call loads it from the tier, never waiting here for the disk */
            }
            const int slot = hy_cache_prefetch(nx->cache, e, nx->predicted, &evicted);
            if (slot < 0) {
                break;
            }
            const int64_t bytes = load(nx, e, slot, true);
            if (bytes < 0) {
                /* the tier refused (the file changed): the slot stays uncommitted, so the next call's plan empties
                   it; that call reports the file */
                nx->err_code = HY_OK;
                nx->err[0] = '\0';
                break;
            }
            n_loaded++;
            nx->counters.bytes_prefetched += bytes;
            nx->counters.prefetched++;
            nx->pf_mark[e] = 1;
            nx->pf_expert[nx->n_pf] = e;
            nx->pf_slot[nx->n_pf] = slot;
            nx->n_pf++;
        }
    }
    nx->counters.prefetch_ns += hy_now_ns() - t0;
}

static void count_call(hy_moe_exec * ex, const hy_call * call) {
    hy_moe_counters * c = &ex->counters;
    c->calls++;
    c->routed += call->n_rows;
    c->distinct += call->n_experts;
    c->rounds += call->plan->n_rounds;
    c->device_ns += hy_now_ns() - call->t0;
}

/* What no call may leave behind, done or failed: the worker on our arrays, uploads in flight into slots the
   next call may plan, the per-expert marks. */
static void clean_up(hy_moe_exec * ex, const hy_call * call, int rc) {
    if (call->job_out) {
        hy_worker_wait(ex->cfg.worker);
    }
    if (rc != HY_OK) {
        if (ex->async_pending) {
            ggml_backend_synchronize(ex->cfg.device);
            ex->async_pending = false;
        }
        if (ex->staged) {
            stage_wait(ex, &ex->stage[0]);
            stage_wait(ex, &ex->stage[1]);
        }
    }
    if (ex->cfg.tier != NULL) {
        hy_tier_release(ex->cfg.tier); /* its reads in flight are done; its experts can be evicted again */
    }
    for (int i = 0; i < call->n_experts; i++) {
        ex->counts[ex->experts[i]] = 0;
        ex->on_cpu[ex->experts[i]] = 0;
    }
    ex->counters.invalidated = ex->cache->counters.invalidated;
}

int hy_moe_exec_run(int region_id, ggml_backend_t backend, struct ggml_tensor * const * inputs, int n_inputs,
                    struct ggml_tensor * const * outputs, int n_outputs, void * user_data) {
    (void) region_id;
    (void) backend;
    hy_moe_exec * ex = user_data;
    hy_call call = { .t0 = hy_now_ns() };
    ex->err_code = HY_OK;
    ex->err[0] = '\0';
    ex->n_last_cpu = 0;
    if (read_ids(ex, &call, inputs, n_inputs, outputs, n_outputs) != HY_OK) {
        return -1; /* nothing to undo yet */
    }
    count_rows(ex, &call);
    if (ex->cfg.tier_direct) {
        settle_prefetch(ex, &call); /* judges the read-ahead for this call (no slot is ever prefetched here) */
        const int rc = run_direct(ex, &call);
        if (rc != HY_OK && call.predicted) {
            withdraw_prediction(ex->next);
        }
        clean_up(ex, &call, rc);
        return rc;
    }
    settle_prefetch(ex, &call);
    cpu_split(ex, &call);
    int rc;
    if (ex->cfg.tier == NULL) {
        rc = submit_cpu(ex, &call);
        if (rc == HY_OK) {
            rc = plan(ex, &call);
        }
    } else { /* the tier reads the CPU's experts, then the device's loads, all in flight before any wait */
        rc = fetch_cpu(ex, &call);
        if (rc == HY_OK) {
            rc = plan(ex, &call);
        }
        if (rc == HY_OK) {
            rc = submit_cpu(ex, &call);
        }
    }
    if (rc == HY_OK) {
        predict(ex, &call);
        call.d0 = hy_now_ns();
        for (int r = 0; r < call.plan->n_rounds && rc == HY_OK; r++) {
            rc = run_round(ex, &call, r);
        }
        call.d1 = hy_now_ns();
    }
    if (rc == HY_OK) {
        rc = merge(ex, &call);
    }
    if (rc == HY_OK) {
        rc = weighted_sum(ex, &call);
    }
    if (rc == HY_OK) {
        prefetch(ex, &call);
        count_call(ex, &call);
    } else if (call.predicted) {
        withdraw_prediction(ex->next); /* a failed call predicts nothing */
    }
    clean_up(ex, &call, rc);
    return rc;
}

/* ---- reading it from Python ---------------------------------------------------------------------- */

const hy_moe_counters * hy_moe_exec_counters(const hy_moe_exec * ex) { return &ex->counters; }
hy_slot_cache * hy_moe_exec_cache(hy_moe_exec * ex) { return ex->cache; }
hy_cost_model * hy_moe_exec_cost_model(hy_moe_exec * ex) { return &ex->model; }

int hy_moe_exec_error(const hy_moe_exec * ex, const char ** message) {
    if (message != NULL) {
        *message = ex->err;
    }
    return ex->err_code;
}

int hy_moe_exec_last_cpu(const hy_moe_exec * ex, const int32_t ** experts) {
    *experts = ex->last_cpu;
    return ex->n_last_cpu;
}

const int32_t * hy_moe_exec_trace(const hy_moe_exec * ex, int64_t * n_ints) {
    *n_ints = ex->n_trace;
    return ex->trace;
}

void hy_moe_exec_trace_take(hy_moe_exec * ex) { ex->n_trace = 0; }

int64_t hy_moe_exec_graph_builds(const hy_moe_exec * ex) { return ex->graphs.builds; }
int hy_moe_exec_load_mode(const hy_moe_exec * ex) { return ex->staged ? 1 : ex->async_loads ? 2 : 0; }

void hy_moe_exec_plain_loads(hy_moe_exec * ex) {
    /* calls never leave uploads in flight, so the buffers can simply go unused */
    ex->staged = false;
    ex->async_loads = false;
    ex->tier_pinned = false;
}

int hy_moe_exec_reserve(hy_moe_exec * ex, int n_tokens) {
    const hy_moe_config * cfg = &ex->cfg;
    const int k = cfg->n_used, E = cfg->n_embd;
    const enum ggml_glu_op glu = (enum ggml_glu_op) cfg->glu;
    const int rows = hy_row_bucket(n_tokens * k); /* a round's row graph holds at most every row of the call;
                                                     a device that is not a CPU backend runs the call's graph */
    if (cfg->tier_direct) {
        if (tier_views(ex) != HY_OK) {
            return -1;
        }
        if (hy_graph_get(&ex->graphs, HY_GRAPH_FULL, n_tokens, &ex->tier_w, ex->tier_w.down, k, E, glu) == NULL) {
            return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graphs%s", "");
        }
        return HY_OK;
    }
    if (hy_graph_get(&ex->graphs, HY_GRAPH_FULL, n_tokens, &cfg->slots, cfg->slots.down, k, E, glu) == NULL ||
        (ex->compact && hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E,
                                     glu) == NULL) ||
        hy_graph_get(&ex->graphs, HY_GRAPH_SUM, n_tokens, NULL, NULL, k, E, glu) == NULL ||
        (!ex->compact && hy_graph_get(&ex->graphs, HY_GRAPH_CALL, n_tokens, &cfg->slots, cfg->slots.down, k, E,
                                      glu) == NULL)) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graphs%s", "");
    }
    return HY_OK;
}

void hy_moe_exec_set_prefetch(hy_moe_exec * ex, hy_moe_exec * next, const float * router, const float * router_bias,
                              const float * select_bias, int max_experts, int max_tokens, int max_read_ahead) {
    ex->next = NULL;
    if (next == NULL || next == ex || (router == NULL && next->cfg.route == NULL)) {
        return;
    }
    const size_t X = (size_t) next->cfg.n_expert;
    void * tmp;
    if (!(GROW(ex->scores, X) && GROW(ex->votes, X) && GROW(ex->cand, X))) {
        return; /* out of memory: no prefetch, which changes no result */
    }
    ex->next = next;
    ex->router = router;
    ex->router_bias = router_bias;
    ex->select_bias = select_bias;
    ex->pf_max = max_experts;
    ex->pf_max_tokens = max_tokens;
    ex->ahead_max = max_read_ahead;
}

int hy_moe_exec_predicted(const hy_moe_exec * ex, const int32_t ** experts) {
    *experts = ex->pred_list;
    return ex->n_pred;
}

void hy_moe_exec_inject_load_failure(hy_moe_exec * ex, int after) { ex->fail_after = after; }

void hy_moe_exec_set_clock(hy_moe_exec * ex, const double clock[HY_COST_N]) {
    ex->cfg.synthetic_clock = 1;
    memcpy(ex->cfg.clock, clock, sizeof(ex->cfg.clock));
}
