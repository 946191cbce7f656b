/* Graph internals that ggml.h does not expose but the Python layer's checks need (ggml-impl.h's cgraph). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

int hy_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i);
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int hy_graph_bare_leaf(struct ggml_cgraph * g);
void hy_sched_pin(ggml_backend_sched_t sched, struct ggml_tensor ** tensors, ggml_backend_t * backends, int n);
int hy_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                              const uintptr_t * pools, int n_pools);
