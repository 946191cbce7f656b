#include "moe_policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- slot cache (ggml_hybrid/moe/slot_cache.py) ------------------------------------------------ */

hy_slot_cache * hy_cache_new(int n_experts, int n_slots, int policy) {
    if (n_experts < 1 || n_slots < 1 || n_slots > n_experts ||
        (policy != HY_POLICY_LRU && policy != HY_POLICY_LFU && policy != HY_POLICY_FREQ)) {
        return NULL;
    }
    hy_slot_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return NULL;
    }
    c->n_experts = n_experts;
    c->n_slots = n_slots;
    c->policy = policy;
    c->slot_expert = malloc(sizeof(int32_t) * n_slots);
    c->where = malloc(sizeof(int32_t) * n_experts);
    c->recency = malloc(sizeof(int64_t) * n_experts);
    c->uses = malloc(sizeof(int64_t) * n_experts);
    c->requests = malloc(sizeof(int64_t) * n_experts);
    c->last_request = malloc(sizeof(int64_t) * n_experts);
    c->uncommitted = malloc(sizeof(int32_t) * n_slots);
    c->plan.hit_expert = malloc(sizeof(int32_t) * n_slots);
    c->plan.hit_slot = malloc(sizeof(int32_t) * n_slots);
    c->plan.load_expert = malloc(sizeof(int32_t) * n_experts);
    c->plan.load_slot = malloc(sizeof(int32_t) * n_experts);
    c->plan.load_round = malloc(sizeof(int32_t) * n_experts);
    c->plan.evicted_expert = malloc(sizeof(int32_t) * n_experts);
    c->plan.evicted_round = malloc(sizeof(int32_t) * n_experts);
    c->s_hit_slots = malloc(sizeof(int32_t) * n_slots);
    c->s_miss = malloc(sizeof(int32_t) * n_experts);
    c->s_miss_rows = malloc(sizeof(int32_t) * n_experts);
    c->s_cand = malloc(sizeof(int32_t) * n_slots);
    c->s_protected = malloc(n_slots);
    if (!c->slot_expert || !c->where || !c->recency || !c->uses || !c->requests || !c->last_request ||
        !c->uncommitted || !c->plan.hit_expert || !c->plan.hit_slot || !c->plan.load_expert || !c->plan.load_slot ||
        !c->plan.load_round ||
        !c->plan.evicted_expert || !c->plan.evicted_round || !c->s_hit_slots || !c->s_miss || !c->s_miss_rows ||
        !c->s_cand || !c->s_protected) {
        hy_cache_free(c);
        return NULL;
    }
    hy_cache_reset(c);
    return c;
}

void hy_cache_free(hy_slot_cache * c) {
    if (c == NULL) {
        return;
    }
    free(c->slot_expert); free(c->where); free(c->recency); free(c->uses); free(c->uncommitted);
    free(c->requests); free(c->last_request);
    free(c->plan.hit_expert); free(c->plan.hit_slot); free(c->plan.load_expert); free(c->plan.load_slot);
    free(c->plan.load_round); free(c->plan.evicted_expert); free(c->plan.evicted_round);
    free(c->s_hit_slots); free(c->s_miss); free(c->s_miss_rows); free(c->s_cand); free(c->s_protected);
    free(c);
}

void hy_cache_reset(hy_slot_cache * c) {
    for (int s = 0; s < c->n_slots; s++) {
        c->slot_expert[s] = -1;
        c->uncommitted[s] = -1;
    }
    for (int e = 0; e < c->n_experts; e++) {
        c->where[e] = -1;
        c->recency[e] = 0;
        c->uses[e] = 0;
        c->requests[e] = 0;
        c->last_request[e] = 0;
    }
    c->n_uncommitted = 0;
    c->tick = 0;
    memset(&c->counters, 0, sizeof(c->counters));
    c->plan.n_rounds = c->plan.n_hits = c->plan.n_loads = c->plan.n_evicted = 0;
}

int hy_cache_slot_of(const hy_slot_cache * c, int expert) {
    const int s = c->where[expert];
    return (s >= 0 && c->uncommitted[s] == expert) ? -1 : s;
}

