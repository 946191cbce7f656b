#define _GNU_SOURCE /* O_DIRECT */
#include "host_tier.h"

#include "clock.h"
#include "file_id.h"
#include "moe_policy.h"

#include "ggml-backend.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* O_DIRECT wants the offset, the length and the buffer aligned to the logical block; 4 KiB covers the
   devices in use (512-byte and 4 KiB sectors). A read covers the expert's bytes rounded out to it. */
#define HY_TIER_ALIGN 4096
#define HY_TIER_KINDS 6 /* an executor's kinds (moe_exec.h: HY_MAX_KINDS): matrices and biases */

enum { ENTRY_EMPTY, ENTRY_QUEUED, ENTRY_READING, ENTRY_READY, ENTRY_FAILED };

typedef struct hy_tier_layer {
    int label, n_expert, n_kinds;
    uint64_t offset[HY_TIER_KINDS];
    size_t nbytes[HY_TIER_KINDS];
    size_t kind_at[HY_TIER_KINDS]; /* where kind k's read lands in a frame (aligned) */
    size_t pos[HY_TIER_KINDS];     /* where kind k's bytes are in a frame, whichever the expert: the same place
                                      for all, so that a frame index can be an expert index of a 3-D view */
    size_t entry_bytes;
    int first;                     /* its experts' entries: first .. first + n_expert - 1 */
} hy_tier_layer;

typedef struct hy_tier_entry {
    int frame;            /* its frame in the arena while it is held or read (-1: none) */
    int state;
    bool pinned;          /* fetched by the current call: not evicted before hy_tier_release */
    bool predicted;       /* predicted for its layer's next call: evicted last, until hy_tier_settle */
    bool ahead;           /* read ahead for that call, not yet judged used or wasted */
    int layer, expert;
    int64_t uses, last_use; /* calls that fetched it since it was read (LFU), and the last one's tick */
    int64_t requests;     /* calls that fetched it, ever: an eviction does not forget them (FREQ) */
    int err_no;           /* a failed read: errno, or 0 for a short read */
    uint64_t err_offset;
    size_t err_got, err_want;
} hy_tier_entry;

struct hy_tier {
    int fd;
    bool direct;
    int64_t file_id[HY_FILE_ID_N];
    int64_t budget;
    int policy;
    hy_tier_layer * layers;
    int n_layers;
    hy_tier_entry * entries;
    int n_entries;
    int * pinned;         /* entries the current call fetched */
    int n_pinned;
    int64_t tick;
    hy_tier_counters counters;
    char err[400];
    int fault_after, fault_kind;
    /* the arena: n_frames frames of frame_bytes, one expert each, in one buffer of `buft` (the device's pinned
       host buffer type, or the CPU's), allocated at the first call once every layer is registered */
    ggml_backend_buffer_type_t buft;
    ggml_backend_buffer_t arena_buf;
    uint8_t * arena;
    size_t frame_bytes;
    int n_frames;
    int * free_frames;
    int n_free;
    /* the I/O threads and their queue */
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int * queue;          /* ring of entry indices, n_entries long: an entry is queued at most once */
    int q_head, q_len;
    bool stop;
    pthread_t * threads;
    int n_threads;
};

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- reading ------------------------------------------------------------------------------------- */

/* Read kind k of entry `en` into its buffer: the expert's bytes rounded out to the alignment. Returns true, or
   false with the entry's error fields set. Runs on an I/O thread, without the lock. */
