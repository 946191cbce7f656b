#include "moe_graphs.h"

#include <stdlib.h>
#include <string.h>

#include "ggml-alloc.h"

/* t + the bias row of each row's expert (ids: the same as the matrix's), or t where there is no bias */
static struct ggml_tensor * biased(struct ggml_context * ctx, struct ggml_tensor * t, struct ggml_tensor * bias,
                                   struct ggml_tensor * ids) {
    return bias == NULL ? t : ggml_add_id(ctx, t, bias, ids);
}

struct ggml_tensor * hy_build_expert_ffn(struct ggml_context * ctx, const hy_experts * w, struct ggml_tensor * x3,
                                         struct ggml_tensor * ids, enum ggml_glu_op glu) {
    struct ggml_tensor * act;
    if (w->gate_up != NULL) {
        act = ggml_glu(ctx, ggml_mul_mat_id(ctx, w->gate_up, x3, ids), glu, false);
    } else if (glu == GGML_GLU_OP_SWIGLU_OAI) {
        /* llama.cpp's order (and ffn.py's): up and its bias first, then gate and its bias */
        struct ggml_tensor * up = biased(ctx, ggml_mul_mat_id(ctx, w->up, x3, ids), w->up_b, ids);
        struct ggml_tensor * gate = biased(ctx, ggml_mul_mat_id(ctx, w->gate, x3, ids), w->gate_b, ids);
        act = ggml_swiglu_oai(ctx, gate, up, HY_SWIGLU_OAI_ALPHA, HY_SWIGLU_OAI_LIMIT);
    } else {
        struct ggml_tensor * gate = biased(ctx, ggml_mul_mat_id(ctx, w->gate, x3, ids), w->gate_b, ids);
        struct ggml_tensor * up = biased(ctx, ggml_mul_mat_id(ctx, w->up, x3, ids), w->up_b, ids);
        act = ggml_glu_split(ctx, gate, up, glu);
    }
    return biased(ctx, ggml_mul_mat_id(ctx, w->down, act, ids), w->down_b, ids);
}

bool hy_experts_buildable(const hy_experts * w, enum ggml_glu_op glu) {
    if (w->down == NULL) {
        return false;
    }
    if (w->gate_up != NULL) {
        return w->gate == NULL && w->up == NULL && w->gate_b == NULL && w->up_b == NULL &&
               glu != GGML_GLU_OP_SWIGLU_OAI && glu != GGML_GLU_OP_SWIGLU_CLAMP;
    }
    return w->gate != NULL && w->up != NULL && glu != GGML_GLU_OP_SWIGLU_CLAMP;
}

struct ggml_tensor ** hy_experts_field(hy_experts * out, const hy_experts * kinds, const struct ggml_tensor * like) {
    if (like == NULL) {
        return NULL;
    }
    struct ggml_tensor * const * in[] = { &kinds->gate_up, &kinds->gate, &kinds->up, &kinds->down,
                                          &kinds->gate_b, &kinds->up_b, &kinds->down_b };
    struct ggml_tensor ** to[] = { &out->gate_up, &out->gate, &out->up, &out->down,
                                   &out->gate_b, &out->up_b, &out->down_b };
    for (size_t i = 0; i < sizeof(in) / sizeof(in[0]); i++) {
        if (*in[i] == like) {
            return to[i];
        }
    }
    return NULL;
}

struct ggml_tensor * hy_build_weighted_sum(struct ggml_context * ctx, struct ggml_tensor * expert_out,
                                           struct ggml_tensor * weights) {
    /* llama.cpp's order: the weighted rows of the selected experts added one by one (moe/ffn.py) */
    struct ggml_tensor * y = ggml_mul(ctx, expert_out, weights);
    const int64_t n_embd = y->ne[0], k = y->ne[1], T = y->ne[2];
    const size_t row = y->nb[2];
    /* the same view as the Python builder makes (ggml_view_4d with its strides), so nothing differs */
    struct ggml_tensor * out = ggml_view_4d(ctx, y, n_embd, T, 1, 1, row, row, row, 0);
    for (int64_t j = 1; j < k; j++) {
        out = ggml_add(ctx, out, ggml_view_4d(ctx, y, n_embd, T, 1, 1, row, row, row, j * y->nb[1]));
    }
    if (k == 1) {
        out = ggml_cont(ctx, out); /* a view cannot be the output the caller copies out */
    }
    return out;
}

int hy_row_bucket(int n) {
    if (n <= HY_EXACT_ROWS) {
        return n;
    }
    int bucket = 1;
    while (bucket < n) {
        bucket *= 2;
    }
    return bucket;
}

hy_scratch * hy_scratch_new(ggml_backend_buffer_type_t buft) {
    hy_scratch * s = calloc(1, sizeof(*s));
    if (s != NULL) {
        s->buft = buft;
    }
    return s;
}

void hy_scratch_free(hy_scratch * s) {
    if (s == NULL) {
        return;
    }
    if (s->buffer != NULL) {
        ggml_backend_buffer_free(s->buffer);
    }
    free(s);
}

void hy_graph_cache_init(hy_graph_cache * c, hy_scratch * scratch) {
    memset(c, 0, sizeof(*c));
    c->scratch = scratch;
}

void hy_graph_cache_free(hy_graph_cache * c) {
    for (int i = 0; i < HY_GRAPH_CACHE; i++) {
        if (c->entries[i].ctx != NULL) {
            ggml_free(c->entries[i].ctx);
        }
        free(c->entries[i].meta);
    }
    memset(c, 0, sizeof(*c));
}

