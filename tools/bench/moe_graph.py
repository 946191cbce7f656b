"""A 48-layer MoE-shaped graph (router, top-k, gate/up/down mul_mat_id, weighted sum, residual),
built with raw cffi calls so that the same code drives the patched and the unpatched module.

Sizes are small on purpose: the benchmarks built on it measure the scheduler and the Python
side, not the kernels.
"""

from __future__ import annotations

import numpy as np

DEFAULTS = dict(n_layer=48, n_embd=64, n_ff=32, n_expert=16, n_used=4, n_tokens=1)


def _new(ffi, lib, ctx, dtype, *ne):
    return lib.ggml_new_tensor(ctx, dtype, len(ne), ffi.new("int64_t[]", list(ne)))


class RawMoE:
    """Weights in one CPU buffer, a graph rebuilt on demand in its own context."""

    def __init__(self, ffi, lib, backend, n_layer, n_embd, n_ff, n_expert, n_used, n_tokens, seed=0):
        self.ffi, self.lib = ffi, lib
        self.p = dict(n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_expert=n_expert, n_used=n_used,
                      n_tokens=n_tokens)
        f32 = lib.GGML_TYPE_F32
        params = ffi.new("struct ggml_init_params *", {"mem_size": (6 * n_layer + 8) * lib.ggml_tensor_overhead(),
                                                        "mem_buffer": ffi.NULL, "no_alloc": True})
        self.wctx = lib.ggml_init(params[0])
        self.layers = []
        for _ in range(n_layer):
            self.layers.append(dict(
                norm=_new(ffi, lib, self.wctx, f32, n_embd),
                router=_new(ffi, lib, self.wctx, f32, n_embd, n_expert),
                gate=_new(ffi, lib, self.wctx, f32, n_embd, n_ff, n_expert),
                up=_new(ffi, lib, self.wctx, f32, n_embd, n_ff, n_expert),
                down=_new(ffi, lib, self.wctx, f32, n_ff, n_embd, n_expert)))
        self.wbuf = lib.ggml_backend_alloc_ctx_tensors(self.wctx, backend)
        lib.ggml_backend_buffer_set_usage(self.wbuf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            for t in layer.values():
                n = lib.ggml_nelements(t)
                data = (rng.standard_normal(n) * 0.1).astype(np.float32)
                lib.ggml_backend_tensor_set(t, ffi.from_buffer(data), 0, data.nbytes)
        self.graph_size = 64 * n_layer + 64
        self.ctx = None

    def build(self):
        """Build the graph into a fresh context; returns (graph, input x, output)."""
        ffi, lib, p = self.ffi, self.lib, self.p
        if self.ctx is not None:
            lib.ggml_free(self.ctx)
        mem = self.graph_size * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(self.graph_size, False)
        params = ffi.new("struct ggml_init_params *", {"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": True})
        ctx = self.ctx = lib.ggml_init(params[0])
        T, E, k, n_embd = p["n_tokens"], p["n_expert"], p["n_used"], p["n_embd"]
        x = _new(ffi, lib, ctx, lib.GGML_TYPE_F32, n_embd, T)
        lib.ggml_set_input(x)
        g = lib.ggml_new_graph_custom(ctx, self.graph_size, False)
        cur = x
        for layer in self.layers:
            h = lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, cur, 1e-6), layer["norm"])
            logits = lib.ggml_mul_mat(ctx, layer["router"], h)                      # [E, T]
            probs = lib.ggml_soft_max_ext(ctx, logits, ffi.NULL, 1.0, 0.0)
            ids = lib.ggml_top_k(ctx, probs, k)                                      # [k, T]
            w = lib.ggml_get_rows(ctx, lib.ggml_reshape_4d(ctx, probs, 1, E, T, 1), ids)  # [1, k, T]
            lib.ggml_build_forward_expand(g, w)
            h3 = lib.ggml_reshape_4d(ctx, h, n_embd, 1, T, 1)
            gate = lib.ggml_mul_mat_id(ctx, layer["gate"], h3, ids)                 # [ff, k, T]
            up = lib.ggml_mul_mat_id(ctx, layer["up"], h3, ids)
            act = lib.ggml_glu_split(ctx, gate, up, lib.GGML_GLU_OP_SWIGLU)
            down = lib.ggml_mul_mat_id(ctx, layer["down"], act, ids)                # [embd, k, T]
            y = lib.ggml_mul(ctx, down, w)
            moe = lib.ggml_view_4d(ctx, y, n_embd, T, 1, 1, y.nb[2], y.nb[2] * T, y.nb[2] * T, 0)
            for j in range(1, k):
                moe = lib.ggml_add(ctx, moe, lib.ggml_view_4d(ctx, y, n_embd, T, 1, 1, y.nb[2], y.nb[2] * T,
                                                               y.nb[2] * T, j * y.nb[1]))
            cur = lib.ggml_add(ctx, moe, cur)
        lib.ggml_set_output(cur)
        lib.ggml_build_forward_expand(g, cur)
        return g, x, cur

    def close(self):
        if self.ctx is not None:
            self.lib.ggml_free(self.ctx)
            self.ctx = None
        self.lib.ggml_backend_buffer_free(self.wbuf)
        self.lib.ggml_free(self.wctx)