void hy_cache_commit(hy_slot_cache * c, int slot, int expert) {
    if (c->uncommitted[slot] == expert) {
        c->uncommitted[slot] = -1;
        c->n_uncommitted--;
    }
}

static void drop_uncommitted(hy_slot_cache * c) {
    for (int s = 0; s < c->n_slots && c->n_uncommitted > 0; s++) {
        const int e = c->uncommitted[s];
        if (e < 0) {
            continue;
        }
        if (c->slot_expert[s] == e) {
            c->slot_expert[s] = -1;
            c->where[e] = -1;
            c->recency[e] = 0;
            c->uses[e] = 0;
            c->counters.invalidated++;
        }
        c->uncommitted[s] = -1;
        c->n_uncommitted--;
    }
    c->n_uncommitted = 0;
}

static void use(hy_slot_cache * c, int e) {
    c->recency[e] = c->tick;
    c->uses[e] += 1;
}

static void request(hy_slot_cache * c, int e) {
    c->requests[e] += 1;
    c->last_request[e] = c->tick;
}

void hy_cache_note_cpu(hy_slot_cache * c, const int32_t * experts, int n) {
    for (int i = 0; i < n; i++) {
        request(c, experts[i]);
    }
}

/* victim order: lru (recency, slot); lfu (uses, recency, slot); freq (requests, last request, slot) */
static bool victim_before(const hy_slot_cache * c, int sa, int sb) {
    const int ea = c->slot_expert[sa], eb = c->slot_expert[sb];
    if (c->policy == HY_POLICY_FREQ) {
        if (c->requests[ea] != c->requests[eb]) {
            return c->requests[ea] < c->requests[eb];
        }
        if (c->last_request[ea] != c->last_request[eb]) {
            return c->last_request[ea] < c->last_request[eb];
        }
        return sa < sb;
    }
    if (c->policy == HY_POLICY_LFU && c->uses[ea] != c->uses[eb]) {
        return c->uses[ea] < c->uses[eb];
    }
    if (c->recency[ea] != c->recency[eb]) {
        return c->recency[ea] < c->recency[eb];
    }
    return sa < sb;
}

/* misses in load order: decreasing rows, ties by increasing expert id */
static bool miss_before(int ra, int ea, int rb, int eb) {
    return ra != rb ? ra > rb : ea < eb;
}