static size_t meta_size_for(int n_used) {
    /* inputs, the FFN's nodes (with gpt-oss's three bias adds), and the sum's k views and k-1 adds */
    const size_t n_tensors = 2 * (size_t) n_used + 24;
    return ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(n_tensors, false) + 1024;
}

static void unplace(struct ggml_context * ctx) {
    for (struct ggml_tensor * t = ggml_get_first_tensor(ctx); t != NULL; t = ggml_get_next_tensor(ctx, t)) {
        t->buffer = NULL;
        t->data = NULL;
    }
}

/* Lay the graph's tensors out from the start of the scratch buffer, growing it first when needed. */
static bool place(hy_graph_cache * c, hy_graph * g) {
    hy_scratch * s = c->scratch;
    unplace(g->ctx);
    const size_t need = ggml_backend_alloc_ctx_tensors_from_buft_size(g->ctx, s->buft);
    if (need > s->size || s->buffer == NULL) {
        size_t size = 4096;
        while (size < need) {
            size *= 2;
        }
        ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(s->buft, size);
        if (b == NULL) {
            return false;
        }
        ggml_backend_buffer_set_usage(b, GGML_BACKEND_BUFFER_USAGE_COMPUTE);
        if (s->buffer != NULL) {
            ggml_backend_buffer_free(s->buffer);
        }
        s->buffer = b;
        s->size = ggml_backend_buffer_get_size(b);
        s->epoch++;
    }
    struct ggml_tallocr ta = ggml_tallocr_new(s->buffer);
    for (struct ggml_tensor * t = ggml_get_first_tensor(g->ctx); t != NULL; t = ggml_get_next_tensor(g->ctx, t)) {
        if (t->view_src == NULL && ggml_tallocr_alloc(&ta, t) != GGML_STATUS_SUCCESS) {
            return false;
        }
    }
    for (struct ggml_tensor * t = ggml_get_first_tensor(g->ctx); t != NULL; t = ggml_get_next_tensor(g->ctx, t)) {
        if (t->view_src != NULL && ggml_backend_view_init(t) != GGML_STATUS_SUCCESS) {
            return false;
        }
    }
    g->epoch = s->epoch;
    return true;
}

static bool build(hy_graph * g, int kind, int n, const hy_experts * w, int n_used, int n_embd,
                  enum ggml_glu_op glu) {
    struct ggml_init_params params = { g->meta_size, g->meta, true };
    g->ctx = ggml_init(params);
    if (g->ctx == NULL) {
        return false;
    }
    struct ggml_context * ctx = g->ctx;
    g->x = g->ids = g->w = g->experts_in = g->out = NULL;
    if (kind == HY_GRAPH_SUM) {
        g->experts_in = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, n_used, n);
        g->w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, n_used, n);
        g->out = hy_build_weighted_sum(ctx, g->experts_in, g->w);
    } else {
        /* TOKEN: the n experts of one token, the resident graph's shape at decode */
        const int k = kind == HY_GRAPH_FULL || kind == HY_GRAPH_CALL ? n_used : kind == HY_GRAPH_TOKEN ? n : 1;
        const int T = kind == HY_GRAPH_TOKEN ? 1 : n;
        g->x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, T);
        g->ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
        struct ggml_tensor * down = hy_build_expert_ffn(ctx, w, g->x, g->ids, glu);
        if (kind == HY_GRAPH_FULL) {
            g->w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, n_used, n);
            g->out = hy_build_weighted_sum(ctx, down, g->w);
        } else {
            g->out = down;
        }
    }
    ggml_set_output(g->out);
    g->gf = ggml_new_graph_custom(ctx, 2 * (size_t) n_used + 24, false);
    ggml_build_forward_expand(g->gf, g->out);
    return true;
}

hy_graph * hy_graph_get(hy_graph_cache * c, int kind, int n, const hy_experts * w, const void * key, int n_used,
                        int n_embd, enum ggml_glu_op glu) {
    hy_graph * g = NULL;
    for (int i = 0; i < HY_GRAPH_CACHE && g == NULL; i++) {
        hy_graph * e = &c->entries[i];
        if (e->ctx != NULL && e->kind == kind && e->n == n && e->key == key) {
            g = e;
        }
    }
    if (g == NULL) {
        /* an empty entry, else the least recently used one */
        for (int i = 0; i < HY_GRAPH_CACHE; i++) {
            hy_graph * e = &c->entries[i];
            if (g == NULL || (g->ctx != NULL && (e->ctx == NULL || e->last_use < g->last_use))) {
                g = e;
            }
        }
        if (g->ctx != NULL) {
            ggml_free(g->ctx);
            g->ctx = NULL;
        }
        const size_t size = meta_size_for(n_used);
        if (g->meta == NULL || g->meta_size < size) {
            free(g->meta);
            g->meta = malloc(size);
            g->meta_size = g->meta != NULL ? size : 0;
            if (g->meta == NULL) {
                return NULL;
            }
        }
        if (!build(g, kind, n, w, n_used, n_embd, glu)) {
            return NULL;
        }
        g->kind = kind;
        g->n = n;
        g->key = key;
        g->epoch = (uint64_t) -1;
        c->builds++;
    }
    if (g->epoch != c->scratch->epoch || c->scratch->buffer == NULL) {
        if (!place(c, g)) {
            return NULL;
        }
    }
    g->last_use = ++c->clock;
    return g;
}
