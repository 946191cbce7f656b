/* GGML's CPU backend reached through its registry (a portable build loads one of several CPU libraries at run
   time), its threads and threadpools, the CPU instances that play devices, and its extra buffer types. */
#pragma once

#include <stdbool.h>

#include "ggml.h"
#include "ggml-backend.h"

/* GGML_SCHED_MAX_BACKENDS of ggml-backend.cpp (private there): a scheduler asserts on more. */
#define HY_SCHED_MAX_BACKENDS 16
/* CPU instances playing devices: every backend of a scheduler but its host CPU. */
#define HY_MAX_INSTANCES (HY_SCHED_MAX_BACKENDS - 1)

int hy_load_cpu(const char * lib_dir);
ggml_backend_t hy_cpu_init(void);
bool hy_is_cpu(ggml_backend_t backend);
void hy_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
struct ggml_threadpool * hy_threadpool_new(struct ggml_threadpool_params * params);
void hy_threadpool_free(struct ggml_threadpool * threadpool);
void hy_cpu_set_threadpool(ggml_backend_t backend, struct ggml_threadpool * threadpool);
const char * hy_cpu_features(void);

/* a CPU backend with a device and buffer type of its own identity: the scheduler treats it as a separate device */
ggml_backend_t hy_cpu_instance(int index);

/* GGML's CPU extra buffer types (repacked weights), NULL-terminated */
ggml_backend_buffer_type_t * hy_cpu_extra_bufts(void);
