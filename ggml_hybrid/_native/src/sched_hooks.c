/* dladdr and Dl_info: which file a backend was loaded from */
#define _GNU_SOURCE

#include "sched_hooks.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "ggml-backend-impl.h"

#ifndef HY_GGML_VERSION
#error "build.py defines HY_GGML_VERSION, HY_PATCH_HASH, HY_SOURCE_HASH and GGML_HYBRID_ABI"
#endif

const char * hy_ggml_version(void) { return HY_GGML_VERSION; }
const char * hy_patch_hash(void) { return HY_PATCH_HASH; }
const char * hy_source_hash(void) { return HY_SOURCE_HASH; }
const char * hy_abi(void) { return GGML_HYBRID_ABI; }

/* The CPU backend through GGML's registry. A portable build loads one of several CPU libraries at run time
   (the best for this CPU), so its functions are looked up, never linked; the native build registers its one
   library at start-up and takes the same path. */
static ggml_backend_reg_t cpu_reg(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return dev != NULL ? ggml_backend_dev_backend_reg(dev) : NULL;
}

static void * cpu_proc(const char * name) {
    ggml_backend_reg_t reg = cpu_reg();
    return reg != NULL ? ggml_backend_reg_get_proc_address(reg, name) : NULL;
}

int hy_load_cpu(const char * lib_dir) {
    if (cpu_reg() == NULL) {
        ggml_backend_load_all_from_path(lib_dir);
    }
    /* every function the package calls must be there, or the first call would jump to NULL */
    static const char * const procs[] = {"ggml_backend_set_n_threads", "ggml_threadpool_new",
                                         "ggml_threadpool_free", "ggml_backend_cpu_set_threadpool"};
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++) {
        if (cpu_proc(procs[i]) == NULL) {
            return 0;
        }
    }
    return 1;
}

ggml_backend_t hy_cpu_init(void) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return dev != NULL ? ggml_backend_dev_init(dev, NULL) : NULL;
}

bool hy_is_cpu(ggml_backend_t backend) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    return dev != NULL && ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

void hy_cpu_set_n_threads(ggml_backend_t backend, int n_threads) {
    ((ggml_backend_set_n_threads_t) cpu_proc("ggml_backend_set_n_threads"))(backend, n_threads);
}

typedef struct ggml_threadpool * (*threadpool_new_t)(struct ggml_threadpool_params * params);
typedef void (*threadpool_free_t)(struct ggml_threadpool * threadpool);
typedef void (*set_threadpool_t)(ggml_backend_t backend, struct ggml_threadpool * threadpool);

struct ggml_threadpool * hy_threadpool_new(struct ggml_threadpool_params * params) {
    return ((threadpool_new_t) cpu_proc("ggml_threadpool_new"))(params);
}

void hy_threadpool_free(struct ggml_threadpool * threadpool) {
    ((threadpool_free_t) cpu_proc("ggml_threadpool_free"))(threadpool);
}

void hy_cpu_set_threadpool(ggml_backend_t backend, struct ggml_threadpool * threadpool) {
    ((set_threadpool_t) cpu_proc("ggml_backend_cpu_set_threadpool"))(backend, threadpool);
}

/* "AVX2 FMA ..." for the features the loaded CPU library was built with (value "1"), space separated. */
const char * hy_cpu_features(void) {
    static char out[512];
    out[0] = '\0';
    ggml_backend_get_features_t get = (ggml_backend_get_features_t) cpu_proc("ggml_backend_get_features");
    if (get == NULL) {
        return out;
    }
    size_t used = 0;
    for (struct ggml_backend_feature * f = get(cpu_reg()); f->name != NULL; f++) {
        if (strcmp(f->value, "1") != 0) {
            continue;
        }
        int n = snprintf(out + used, sizeof(out) - used, "%s%s", used ? " " : "", f->name);
        if (n < 0 || (size_t) n >= sizeof(out) - used) {
            break;
        }
        used += (size_t) n;
    }
    return out;
}

/* The file a backend's code lives in (a registry entry's functions point into it). */
const char * hy_reg_path(ggml_backend_reg_t reg) {
    Dl_info dl;
    if (reg == NULL || dladdr((void *) reg->iface.get_name, &dl) == 0 || dl.dli_fname == NULL) {
        return "";
    }
    return dl.dli_fname;
}

