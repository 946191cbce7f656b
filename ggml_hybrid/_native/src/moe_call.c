/* A layer call of the native executor: hy_moe_exec_run runs the steps of the executor's mode, in the order STEPS
   gives, then clean_up. Each step is a function named as the Python reference's method (moe/executor.py:
   ExpertCacheExecutor), the call's state one hy_call; the steps of the routing, the CPU share, the plan, the
   rounds and the merge are here, those of the loads in moe_loads.c, the lookahead's in moe_lookahead.c. */
#include "moe_exec_state.h"

#include "clock.h"
#include "map_guard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the steps of each mode: the one list ---------------------------------------------------------- */

/* The slots fed from the mapping: the routing read and counted, the previous layer's prefetch settled, the CPU's
   misses chosen and handed to the worker first, the device's planned in the slot cache, the next layer predicted,
   the rounds loaded and computed, the worker's rows merged, the weighted sum, the next layer's prefetch, the
   counters. */
static const uint8_t STEPS_SLOTS[] = {
    HY_STEP_READ_IDS, HY_STEP_COUNT_ROWS, HY_STEP_SETTLE_PREFETCH, HY_STEP_CPU_SPLIT, HY_STEP_SUBMIT_CPU,
    HY_STEP_PLAN, HY_STEP_PREDICT, HY_STEP_RUN_ROUNDS, HY_STEP_MERGE, HY_STEP_WEIGHTED_SUM, HY_STEP_PREFETCH,
    HY_STEP_COUNT_CALL,
};
/* The slots fed from the host tier: its reads of the CPU's experts start first, then the plan's loads, all in
   flight before the worker waits for its experts' frames. */
static const uint8_t STEPS_TIER[] = {
    HY_STEP_READ_IDS, HY_STEP_COUNT_ROWS, HY_STEP_SETTLE_PREFETCH, HY_STEP_CPU_SPLIT, HY_STEP_FETCH_CPU,
    HY_STEP_PLAN, HY_STEP_FETCH_LOADS, HY_STEP_SUBMIT_CPU, HY_STEP_PREDICT, HY_STEP_RUN_ROUNDS, HY_STEP_MERGE,
    HY_STEP_WEIGHTED_SUM, HY_STEP_PREFETCH, HY_STEP_COUNT_CALL,
};
/* A CPU playing the device computes every expert straight from the tier's frames: their reads started, the next
   layer predicted (its misses read ahead behind this call's), the whole graph over the frames. */
static const uint8_t STEPS_DIRECT[] = {
    HY_STEP_READ_IDS, HY_STEP_COUNT_ROWS, HY_STEP_SETTLE_PREFETCH, HY_STEP_FETCH_DIRECT, HY_STEP_PREDICT,
    HY_STEP_COMPUTE_DIRECT, HY_STEP_COUNT_CALL,
};

static const struct { const uint8_t * steps; int n; } STEPS[HY_MODE_N] = {
    [HY_MODE_SLOTS] = { STEPS_SLOTS, (int) sizeof(STEPS_SLOTS) },
    [HY_MODE_TIER] = { STEPS_TIER, (int) sizeof(STEPS_TIER) },
    [HY_MODE_DIRECT] = { STEPS_DIRECT, (int) sizeof(STEPS_DIRECT) },
};

int hy_moe_exec_steps(int mode, const uint8_t ** steps) {
    if (mode < 0 || mode >= HY_MODE_N) {
        return 0;
    }
    *steps = STEPS[mode].steps;
    return STEPS[mode].n;
}

/* ---- helpers ------------------------------------------------------------------------------------- */

/* realloc array `p` to `n` elements of its type; false (p unchanged) when out of memory */
#define GROW(p, n) ((tmp = realloc((p), sizeof(*(p)) * (n))) != NULL && ((p) = tmp, true))

