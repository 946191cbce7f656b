#include "hybrid.h"

#include <stdio.h>

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "ggml-backend-impl.h"
#ifdef GGML_HYBRID_CUDA
#include "ggml-cuda.h"
#endif

#ifndef GGML_HYBRID_GGML_VERSION
#error "build.py defines GGML_HYBRID_GGML_VERSION, GGML_HYBRID_PATCH_HASH and GGML_HYBRID_SOURCE_HASH"
#endif

const char * ggml_hybrid_ggml_version(void) { return GGML_HYBRID_GGML_VERSION; }
const char * ggml_hybrid_patch_hash(void) { return GGML_HYBRID_PATCH_HASH; }
const char * ggml_hybrid_source_hash(void) { return GGML_HYBRID_SOURCE_HASH; }

int ggml_hybrid_graph_n_leafs(struct ggml_cgraph * g) { return g->n_leafs; }
struct ggml_tensor * ggml_hybrid_graph_leaf(struct ggml_cgraph * g, int i) { return g->leafs[i]; }
bool ggml_hybrid_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t) {
    return ggml_hash_contains(&g->visited_hash_set, t);
}

/* Forget the memory a scheduler gave the graph's tensors (it may be freed by now), keeping tensors
   in the buffers listed: only pointer values are compared. Only tensor structs inside the live
   context pools listed ([start, end) pairs) are touched: a tensor of a freed context is never read
   or written. Returns how many tensors lie in no live pool (their context was freed). */
int ggml_hybrid_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
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

/* CPU backend instances that stand in for separate devices: each gets its own copy of the CPU
   device and buffer type (same functions, distinct identity), so that the scheduler treats their
   buffers as different memories, as it does for two GPUs, instead of moving every node onto the
   first instance (it merges backends whose buffer types are the same object). */
static struct ggml_backend_device inst_dev[GGML_HYBRID_MAX_INSTANCES];
static struct ggml_backend_buffer_type inst_buft[GGML_HYBRID_MAX_INSTANCES];

static ggml_backend_buffer_type_t inst_get_buft(ggml_backend_dev_t dev) {
    return &inst_buft[dev - inst_dev];
}

ggml_backend_t ggml_hybrid_cpu_instance(int index) {
    if (index < 0 || index >= GGML_HYBRID_MAX_INSTANCES) {
        return NULL;
    }
    ggml_backend_t b = ggml_backend_cpu_init();
    if (b == NULL) {
        return NULL;
    }
    inst_dev[index] = *b->device;
    inst_dev[index].iface.get_buffer_type = inst_get_buft;
    inst_buft[index] = *ggml_backend_cpu_buffer_type();
    inst_buft[index].device = &inst_dev[index];
    b->device = &inst_dev[index];
    return b;
}

/* GGML's default logger prints every level to stderr, debug included (one line per repacked tensor);
   llama.cpp installs its own. Ours drops debug messages (and their continuations). */
static enum ggml_log_level last_level = GGML_LOG_LEVEL_INFO;

static void quiet_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_CONT) {
        level = last_level;
    } else {
        last_level = level;
    }
    if (level != GGML_LOG_LEVEL_DEBUG) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

void ggml_hybrid_log_quiet(void) { ggml_log_set(quiet_log, NULL); }

/* GGML's CPU "extra" buffer types, NULL-terminated, in the order llama.cpp prefers them (make_cpu_buft_list):
   weights there are repacked at load for faster CPU kernels (CPU_REPACK; AMX and KleidiAI where built). */
ggml_backend_buffer_type_t * ggml_hybrid_cpu_extra_bufts(void) {
    static ggml_backend_buffer_type_t none[1] = { NULL };
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t fn = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (fn == NULL || ggml_backend_reg_dev_count(reg) == 0) {
        return none;
    }
    ggml_backend_buffer_type_t * list = fn(ggml_backend_reg_dev_get(reg, 0));
    return list != NULL ? list : none;
}

/* Whether GGML can copy a buffer's tensors back out: a repacked buffer has no get_tensor (and
   ggml_backend_tensor_get would call NULL). */
bool ggml_hybrid_buffer_readable(ggml_backend_buffer_t buf) {
    return buf != NULL && buf->iface.get_tensor != NULL;
}

#ifdef GGML_HYBRID_CUDA
int ggml_hybrid_has_cuda(void) { return 1; }
ggml_backend_t ggml_hybrid_cuda_init(int device) { return ggml_backend_cuda_init(device); }
int ggml_hybrid_cuda_device_count(void) { return ggml_backend_cuda_get_device_count(); }
#else
int ggml_hybrid_has_cuda(void) { return 0; }
ggml_backend_t ggml_hybrid_cuda_init(int device) { (void) device; return NULL; }
int ggml_hybrid_cuda_device_count(void) { return 0; }
#endif
