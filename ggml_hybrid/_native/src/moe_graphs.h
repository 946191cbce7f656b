/* The expert FFN and the weighted sum of a MoE layer as GGML graphs, built in C exactly as the Python
   builders (ggml_hybrid/moe/ffn.py: expert_ffn, weighted_sum) and llama.cpp build them, so that the
   native executor's output is bit-identical to the resident graph's.

   Graphs are kept in a small cache per owner (an executor or the CPU worker), keyed by what they compute
   and their row count, each built in its own preallocated context memory; all the graphs of one owner
   share one compute buffer (they never run at the same time), laid out from its start. A steady decode
   therefore allocates nothing: a new row count rebuilds a graph in existing memory, and the buffer only
   grows when a larger graph than any before arrives. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

/* one layer's routed experts: gate_up and down (fused), or gate, up and down; and gpt-oss's per-expert biases
   (2-D: [rows, experts], selected per expert like the matrices by ggml_add_id), NULL where the layer has none */
typedef struct hy_experts {
    struct ggml_tensor * gate_up, * gate, * up, * down;
    struct ggml_tensor * gate_b, * up_b, * down_b;
} hy_experts;

/* gpt-oss's clamped SwiGLU (GGML_GLU_OP_SWIGLU_OAI): the constants of llama.cpp's build_moe_ffn
   (LLM_FFN_SWIGLU_OAI_MOE), as ggml_hybrid/moe/ffn.py's SWIGLU_OAI_ALPHA and SWIGLU_OAI_LIMIT */
#define HY_SWIGLU_OAI_ALPHA 1.702f
#define HY_SWIGLU_OAI_LIMIT 7.0f

/* The FFN of llama.cpp's build_moe_ffn: up (+ up bias), gate (+ gate bias), the GLU (swiglu_oai: the clamped one,
   gate and up separate), down (+ down bias); unweighted expert rows [E, k, T]. */
struct ggml_tensor * hy_build_expert_ffn(struct ggml_context * ctx, const hy_experts * w, struct ggml_tensor * x3,
                                         struct ggml_tensor * ids, enum ggml_glu_op glu);
/* Whether the expert graphs can build `w`'s FFN with `glu`: gate_up fused only without gate and up biases and with
   a GLU of one input; the clamped SwiGLU only with gate and up separate. */
bool hy_experts_buildable(const hy_experts * w, enum ggml_glu_op glu);
/* The field of `out` that holds the kind `like` is in `kinds` (the same experts seen elsewhere: slots, frames),
   NULL when `like` is none of them. */
struct ggml_tensor ** hy_experts_field(hy_experts * out, const hy_experts * kinds, const struct ggml_tensor * like);
struct ggml_tensor * hy_build_weighted_sum(struct ggml_context * ctx, struct ggml_tensor * expert_out,
                                           struct ggml_tensor * weights);

/* A compute buffer shared by the graphs of several caches that run one after another (the executors of
   the layers of one model on one device): every graph is placed from its start. */
typedef struct hy_scratch {
    ggml_backend_buffer_type_t buft;
    ggml_backend_buffer_t buffer;
    size_t size;
    uint64_t epoch; /* bumped when the buffer is replaced: graphs placed before must be placed again */
} hy_scratch;

hy_scratch * hy_scratch_new(ggml_backend_buffer_type_t buft);
void hy_scratch_free(hy_scratch * s);

enum { HY_GRAPH_FULL = 0, HY_GRAPH_ROWS = 1, HY_GRAPH_SUM = 2, HY_GRAPH_TOKEN = 3, HY_GRAPH_CALL = 4 };

/* A built graph: inputs x (rows x n_embd, shaped [n,1,E]; TOKEN: one row, [1,1,E]), ids ([n,k] or [n,1];
   TOKEN: [1,n], the n experts of that one row), w ([n,k,1]) and experts_in ([n,k,E], the sum's input),
   and its output (out: [n,E] for FULL/SUM, [n,1,E] for ROWS, [1,n,E] for TOKEN, [n,k,E] for CALL: FULL's
   expert rows before the weighted sum). */
typedef struct hy_graph {
    int kind, n;
    const void * key;            /* what the graph's weights are (the experts it multiplies) */
    uint64_t epoch;              /* the scratch epoch it is placed for */
    int64_t last_use;
    void * meta;                 /* the context memory, allocated once per cache entry */
    size_t meta_size;
    struct ggml_context * ctx;
    struct ggml_cgraph * gf;
    struct ggml_tensor * x, * ids, * w, * experts_in, * out;
} hy_graph;

/* The row bucket: the row count of the graph that computes n compacted (token, expert) rows. Exact up to
   HY_EXACT_ROWS rows (decode never pads), then the next power of two (fewer graph shapes). The one
   definition of the rule: the executor's rounds, the CPU worker and the Python row graphs
   (ggml_hybrid/moe/row_graphs.py, through cffi) all call this. */
#define HY_EXACT_ROWS 32
int hy_row_bucket(int n);

#define HY_GRAPH_CACHE 12

typedef struct hy_graph_cache {
    hy_graph entries[HY_GRAPH_CACHE];
    int64_t clock;
    int64_t builds;              /* graphs built so far: constant once warm */
    hy_scratch * scratch;
} hy_graph_cache;

void hy_graph_cache_init(hy_graph_cache * c, hy_scratch * scratch);
void hy_graph_cache_free(hy_graph_cache * c);

/* The graph of `kind` over `n` rows for experts `w` (key), built or found, placed in the scratch and ready
   to take inputs; NULL when memory cannot be had. n_used: experts per token (FULL, SUM); glu for FFNs. */
hy_graph * hy_graph_get(hy_graph_cache * c, int kind, int n, const hy_experts * w, const void * key, int n_used,
                        int n_embd, enum ggml_glu_op glu);