/* the host arrays of a call of T tokens, grown by powers of two to the largest call seen */
static bool grow_tokens(hy_moe_exec * ex, int T) {
    hy_call_arrays * b = &ex->buf;
    if (T <= b->cap_tokens) {
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
    if (!(GROW(b->ids, rows) && GROW(b->x, (size_t) cap * E) && GROW(b->merged, rows * E) &&
          GROW(b->slot_ids, rows) && GROW(b->rows_x, bucket * E) && GROW(b->rows_ids, bucket) &&
          GROW(b->rows_pos, rows) && GROW(b->rows_out, rows * E) && GROW(b->cpu_x, rows * E) &&
          GROW(b->cpu_ids, rows) && GROW(b->cpu_pos, rows) && GROW(b->cpu_out, rows * E))) {
        return false;
    }
    b->cap_tokens = cap;
    return true;
}

static bool is_host(const struct ggml_tensor * t) {
    const struct ggml_tensor * base = t->view_src != NULL ? t->view_src : t;
    return base->buffer != NULL && ggml_backend_buffer_is_host(base->buffer);
}

/* the routed ids [T, k] into buf.ids, from any backend, strides included (top-k ids can be a view) */
static bool read_rows(hy_moe_exec * ex, const struct ggml_tensor * t, int T) {
    hy_call_arrays * b = &ex->buf;
    const int k = ex->cfg.n_used;
    const size_t nb1 = t->nb[1], bytes = ggml_nbytes(t);
    const uint8_t * src;
    if (is_host(t)) {
        src = t->data;
    } else {
        if (bytes > b->cap_raw) {
            uint8_t * p = realloc(b->raw_ids, bytes);
            if (p == NULL) {
                return false;
            }
            b->raw_ids = p;
            b->cap_raw = bytes;
        }
        ggml_backend_tensor_get(t, b->raw_ids, 0, bytes);
        src = b->raw_ids;
    }
    for (int i = 0; i < T; i++) {
        memcpy(b->ids + (size_t) i * k, src + (size_t) i * nb1, sizeof(int32_t) * k);
    }
    return true;
}

void hy_read_x(hy_moe_exec * ex, hy_call * call) {
    ggml_backend_tensor_get(call->x, ex->buf.x, 0, sizeof(float) * (size_t) call->T * ex->cfg.n_embd);
    call->x_read = true;
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
    hy_trace_buf * tr = &ex->trace;
    const int n_pred = ex->pred.pending ? ex->pred.n : 0;
    const int64_t need = tr->n + 5 + (int64_t) T * ex->cfg.n_used + n_pred;
    if (need > tr->cap) {
        int64_t cap = tr->cap ? tr->cap : 1024;
        while (cap < need) {
            cap *= 2;
        }
        int32_t * p = realloc(tr->data, sizeof(int32_t) * cap);
        if (p == NULL) {
            return false;
        }
        tr->data = p;
        tr->cap = cap;
    }
    const int64_t seq = ex->cfg.trace_seq != NULL ? (*ex->cfg.trace_seq)++ : 0;
    tr->data[tr->n++] = (int32_t) (uint32_t) (seq & 0xffffffff);
    tr->data[tr->n++] = (int32_t) (uint32_t) ((uint64_t) seq >> 32);
    tr->data[tr->n++] = ex->cfg.layer;
    tr->data[tr->n++] = T;
    memcpy(tr->data + tr->n, ex->buf.ids, sizeof(int32_t) * T * ex->cfg.n_used);
    tr->n += (int64_t) T * ex->cfg.n_used;
    tr->data[tr->n++] = n_pred; /* the lookahead's prediction for this call, 0: none */
    memcpy(tr->data + tr->n, ex->pred.list, sizeof(int32_t) * n_pred);
    tr->n += n_pred;
    return true;
}

/* ---- the routing ----------------------------------------------------------------------------------- */

/* The region's tensors checked against the layer; the routed ids read, checked in range and traced. */
static int read_ids(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    if (call->n_inputs != 3 || call->n_outputs != 1) {
        return hy_exec_fail(ex, HY_ERR_INPUT, "layer %d: the region has the wrong inputs or outputs%s", "");
    }
    call->x = call->inputs[0];
    call->ids = call->inputs[1];
    call->w = call->inputs[2];
    call->out = call->outputs[0];
    const int T = (int) call->x->ne[2], k = cfg->n_used;
    if (call->x->ne[0] != cfg->n_embd || call->ids->ne[0] != k || call->ids->ne[1] != T ||
        !ggml_is_contiguous(call->x) || !ggml_is_contiguous(call->w) || !ggml_is_contiguous(call->out)) {
        return hy_exec_fail(ex, HY_ERR_INPUT, "layer %d: the region's inputs do not have the layer's shapes%s", "");
    }
    if (!grow_tokens(ex, T) || !read_rows(ex, call->ids, T)) {
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory%s", "");
    }
    call->T = T;
    call->n_rows = T * k;
    int32_t * ids = ex->buf.ids;
    if (cfg->route != NULL) { /* moe_route_trace: the trace's routing, token by token, instead of the router's */
        for (int t = 0; t < T; t++) {
            memcpy(ids + (size_t) t * k, cfg->route + (size_t) (ex->trace.route_pos % cfg->n_route) * k,
                   sizeof(int32_t) * k);
            ex->trace.route_pos++;
        }
    }
    for (int i = 0; i < call->n_rows; i++) {
        if (ids[i] < 0 || ids[i] >= cfg->n_expert) {
            return hy_exec_fail(ex, HY_ERR_INPUT, "layer %d: a routed expert id is out of range%s", "");
        }
    }
    if (cfg->trace && !trace_append(ex, T)) {
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory for the trace%s", "");
    }
    return HY_OK;
}

/* The distinct experts, in id order, and the rows of each. */
static int count_rows(hy_moe_exec * ex, hy_call * call) {
    hy_expert_arrays * per = &ex->per;
    for (int i = 0; i < call->n_rows; i++) {
        per->counts[ex->buf.ids[i]]++;
    }
    int n = 0;
    for (int e = 0; e < ex->cfg.n_expert; e++) {
        if (per->counts[e] > 0) {
            per->experts[n] = e;
            per->expert_rows[n] = per->counts[e];
            n++;
        }
    }
    call->n_experts = n;
    return HY_OK;
}

/* ---- the CPU share ------------------------------------------------------------------------------- */

/* Which misses the CPU computes (moe_policy.c: hy_split_misses), marked in per.on_cpu. */
static int cpu_split(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    hy_expert_arrays * per = &ex->per;
    if (cfg->worker == NULL || cfg->share_mode == HY_SHARE_NONE) {
        return HY_OK;
    }
    const bool fixed = cfg->share_mode == HY_SHARE_FIXED;
    int n_miss = 0;
    const int n_cpu = hy_split_misses(ex->cache, per->experts, per->expert_rows, call->n_experts,
                                      fixed ? per->n_cpu_table : NULL, fixed ? NULL : &ex->model, ex->expert_bytes,
                                      per->miss_e, per->miss_r, &n_miss);
    if (n_miss > 0) {
        ex->counters.share_calls++;
        ex->counters.share_sum += (double) n_cpu / (double) n_miss;
    }
    for (int i = 0; i < n_cpu; i++) {
        per->on_cpu[per->miss_e[i]] = 1;
    }
    for (int e = 0, j = 0; e < cfg->n_expert && j < n_cpu; e++) {
        if (per->on_cpu[e]) {
            per->last_cpu[j++] = e;
        }
    }
    per->n_last_cpu = n_cpu;
    call->n_cpu = n_cpu;
    return HY_OK;
}

/* The CPU's rows handed to the worker first, so that it computes them while the device works. */
static int submit_cpu(hy_moe_exec * ex, hy_call * call) {
    const hy_moe_config * cfg = &ex->cfg;
    hy_expert_arrays * per = &ex->per;
    hy_call_arrays * b = &ex->buf;
    if (call->n_cpu == 0) {
        return HY_OK;
    }
    if (!hy_mapping_unchanged(ex)) { /* the worker reads the mapping: a truncated file would kill us (SIGBUS) */
        return hy_exec_fail(ex, HY_ERR_FILE, HY_ERR_FILE_TEXT, "");
    }
    call->checked = true;
    /* fed by the host tier: each CPU expert's frame (its read started by fetch_cpu) is the expert index the
       worker's rows use */
    const bool tier = ex->mode == HY_MODE_TIER;
    if (tier && tier_frames(ex, per->last_cpu, call->n_cpu) != HY_OK) {
        return -1;
    }
    if (!call->x_read) {
        hy_read_x(ex, call);
    }
    /* the CPU's rows in row-major (token, expert) order, as mul_mat_id groups them */
    const int k = cfg->n_used, E = cfg->n_embd;
    int n = 0;
    for (int t = 0; t < call->T; t++) {
        for (int j = 0; j < k; j++) {
            const int e = b->ids[t * k + j];
            if (per->on_cpu[e]) {
                memcpy(b->cpu_x + (size_t) n * E, b->x + (size_t) t * E, sizeof(float) * E);
                b->cpu_ids[n] = tier ? per->slot_of[e] : e;
                b->cpu_pos[n] = t * k + j;
                n++;
            }
        }
    }
    call->n_cpu_rows = n;
    const hy_experts * w = tier ? &ex->frames.w : &cfg->host;
    call->job = (hy_job) { .w = w, .key = w->down, .glu = (enum ggml_glu_op) cfg->glu,
                           .n_expert = tier ? ex->frames.n : cfg->n_expert, .n_embd = E, .n = n, .x = b->cpu_x,
                           .ids = b->cpu_ids, .out = b->cpu_out };
    call->t_submit = hy_now_ns();
    hy_worker_submit(cfg->worker, &call->job);
    call->job_out = true;
    ex->counters.cpu_misses += call->n_cpu;
    ex->counters.cpu_rows += n;
    return HY_OK;
}

/* ---- the plan and the rounds ------------------------------------------------------------------------ */

/* The device's experts (those the CPU does not take) planned in the slot cache: hits, then loads by round. */
static int plan(hy_moe_exec * ex, hy_call * call) {
    hy_expert_arrays * per = &ex->per;
    int n_dev = 0;
    for (int i = 0; i < call->n_experts; i++) {
        const int e = per->experts[i];
        if (!per->on_cpu[e]) {
            per->dev_experts[n_dev] = e;
            per->dev_rows[n_dev] = per->expert_rows[i];
            n_dev++;
        }
    }
    call->plan = hy_cache_plan(ex->cache, per->dev_experts, per->dev_rows, n_dev, true);
    if (call->n_cpu > 0) {
        hy_cache_note_cpu(ex->cache, per->last_cpu, call->n_cpu); /* the CPU's requests count in the history */
    }
    if (ex->mode == HY_MODE_SLOTS && !call->checked && call->plan->n_loads > 0 && !hy_mapping_unchanged(ex)) {
        /* loads read the mapping */
        return hy_exec_fail(ex, HY_ERR_FILE, HY_ERR_FILE_TEXT, "");
    }
    /* one round and no CPU rows: the full graph over the slots, nothing leaves the device; otherwise each
       round computes only its own rows (compacted) and the rows merge on the host */
    call->on_host = call->n_cpu > 0 || call->plan->n_rounds > 1;
    return HY_OK;
}

/* The layer's whole graph over experts `w` (the slots, or the tier's frames): every row of the call, each id
   remapped through per.slot_of to its place in `w`; the graph is left in call->full, its compute's time in
   *compute_ns. */
static int full_graph(hy_moe_exec * ex, hy_call * call, const hy_experts * w, int64_t * compute_ns) {
    const hy_moe_config * cfg = &ex->cfg;
    call->full = hy_graph_get(&ex->graphs, HY_GRAPH_FULL, call->T, w, w->down, cfg->n_used, cfg->n_embd,
                              (enum ggml_glu_op) cfg->glu);
    if (call->full == NULL) {
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graph%s", "");
    }
    int32_t * slot_ids = ex->buf.slot_ids;
    for (int i = 0; i < call->n_rows; i++) {
        slot_ids[i] = ex->per.slot_of[ex->buf.ids[i]];
    }
    ggml_backend_tensor_copy(call->x, call->full->x);
    ggml_backend_tensor_copy(call->w, call->full->w);
    ggml_backend_tensor_set(call->full->ids, slot_ids, 0, sizeof(int32_t) * call->n_rows);
    const int64_t t = hy_now_ns();
    if (ggml_backend_graph_compute(cfg->device, call->full->gf) != GGML_STATUS_SUCCESS) {
        return hy_exec_fail(ex, HY_ERR_COMPUTE, "layer %d: the expert graph failed%s", "");
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
    hy_call_arrays * b = &ex->buf;
    const int E = cfg->n_embd, pad_slot = cfg->n_slots;
    int n = 0;
    for (int i = 0; i < call->n_rows; i++) {
        b->slot_ids[i] = ex->per.slot_of[b->ids[i]];
        n += b->slot_ids[i] != pad_slot;
    }
    const int64_t t = hy_now_ns();
    if (n > 0) {
        hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_CALL, call->T, &cfg->slots, cfg->slots.down, cfg->n_used,
                                    E, (enum ggml_glu_op) cfg->glu);
        if (g == NULL) {
            return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graph%s", "");
        }
        ggml_backend_tensor_copy(call->x, g->x); /* device to device */
        ggml_backend_tensor_set(g->ids, b->slot_ids, 0, sizeof(int32_t) * call->n_rows);
        if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
            return hy_exec_fail(ex, HY_ERR_COMPUTE, "layer %d: the expert graph failed%s", "");
        }
        ggml_backend_tensor_get(g->out, b->rows_out, 0, sizeof(float) * (size_t) call->n_rows * E);
        for (int i = 0; i < call->n_rows; i++) {
            if (b->slot_ids[i] != pad_slot) {
                memcpy(b->merged + (size_t) i * E, b->rows_out + (size_t) i * E, sizeof(float) * E);
            }
        }
    }
    call->round_ns = hy_now_ns() - t;
    call->round_rows = n;
    return HY_OK;
}

