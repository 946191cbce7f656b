/* The native executor made, freed and read from Python; its calls are in moe_call.c. */
#include "moe_exec_state.h"

#include "cpu_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

hy_moe_exec * hy_moe_exec_new(const hy_moe_config * cfg) {
    if (cfg->n_kinds < 2 || cfg->n_kinds > HY_MAX_KINDS || cfg->n_used < 1 || cfg->n_expert < cfg->n_used ||
        cfg->device == NULL || cfg->scratch == NULL ||
        !hy_experts_buildable(&cfg->slots, (enum ggml_glu_op) cfg->glu)) {
        return NULL;
    }
    hy_moe_exec * ex = calloc(1, sizeof(*ex));
    if (ex == NULL) {
        return NULL;
    }
    ex->cfg = *cfg;
    ex->mode = cfg->tier == NULL ? HY_MODE_SLOTS : cfg->tier_direct ? HY_MODE_DIRECT : HY_MODE_TIER;
    ex->loads.fail_after = -1;
    ex->cache = hy_cache_new(cfg->n_expert, cfg->n_slots, cfg->policy);
    /* the arrays of one entry per expert, zeroed, in two blocks (the fixed share's table has one more) */
    const size_t n = (size_t) cfg->n_expert;
    hy_expert_arrays * per = &ex->per;
    hy_prediction * pred = &ex->pred;
    int32_t ** i32[] = { &per->counts, &per->experts, &per->expert_rows, &per->dev_experts, &per->dev_rows,
                         &per->miss_e, &per->miss_r, &per->slot_of, &per->last_cpu, &pred->list, &pred->pf_expert,
                         &pred->pf_slot, &per->n_cpu_table };
    uint8_t ** u8[] = { &per->on_cpu, &pred->marked, &pred->prefetched };
    const size_t n_i32 = sizeof(i32) / sizeof(i32[0]), n_u8 = sizeof(u8) / sizeof(u8[0]);
    ex->i32_block = calloc(n_i32 * n + 1, sizeof(int32_t));
    ex->u8_block = calloc(n_u8 * n, 1);
    if (ex->cache == NULL || ex->i32_block == NULL || ex->u8_block == NULL) {
        hy_moe_exec_free(ex);
        return NULL;
    }
    for (size_t i = 0; i < n_i32; i++) {
        *i32[i] = ex->i32_block + i * n;
    }
    for (size_t i = 0; i < n_u8; i++) {
        *u8[i] = ex->u8_block + i * n;
    }
    if (cfg->share_mode == HY_SHARE_FIXED) {
        memcpy(per->n_cpu_table, cfg->n_cpu_table, sizeof(int32_t) * (n + 1));
    }
    ex->cfg.n_cpu_table = per->n_cpu_table;
    for (int i = 0; i < cfg->n_kinds; i++) {
        ex->expert_bytes += (int64_t) cfg->nbytes[i];
    }
    if (cfg->fixed_model) {
        hy_cost_init_fixed(&ex->model, cfg->hysteresis, cfg->coef);
    } else {
        hy_cost_init(&ex->model, cfg->alpha, cfg->hysteresis, cfg->prior);
    }
    ex->model.round_s = cfg->round_s;
    hy_graph_cache_init(&ex->graphs, cfg->scratch);
    ex->compact = hy_is_cpu(cfg->device) || cfg->remote_cpu;
    if (hy_loads_init(ex) != HY_OK) {
        hy_moe_exec_free(ex);
        return NULL;
    }
    return ex;
}

void hy_moe_exec_free(hy_moe_exec * ex) {
    if (ex == NULL) {
        return;
    }
    hy_loads_free(ex);
    hy_graph_cache_free(&ex->graphs);
    if (ex->frames.ctx != NULL) {
        ggml_free(ex->frames.ctx);
    }
    hy_cache_free(ex->cache);
    hy_call_arrays * b = &ex->buf;
    free(b->ids); free(b->raw_ids); free(b->x); free(b->merged); free(b->slot_ids); free(b->rows_x);
    free(b->rows_ids); free(b->rows_pos); free(b->rows_out); free(b->cpu_x); free(b->cpu_ids); free(b->cpu_pos);
    free(b->cpu_out);
    free(ex->i32_block);
    free(ex->u8_block);
    free(ex->trace.data);
    free(ex->ahead.scores); free(ex->ahead.votes); free(ex->ahead.cand);
    free(ex);
}