const hy_plan * hy_cache_plan(hy_slot_cache * c, const int32_t * experts, const int32_t * rows, int n,
                              bool deferred_loads) {
    hy_plan * p = &c->plan;
    p->n_rounds = p->n_hits = p->n_loads = p->n_evicted = 0;
    if (c->n_uncommitted > 0) {
        drop_uncommitted(c);
    }
    c->tick += 1;
    for (int i = 0; i < n; i++) {
        request(c, experts[i]);
    }
    c->counters.calls += 1;
    c->counters.distinct += n;
    if (n == 0) {
        return p;
    }
    /* hits in increasing slot order; misses in load order (insertion sorts: n is small) */
    int n_hit = 0, n_miss = 0;
    for (int i = 0; i < n; i++) {
        const int e = experts[i];
        const int s = c->where[e];
        if (s >= 0) {
            int j = n_hit++;
            while (j > 0 && c->s_hit_slots[j - 1] > s) {
                c->s_hit_slots[j] = c->s_hit_slots[j - 1];
                j--;
            }
            c->s_hit_slots[j] = s;
        } else {
            int j = n_miss++;
            while (j > 0 && miss_before(rows[i], e, c->s_miss_rows[j - 1], c->s_miss[j - 1])) {
                c->s_miss[j] = c->s_miss[j - 1];
                c->s_miss_rows[j] = c->s_miss_rows[j - 1];
                j--;
            }
            c->s_miss[j] = e;
            c->s_miss_rows[j] = rows[i];
        }
    }
    memset(c->s_protected, 0, c->n_slots);
    for (int i = 0; i < n_hit; i++) {
        const int s = c->s_hit_slots[i];
        const int e = c->slot_expert[s];
        p->hit_expert[i] = e;
        p->hit_slot[i] = s;
        use(c, e);
        c->s_protected[s] = 1;
    }
    p->n_hits = n_hit;
    c->counters.hits += n_hit;
    c->counters.misses += n_miss;

    int capacity = c->n_slots - n_hit;
    int pos = 0;
    bool first = true;
    while (first || pos < n_miss) {
        int batch = n_miss - pos < capacity ? n_miss - pos : capacity;
        /* targets: the empty slots by increasing id, then the best victims */
        int n_target = 0;
        int32_t * targets = c->s_cand; /* reused: free slots first */
        for (int s = 0; s < c->n_slots && n_target < batch; s++) {
            if (c->slot_expert[s] < 0) {
                targets[n_target++] = s;
            }
        }
        const int need = batch - n_target;
        if (need > 0) {
            /* the `need` best victims among occupied, unprotected slots (selection, stable by order) */
            for (int k = 0; k < need; k++) {
                int best = -1;
                for (int s = 0; s < c->n_slots; s++) {
                    if (c->slot_expert[s] < 0 || c->s_protected[s]) {
                        continue;
                    }
                    if (best < 0 || victim_before(c, s, best)) {
                        best = s;
                    }
                }
                const int victim = c->slot_expert[best];
                p->evicted_expert[p->n_evicted] = victim;
                p->evicted_round[p->n_evicted] = p->n_rounds;
                p->n_evicted++;
                c->where[victim] = -1;
                c->recency[victim] = 0;
                c->uses[victim] = 0;
                c->slot_expert[best] = -1;
                c->s_protected[best] = 1; /* taken for this round's load: not a victim again */
                targets[n_target++] = best;
            }
            c->counters.evictions += need;
        }
        for (int k = 0; k < batch; k++) {
            const int e = c->s_miss[pos + k];
            const int s = targets[k];
            c->slot_expert[s] = e;
            c->where[e] = s;
            c->uses[e] = 0;
            use(c, e);
            p->load_expert[p->n_loads] = e;
            p->load_slot[p->n_loads] = s;
            p->load_round[p->n_loads] = p->n_rounds;
            p->n_loads++;
            if (deferred_loads) {
                if (c->uncommitted[s] < 0) {
                    c->n_uncommitted++;
                }
                c->uncommitted[s] = e;
            }
        }
        pos += batch;
        p->n_rounds++;
        /* after round 1 everything computed so far may be evicted, but not this round's own loads */
        memset(c->s_protected, 0, c->n_slots);
        capacity = c->n_slots;
        first = false;
    }
    c->counters.rounds += p->n_rounds;
    return p;
}

/* A lookahead prefetch of `expert` (not resident) into the first empty slot, else the best victim whose expert is
   not marked in `keep` (the call's other predictions) nor an uncommitted load; its load stays uncommitted until
   the caller's copy is done. The expert ranks as used at the last call's tick, with no uses. Returns the slot,
   with the displaced expert in *evicted (-1: none), or -1 when every slot is kept (slot_cache.py: prefetch). */
int hy_cache_prefetch(hy_slot_cache * c, int expert, const uint8_t * keep, int * evicted) {
    *evicted = -1;
    if (c->where[expert] >= 0) {
        return -1;
    }
    int slot = -1;
    for (int s = 0; s < c->n_slots && slot < 0; s++) {
        if (c->slot_expert[s] < 0) {
            slot = s;
        }
    }
    if (slot < 0) {
        for (int s = 0; s < c->n_slots; s++) {
            const int e = c->slot_expert[s];
            if (keep[e] || c->uncommitted[s] >= 0) {
                continue;
            }
            if (slot < 0 || victim_before(c, s, slot)) {
                slot = s;
            }
        }
        if (slot < 0) {
            return -1;
        }
        const int victim = c->slot_expert[slot];
        *evicted = victim;
        c->where[victim] = -1;
        c->recency[victim] = 0;
        c->uses[victim] = 0;
    }
    c->slot_expert[slot] = expert;
    c->where[expert] = slot;
    c->recency[expert] = c->tick;
    c->uses[expert] = 0;
    if (c->uncommitted[slot] < 0) {
        c->n_uncommitted++;
    }
    c->uncommitted[slot] = expert;
    return slot;
}