static bool read_kind(hy_tier * t, hy_tier_entry * en, const hy_tier_layer * L, int k, int fault) {
    const uint64_t off = L->offset[k] + (uint64_t) en->expert * L->nbytes[k];
    uint8_t * frame = t->arena + (size_t) en->frame * t->frame_bytes;
    /* direct reads: whole aligned blocks into the aligned start of the kind's place, then the expert's bytes
       moved to their fixed place if this expert starts elsewhere in its block (an expert size that is not a
       multiple of the block); buffered reads: the expert's bytes straight to their place */
    const uint64_t at = t->direct ? off / HY_TIER_ALIGN * HY_TIER_ALIGN : off;
    const size_t want = (size_t) (off - at) + L->nbytes[k];   /* what must arrive: up to the expert's last byte */
    const size_t len = t->direct ? round_up(want, HY_TIER_ALIGN) : want;  /* what is asked */
    uint8_t * dst = t->direct ? frame + L->kind_at[k] : frame + L->pos[k];
    size_t got = 0;
    while (got < want) {
        ssize_t r;
        if (fault == HY_TIER_FAULT_EIO + 1) {
            r = -1;
            errno = EIO;
        } else if (fault == HY_TIER_FAULT_SHORT + 1) {
            r = 0;
        } else {
            r = pread(t->fd, dst + got, len - got, (off_t) (at + got));
        }
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            en->err_no = r < 0 ? errno : 0;
            en->err_offset = off;
            en->err_got = got > off - at ? got - (size_t) (off - at) : 0;
            en->err_want = L->nbytes[k];
            return false;
        }
        got += (size_t) r;
    }
    if (dst + (off - at) != frame + L->pos[k]) {
        memmove(frame + L->pos[k], dst + (off - at), L->nbytes[k]);
    }
    return true;
}

static void drop(hy_tier * t, hy_tier_entry * en);

static void * io_thread(void * arg) {
    hy_tier * t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (t->q_len == 0 && !t->stop) {
            pthread_cond_wait(&t->work, &t->mu);
        }
        if (t->stop) {
            break;
        }
        const int i = t->queue[t->q_head];
        t->q_head = (t->q_head + 1) % t->n_entries;
        t->q_len--;
        hy_tier_entry * en = &t->entries[i];
        en->state = ENTRY_READING;
        int fault = 0;
        if (t->fault_after == 0) {
            fault = t->fault_kind + 1;
            t->fault_after = -1;
        } else if (t->fault_after > 0) {
            t->fault_after--;
        }
        const hy_tier_layer * L = &t->layers[en->layer];
        pthread_mutex_unlock(&t->mu);
        const int64_t t0 = hy_now_ns();
        bool ok = true;
        int64_t bytes = 0;
        for (int k = 0; k < L->n_kinds && ok; k++) {
            ok = read_kind(t, en, L, k, fault);
            const uint64_t off = L->offset[k] + (uint64_t) en->expert * L->nbytes[k];
            bytes += t->direct ? (int64_t) round_up((size_t) (off % HY_TIER_ALIGN) + L->nbytes[k], HY_TIER_ALIGN)
                               : (int64_t) L->nbytes[k];
        }
        const int64_t dt = hy_now_ns() - t0;
        pthread_mutex_lock(&t->mu);
        t->counters.read_ns += dt;
        if (ok) {
            t->counters.bytes_read += bytes;
            en->state = ENTRY_READY;
        } else {
            t->counters.faults++;
            en->state = ENTRY_FAILED;
            if (!en->pinned) { /* a read ahead that no call has asked for yet: forget it, a call reads it again */
                drop(t, en);
            }
        }
        pthread_cond_broadcast(&t->done);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ---- making and unmaking ------------------------------------------------------------------------- */

static int open_reader(int fd, bool direct) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    return open(path, O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
}

/* whether an aligned direct read works on this file (some filesystems accept O_DIRECT at open, not at read) */
static bool direct_reads_work(int fd) {
    void * p = NULL;
    if (posix_memalign(&p, HY_TIER_ALIGN, HY_TIER_ALIGN) != 0) {
        return false;
    }
    const ssize_t r = pread(fd, p, HY_TIER_ALIGN, 0);
    free(p);
    return r >= 0;
}

hy_tier * hy_tier_new(int fd, const int64_t file_id[HY_FILE_ID_N], int64_t budget, int n_threads, int direct,
                      int policy, ggml_backend_buffer_type_t buft, char * err, size_t err_size) {
    if (policy < 0 || policy >= HY_POLICY_N) {
        snprintf(err, err_size, "host tier: no eviction policy %d", policy);
        return NULL;
    }
    hy_tier * t = calloc(1, sizeof(*t));
    if (t == NULL) {
        snprintf(err, err_size, "host tier: out of memory");
        return NULL;
    }
    t->fd = -1;
    if (direct) {
        t->fd = open_reader(fd, true);
        if (t->fd >= 0 && !direct_reads_work(t->fd)) {
            close(t->fd);
            t->fd = -1;
        }
        t->direct = t->fd >= 0;
    }
    if (t->fd < 0) {
        t->fd = open_reader(fd, false);
    }
    if (t->fd < 0) {
        snprintf(err, err_size, "host tier: cannot reopen the model file (descriptor %d): %s", fd, strerror(errno));
        free(t);
        return NULL;
    }
    memcpy(t->file_id, file_id, sizeof(t->file_id));
    t->budget = budget;
    t->policy = policy;
    t->fault_after = -1;
    t->buft = buft != NULL ? buft : ggml_backend_cpu_buffer_type();
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->work, NULL);
    pthread_cond_init(&t->done, NULL);
    t->threads = calloc((size_t) n_threads, sizeof(pthread_t));
    for (int i = 0; t->threads != NULL && i < n_threads; i++) {
        if (pthread_create(&t->threads[i], NULL, io_thread, t) != 0) {
            break;
        }
        t->n_threads++;
    }
    if (t->n_threads < n_threads) {
        snprintf(err, err_size, "host tier: cannot start %d I/O threads", n_threads);
        hy_tier_free(t);
        return NULL;
    }
    return t;
}

