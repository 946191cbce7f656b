/* Scheduler.step's one native call: a decode step's inputs set, the graph computed, its result read back. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include "ggml.h"
#include "ggml-backend.h"

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
