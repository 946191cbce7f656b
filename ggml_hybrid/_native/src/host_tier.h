/* The host expert tier: a bounded cache of whole experts in host RAM, read from the model file with large
   explicit reads (pread on a small pool of I/O threads, O_DIRECT where the filesystem allows it), never
   through page faults of the mapping inside a kernel.

   Between the device's slots and the file: a disk layer's executor (moe_loads.c) asks the tier for the
   experts its call will load as soon as the plan names them (hy_tier_fetch: the reads start at once, several
   in flight), then takes each one's bytes when it loads it (hy_tier_get: waits only for that expert's read)
   and copies them into its slot. One tier serves every disk layer of a model, within one byte budget; whole
   experts are evicted by the slot cache's orders (LRU, or LFU with LRU among equals), never an expert the
   current call fetched.

   The experts live in one arena of equal frames (one expert each, as large as the largest layer's), and each
   kind of a layer's experts sits at the same place in every frame: the arena seen as a 3-D tensor per layer and
   kind (ne[2] = frames, nb[2] = the frame's bytes: hy_tier_view) is an expert tensor whose
   expert index is the frame, so the CPU computes straight from the tier (the CPU worker's rows, and a CPU
   playing the device: no slot, no copy). The arena is one buffer of the buffer type the tier is made with: the
   device's pinned host type when there is a device, else the CPU's. A fault (an I/O error, a short read, the file truncated or rewritten since it was
   opened) fails the call that needed it with a message naming the layer, the expert, the offset and the
   cause; nothing of it stays cached, so the next call reads again.

   Read-ahead (with the lookahead prefetch, moe_prefetch): after a layer's call, the executor predicts the next
   layer's experts and hands the predicted ones its slots lack to hy_tier_read_ahead, which starts their reads
   without waiting and keeps them (and the predicted experts already held) from eviction until that layer's call
   judges them (hy_tier_settle): a read-ahead expert the call routed to was used, the others were wasted. The
   call then finds them held or on their way (a hit) instead of reading them itself after its routing. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "ggml-backend.h"
#include "file_id.h"

enum { HY_TIER_FAULT_EIO = 0, HY_TIER_FAULT_SHORT = 1 };

/* The tier's counters, summed since it was made. */
typedef struct hy_tier_counters {
    int64_t hits;        /* experts a call fetched that the tier held, or was already reading ahead */
    int64_t misses;      /* experts a call fetched that had to be read from the file */
    int64_t bytes_read;  /* bytes read from the file (aligned reads included) */
    int64_t read_ns;     /* time the I/O threads spent reading, summed over them */
    int64_t waits;       /* gets that found their expert's read still in flight */
    int64_t wait_ns;     /* time those gets waited */
    int64_t evictions;   /* experts dropped to stay within the budget */
    int64_t faults;      /* reads that failed */
    int64_t ahead;       /* reads started ahead of a call, for a predicted expert (hy_tier_read_ahead) */
    int64_t ahead_used;  /* of which the predicted call routed to */
    int64_t ahead_wasted; /* of which it did not, or that were dropped first (evicted, failed) */
    int64_t bytes_held;  /* bytes of host memory the cached experts take now */
} hy_tier_counters;

typedef struct hy_tier hy_tier;

/* A tier reading the file open as descriptor `fd` (reopened through /proc/self/fd, so a file renamed over its
   path later does not matter), whose identity (dev, ino, size, mtime_ns) must stay `file_id`; `budget` bytes
   of experts at most; `n_threads` I/O threads; `direct`: try O_DIRECT; `buft`: the arena's buffer type (NULL:
   the CPU's). NULL with `err` set on failure. */
hy_tier * hy_tier_new(int fd, const int64_t file_id[HY_FILE_ID_N], int64_t budget, int n_threads, int direct,
                      int policy, ggml_backend_buffer_type_t buft, char * err, size_t err_size);
void hy_tier_free(hy_tier * t);

/* Register a layer's experts: `n_kinds` tensors, expert e of kind k at file offset offset[k] + e * nbytes[k].
   `label` names the layer in messages. Its index (>= 0), or -1 (out of memory, or one expert larger than the
   budget). */
