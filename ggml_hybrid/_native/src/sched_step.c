#include "sched_step.h"

#include "ggml-backend-impl.h"

/* Whether GGML can copy a buffer's tensors back out: a repacked buffer has no get_tensor (and
   ggml_backend_tensor_get would call NULL). */
bool hy_buffer_readable(ggml_backend_buffer_t buf) {
    return buf != NULL && buf->iface.get_tensor != NULL;
}

/* Where a tensor's memory lives, by GGML's own rule (a view's is its source's). */
static ggml_backend_buffer_t buffer_of(const struct ggml_tensor * t) {
    return t->view_src != NULL ? t->view_src->buffer : t->buffer;
}

/* Whether ggml_backend_tensor_set/get would take size bytes of t whole, rather than abort. */
static bool fits(const struct ggml_tensor * t, size_t size, bool read) {
    ggml_backend_buffer_t buf = buffer_of(t);
    return buf != NULL && t->data != NULL && size == ggml_nbytes(t) && (!read || buf->iface.get_tensor != NULL);
}

enum ggml_status hy_sched_step(ggml_backend_sched_t sched, struct ggml_cgraph * graph,
        const struct hy_io * in, int n_in, struct ggml_tensor * out, void * out_data, size_t out_size,
        int * bad) {
    *bad = 0;
    for (int i = 0; i < n_in; i++) {
        if (!fits(in[i].tensor, in[i].size, false)) {
            *bad = i + 1;
            return GGML_STATUS_FAILED;
        }
    }
    if (!fits(out, out_size, true)) {
        *bad = n_in + 1;
        return GGML_STATUS_FAILED;
    }
    for (int i = 0; i < n_in; i++) {
        ggml_backend_tensor_set(in[i].tensor, in[i].data, 0, in[i].size);
    }
    enum ggml_status status = ggml_backend_sched_graph_compute(sched, graph);
    if (status == GGML_STATUS_SUCCESS) {
        ggml_backend_tensor_get(out, out_data, 0, out_size);
    }
    return status;
}