/* ---- the CPU share (ggml_hybrid/moe/cpu_share.py) ---------------------------------------------- */

int hy_n_cpu_for_share(uint64_t num, uint64_t den, int n) {
    if (den == 0 || n <= 0) {
        return 0;
    }
    /* floor(num/den * n + 1/2) = floor((2 num n + den) / (2 den)), exact in 128 bits */
    const unsigned __int128 k = ((unsigned __int128) 2 * num * (unsigned) n + den) / ((unsigned __int128) 2 * den);
    return k > (unsigned __int128) n ? n : (int) k;
}

#define HY_RIDGE 1e-6

void hy_cost_init(hy_cost_model * m, double alpha, double hysteresis, const double prior[HY_COST_N]) {
    memset(m, 0, sizeof(*m));
    m->alpha = alpha;
    m->hysteresis = hysteresis;
    memcpy(m->prior, prior, sizeof(m->prior));
}

void hy_cost_init_fixed(hy_cost_model * m, double hysteresis, const double coef[HY_COST_N]) {
    memset(m, 0, sizeof(*m));
    m->alpha = 0.25;
    m->hysteresis = hysteresis;
    m->fixed = true;
    memcpy(m->coef, coef, sizeof(m->coef));
}

static void ema(const hy_cost_model * m, double * stats, const double * values, int n) {
    const double keep = 1.0 - m->alpha;
    for (int i = 0; i < n; i++) {
        stats[i] = keep * stats[i] + m->alpha * values[i];
    }
}

void hy_cost_observe_cpu(hy_cost_model * m, double x, double r, double t) {
    if (m->fixed) {
        return;
    }
    const double v[5] = { x * x, x * r, r * r, x * t, r * t };
    ema(m, m->cpu, v, 5);
    m->n_cpu++;
}

void hy_cost_observe_job(hy_cost_model * m, double t) {
    if (m->fixed) {
        return;
    }
    const double v[2] = { t, 1.0 };
    ema(m, m->job, v, 2);
    m->n_job++;
}

void hy_cost_observe_load(hy_cost_model * m, double x, double t) {
    if (m->fixed) {
        return;
    }
    const double v[2] = { t, x };
    ema(m, m->load, v, 2);
    m->n_load++;
}

void hy_cost_observe_device(hy_cost_model * m, double r, double t) {
    if (m->fixed) {
        return;
    }
    const double v[2] = { t, r };
    ema(m, m->dev, v, 2);
    if (m->round_s > 0.0) {
        const double w[5] = { 1.0, r, r * r, t, r * t };
        ema(m, m->dev_fit, w, 5);
    }
    m->n_dev++;
}

static double objective(double m11, double m12, double m22, double r1, double r2, double u, double v) {
    return 0.5 * (m11 * u * u + 2.0 * m12 * u * v + m22 * v * v) - r1 * u - r2 * v;
}

/* The per-row pull of a device round's fit: a thousand times the fixed cost's, so that rounds of one row count
   (decode's hits, which cannot tell a round's fixed cost from its rows') go to the fixed cost, and the per-row
   cost keeps its prior until rounds of several row counts tell them apart. */
#define HY_RIDGE_DEVICE_ROW 1e-3

/* t = a x + b r by the EMAs s (x^2, x r, r^2, x t, r t), in units of the priors a0, b0, pulled toward them by
   ridge1 and ridge2 (cpu_share.py: CostModel._fit) */