int hy_exec_fail(hy_moe_exec * ex, int code, const char * fmt, const char * detail) {
    ex->err_code = code;
    snprintf(ex->err, sizeof(ex->err), fmt, ex->cfg.layer, detail);
    return -1;
}

/* the host tier's failure as the call's (its message names the layer) */
int hy_exec_fail_tier(hy_moe_exec * ex) {
    ex->err_code = HY_ERR_FILE;
    snprintf(ex->err, sizeof(ex->err), "%s", hy_tier_error(ex->cfg.tier));
    return -1;
}

const char * const HY_ERR_FILE_TEXT =
    "layer %d: the model file changed on disk while it was in use%s; reload the model";

/* ---- reading it from Python ---------------------------------------------------------------------- */

const hy_moe_counters * hy_moe_exec_counters(const hy_moe_exec * ex) { return &ex->counters; }
hy_slot_cache * hy_moe_exec_cache(hy_moe_exec * ex) { return ex->cache; }
hy_cost_model * hy_moe_exec_cost_model(hy_moe_exec * ex) { return &ex->model; }

int hy_moe_exec_compacts(const hy_moe_exec * ex) { return ex->compact; }

int hy_moe_exec_error(const hy_moe_exec * ex, const char ** message) {
    if (message != NULL) {
        *message = ex->err;
    }
    return ex->err_code;
}

int hy_moe_exec_last_cpu(const hy_moe_exec * ex, const int32_t ** experts) {
    *experts = ex->per.last_cpu;
    return ex->per.n_last_cpu;
}

const int32_t * hy_moe_exec_trace(const hy_moe_exec * ex, int64_t * n_ints) {
    *n_ints = ex->trace.n;
    return ex->trace.data;
}

void hy_moe_exec_trace_take(hy_moe_exec * ex) { ex->trace.n = 0; }

int64_t hy_moe_exec_graph_builds(const hy_moe_exec * ex) { return ex->graphs.builds; }
int hy_moe_exec_load_mode(const hy_moe_exec * ex) { return (int) ex->loads.mode; }
int hy_moe_exec_mode(const hy_moe_exec * ex) { return (int) ex->mode; }

void hy_moe_exec_plain_loads(hy_moe_exec * ex) {
    /* calls never leave uploads in flight, so the buffers can simply go unused */
    ex->loads.mode = HY_LOAD_COPY;
    ex->loads.from_frames = false;
}

int hy_moe_exec_reserve(hy_moe_exec * ex, int n_tokens) {
    const hy_moe_config * cfg = &ex->cfg;
    const int k = cfg->n_used, E = cfg->n_embd;
    const enum ggml_glu_op glu = (enum ggml_glu_op) cfg->glu;
    const int rows = hy_row_bucket(n_tokens * k); /* a round's row graph holds at most every row of the call;
                                                     a device that is not a CPU backend runs the call's graph */
    if (ex->mode == HY_MODE_DIRECT) {
        if (tier_views(ex) != HY_OK) {
            return -1;
        }
        if (hy_graph_get(&ex->graphs, HY_GRAPH_FULL, n_tokens, &ex->frames.w, ex->frames.w.down, k, E, glu) ==
            NULL) {
            return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graphs%s", "");
        }
        return HY_OK;
    }
    if (hy_graph_get(&ex->graphs, HY_GRAPH_FULL, n_tokens, &cfg->slots, cfg->slots.down, k, E, glu) == NULL ||
        (ex->compact && hy_graph_get(&ex->graphs, HY_GRAPH_ROWS, rows, &cfg->slots, cfg->slots.down, k, E,
                                     glu) == NULL) ||
        hy_graph_get(&ex->graphs, HY_GRAPH_SUM, n_tokens, NULL, NULL, k, E, glu) == NULL ||
        (!ex->compact && hy_graph_get(&ex->graphs, HY_GRAPH_CALL, n_tokens, &cfg->slots, cfg->slots.down, k, E,
                                      glu) == NULL)) {
        return hy_exec_fail(ex, HY_ERR_ALLOC, "layer %d: cannot allocate the expert graphs%s", "");
    }
    return HY_OK;
}

void hy_moe_exec_inject_load_failure(hy_moe_exec * ex, int after) { ex->loads.fail_after = after; }

void hy_moe_exec_set_clock(hy_moe_exec * ex, const double clock[HY_COST_N]) {
    ex->cfg.synthetic_clock = 1;
    memcpy(ex->cfg.clock, clock, sizeof(ex->cfg.clock));
}
