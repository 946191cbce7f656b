#include "cpu_backend.h"

#include <stdio.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml-backend-impl.h"

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