static void fit2(const double * s, double ridge1, double ridge2, double a0, double b0, double * a, double * b) {
    const double sbb = s[0], sbr = s[1], srr = s[2], sbt = s[3], srt = s[4];
    double m11 = a0 * a0 * sbb, m12 = a0 * b0 * sbr, m22 = b0 * b0 * srr;
    double r1 = a0 * sbt, r2 = b0 * srt;
    if (!(m11 + m22 > 0.0)) {
        *a = a0;
        *b = b0;
        return;
    }
    double lam1 = ridge1 * m11, lam2 = ridge2 * m22;
    if (lam1 == 0.0 || lam2 == 0.0) {
        lam1 = ridge1 * (m11 + m22);
        lam2 = ridge2 * (m11 + m22);
    }
    m11 += lam1;
    m22 += lam2;
    r1 += lam1;
    r2 += lam2;
    const double det = m11 * m22 - m12 * m12;
    double u = (m22 * r1 - m12 * r2) / det;
    double v = (m11 * r2 - m12 * r1) / det;
    if (u < 0.0 || v < 0.0) {
        const double v0 = fmax(0.0, r2 / m22), u1 = fmax(0.0, r1 / m11);
        if (objective(m11, m12, m22, r1, r2, u1, 0.0) < objective(m11, m12, m22, r1, r2, 0.0, v0)) {
            u = u1;
            v = 0.0;
        } else { /* ties: the first candidate, as Python's min() */
            u = 0.0;
            v = v0;
        }
    }
    *a = a0 * u;
    *b = b0 * v;
}

void hy_cost_estimate(const hy_cost_model * m, int64_t B, double out[HY_COST_N]) {
    if (m->fixed) {
        memcpy(out, m->coef, sizeof(double) * HY_COST_N);
        return;
    }
    const double * p = m->prior; /* per-row priors are per expert byte too */
    fit2(m->cpu, HY_RIDGE, HY_RIDGE, p[HY_COST_CPU_PER_BYTE], p[HY_COST_CPU_PER_ROW] * (double) B,
         &out[HY_COST_CPU_PER_BYTE], &out[HY_COST_CPU_PER_ROW]);
    out[HY_COST_LOAD_PER_BYTE] = m->load[1] > 0.0 ? m->load[0] / m->load[1] : p[HY_COST_LOAD_PER_BYTE];
    if (m->round_s > 0.0) {
        double round;
        fit2(m->dev_fit, HY_RIDGE, HY_RIDGE_DEVICE_ROW, m->round_s, p[HY_COST_DEVICE_PER_ROW] * (double) B, &round,
             &out[HY_COST_DEVICE_PER_ROW]);
    } else {
        out[HY_COST_DEVICE_PER_ROW] = m->dev[1] > 0.0 ? m->dev[0] / m->dev[1] : p[HY_COST_DEVICE_PER_ROW] * (double) B;
    }
    out[HY_COST_CPU_PER_JOB] = m->job[1] > 0.0 ? m->job[0] / m->job[1] : p[HY_COST_CPU_PER_JOB];
}

int hy_cost_rounds(int n_hits, int n_loads, int n_slots) {
    if (n_hits + n_loads == 0) {
        return 0;
    }
    if (n_slots <= 0) { /* no cache to count rounds in: one */
        return 1;
    }
    const int first = n_slots > n_hits ? n_slots - n_hits : 0; /* round 1 loads into the slots its hits leave */
    return n_loads <= first ? 1 : 1 + (n_loads - first + n_slots - 1) / n_slots;
}

double hy_cost_round(const hy_cost_model * m, int64_t B) {
    if (m->fixed || !(m->round_s > 0.0)) {
        return m->round_s;
    }
    double round, per_row;
    fit2(m->dev_fit, HY_RIDGE, HY_RIDGE_DEVICE_ROW, m->round_s, m->prior[HY_COST_DEVICE_PER_ROW] * (double) B, &round,
         &per_row);
    return round;
}

static double makespan(const double * c, int64_t B, int k, int64_t cpu_rows, int n_dev, int64_t dev_rows,
                       double round_cost) {
    const double job = k ? c[HY_COST_CPU_PER_JOB] : 0.0;
    const double cpu = job + c[HY_COST_CPU_PER_BYTE] * (double) B * (double) k + c[HY_COST_CPU_PER_ROW] * (double) cpu_rows;
    double dev = c[HY_COST_LOAD_PER_BYTE] * (double) B * (double) n_dev + c[HY_COST_DEVICE_PER_ROW] * (double) dev_rows;
    if (round_cost > 0.0) {
        dev += round_cost;
    }
    return cpu > dev ? cpu : dev; /* Python's max(): the first on a tie, equal anyway */
}

