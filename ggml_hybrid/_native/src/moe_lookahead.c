/* The lookahead (moe_prefetch): a call predicts the next disk layer's experts by that layer's router applied to its
   own input (predict, as soon as its own loads are planned: with a host tier the predicted misses it lacks are read
   ahead then), and after the call loads the predicted misses into the next layer's slots (prefetch); the next
   layer's call waits for those loads, commits them and judges the prediction (settle_prefetch). Only where and
   when an expert is loaded changes, never a result. moe_exec.h: hy_moe_exec_set_prefetch states the rules. */
#include "moe_exec_state.h"

#include "clock.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* realloc array `p` to `n` elements of its type; false (p unchanged) when out of memory */
#define GROW(p, n) ((tmp = realloc((p), sizeof(*(p)) * (n))) != NULL && ((p) = tmp, true))

void hy_moe_exec_set_prefetch(hy_moe_exec * ex, hy_moe_exec * next, const float * router, const float * router_bias,
                              const float * select_bias, int max_experts, int max_tokens, int max_read_ahead) {
    hy_lookahead * a = &ex->ahead;
    a->next = NULL;
    if (next == NULL || next == ex || (router == NULL && next->cfg.route == NULL)) {
        return;
    }
    const size_t X = (size_t) next->cfg.n_expert;
    void * tmp;
    if (!(GROW(a->scores, X) && GROW(a->votes, X) && GROW(a->cand, X))) {
        return; /* out of memory: no prefetch, which changes no result */
    }
    a->next = next;
    a->router = router;
    a->router_bias = router_bias;
    a->select_bias = select_bias;
    a->max_experts = max_experts;
    a->max_tokens = max_tokens;
    a->max_read_ahead = max_read_ahead;
}

int hy_moe_exec_predicted(const hy_moe_exec * ex, const int32_t ** experts) {
    *experts = ex->pred.list;
    return ex->pred.n;
}

/* The previous layer's prefetch into this layer: its loads waited for and committed, its prediction scored
   against this call's experts (and the host tier's read-ahead for it judged). */
int settle_prefetch(hy_moe_exec * ex, hy_call * call) {
    hy_prediction * pred = &ex->pred;
    if (pred->n_pf > 0) {
        wait_loads(ex);
        for (int i = 0; i < pred->n_pf; i++) {
            hy_cache_commit(ex->cache, pred->pf_slot[i], pred->pf_expert[i]);
        }
        pred->n_pf = 0;
    }
    if (!pred->pending) {
        return HY_OK;
    }
    if (ex->cfg.tier != NULL) { /* the host tier judges what it read ahead for this call */
        hy_tier_settle(ex->cfg.tier, ex->cfg.tier_layer, ex->per.experts, call->n_experts);
    }
    hy_moe_counters * c = &ex->counters;
    c->predicted += pred->n;
    c->predicted_of += call->n_experts;
    for (int i = 0; i < call->n_experts; i++) {
        const int e = ex->per.experts[i];
        c->predicted_right += pred->marked[e];
        if (pred->prefetched[e]) {
            c->prefetch_used++;
            pred->prefetched[e] = 0;
        }
    }
    for (int i = 0; i < pred->n; i++) {
        const int e = pred->list[i];
        if (pred->prefetched[e]) {
            c->prefetch_wasted++;
            pred->prefetched[e] = 0;
        }
        pred->marked[e] = 0;
    }
    pred->pending = false;
    return HY_OK;
}

/* each token's top k of next by score (ties: the lower id), counted in ahead.votes */
static void vote(hy_moe_exec * ex, const float * x) {
    hy_lookahead * a = &ex->ahead;
    const hy_moe_exec * nx = a->next;
    const int E = ex->cfg.n_embd, X = nx->cfg.n_expert, k = nx->cfg.n_used;
    for (int e = 0; e < X; e++) {
        const float * w = a->router + (size_t) e * E;
        double s = 0.0;
        for (int d = 0; d < E; d++) {
            s += (double) w[d] * (double) x[d];
        }
        if (a->router_bias != NULL) {
            s += (double) a->router_bias[e];
        }
        if (a->select_bias != NULL) {
            s = 1.0 / (1.0 + exp(-s)) + (double) a->select_bias[e];
        }
        a->scores[e] = isnan(s) ? -INFINITY : s; /* a non-finite input predicts, it does not crash */
        a->cand[e] = 0;
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < X; e++) {
            if (!a->cand[e] && (best < 0 || a->scores[e] > a->scores[best])) {
                best = e;
            }
        }
        a->votes[best]++;
        a->cand[best] = 1;
    }
}

/* A prediction of nx's coming call withdrawn unjudged (nx's call never ran, or the predicting call failed): what
   it loaded or read ahead is wasted. */