void hy_tier_free(hy_tier * t) {
    if (t == NULL) {
        return;
    }
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->work);
    pthread_mutex_unlock(&t->mu);
    for (int i = 0; i < t->n_threads; i++) {
        pthread_join(t->threads[i], NULL);
    }
    if (t->arena_buf != NULL) {
        ggml_backend_buffer_free(t->arena_buf);
    }
    free(t->free_frames);
    if (t->fd >= 0) {
        close(t->fd);
    }
    pthread_cond_destroy(&t->done);
    pthread_cond_destroy(&t->work);
    pthread_mutex_destroy(&t->mu);
    free(t->threads);
    free(t->queue);
    free(t->pinned);
    free(t->entries);
    free(t->layers);
    free(t);
}

int hy_tier_add_layer(hy_tier * t, int label, int n_expert, int n_kinds, const uint64_t * offset,
                      const size_t * nbytes) {
    if (n_kinds < 1 || n_kinds > HY_TIER_KINDS || n_expert < 1 || t->arena != NULL) {
        return -1;
    }
    hy_tier_layer L = { .label = label, .n_expert = n_expert, .n_kinds = n_kinds, .first = t->n_entries };
    for (int k = 0; k < n_kinds; k++) {
        L.offset[k] = offset[k];
        L.nbytes[k] = nbytes[k];
        L.kind_at[k] = L.entry_bytes;
        L.pos[k] = L.entry_bytes + offset[k] % HY_TIER_ALIGN;
        /* an expert starting anywhere in a block needs its bytes rounded up plus one block */
        L.entry_bytes += round_up(nbytes[k], HY_TIER_ALIGN) + HY_TIER_ALIGN;
    }
    if ((int64_t) L.entry_bytes > t->budget) {
        return -1;
    }
    const int n = t->n_entries + n_expert;
    hy_tier_layer * layers = realloc(t->layers, sizeof(*layers) * (size_t) (t->n_layers + 1));
    if (layers == NULL) {
        return -1;
    }
    t->layers = layers;
    hy_tier_entry * entries = realloc(t->entries, sizeof(*entries) * (size_t) n);
    if (entries == NULL) {
        return -1;
    }
    t->entries = entries;
    int * queue = realloc(t->queue, sizeof(int) * (size_t) n);
    int * pinned = queue == NULL ? NULL : realloc(t->pinned, sizeof(int) * (size_t) n);
    if (queue == NULL || pinned == NULL) {
        if (queue != NULL) {
            t->queue = queue;
        }
        return -1;
    }
    /* the queue is empty between calls (layers are added before the first), so its ring can simply grow */
    t->queue = queue;
    t->pinned = pinned;
    for (int e = 0; e < n_expert; e++) {
        t->entries[t->n_entries + e] = (hy_tier_entry) { .frame = -1, .layer = t->n_layers, .expert = e };
    }
    t->n_entries = n;
    t->layers[t->n_layers] = L;
    return t->n_layers++;
}