/* What GGML logs while a backend loads is kept here instead of going to stderr: a CUDA backend on a
   machine without a GPU explains why, once, in the package's own words. */
static char load_log[2048];
static size_t load_log_used;

static void capture_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level;
    (void) user_data;
    size_t n = strlen(text);
    if (load_log_used + n >= sizeof(load_log)) {
        n = sizeof(load_log) - 1 - load_log_used;
    }
    memcpy(load_log + load_log_used, text, n);
    load_log_used += n;
    load_log[load_log_used] = '\0';
}

const char * hy_backend_load_log(void) { return load_log; }

ggml_backend_reg_t hy_backend_load(const char * path, char * err, size_t n_err) {
    err[0] = '\0';
    load_log_used = 0;
    load_log[0] = '\0';
    void * handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char * why = dlerror();
        snprintf(err, n_err, "%s", why != NULL ? why : "dlopen failed");
        return NULL;
    }
    const char * (*abi)(void) = (const char * (*)(void)) dlsym(handle, "ggml_hybrid_backend_abi");
    if (abi == NULL) {
        snprintf(err, n_err, "%s was not built by ggml-hybrid's build.py (it has no ABI stamp)", path);
        dlclose(handle);
        return NULL;
    }
    if (strcmp(abi(), ggml_hybrid_base_abi()) != 0) {
        snprintf(err, n_err, "%s was built for GGML ABI %s, this ggml-base is %s; rebuild it", path, abi(),
                 ggml_hybrid_base_abi());
        dlclose(handle);
        return NULL;
    }
    /* the logger in place before (the package's quiet one) is put back afterwards */
    ggml_log_callback prev_log;
    void * prev_data;
    ggml_log_get(&prev_log, &prev_data);
    ggml_log_set(capture_log, NULL);
    ggml_backend_reg_t reg = ggml_backend_load(path); /* GGML's loader: API version check, registers the devices */
    ggml_log_set(prev_log, prev_data);
    dlclose(handle); /* GGML keeps a handle of its own */
    if (reg == NULL) {
        snprintf(err, n_err, "GGML could not initialise %s: %s", path, load_log);
    }
    return reg;
}

int hy_graph_n_leafs(struct ggml_cgraph * g) { return g->n_leafs; }
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i) { return g->leafs[i]; }
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t) {
    return ggml_hash_contains(&g->visited_hash_set, t);
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

/* CPU backend instances that stand in for separate devices: each gets its own copy of the CPU
   device and buffer type (same functions, distinct identity), so that the scheduler treats their
   buffers as different memories, as it does for two GPUs, instead of moving every node onto the
   first instance (it merges backends whose buffer types are the same object). */
static struct ggml_backend_device inst_dev[HY_MAX_INSTANCES];
static struct ggml_backend_buffer_type inst_buft[HY_MAX_INSTANCES];

static ggml_backend_buffer_type_t inst_get_buft(ggml_backend_dev_t dev) {
    return &inst_buft[dev - inst_dev];
}

ggml_backend_t hy_cpu_instance(int index) {
    if (index < 0 || index >= HY_MAX_INSTANCES) {
        return NULL;
    }
    ggml_backend_t b = hy_cpu_init();
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

void hy_log_quiet(void) { ggml_log_set(quiet_log, NULL); }

/* GGML's CPU "extra" buffer types, NULL-terminated, in the order llama.cpp prefers them (make_cpu_buft_list):
   weights there are repacked at load for faster CPU kernels (CPU_REPACK; AMX and KleidiAI where built). */
ggml_backend_buffer_type_t * hy_cpu_extra_bufts(void) {
    static ggml_backend_buffer_type_t none[1] = { NULL };
    ggml_backend_reg_t reg = cpu_reg();
    ggml_backend_dev_get_extra_bufts_t fn =
        (ggml_backend_dev_get_extra_bufts_t) cpu_proc("ggml_backend_dev_get_extra_bufts");
    if (fn == NULL || ggml_backend_reg_dev_count(reg) == 0) {
        return none;
    }
    ggml_backend_buffer_type_t * list = fn(ggml_backend_reg_dev_get(reg, 0));
    return list != NULL ? list : none;
}

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
