#include "step_feed.h"

#include <math.h>

#include "ggml.h"

/* GGML's f16 bits of 0 and of -inf */
#define F16_ZERO ((ggml_fp16_t) 0x0000)
#define F16_NEG_INF ((ggml_fp16_t) 0xFC00)

static void set_cells(void * mask, bool f16, int64_t from, int64_t to, bool seen) {
    if (f16) {
        ggml_fp16_t * m = mask;
        for (int64_t i = from; i < to; i++) {
            m[i] = seen ? F16_ZERO : F16_NEG_INF;
        }
    } else {
        float * m = mask;
        for (int64_t i = from; i < to; i++) {
            m[i] = seen ? 0.0f : -INFINITY;
        }
    }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* A query at p sees the cells 0..p; with a window, the cells p - n_swa < c <= p. */
static void write_masks(const struct hy_feed * f, struct hy_feed_row * r, int64_t p) {
    if (r->at == p - 1) {
        /* the next position of the same sequence: one cell comes into view, one leaves the window */
        set_cells(r->mask, f->mask_f16, p, p + 1, true);
        if (r->mask_swa != NULL) {
            set_cells(r->mask_swa, f->mask_f16, p, p + 1, true);
            if (p >= f->n_swa) {
                set_cells(r->mask_swa, f->mask_f16, p - f->n_swa, p - f->n_swa + 1, false);
            }
        }
    } else if (r->at != p) {
        set_cells(r->mask, f->mask_f16, 0, p + 1, true);
        set_cells(r->mask, f->mask_f16, p + 1, r->n_kv, false);
        if (r->mask_swa != NULL) {
            int64_t lo = max64(p - f->n_swa + 1, 0);
            set_cells(r->mask_swa, f->mask_f16, 0, lo, false);
            set_cells(r->mask_swa, f->mask_f16, lo, p + 1, true);
            set_cells(r->mask_swa, f->mask_f16, p + 1, r->n_kv, false);
        }
    }
    r->at = p;
}

int hy_feed_write(struct hy_feed * f, const int32_t * tokens, const int64_t * pos) {
    const int n = f->n_rows;
    for (int i = 0; i < n; i++) {
        const int64_t p = pos[i];
        struct hy_feed_row * r = &f->rows[i];
        if (p < 0 || p >= r->n_kv) {
            return i + 1;
        }
        f->tokens[i] = tokens[i];
        f->pos[i] = (int32_t) p;
        if (f->sections) {
            f->pos[n + i] = f->pos[2 * n + i] = (int32_t) p;
        }
        r->k_idx[0] = p;
        write_masks(f, r, p);
        if (r->v_idx != NULL) {
            for (int64_t c = 0; c < f->n_embd_v; c++) {
                r->v_idx[c] = c * f->n_ctx + p;
            }
        }
    }
    return 0;
}