/* with the lock held: the arena, made at the first call (every layer is registered by then): frames as large as
   the largest layer's expert, as many as the budget holds, in one buffer of the tier's buffer type (its pages
   are touched only as frames fill) */
static int ensure_arena(hy_tier * t, char * err, size_t err_size) {
    if (t->arena != NULL) {
        return 0;
    }
    size_t frame = 0;
    for (int l = 0; l < t->n_layers; l++) {
        frame = t->layers[l].entry_bytes > frame ? t->layers[l].entry_bytes : frame;
    }
    const int64_t n = frame > 0 ? t->budget / (int64_t) frame : 0;
    if (n < 1 || n > INT32_MAX) {
        snprintf(err, err_size, "the host tier's budget (%lld bytes) holds no expert of %zu bytes",
                 (long long) t->budget, frame);
        return -1;
    }
    t->free_frames = malloc(sizeof(int) * (size_t) n);
    t->arena_buf = t->free_frames == NULL ? NULL
        : ggml_backend_buft_alloc_buffer(t->buft, (size_t) n * frame + HY_TIER_ALIGN);
    if (t->arena_buf == NULL && t->free_frames != NULL && t->buft != ggml_backend_cpu_buffer_type()) {
        /* pinned memory is allocated (and locked) whole, and a driver may refuse a large budget of it: plain
           memory then, whose pages are touched only as frames fill (loads stage through the device's buffers) */
        t->buft = ggml_backend_cpu_buffer_type();
        t->arena_buf = ggml_backend_buft_alloc_buffer(t->buft, (size_t) n * frame + HY_TIER_ALIGN);
    }
    if (t->arena_buf == NULL) {
        snprintf(err, err_size, "the host tier cannot allocate %lld bytes of %s memory for its %lld experts",
                 (long long) n * (long long) frame, ggml_backend_buft_name(t->buft), (long long) n);
        free(t->free_frames);
        t->free_frames = NULL;
        return -1;
    }
    uint8_t * base = ggml_backend_buffer_get_base(t->arena_buf);
    t->arena = (uint8_t *) (((uintptr_t) base + HY_TIER_ALIGN - 1) / HY_TIER_ALIGN * HY_TIER_ALIGN);
    t->frame_bytes = frame;
    t->n_frames = (int) n;
    for (int i = 0; i < t->n_frames; i++) {
        t->free_frames[i] = t->n_frames - 1 - i; /* frame 0 first */
    }
    t->n_free = t->n_frames;
    return 0;
}