int hy_cost_choose(hy_cost_model * m, int64_t B, int64_t hit_rows, const int32_t * miss_rows, int n) {
    return hy_cost_choose_rounds(m, B, hit_rows, hit_rows > 0, 0, miss_rows, n);
}

int hy_cost_choose_rounds(hy_cost_model * m, int64_t B, int64_t hit_rows, int n_hits, int n_slots,
                          const int32_t * miss_rows, int n) {
    if (n == 0) {
        return 0;
    }
    double c[HY_COST_N];
    hy_cost_estimate(m, B, c);
    const double round = hy_cost_round(m, B);
    int64_t total = hit_rows;
    for (int i = 0; i < n; i++) {
        total += miss_rows[i];
    }
    /* the sweep over n_cpu = 0..n (the CPU taking the first n_cpu misses): the minimum, ties by the
       smallest n_cpu; and the span of the remembered share's n_cpu */
    int k_prev = -1;
    if (m->has_share) {
        k_prev = hy_n_cpu_for_share((uint64_t) m->share_num, (uint64_t) m->share_den, n);
    }
    int best = 0;
    double best_span = 0.0, prev_span = 0.0;
    int64_t cpu_rows = 0;
    for (int k = 0; k <= n; k++) {
        if (k) {
            cpu_rows += miss_rows[k - 1];
        }
        const double rounds = round > 0.0 ? (double) hy_cost_rounds(n_hits, n - k, n_slots) : 0.0;
        const double span = makespan(c, B, k, cpu_rows, n - k, total - cpu_rows, round * rounds);
        if (k == 0 || span < best_span) {
            best = k;
            best_span = span;
        }
        if (k == k_prev) {
            prev_span = span;
        }
    }
    if (k_prev < 0 || (best != k_prev && best_span < (1.0 - m->hysteresis) * prev_span)) {
        m->has_share = true;
        m->share_num = best;
        m->share_den = n;
        return best;
    }
    return k_prev;
}

/* the order the CPU takes misses in: increasing rows, then the least likely to be reused (fewest requests, then
   the least recent request), then increasing expert id */
static bool cpu_before(const hy_slot_cache * c, int ra, int ea, int rb, int eb) {
    if (ra != rb) {
        return ra < rb;
    }
    if (c->requests[ea] != c->requests[eb]) {
        return c->requests[ea] < c->requests[eb];
    }
    if (c->last_request[ea] != c->last_request[eb]) {
        return c->last_request[ea] < c->last_request[eb];
    }
    return ea < eb;
}

int hy_split_misses(const hy_slot_cache * cache, const int32_t * experts, const int32_t * rows, int n,
                    const int32_t * n_cpu_table, hy_cost_model * model, int64_t expert_bytes,
                    int32_t * miss_expert, int32_t * miss_rows, int * n_miss) {
    int64_t hit_rows = 0;
    int m = 0, n_hits = 0;
    for (int i = 0; i < n; i++) {
        const int e = experts[i], r = rows[i];
        if (hy_cache_slot_of(cache, e) >= 0) {
            hit_rows += r;
            n_hits++;
            continue;
        }
        int j = m++; /* insertion sort: n is small */
        while (j > 0 && cpu_before(cache, r, e, miss_rows[j - 1], miss_expert[j - 1])) {
            miss_expert[j] = miss_expert[j - 1];
            miss_rows[j] = miss_rows[j - 1];
            j--;
        }
        miss_expert[j] = e;
        miss_rows[j] = r;
    }
    *n_miss = m;
    return n_cpu_table != NULL ? n_cpu_table[m]
                               : hy_cost_choose_rounds(model, expert_bytes, hit_rows, n_hits, cache->n_slots, miss_rows, m);
}
