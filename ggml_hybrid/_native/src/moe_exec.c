#include "moe_exec.h"

#include "map_guard.h"

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
    /* per expert */
    int32_t * counts, * experts, * dev_experts, * dev_rows, * miss_e, * miss_r, * slot_of;
    uint8_t * on_cpu;
    int32_t * last_cpu;
    int n_last_cpu;
    /* trace: [layer, T, ids...] records */
    int32_t * trace;
    int64_t n_trace, cap_trace;
};

static int fail(hy_moe_exec * ex, int code, const char * fmt, const char * detail) {
    ex->err_code = code;
    snprintf(ex->err, sizeof(ex->err), fmt, ex->cfg.layer, detail);
    return -1;
}

static bool grow_tokens(hy_moe_exec * ex, int T) {
    if (T <= ex->cap_tokens) {
        return true;
    }
    int cap = 1;
    while (cap < T) {
        cap *= 2;
    }
    const size_t k = (size_t) ex->cfg.n_used, E = (size_t) ex->cfg.n_embd, rows = (size_t) cap * k;
    /* a round's compacted rows are padded up to a power of two above 32 (fewer graph shapes), which can
       exceed the call's rows */
    size_t padded = 32;
    while (padded < rows) {
        padded *= 2;
    }
    void * p;
    if ((p = realloc(ex->ids, sizeof(int32_t) * (rows))) == NULL) {
        return false;
    }
    ex->ids = p;
    if ((p = realloc(ex->x, sizeof(float) * ((size_t) cap * E))) == NULL) {
        return false;
    }
    ex->x = p;
    if ((p = realloc(ex->merged, sizeof(float) * (rows * E))) == NULL) {
        return false;
    }
    ex->merged = p;
    if ((p = realloc(ex->slot_ids, sizeof(int32_t) * (rows))) == NULL) {
        return false;
    }
    ex->slot_ids = p;
    if ((p = realloc(ex->rows_x, sizeof(float) * (padded * E))) == NULL) {
        return false;
    }
    ex->rows_x = p;
    if ((p = realloc(ex->rows_ids, sizeof(int32_t) * (padded))) == NULL) {
        return false;
    }
    ex->rows_ids = p;
    if ((p = realloc(ex->rows_pos, sizeof(int32_t) * (rows))) == NULL) {
        return false;
    }
    ex->rows_pos = p;
    if ((p = realloc(ex->rows_out, sizeof(float) * (rows * E))) == NULL) {
        return false;
    }
    ex->rows_out = p;
    if ((p = realloc(ex->cpu_x, sizeof(float) * (rows * E))) == NULL) {
        return false;
    }
    ex->cpu_x = p;
    if ((p = realloc(ex->cpu_ids, sizeof(int32_t) * (rows))) == NULL) {
        return false;
    }
    ex->cpu_ids = p;
    if ((p = realloc(ex->cpu_pos, sizeof(int32_t) * (rows))) == NULL) {
        return false;
    }
    ex->cpu_pos = p;
    if ((p = realloc(ex->cpu_out, sizeof(float) * (rows * E))) == NULL) {
        return false;
    }
    ex->cpu_out = p;
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
    ex->dev_experts = malloc(sizeof(int32_t) * n);
    ex->dev_rows = malloc(sizeof(int32_t) * n);
    ex->miss_e = malloc(sizeof(int32_t) * n);
    ex->miss_r = malloc(sizeof(int32_t) * n);
    ex->slot_of = malloc(sizeof(int32_t) * n);
    ex->on_cpu = calloc(n, 1);
    ex->last_cpu = malloc(sizeof(int32_t) * n);
    if (ex->cache == NULL || !ex->n_cpu_table || !ex->counts || !ex->experts || !ex->dev_experts || !ex->dev_rows ||
        !ex->miss_e || !ex->miss_r || !ex->slot_of || !ex->on_cpu || !ex->last_cpu) {
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
    for (int i = 0; i < 2; i++) {
        if (ex->stage[i].event != NULL) {
            ggml_backend_event_free(ex->stage[i].event);
        }
        if (ex->stage[i].buf != NULL) {
            ggml_backend_buffer_free(ex->stage[i].buf);
        }
    }
    hy_graph_cache_free(&ex->graphs);
    hy_cache_free(ex->cache);
    free(ex->n_cpu_table); free(ex->ids); free(ex->raw_ids); free(ex->x); free(ex->merged); free(ex->slot_ids);
    free(ex->rows_x); free(ex->rows_ids); free(ex->rows_pos); free(ex->rows_out); free(ex->cpu_x); free(ex->cpu_ids);
    free(ex->cpu_pos); free(ex->cpu_out); free(ex->counts); free(ex->experts); free(ex->dev_experts);
    free(ex->dev_rows); free(ex->miss_e); free(ex->miss_r); free(ex->slot_of); free(ex->on_cpu); free(ex->last_cpu);
    free(ex->trace);
    free(ex);
}

/* ---- pieces of a call --------------------------------------------------------------------------- */

static bool is_host(const struct ggml_tensor * t) {
    const struct ggml_tensor * base = t->view_src != NULL ? t->view_src : t;
    return base->buffer != NULL && ggml_backend_buffer_is_host(base->buffer);
}

/* the routed ids [T, k], from any backend, strides included (top-k ids can be a view) */
static bool read_ids(hy_moe_exec * ex, const struct ggml_tensor * t, int T) {
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
    if (ex->cfg.path == NULL) {
        return true;
    }
    struct stat st;
    if (stat(ex->cfg.path, &st) != 0) {
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

/* copy expert `e` from the mapping into `slot` of every expert tensor */
static int64_t load(hy_moe_exec * ex, int e, int slot) {
    int64_t n = 0;
    for (int i = 0; i < ex->cfg.n_kinds; i++) {
        const size_t nb = ex->cfg.nbytes[i];
        const uint8_t * src = ex->cfg.src[i] + (size_t) e * nb;
        if (ex->async_loads) {
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

static double seconds(const hy_moe_exec * ex, int which, double q1, double q2, int64_t ns) {
    if (!ex->cfg.synthetic_clock) {
        return (double) ns / 1e9;
    }
    const double * c = ex->cfg.clock; /* load_per_byte, device_per_row, cpu_per_byte, cpu_per_row, cpu_per_job */
    switch (which) {
        case 0: return c[0] * q1;
        case 1: return c[1] * q1;
        case 2: return c[2] * q1 + c[3] * q2;
        default: return c[4];
    }
}

static bool trace_append(hy_moe_exec * ex, int T) {
    const int64_t need = ex->n_trace + 4 + (int64_t) T * ex->cfg.n_used;
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
    return true;
}

/* ---- the call ------------------------------------------------------------------------------------ */

static const char * ERR_FILE = "layer %d: the model file changed on disk while it was in use%s; reload the model";

int hy_moe_exec_run(int region_id, ggml_backend_t backend, struct ggml_tensor * const * inputs, int n_inputs,
                    struct ggml_tensor * const * outputs, int n_outputs, void * user_data) {
    (void) region_id;
    (void) backend;
    hy_moe_exec * ex = user_data;
    hy_moe_counters * c = &ex->counters;
    const hy_moe_config * cfg = &ex->cfg;
    const int64_t t0 = hy_now_ns();
    ex->err_code = HY_OK;
    ex->err[0] = '\0';
    ex->n_last_cpu = 0;
    if (n_inputs != 3 || n_outputs != 1) {
        return fail(ex, HY_ERR_INPUT, "layer %d: the region has the wrong inputs or outputs%s", "");
    }
    struct ggml_tensor * x3 = inputs[0], * ids_t = inputs[1], * w_t = inputs[2], * out = outputs[0];
    const int T = (int) x3->ne[2], k = cfg->n_used, E = cfg->n_embd;
    if (x3->ne[0] != E || ids_t->ne[0] != k || ids_t->ne[1] != T || !ggml_is_contiguous(x3) ||
        !ggml_is_contiguous(w_t) || !ggml_is_contiguous(out)) {
        return fail(ex, HY_ERR_INPUT, "layer %d: the region's inputs do not have the layer's shapes%s", "");
    }
    if (!grow_tokens(ex, T) || !read_ids(ex, ids_t, T)) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory%s", "");
    }
    const int n_rows = T * k;
    for (int i = 0; i < n_rows; i++) {
        if (ex->ids[i] < 0 || ex->ids[i] >= cfg->n_expert) {
            return fail(ex, HY_ERR_INPUT, "layer %d: a routed expert id is out of range%s", "");
        }
    }
    if (cfg->trace && !trace_append(ex, T)) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: out of host memory for the trace%s", "");
    }

    /* distinct experts and their rows */
    int n_e = 0;
    for (int i = 0; i < n_rows; i++) {
        ex->counts[ex->ids[i]]++;
    }
    for (int e = 0; e < cfg->n_expert; e++) {
        if (ex->counts[e] > 0) {
            ex->experts[n_e++] = e;
        }
    }

    /* the CPU share: hits stay; the CPU takes the misses with the fewest rows first (ties: lower id) */
    int n_cpu = 0, n_miss = 0;
    int64_t hit_rows = 0;
    const bool share = cfg->worker != NULL && cfg->share_mode != HY_SHARE_NONE;
    if (share) {
        for (int i = 0; i < n_e; i++) {
            const int e = ex->experts[i], r = ex->counts[e];
            if (hy_cache_slot_of(ex->cache, e) >= 0) {
                hit_rows += r;
                continue;
            }
            int j = n_miss++;
            while (j > 0 && (ex->miss_r[j - 1] > r || (ex->miss_r[j - 1] == r && ex->miss_e[j - 1] > e))) {
                ex->miss_e[j] = ex->miss_e[j - 1];
                ex->miss_r[j] = ex->miss_r[j - 1];
                j--;
            }
            ex->miss_e[j] = e;
            ex->miss_r[j] = r;
        }
        n_cpu = cfg->share_mode == HY_SHARE_FIXED ? ex->n_cpu_table[n_miss]
                                                   : hy_cost_choose(&ex->model, ex->expert_bytes, hit_rows, ex->miss_r, n_miss);
        if (n_miss > 0) {
            c->share_calls++;
            c->share_sum += (double) n_cpu / (double) n_miss;
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
    }
    int n_dev = 0;
    for (int i = 0; i < n_e; i++) {
        const int e = ex->experts[i];
        if (!ex->on_cpu[e]) {
            ex->dev_experts[n_dev] = e;
            ex->dev_rows[n_dev] = ex->counts[e];
            n_dev++;
        }
    }

    int rc = 0;
    bool checked = false, x_read = false, job_out = false;
    hy_job job;
    int64_t t_submit = 0;
    int n_cpu_rows = 0;
    if (n_cpu > 0) {
        if (!file_unchanged(ex)) {
            rc = fail(ex, HY_ERR_FILE, ERR_FILE, "");
            goto done;
        }
        checked = true;
        ggml_backend_tensor_get(x3, ex->x, 0, sizeof(float) * (size_t) T * E);
        x_read = true;
        /* the CPU's rows in row-major (token, expert) order, as mul_mat_id groups them */
        for (int t = 0; t < T; t++) {
            for (int j = 0; j < k; j++) {
                const int e = ex->ids[t * k + j];
                if (ex->on_cpu[e]) {
                    memcpy(ex->cpu_x + (size_t) n_cpu_rows * E, ex->x + (size_t) t * E, sizeof(float) * E);
                    ex->cpu_ids[n_cpu_rows] = e;
                    ex->cpu_pos[n_cpu_rows] = t * k + j;
                    n_cpu_rows++;
                }
            }
        }
        job = (hy_job) { .w = &cfg->host, .key = cfg->host.down, .glu = (enum ggml_glu_op) cfg->glu,
                         .n_expert = cfg->n_expert, .n_embd = E, .n = n_cpu_rows, .x = ex->cpu_x,
                         .ids = ex->cpu_ids, .out = ex->cpu_out };
        t_submit = hy_now_ns();
        hy_worker_submit(cfg->worker, &job);
        job_out = true;
        c->cpu_misses += n_cpu;
        c->cpu_rows += n_cpu_rows;
    }

    const hy_plan * plan = hy_cache_plan(ex->cache, ex->dev_experts, ex->dev_rows, n_dev, true);
    if (!checked && plan->n_loads > 0 && !file_unchanged(ex)) {
        rc = fail(ex, HY_ERR_FILE, ERR_FILE, "");
        goto done;
    }
    const bool on_host = job_out || plan->n_rounds > 1;
    if (on_host && !x_read) {
        ggml_backend_tensor_get(x3, ex->x, 0, sizeof(float) * (size_t) T * E);
    }
    const int scratch = cfg->n_slots;
    hy_graph * full = NULL;
    const int64_t d0 = hy_now_ns();
    int li = 0, ei = 0;
    for (int r = 0; r < plan->n_rounds; r++) {
        const int64_t t1 = hy_now_ns();
        int64_t loaded = 0;
        int n_loads = 0;
        for (; li < plan->n_loads && plan->load_round[li] == r; li++, n_loads++) {
            if (ex->fail_after == 0) {
                ex->fail_after = -1;
                rc = fail(ex, HY_ERR_INJECTED, "layer %d: injected expert load failure%s", "");
                goto done;
            }
            if (ex->fail_after > 0) {
                ex->fail_after--;
            }
            const int64_t n = load(ex, plan->load_expert[li], plan->load_slot[li]);
            loaded += n;
            c->bytes_loaded += n;
        }
        if (ex->staged) {
            stage_wait(ex, &ex->stage[0]);
            stage_wait(ex, &ex->stage[1]);
        }
        if (ex->async_pending) {
            const int64_t t = hy_now_ns();
            ggml_backend_synchronize(cfg->device);
            ex->async_pending = false;
            ex->counters.staging_wait_ns += hy_now_ns() - t;
        }
        /* only now are the round's slots whole */
        for (int i = li - n_loads; i < li; i++) {
            hy_cache_commit(ex->cache, plan->load_slot[i], plan->load_expert[i]);
        }
        const int64_t t2 = hy_now_ns();
        for (int e = 0; e < cfg->n_expert; e++) {
            ex->slot_of[e] = scratch;
        }
        if (r == 0) {
            for (int i = 0; i < plan->n_hits; i++) {
                ex->slot_of[plan->hit_expert[i]] = plan->hit_slot[i];
            }
        }
        for (int i = li - n_loads; i < li; i++) {
            ex->slot_of[plan->load_expert[i]] = plan->load_slot[i];
        }
        int64_t t3, t4;
        int round_rows;
        if (!on_host) {
            /* one round, nothing on the CPU: the layer's whole graph over the slots */
            full = hy_graph_get(&ex->graphs, HY_GRAPH_FULL, T, &cfg->slots, cfg->slots.down, k, E,
                                (enum ggml_glu_op) cfg->glu);
            if (full == NULL) {
                rc = fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graph%s", "");
                goto done;
            }
            for (int i = 0; i < n_rows; i++) {
                ex->slot_ids[i] = ex->slot_of[ex->ids[i]];
            }
            ggml_backend_tensor_copy(x3, full->x);
            ggml_backend_tensor_copy(w_t, full->w);
            ggml_backend_tensor_set(full->ids, ex->slot_ids, 0, sizeof(int32_t) * n_rows);
            t3 = hy_now_ns();
            if (ggml_backend_graph_compute(cfg->device, full->gf) != GGML_STATUS_SUCCESS) {
                rc = fail(ex, HY_ERR_COMPUTE, "layer %d: the expert graph failed%s", "");
                goto done;
            }
            t4 = hy_now_ns();
            round_rows = n_rows;
        } else {
            /* this round's rows only, compacted; padding rows go to the zeroed scratch slot */
            int n = 0;
            for (int i = 0; i < n_rows; i++) {
                const int s = ex->slot_of[ex->ids[i]];
                if (s != scratch) {
                    memcpy(ex->rows_x + (size_t) n * E, ex->x + (size_t) (i / k) * E, sizeof(float) * E);
                    ex->rows_ids[n] = s;
                    ex->rows_pos[n] = i;
                    n++;
                }
            }
            int rows = n;
            if (n > 32) {
                rows = 1;
                while (rows < n) {
                    rows *= 2;
                }
            }
            t3 = hy_now_ns();
            if (n > 0) {
                hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E,
                                            (enum ggml_glu_op) cfg->glu);
                if (g == NULL) {
                    rc = fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert row graph%s", "");
                    goto done;
                }
                for (int i = n; i < rows; i++) {
                    memset(ex->rows_x + (size_t) i * E, 0, sizeof(float) * E);
                    ex->rows_ids[i] = scratch;
                }
                ggml_backend_tensor_set(g->x, ex->rows_x, 0, sizeof(float) * (size_t) rows * E);
                ggml_backend_tensor_set(g->ids, ex->rows_ids, 0, sizeof(int32_t) * rows);
                if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
                    rc = fail(ex, HY_ERR_COMPUTE, "layer %d: the expert row graph failed%s", "");
                    goto done;
                }
                ggml_backend_tensor_get(g->out, ex->rows_out, 0, sizeof(float) * (size_t) n * E);
                for (int i = 0; i < n; i++) {
                    memcpy(ex->merged + (size_t) ex->rows_pos[i] * E, ex->rows_out + (size_t) i * E, sizeof(float) * E);
                }
            }
            t4 = hy_now_ns();
            round_rows = n;
        }
        c->load_ns += t2 - t1;
        c->compute_ns += t4 - t3;
        c->hits += r == 0 ? plan->n_hits : 0;
        c->misses += n_loads;
        for (; ei < plan->n_evicted && plan->evicted_round[ei] == r; ei++) {
            c->evictions++;
        }
        if (cfg->share_mode == HY_SHARE_AUTO && share) {
            if (loaded) {
                hy_cost_observe_load(&ex->model, (double) loaded, seconds(ex, 0, (double) loaded, 0, t2 - t1));
            }
            hy_cost_observe_device(&ex->model, (double) round_rows, seconds(ex, 1, (double) round_rows, 0, t4 - t3));
        }
    }
    const int64_t d1 = hy_now_ns();
    if (job_out) {
        job_out = false;
        if (hy_worker_wait(cfg->worker) != HY_OK) {
            ex->err_code = job.status == HY_ERR_INJECTED ? HY_ERR_INJECTED : HY_ERR_WORKER;
            snprintf(ex->err, sizeof(ex->err), "layer %d: %s", cfg->layer, cfg->worker->err);
            rc = -1;
            goto done;
        }
        for (int i = 0; i < n_cpu_rows; i++) {
            memcpy(ex->merged + (size_t) ex->cpu_pos[i] * E, ex->cpu_out + (size_t) i * E, sizeof(float) * E);
        }
        c->cpu_ns += job.t_end - job.t_start;
        if (plan->n_rounds > 0) {
            const int64_t lo = d0 > job.t_start ? d0 : job.t_start, hi = d1 < job.t_end ? d1 : job.t_end;
            c->overlap_ns += hi > lo ? hi - lo : 0;
        }
        if (cfg->share_mode == HY_SHARE_AUTO) {
            const double bytes = (double) n_cpu * (double) ex->expert_bytes;
            hy_cost_observe_cpu(&ex->model, bytes, (double) n_cpu_rows,
                                seconds(ex, 2, bytes, (double) n_cpu_rows, job.t_end - job.t_start));
            hy_cost_observe_job(&ex->model, seconds(ex, 3, 0, 0, job.t_start - t_submit));
        }
    }
    /* the worker and the loads read the mapping: a read past the end of a file truncated meanwhile gave
       zeros (the mapping's guard), which must not reach the output */
    if (cfg->map_guard > 0 && ggml_hybrid_map_guard_faults(cfg->map_guard - 1) > 0) {
        rc = fail(ex, HY_ERR_FILE, ERR_FILE, " (truncated: a read went past its end)");
        goto done;
    }
    if (on_host) {
        hy_graph * g = hy_graph_get(&ex->graphs, HY_GRAPH_SUM, T, NULL, NULL, k, E, (enum ggml_glu_op) cfg->glu);
        if (g == NULL) {
            rc = fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the weighted-sum graph%s", "");
            goto done;
        }
        ggml_backend_tensor_set(g->experts_in, ex->merged, 0, sizeof(float) * (size_t) n_rows * E);
        ggml_backend_tensor_copy(w_t, g->w);
        const int64_t t5 = hy_now_ns();
        if (ggml_backend_graph_compute(cfg->device, g->gf) != GGML_STATUS_SUCCESS) {
            rc = fail(ex, HY_ERR_COMPUTE, "layer %d: the weighted-sum graph failed%s", "");
            goto done;
        }
        c->compute_ns += hy_now_ns() - t5;
        ggml_backend_tensor_copy(g->out, out);
    } else if (full != NULL) {
        ggml_backend_tensor_copy(full->out, out);
    }
    c->calls++;
    c->routed += n_rows;
    c->distinct += n_e;
    c->rounds += plan->n_rounds;
    c->device_ns += hy_now_ns() - t0;

done:
    if (job_out) {
        hy_worker_wait(cfg->worker); /* the worker reads our arrays: never leave it running on them */
    }
    if (rc != HY_OK) { /* a failed call leaves no upload in flight into slots the next call may plan */
        if (ex->async_pending) {
            ggml_backend_synchronize(cfg->device);
            ex->async_pending = false;
        }
        if (ex->staged) {
            stage_wait(ex, &ex->stage[0]);
            stage_wait(ex, &ex->stage[1]);
        }
    }
    for (int i = 0; i < n_e; i++) {
        ex->counts[ex->experts[i]] = 0;
        ex->on_cpu[ex->experts[i]] = 0;
    }
    c->invalidated = ex->cache->counters.invalidated;
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
}

int hy_moe_exec_reserve(hy_moe_exec * ex, int n_tokens) {
    const hy_moe_config * cfg = &ex->cfg;
    const int k = cfg->n_used, E = cfg->n_embd;
    const enum ggml_glu_op glu = (enum ggml_glu_op) cfg->glu;
    /* the row graph's size rule of a call (hy_moe_exec_run): exact up to 32 rows, then a power of two */
    int rows = n_tokens * k;
    if (rows > 32) {
        int r = 1;
        while (r < rows) {
            r *= 2;
        }
        rows = r;
    }
    if (hy_graph_get(&ex->graphs, HY_GRAPH_FULL, n_tokens, &cfg->slots, cfg->slots.down, k, E, glu) == NULL ||
        hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E, glu) == NULL ||
        hy_graph_get(&ex->graphs, HY_GRAPH_SUM, n_tokens, NULL, NULL, k, E, glu) == NULL) {
        return fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graphs%s", "");
    }
    return HY_OK;
}

void hy_moe_exec_inject_load_failure(hy_moe_exec * ex, int after) { ex->fail_after = after; }

void hy_moe_exec_set_clock(hy_moe_exec * ex, const double clock[5]) {
    ex->cfg.synthetic_clock = 1;
    memcpy(ex->cfg.clock, clock, sizeof(ex->cfg.clock));
}
