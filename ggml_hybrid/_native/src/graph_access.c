#include "graph_access.h"

#include "ggml-impl.h"

int hy_graph_n_leafs(struct ggml_cgraph * g) { return g->n_leafs; }
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i) { return g->leafs[i]; }
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t) {
    return ggml_hash_contains(&g->visited_hash_set, t);
}

/* The index of the graph's first leaf that has no memory, is no view and is not marked as an input (a scheduler
   would compute it from garbage), or -1: the check every allocation makes, in one call. */
int hy_graph_bare_leaf(struct ggml_cgraph * g) {
    for (int i = 0; i < g->n_leafs; i++) {
        const struct ggml_tensor * t = g->leafs[i];
        if (t->data == NULL && t->view_src == NULL && (t->flags & GGML_TENSOR_FLAG_INPUT) == 0) {
            return i;
        }
    }
    return -1;
}

/* ggml_backend_sched_set_tensor_backend for each of n (tensor, backend) pairs: a scheduler's pins, applied again
   after each reset in one call rather than one call a node. */
void hy_sched_pin(ggml_backend_sched_t sched, struct ggml_tensor ** tensors, ggml_backend_t * backends, int n) {
    for (int i = 0; i < n; i++) {
        ggml_backend_sched_set_tensor_backend(sched, tensors[i], backends[i]);
    }
}

/* Forget the memory a scheduler gave the graph's tensors (it may be freed by now), keeping tensors
   in the buffers listed: only pointer values are compared. Only tensor structs inside the live
   context pools listed ([start, end) pairs) are touched: a tensor of a freed context is never read
   or written. Returns how many tensors lie in no live pool (their context was freed). */
int hy_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                              const uintptr_t * pools, int n_pools) {
    int dangling = 0;
    for (int pass = 0; pass < 2; pass++) {
        const int n = pass == 0 ? g->n_nodes : g->n_leafs;
        struct ggml_tensor ** ts = pass == 0 ? g->nodes : g->leafs;
        for (int i = 0; i < n; i++) {
            struct ggml_tensor * t = ts[i];
            const uintptr_t a = (uintptr_t) t;
            bool live = false;
            for (int k = 0; k < n_pools && !live; k++) {
                live = a >= pools[2 * k] && a < pools[2 * k + 1];
            }
            dangling += !live;
            if (!live || t->buffer == NULL) {
                continue;
            }
            bool user = false;
            for (int k = 0; k < n_keep && !user; k++) {
                user = t->buffer == keep[k];
            }
            if (!user) {
                t->buffer = NULL;
                t->data = NULL;
            }
        }
    }
    return dangling;
}
