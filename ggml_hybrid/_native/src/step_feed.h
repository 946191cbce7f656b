/* The inputs of a decode step (one token for each of a few sequences) written in place in host arrays, which
   hy_sched_step then sets: the token and position of each row, its K cache write index, the mask
   cells that come into view (and, for sliding-window layers, leave it), the V cache's write indices. The
   interpreter writes none of it: each numpy call it makes right after a compute runs cold, tens of
   microseconds a step (model/step_feed.py has the layout and the Python side). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

/* One sequence of the step: its inputs (NULL where the model has none) and the position its masks were
   last written for (-2: never, so the first write is whole). */
struct hy_feed_row {
    int64_t * k_idx;     /* [1] */
    void * mask;         /* [n_kv], f32 or f16 */
    void * mask_swa;     /* [n_kv] or NULL */
    int64_t * v_idx;     /* [n_embd_v] or NULL: V transposed in the cache, written column by column */
    int64_t n_kv;        /* cells its masks cover */
    int64_t at;
};

struct hy_feed {
    int n_rows;
    bool sections;       /* M-RoPE: four position rows, (p, p, p, 0) */
    bool mask_f16;
    int64_t n_swa;       /* sliding window (0: none) */
    int64_t n_embd_v;    /* v_idx[c] = c * n_ctx + p */
    int64_t n_ctx;
    int32_t * tokens;    /* [n_rows] */
    int32_t * pos;       /* [n_rows], or [4 * n_rows] with sections */
    struct hy_feed_row * rows;
};

/* Write the step that puts tokens[i] at position pos[i] of row i. Returns 0, or i + 1 for the first row
   whose position is outside its 0..n_kv-1 (then nothing of that row or the rows after it is written). */
int hy_feed_write(struct hy_feed * feed, const int32_t * tokens, const int64_t * pos);