void withdraw_prediction(hy_moe_exec * nx) {
    hy_prediction * pred = &nx->pred;
    if (!pred->pending) {
        return;
    }
    if (nx->cfg.tier != NULL) {
        hy_tier_settle(nx->cfg.tier, nx->cfg.tier_layer, NULL, 0);
    }
    for (int i = 0; i < pred->n; i++) {
        const int e = pred->list[i];
        nx->counters.prefetch_wasted += pred->prefetched[e];
        pred->prefetched[e] = 0;
        pred->marked[e] = 0;
    }
    pred->pending = false;
}

/* As soon as the call's own loads are planned (their reads queued first): predict the next layer's experts from
   this call's x, and with a host tier start reading the predicted misses it lacks, so that the reads overlap this
   call's loads and compute as well as the next layer's dense part. */
int predict(hy_moe_exec * ex, hy_call * call) {
    hy_lookahead * a = &ex->ahead;
    hy_moe_exec * nx = a->next;
    if (nx == NULL || call->T > a->max_tokens) {
        return HY_OK;
    }
    const int64_t t0 = hy_now_ns();
    if (!call->x_read && a->router != NULL) {
        hy_read_x(ex, call);
    }
    const int X = nx->cfg.n_expert;
    hy_prediction * pred = &nx->pred;
    withdraw_prediction(nx); /* never judged (the next layer's call did not run) */
    memset(a->votes, 0, sizeof(int32_t) * X);
    for (int t = 0; t < call->T; t++) {
        if (a->router != NULL) {
            vote(ex, ex->buf.x + (size_t) t * ex->cfg.n_embd);
        } else { /* the oracle (benchmarks, moe_route_trace): the next layer's coming rows of its trace */
            const int32_t * row =
                nx->cfg.route + (size_t) ((nx->trace.route_pos + t) % nx->cfg.n_route) * nx->cfg.n_used;
            for (int j = 0; j < nx->cfg.n_used; j++) {
                a->votes[row[j]]++;
            }
        }
    }
    /* the prediction by decreasing votes, ties by increasing id: the order the misses among it load in */
    int n_pred = 0, n_cand = 0;
    for (int e = 0; e < X; e++) {
        if (a->votes[e] == 0) {
            continue;
        }
        pred->marked[e] = 1;
        int j = n_pred++;
        while (j > 0 && a->votes[pred->list[j - 1]] < a->votes[e]) {
            pred->list[j] = pred->list[j - 1];
            j--;
        }
        pred->list[j] = e;
    }
    for (int i = 0; i < n_pred; i++) {
        if (nx->cache->where[pred->list[i]] < 0) {
            a->cand[n_cand++] = pred->list[i];
        }
    }
    pred->n = n_pred;
    pred->pending = true;
    call->predicted = true;
    call->n_cand = n_cand;
    /* with a host tier, the predicted misses it lacks are read ahead now, without waiting */
    hy_tier * tier = nx->cfg.tier;
    if (tier != NULL && n_cand > 0 && a->max_read_ahead > 0) {
        hy_tier_read_ahead(tier, nx->cfg.tier_layer, a->cand, n_cand < a->max_read_ahead ? n_cand : a->max_read_ahead);
    }
    nx->counters.prefetch_ns += hy_now_ns() - t0;
    return HY_OK;
}

/* After a call: load the predicted misses (predict above) into the next layer's free or evictable slots. */
int prefetch(hy_moe_exec * ex, hy_call * call) {
    hy_lookahead * a = &ex->ahead;
    hy_moe_exec * nx = a->next;
    const int n_cand = call->n_cand;
    if (nx == NULL || n_cand == 0 || a->max_experts <= 0) {
        return HY_OK;
    }
    const int64_t t0 = hy_now_ns();
    hy_tier * tier = nx->cfg.tier;
    hy_prediction * pred = &nx->pred;
    /* loads read the mapping (or the tier): a changed file is left to the next call to report */
    if (tier != NULL || call->checked || hy_mapping_unchanged(ex)) {
        for (int i = 0, n_loaded = 0; i < n_cand && n_loaded < a->max_experts; i++) {
            int evicted;
            const int e = a->cand[i];
            if (tier != NULL && !hy_tier_holds(tier, nx->cfg.tier_layer, e)) {
                continue; /* still being read: the call loads it from the tier, never waiting here for the disk */
            }
            const int slot = hy_cache_prefetch(nx->cache, e, pred->marked, &evicted);
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
            pred->prefetched[e] = 1;
            pred->pf_expert[pred->n_pf] = e;
            pred->pf_slot[pred->n_pf] = slot;
            pred->n_pf++;
        }
    }
    nx->counters.prefetch_ns += hy_now_ns() - t0;
    return HY_OK;
}
