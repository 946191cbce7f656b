/* Graph internals that ggml.h does not expose but the Python layer's checks need (ggml-impl.h's cgraph). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

int hy_graph_n_leafs(struct ggml_cgraph * g);
struct ggml_tensor * hy_graph_leaf(struct ggml_cgraph * g, int i);
bool hy_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t);
int hy_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                              const uintptr_t * pools, int n_pools);
