/* ggml-hybrid's own C, compiled into the cffi module next to GGML: small accessors the public GGML
   headers do not offer, CPU backend instances that play devices, and the build fingerprint. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

/* GGML_SCHED_MAX_BACKENDS of ggml-backend.cpp (private there): a scheduler asserts on more. */
#define GGML_HYBRID_SCHED_MAX_BACKENDS 16
/* CPU instances playing devices: every backend of a scheduler but its host CPU. */
#define GGML_HYBRID_MAX_INSTANCES (GGML_HYBRID_SCHED_MAX_BACKENDS - 1)

/* what the module was built from (compiled in as macros by build.py) */
const char * ggml_hybrid_ggml_version(void);
const char * ggml_hybrid_patch_hash(void);
const char * ggml_hybrid_source_hash(void);
const char * ggml_hybrid_abi(void);
/* the ABI stamp compiled into the ggml-base actually loaded (vendor/CMakeLists.txt adds it) */
const char * ggml_hybrid_base_abi(void);

/* the CPU backend, reached through GGML's registry (see hybrid.c) */
int ggml_hybrid_load_cpu(const char * lib_dir);
ggml_backend_t ggml_hybrid_cpu_init(void);
bool ggml_hybrid_is_cpu(ggml_backend_t backend);
void ggml_hybrid_cpu_set_n_threads(ggml_backend_t backend, int n_threads);
struct ggml_threadpool * ggml_hybrid_threadpool_new(struct ggml_threadpool_params * params);
void ggml_hybrid_threadpool_free(struct ggml_threadpool * threadpool);
void ggml_hybrid_cpu_set_threadpool(ggml_backend_t backend, struct ggml_threadpool * threadpool);
const char * ggml_hybrid_cpu_features(void);

/* optional backends, loaded at run time (GGML_BACKEND_DL) */
const char * ggml_hybrid_reg_path(ggml_backend_reg_t reg);
ggml_backend_reg_t ggml_hybrid_backend_load(const char * path, char * err, size_t n_err);
const char * ggml_hybrid_backend_load_log(void);

/* graph internals that ggml.h does not expose but overflow checks need */
int ggml_hybrid_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * ggml_hybrid_graph_leaf(struct ggml_cgraph * g, int i);
bool ggml_hybrid_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int ggml_hybrid_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                              const uintptr_t * pools, int n_pools);

ggml_backend_t ggml_hybrid_cpu_instance(int index);

/* GGML's log messages to stderr, but for debug ones */
void ggml_hybrid_log_quiet(void);

/* GGML's CPU extra buffer types (repacked weights), NULL-terminated */
ggml_backend_buffer_type_t * ggml_hybrid_cpu_extra_bufts(void);
/* whether ggml_backend_tensor_get works on the buffer's tensors (not on repacked ones) */
bool ggml_hybrid_buffer_readable(ggml_backend_buffer_t buf);

/* One compute of a graph with all of its inputs given: each input set whole from host memory, the graph
   computed, one result (out, out_size bytes) copied out whole into out_data. A decode step then crosses from the interpreter once, not once
   per tensor. Every tensor is checked first (in a buffer, allocated, of the given size; the output in a
   buffer that can be read back): on the first that is not, nothing is set or computed, *bad is its number
   (the inputs from 1, then the output) and the status GGML_STATUS_FAILED; else *bad is 0 and the status
   the compute's (the output is copied only after a successful one). */
struct ggml_hybrid_io {
    struct ggml_tensor * tensor;
    void * data;
    size_t size;
};
enum ggml_status ggml_hybrid_sched_step(ggml_backend_sched_t sched, struct ggml_cgraph * graph,
        const struct ggml_hybrid_io * in, int n_in, struct ggml_tensor * out, void * out_data, size_t out_size,
        int * bad);