int hy_tier_add_layer(hy_tier * t, int label, int n_expert, int n_kinds, const uint64_t * offset,
                      const size_t * nbytes);

typedef struct hy_tier_arena_info {
    ggml_backend_buffer_t buffer;  /* the arena's buffer (of the tier's buffer type) */
    uint8_t * base;                /* frame 0 */
    size_t frame_bytes;
    int n_frames;
} hy_tier_arena_info;

/* The arena, made now if it is not yet (every layer must be registered by then: none can be added after). 0, or
   -1 with the error set (the budget holds no frame, or the memory cannot be had). */
int hy_tier_arena(hy_tier * t, hy_tier_arena_info * info);
/* Where kind `kind` of layer `layer`'s experts sits in every frame (bytes from the frame's start). */
size_t hy_tier_kind_pos(const hy_tier * t, int layer, int kind);
/* Kind `kind` of layer `layer`'s experts as a 3-D tensor of `ctx` (no_alloc) over the arena: `like`'s type and rows
   (an expert tensor of the layer, or a slot tensor), one expert per frame (ne[2] = the frames, nb[2] = a frame's
   bytes; a 2-D `like`, a bias: [rows, frames], nb[1] = a frame's bytes), so that expert index f is frame f; the
   arena is made first if it is not yet. `ctx` must have room for the tensor. NULL, the error set, when the arena
   cannot be had. Both executors see the tier through it. */
struct ggml_tensor * hy_tier_view(hy_tier * t, struct ggml_context * ctx, int layer, int kind,
                                  const struct ggml_tensor * like);
/* The arena's buffer type (a device's pinned host type: its uploads can read the frames directly; the CPU's when
   the pinned allocation was refused). */
ggml_backend_buffer_type_t hy_tier_buffer_type(const hy_tier * t);

/* Start reading the experts `experts[0..n)` of `layer` that the tier does not hold, and keep all of them
   (held or in flight) until hy_tier_release. 0, or -1 with the error set (the file changed, out of budget). */
int hy_tier_fetch(hy_tier * t, int layer, const int32_t * experts, int n);

/* The bytes of expert `e` of `layer`, kind by kind in `src`, and its frame in `frame` (either may be NULL),
   fetched first if the call did not, waiting for its read; valid until hy_tier_release. 0, or -1 with the error
   set (the read failed: nothing of it is kept). */
int hy_tier_get(hy_tier * t, int layer, int e, const uint8_t ** src, int * frame);

/* Read ahead the experts `experts[0..n)` of `layer` (a prediction of its next call, the likeliest first): start
   reading those the tier neither holds nor reads, as far as the budget allows without evicting an expert the
   current call fetched, a predicted one or one still being read, and keep all of them from eviction while any
   other expert can go, until hy_tier_settle. Never waits and never fails: a full budget or a changed file only
   stops it (the call that needs the expert reads it then, or reports). The number of reads started. */
int hy_tier_read_ahead(hy_tier * t, int layer, const int32_t * experts, int n);

/* whether expert `e` of `layer` is held with its read done (a get would not wait) */
int hy_tier_holds(hy_tier * t, int layer, int e);

/* The call of `layer` that a read-ahead predicted starts, routed to `experts[0..n)` (n = 0: it never came): the
   experts read ahead for it count as used (routed to) or wasted (not), and none of the layer's stays kept. */
void hy_tier_settle(hy_tier * t, int layer, const int32_t * experts, int n);

/* The end of a call: waits for its reads still in flight, lets its experts be evicted again, forgets failed
   reads. */
void hy_tier_release(hy_tier * t);

const char * hy_tier_error(const hy_tier * t);
const hy_tier_counters * hy_tier_counters_of(const hy_tier * t);
/* whether reads bypass the page cache (O_DIRECT) */
int hy_tier_direct(const hy_tier * t);
/* tests: the read after the next `after` reads fails with `kind` (HY_TIER_FAULT_*) */
void hy_tier_inject_fault(hy_tier * t, int after, int kind);
