/* ggml-hybrid's own C, compiled into the cffi module next to GGML: small accessors the public GGML
   headers do not offer, CPU backend instances that play devices, and the build fingerprint. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

/* GGML_SCHED_MAX_BACKENDS of ggml-backend.cpp (private there): a scheduler asserts on more. */
#define HY_SCHED_MAX_BACKENDS 16
/* CPU instances playing devices: every backend of a scheduler but its host CPU. */
#define HY_MAX_INSTANCES (HY_SCHED_MAX_BACKENDS - 1)

/* what the module was built from (compiled in as macros by build.py) */
const char * hy_ggml_version(void);
const char * hy_patch_hash(void);
const char * hy_source_hash(void);
const char * hy_abi(void);
/* the ABI stamp compiled into the ggml-base actually loaded (vendor/CMakeLists.txt adds it) */
const char * ggml_hybrid_base_abi(void);

/* the CPU backend, reached through GGML's registry (see sched_hooks.c) */
int hy_load_cpu(const char * lib_dir);
ggml_backend_t hy_cpu_init(void);
bool hy_is_cpu(ggml_backend_t backend);
void hy_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
struct ggml_threadpool * hy_threadpool_new(struct ggml_threadpool_params * params);
void hy_threadpool_free(struct ggml_threadpool * threadpool);
void hy_cpu_set_threadpool(ggml_backend_t backend, struct ggml_threadpool * threadpool);
const char * hy_cpu_features(void);

/* optional backends, loaded at run time (GGML_BACKEND_DL) */
const char * hy_reg_path(ggml_backend_reg_t reg);
ggml_backend_reg_t hy_backend_load(const char * path, char * err, size_t n_err);
const char * hy_backend_load_log(void);

/* graph internals that ggml.h does not expose but overflow checks need */
int hy_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i);
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int hy_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                              const uintptr_t * pools, int n_pools);

ggml_backend_t hy_cpu_instance(int index);

/* GGML's log messages to stderr, but for debug ones */
void hy_log_quiet(void);

/* GGML's CPU extra buffer types (repacked weights), NULL-terminated */
ggml_backend_buffer_type_t * hy_cpu_extra_bufts(void);
/* whether ggml_backend_tensor_get works on the buffer's tensors (not on repacked ones) */
bool hy_buffer_readable(ggml_backend_buffer_t buf);

/* One compute of a graph with all of its inputs given: each input set whole from host memory, the graph
   computed, one result (out, out_size bytes) copied out whole into out_data. A decode step then crosses from the interpreter once, not once
   per tensor. Every tensor is checked first (in a buffer, allocated, of the given size; the output in a
   buffer that can be read back): on the first that is not, nothing is set or computed, *bad is its number
   (the inputs from 1, then the output) and the status GGML_STATUS_FAILED; else *bad is 0 and the status
   the compute's (the output is copied only after a successful one). */
struct hy_io {
    struct ggml_tensor * tensor;
    void * data;
    size_t size;
};
enum ggml_status hy_sched_step(ggml_backend_sched_t sched, struct ggml_cgraph * graph,
        const struct hy_io * in, int n_in, struct ggml_tensor * out, void * out_data, size_t out_size,
        int * bad);