/* This round's rows only, compacted and padded to their row bucket (padding rows go to the zeroed pad
   slot); the results go to their places in merged. A CPU backend's mul_mat_id picks its kernel per expert
   from that expert's rows, which compaction keeps (an RPC server that computes on a CPU too: vendor patch 0016
   says so); other devices run the call's graph (compute_rows_call). */
static int compute_rows(hy_moe_exec * ex, hy_call * call) {
    if (!ex->compact) {
        return compute_rows_call(ex, call);
    }
    const hy_moe_config * cfg = &ex->cfg;
    hy_call_arrays * b = &ex->buf;
    const int k = cfg->n_used, E = cfg->n_embd, pad_slot = cfg->n_slots;
    int n = 0;
    for (int i = 0; i < call->n_rows; i++) {
        const int s = ex->per.slot_of[b->ids[i]];
        if (s != pad_slot) {
            memcpy(b->rows_x + (size_t) n * E, b->x + (size_t) (i / k) * E, sizeof(float) * E);
            b->rows_ids[n] = s;
            b->rows_pos[n] = i;
            n++;
        }
    }
    const int rows = hy_row_bucket(n);
    const int64_t t = hy_now_ns();
    if (n > 0) {
        hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E,
                                    (enum ggml_glu_op) cfg->glu);
        if (g == NULL) {
            return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert row graph%s", "");
        }
        for (int i = n; i < rows; i++) {
            memset(b->rows_x + (size_t) i * E, 0, sizeof(float) * E);
            b->rows_ids[i] = pad_slot;
        }
        ggml_backend_tensor_set(g->x, b->rows_x, 0, sizeof(float) * (size_t) rows * E);
        ggml_backend_tensor_set(g->ids, b->rows_ids, 0, sizeof(int32_t) * rows);
        if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
            return hy_exec_fail(ex, HY_ERR_COMPUTE, "layer %d: the expert row graph failed%s", "");
        }
        ggml_backend_tensor_get(g->out, b->rows_out, 0, sizeof(float) * (size_t) n * E);
        for (int i = 0; i < n; i++) {
            memcpy(b->merged + (size_t) b->rows_pos[i] * E, b->rows_out + (size_t) i * E, sizeof(float) * E);
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
    int32_t * slot_of = ex->per.slot_of;
    const int first = call->next_load;
    const int64_t t1 = hy_now_ns();
    int64_t loaded = 0;
    for (int i = first; i < p->n_loads && p->load_round[i] == r; i++, call->next_load++) {
        if (ex->loads.fail_after == 0) {
            ex->loads.fail_after = -1;
            return hy_exec_fail(ex, HY_ERR_INJECTED, "layer %d: injected expert load failure%s", "");
        }
        if (ex->loads.fail_after > 0) {
            ex->loads.fail_after--;
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
        slot_of[e] = cfg->n_slots;
    }
    if (r == 0) {
        for (int i = 0; i < p->n_hits; i++) {
            slot_of[p->hit_expert[i]] = p->hit_slot[i];
        }
    }
    for (int i = first; i < call->next_load; i++) {
        slot_of[p->load_expert[i]] = p->load_slot[i];
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

/* Every round of the plan, in order. */
static int run_rounds(hy_moe_exec * ex, hy_call * call) {
    if (call->on_host && !call->x_read) {
        hy_read_x(ex, call);
    }
    int rc = HY_OK;
    call->d0 = hy_now_ns();
    for (int r = 0; r < call->plan->n_rounds && rc == HY_OK; r++) {
        rc = run_round(ex, call, r);
    }
    call->d1 = hy_now_ns();
    return rc;
}

/* ---- the merge ------------------------------------------------------------------------------------- */

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
    hy_call_arrays * b = &ex->buf;
    for (int i = 0; i < call->n_cpu_rows; i++) {
        memcpy(b->merged + (size_t) b->cpu_pos[i] * E, b->cpu_out + (size_t) i * E, sizeof(float) * E);
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
        return hy_exec_fail(ex, HY_ERR_FILE, HY_ERR_FILE_TEXT, " (truncated: a read went past its end)");
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
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the weighted-sum graph%s", "");
    }
    ggml_backend_tensor_set(g->experts_in, ex->buf.merged, 0, sizeof(float) * (size_t) call->n_rows * cfg->n_embd);
    ggml_backend_tensor_copy(call->w, g->w);
    const int64_t t = hy_now_ns();
    if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
        return hy_exec_fail(ex, HY_ERR_COMPUTE, "layer %d: the weighted-sum graph failed%s", "");
    }
    ex->counters.compute_ns += hy_now_ns() - t;
    ggml_backend_tensor_copy(g->out, call->out);
    return HY_OK;
}

/* Tier-direct: the whole graph over the tier's frames, as the resident graph computes it, once every expert's
   read is done; no slot, no copy. The call's experts count as hits (none needed a load: hits + misses +
   cpu_misses = distinct still holds); the tier's own counters tell those in RAM from those read from the file. */
static int compute_direct(hy_moe_exec * ex, hy_call * call) {
    if (tier_frames(ex, ex->per.experts, call->n_experts) != HY_OK) { /* the ids the graph over the frames uses */
        return -1;
    }
    const int64_t t2 = hy_now_ns();
    int64_t compute_ns;
    const int rc = full_graph(ex, call, &ex->frames.w, &compute_ns); /* the frames' numbers are in per.slot_of */
    if (rc != HY_OK) {
        return rc;
    }
    ggml_backend_tensor_copy(call->full->out, call->out);
    hy_moe_counters * c = &ex->counters;
    c->load_ns += t2 - call->d0; /* waiting for the tier's reads */
    c->compute_ns += hy_now_ns() - t2;
    c->hits += call->n_experts;
    return HY_OK;
}

static int count_call(hy_moe_exec * ex, hy_call * call) {
    hy_moe_counters * c = &ex->counters;
    c->calls++;
    c->routed += call->n_rows;
    c->distinct += call->n_experts;
    c->rounds += call->plan != NULL ? call->plan->n_rounds : 0;
    c->device_ns += hy_now_ns() - call->t0;
    return HY_OK;
}

/* What no call may leave behind, done or failed: the worker on our arrays, uploads in flight into slots the
   next call may plan, the tier's experts pinned, the per-expert marks. */
static void clean_up(hy_moe_exec * ex, const hy_call * call, int rc) {
    if (call->job_out) {
        hy_worker_wait(ex->cfg.worker);
    }
    if (rc != HY_OK) {
        hy_loads_abandon(ex);
    }
    if (ex->cfg.tier != NULL) {
        hy_tier_release(ex->cfg.tier); /* its reads in flight are done; its experts can be evicted again */
    }
    for (int i = 0; i < call->n_experts; i++) {
        ex->per.counts[ex->per.experts[i]] = 0;
        ex->per.on_cpu[ex->per.experts[i]] = 0;
    }
    ex->counters.invalidated = ex->cache->counters.invalidated;
}

/* ---- the call ------------------------------------------------------------------------------------ */

typedef int (*hy_step_fn)(hy_moe_exec * ex, hy_call * call);

/* each step's function and name, from the one list (moe_exec.h: HY_STEPS): a step is its function's name */
#define STEP_FN_OF(NAME, name) [HY_STEP_##NAME] = name,
#define STEP_NAME_OF(NAME, name) [HY_STEP_##NAME] = #name,
static const hy_step_fn STEP_FN[HY_STEP_N] = { HY_STEPS(STEP_FN_OF) };
static const char * const STEP_NAME[HY_STEP_N] = { HY_STEPS(STEP_NAME_OF) };

const char * hy_moe_exec_step_name(int step) { return step >= 0 && step < HY_STEP_N ? STEP_NAME[step] : NULL; }

int hy_moe_exec_run(int region_id, ggml_backend_t backend, struct ggml_tensor * const * inputs, int n_inputs,
                    struct ggml_tensor * const * outputs, int n_outputs, void * user_data) {
    (void) region_id;
    (void) backend;
    hy_moe_exec * ex = user_data;
    hy_call call = { .t0 = hy_now_ns(), .inputs = inputs, .n_inputs = n_inputs, .outputs = outputs,
                     .n_outputs = n_outputs };
    ex->err_code = HY_OK;
    ex->err[0] = '\0';
    ex->per.n_last_cpu = 0;
    const uint8_t * steps = STEPS[ex->mode].steps;
    int rc = HY_OK;
    for (int i = 0; i < STEPS[ex->mode].n && rc == HY_OK; i++) {
        rc = STEP_FN[steps[i]](ex, &call);
    }
    if (rc != HY_OK && call.predicted) {
        withdraw_prediction(ex->ahead.next); /* a failed call predicts nothing */
    }
    clean_up(ex, &call, rc);
    return rc;
}