int hy_tier_arena(hy_tier * t, hy_tier_arena_info * info) {
    pthread_mutex_lock(&t->mu);
    const int rc = ensure_arena(t, t->err, sizeof(t->err));
    if (rc == 0) {
        info->buffer = t->arena_buf;
        info->base = t->arena;
        info->frame_bytes = t->frame_bytes;
        info->n_frames = t->n_frames;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

size_t hy_tier_kind_pos(const hy_tier * t, int layer, int kind) { return t->layers[layer].pos[kind]; }

struct ggml_tensor * hy_tier_view(hy_tier * t, struct ggml_context * ctx, int layer, int kind,
                                  const struct ggml_tensor * like) {
    hy_tier_arena_info a;
    if (hy_tier_arena(t, &a) != 0) {
        return NULL;
    }
    struct ggml_tensor * v;
    if (ggml_n_dims(like) <= 2) {
        /* a bias (gpt-oss): [rows, frames], the frame's row where an expert's row is */
        v = ggml_new_tensor_2d(ctx, like->type, like->ne[0], a.n_frames);
        v->nb[1] = a.frame_bytes;
        v->nb[2] = v->nb[3] = a.frame_bytes * (size_t) a.n_frames;
    } else {
        v = ggml_new_tensor_3d(ctx, like->type, like->ne[0], like->ne[1], a.n_frames);
        v->nb[2] = a.frame_bytes;
        v->nb[3] = a.frame_bytes * (size_t) a.n_frames;
    }
    v->data = a.base + t->layers[layer].pos[kind];
    v->buffer = a.buffer;
    return v;
}
ggml_backend_buffer_type_t hy_tier_buffer_type(const hy_tier * t) { return t->buft; }

/* ---- a call ---------------------------------------------------------------------------------------- */

static int set_error(hy_tier * t, const char * fmt, ...) __attribute__((format(printf, 2, 3)));
static int set_error(hy_tier * t, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->err, sizeof(t->err), fmt, ap);
    va_end(ap);
    return -1;
}

static bool file_unchanged(const hy_tier * t) { return hy_file_unchanged(t->fd, t->file_id); }

/* the cached expert the policy drops first: not fetched by this call, not predicted for a coming call (unless
   `predicted_too` and nothing else can go), then by the slot cache's orders (moe_policy.h, the expert_eviction
   option): the least recently fetched (LRU); the least fetched since it was read, the least recent among equals
   (LFU); the least fetched ever, the least recent among equals (FREQ). -1 when none can go */
static int victim(const hy_tier * t, bool predicted_too) {
    int best = -1;
    for (int i = 0; i < t->n_entries; i++) {
        const hy_tier_entry * en = &t->entries[i];
        if (en->state != ENTRY_READY || en->pinned || (en->predicted && !predicted_too)) {
            continue;
        }
        if (best < 0) {
            best = i;
            continue;
        }
        const hy_tier_entry * b = &t->entries[best];
        bool better;
        if (en->predicted != b->predicted) {
            better = !en->predicted;
        } else if (t->policy == HY_POLICY_FREQ) {
            better = en->requests < b->requests || (en->requests == b->requests && en->last_use < b->last_use);
        } else if (t->policy == HY_POLICY_LFU) {
            better = en->uses < b->uses || (en->uses == b->uses && en->last_use < b->last_use);
        } else {
            better = en->last_use < b->last_use;
        }
        if (better) {
            best = i;
        }
    }
    return best;
}

/* whether a read no call fetched (a read-ahead) is still in flight: its entry can be evicted once it is done */
static bool reading_ahead(const hy_tier * t) {
    for (int i = 0; i < t->n_entries; i++) {
        const hy_tier_entry * en = &t->entries[i];
        if (!en->pinned && (en->state == ENTRY_QUEUED || en->state == ENTRY_READING)) {
            return true;
        }
    }
    return false;
}

static void drop(hy_tier * t, hy_tier_entry * en) {
    t->free_frames[t->n_free++] = en->frame;
    en->frame = -1;
    en->state = ENTRY_EMPTY;
    en->uses = 0;
    en->predicted = false;
    if (en->ahead) { /* read ahead, and gone before its call could use it */
        en->ahead = false;
        t->counters.ahead_wasted++;
    }
    t->counters.bytes_held -= (int64_t) t->frame_bytes;
}

/* with the lock held: a frame for entry i (evicting `victim(predicted_too)`s) and its read queued. 0, or 1 when
   no frame can be freed. */
static int start_read(hy_tier * t, int i, bool predicted_too) {
    hy_tier_entry * en = &t->entries[i];
    while (t->n_free == 0) {
        const int v = victim(t, predicted_too);
        if (v >= 0) {
            drop(t, &t->entries[v]);
            t->counters.evictions++;
        } else if (predicted_too && reading_ahead(t)) {
            pthread_cond_wait(&t->done, &t->mu); /* a read-ahead's frame can go once its read is done */
        } else {
            return 1;
        }
    }
    en->frame = t->free_frames[--t->n_free];
    t->counters.bytes_held += (int64_t) t->frame_bytes;
    en->state = ENTRY_QUEUED;
    t->queue[(t->q_head + t->q_len) % t->n_entries] = i;
    t->q_len++;
    pthread_cond_signal(&t->work);
    return 0;
}

/* with the lock held: fetch entry i for the current call */
static int fetch_one(hy_tier * t, int i) {
    hy_tier_entry * en = &t->entries[i];
    const hy_tier_layer * L = &t->layers[en->layer];
    const bool was_pinned = en->pinned;
    if (!en->pinned) {
        en->pinned = true;
        t->pinned[t->n_pinned++] = i;
    }
    en->uses++;
    en->requests++;
    en->last_use = ++t->tick;
    if (en->state != ENTRY_EMPTY) { /* held, read ahead, or already on its way for this call */
        if (en->state == ENTRY_READY || !was_pinned) { /* in flight and not fetched by this call: read ahead */
            t->counters.hits++;
        }
        return 0;
    }
    const int64_t need = (int64_t) t->frame_bytes;
    if (start_read(t, i, true) != 0) {
        return set_error(t, "layer %d: the host tier's budget (%lld bytes) cannot hold this call's experts "
                         "(%d of %lld bytes each); give host_tier_bytes at least one layer's experts",
                         L->label, (long long) t->budget, t->n_pinned, (long long) need);
    }
    t->counters.misses++;
    return 0;
}

int hy_tier_fetch(hy_tier * t, int layer, const int32_t * experts, int n) {
    if (n > 0 && !file_unchanged(t)) {
        return set_error(t, "layer %d: the model file changed on disk while it was in use (truncated or rewritten "
                         "in place); reload the model", t->layers[layer].label);
    }
    pthread_mutex_lock(&t->mu);
    char why[200];
    int rc = ensure_arena(t, why, sizeof(why));
    if (rc != 0) {
        set_error(t, "layer %d: %s", t->layers[layer].label, why);
    }
    for (int j = 0; j < n && rc == 0; j++) {
        rc = fetch_one(t, t->layers[layer].first + experts[j]);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int hy_tier_get(hy_tier * t, int layer, int e, const uint8_t ** src, int * frame) {
    const hy_tier_layer * L = &t->layers[layer];
    const int i = L->first + e;
    hy_tier_entry * en = &t->entries[i];
    pthread_mutex_lock(&t->mu);
    char why[200];
    int rc = ensure_arena(t, why, sizeof(why));
    if (rc != 0) {
        set_error(t, "layer %d: %s", L->label, why);
    }
    if (rc == 0 && (!en->pinned || en->state == ENTRY_EMPTY)) {
        if (!file_unchanged(t)) {
            pthread_mutex_unlock(&t->mu);
            return set_error(t, "layer %d: the model file changed on disk while it was in use (truncated or "
                             "rewritten in place); reload the model", L->label);
        }
        rc = fetch_one(t, i);
    }
    if (rc == 0 && (en->state == ENTRY_QUEUED || en->state == ENTRY_READING)) {
        const int64_t t0 = hy_now_ns();
        while (en->state == ENTRY_QUEUED || en->state == ENTRY_READING) {
            pthread_cond_wait(&t->done, &t->mu);
        }
        t->counters.waits++;
        t->counters.wait_ns += hy_now_ns() - t0;
    }
    if (rc == 0 && en->state == ENTRY_FAILED) {
        if (en->err_no != 0) {
            set_error(t, "layer %d: reading expert %d from the model file failed at offset %llu: %s; the next call "
                      "reads it again", L->label, e, (unsigned long long) en->err_offset, strerror(en->err_no));
        } else {
            set_error(t, "layer %d: short read of expert %d from the model file at offset %llu: %zu of %zu bytes "
                      "(the file is shorter than its header says: truncated?)", L->label, e,
                      (unsigned long long) en->err_offset, en->err_got, en->err_want);
        }
        drop(t, en);
        rc = -1;
    }
    if (rc == 0) {
        for (int k = 0; k < L->n_kinds && src != NULL; k++) {
            src[k] = t->arena + (size_t) en->frame * t->frame_bytes + L->pos[k];
        }
        if (frame != NULL) {
            *frame = en->frame;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int hy_tier_read_ahead(hy_tier * t, int layer, const int32_t * experts, int n) {
    if (n <= 0 || !file_unchanged(t)) {
        return 0;
    }
    const hy_tier_layer * L = &t->layers[layer];
    pthread_mutex_lock(&t->mu);
    char why[200];
    if (ensure_arena(t, why, sizeof(why)) != 0) { /* the call that needs the experts reports it */
        pthread_mutex_unlock(&t->mu);
        return 0;
    }
    for (int j = 0; j < n; j++) { /* all of them first: none is evicted for another */
        t->entries[L->first + experts[j]].predicted = true;
    }
    int started = 0;
    for (int j = 0; j < n; j++) {
        const int i = L->first + experts[j];
        hy_tier_entry * en = &t->entries[i];
        if (en->state != ENTRY_EMPTY) {
            continue;
        }
        if (start_read(t, i, false) != 0) {
            break; /* no room without evicting what matters more (or no memory): the rest are less likely still */
        }
        en->ahead = true;
        t->counters.ahead++;
        started++;
    }
    pthread_mutex_unlock(&t->mu);
    return started;
}

int hy_tier_holds(hy_tier * t, int layer, int e) {
    pthread_mutex_lock(&t->mu);
    const int held = t->entries[t->layers[layer].first + e].state == ENTRY_READY;
    pthread_mutex_unlock(&t->mu);
    return held;
}

void hy_tier_settle(hy_tier * t, int layer, const int32_t * experts, int n) {
    const hy_tier_layer * L = &t->layers[layer];
    pthread_mutex_lock(&t->mu);
    for (int j = 0; j < n; j++) {
        hy_tier_entry * en = &t->entries[L->first + experts[j]];
        if (en->ahead) {
            en->ahead = false;
            t->counters.ahead_used++;
        }
    }
    for (int e = 0; e < L->n_expert; e++) {
        hy_tier_entry * en = &t->entries[L->first + e];
        if (en->ahead) {
            en->ahead = false;
            t->counters.ahead_wasted++;
        }
        en->predicted = false;
    }
    pthread_mutex_unlock(&t->mu);
}

void hy_tier_release(hy_tier * t) {
    pthread_mutex_lock(&t->mu);
    for (int j = 0; j < t->n_pinned; j++) {
        hy_tier_entry * en = &t->entries[t->pinned[j]];
        while (en->state == ENTRY_QUEUED || en->state == ENTRY_READING) { /* a failed call's reads */
            pthread_cond_wait(&t->done, &t->mu);
        }
        if (en->state == ENTRY_FAILED) {
            drop(t, en);
        }
        en->pinned = false;
    }
    t->n_pinned = 0;
    pthread_mutex_unlock(&t->mu);
}

const char * hy_tier_error(const hy_tier * t) { return t->err; }
const hy_tier_counters * hy_tier_counters_of(const hy_tier * t) { return &t->counters; }
int hy_tier_direct(const hy_tier * t) { return t->direct; }

void hy_tier_inject_fault(hy_tier * t, int after, int kind) {
    pthread_mutex_lock(&t->mu);
    t->fault_after = after;
    t->fault_kind = kind;
    pthread_mutex_unlock(&t->mu);
}
