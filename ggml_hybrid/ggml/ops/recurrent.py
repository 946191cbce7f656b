"""Recurrent and state-space layers: ssm_conv, ssm_scan, rwkv_wkv6, gated_linear_attn, rwkv_wkv7, gated_delta_net,
solve_tri, and DeepSeek V4's hyper-connections (dsv4_hc_comb, dsv4_hc_pre, dsv4_hc_post).

All F32. The linear-attention ops (rwkv_wkv6, gated_linear_attn, rwkv_wkv7) take T tokens of ``n_seqs`` sequences
(T / n_seqs each, in order) with H heads of size S, and return one flat [T + S n_seqs, H S] tensor: the T outputs,
then each sequence's final state [H, S, S].
"""

from __future__ import annotations

from ..._native import ffi, lib
from ..tensor import Tensor
from .rules import (
    F32,
    I32,
    OpsBase,
    contiguous,
    finite,
    int32,
    integer,
    is_matrix,
    is_vector,
    need,
    rows_contiguous,
    types,
)


def _tokens(op: str, ref: Tensor, state: Tensor, *others: tuple[Tensor, str]) -> tuple[int, int, int, int]:
    """(S, H, T, n_seqs) of a linear-attention op, with every operand's shape and the token split checked."""
    S, H, T = ref.ne[0], ref.ne[1], ref.ne[2]
    for t, role in others:
        need(t.ne[:3] == (S, H, T) and t.ne[3] == 1, op, f"{role} must be [T, H, S] like the others", ref, t)
    n_seqs = state.ne[1]
    need(state.nelements == S * S * H * n_seqs and state.ne[0] == S * S * H and state.ne[2] == state.ne[3] == 1, op,
         "state must be [n_seqs, H S S]", ref, state)
    need(n_seqs >= 1 and T >= n_seqs and T % n_seqs == 0, op,
         f"the {T} tokens must split evenly into the state's {n_seqs} sequences", ref, state)
    return S, H, T, n_seqs


_WKV7_STEP = 64  # the largest GGML_F32_STEP of ggml-cpu/simd-mappings.h (AVX-512)


class RecurrentOps(OpsBase):
    """Token-by-token recurrences over a carried state."""

    def ssm_conv(self, sx: Tensor, c: Tensor) -> Tensor:
        """Short causal convolution: sx [seqs, channels, d_conv - 1 + T] (each channel's history then its T
        inputs, time innermost), c [channels, d_conv] -> [seqs, T, channels], output t of a channel the sum
        over j of ``sx[.., t + j] * c[.., j]`` (float, j ascending)."""
        op = "ssm_conv"
        self._own(op, sx, c)
        types(op, sx, {F32}, "sx")  # the CPU kernel has no other case
        types(op, c, {F32}, "c")
        need(sx.nb[0] == 4 and sx.nb[1] == sx.ne[0] * 4, op, "sx must be contiguous in its two inner dims", sx)
        need(c.nb[0] == 4, op, "c must have contiguous rows", c)
        need(sx.ne[3] == 1, op, "sx must be 3-D [seqs, channels, d_conv - 1 + tokens]", sx)
        need(c.ne[2] == 1 and c.ne[3] == 1, op, "c must be 2-D [channels, d_conv]", c)
        need(sx.ne[1] == c.ne[1], op, "sx and c must have the same number of channels", sx, c)
        need(sx.ne[0] >= c.ne[0], op, "sx must hold d_conv - 1 history steps and at least one token", sx, c)
        return self._node(lib.ggml_ssm_conv(self.ptr, sx.ptr, c.ptr))

    def gated_delta_net(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                        snapshots: int = 1) -> Tensor:
        """The gated delta rule, token by token (``ggml_gated_delta_net``).

        v [seqs, T, H, S] with H value heads of size S; q, k [seqs, T, Hk, S] with Hk dividing H (value head h
        reads query/key head h % Hk); g [seqs, T, H, 1] (or S per head) and beta [seqs, T, H, 1]; state
        [seqs, H, S, S], each head's matrix stored transposed. Per head and token: ``M *= exp(g)``,
        ``delta = (v - M k) * beta``, ``M += delta k^T``, ``out = (M q) / sqrt(S)``. The result is flat
        [T * seqs + snapshots * S * seqs, H * S]: the outputs [seqs, T, H, S], then the final state (the
        last ``snapshots`` states, newest first).
        """
        op = "gated_delta_net"
        self._own(op, q, k, v, g, beta, state)
        for t, role in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
            types(op, t, {F32}, role)
        for t, role in ((q, "q"), (k, "k"), (v, "v")):
            need(bool(lib.ggml_is_contiguous_rows(t.ptr)), op, f"{role} must have contiguous rows", t)
        for t, role in ((g, "g"), (beta, "beta"), (state, "state")):
            need(t.is_contiguous, op, f"{role} must be contiguous", t)
        S, H, T, n_seqs = v.ne
        need(q.ne == k.ne, op, "q and k must have the same shape", q, k)
        need(q.ne[0] == S, op, "q, k and v must have the same head size", q, v)
        need(q.ne[1] > 0 and H % q.ne[1] == 0, op, "the query/key heads must divide the value heads", q, v)
        need(q.ne[2] == T and q.ne[3] > 0 and n_seqs % q.ne[3] == 0, op,
              "q and k must have v's tokens and a number of sequences dividing v's", q, v)
        need(g.ne[0] in (1, S) and g.ne[1:] == (H, T, n_seqs), op, "g must be [seqs, T, H, 1 or S] like v", g, v)
        need(beta.ne == (1, H, T, n_seqs), op, "beta must be [seqs, T, H, 1] like v", beta, v)
        need(state.ne == (S, S, H, n_seqs), op, "state must be [seqs, H, S, S] for v [seqs, T, H, S]", state, v)
        snapshots = integer(op, "snapshots", snapshots, 1)
        return self._node(lib.ggml_gated_delta_net(self.ptr, q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, state.ptr,
                                                   snapshots))

    def ssm_scan(self, s: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, ids: Tensor,
                 snapshots: int = 1) -> Tensor:
        """Mamba's selective scan. s [states, H, dim, N] (the state pool), x [seqs, T, H, dim], dt [seqs, T, H],
        A [H, N] (Mamba-1) or [H, 1] (Mamba-2), B and C [seqs, T, G, N] (G groups dividing H), ids [seqs] (each
        sequence's state in s). Per token and head, with ``d = softplus(dt)``: ``state = state exp(d A) + B x d``,
        ``y = state . C``. The result is flat: y [seqs, T, H, dim], then the final states (the last ``snapshots``,
        newest first; more than one only for Mamba-2)."""
        op = "ssm_scan"
        self._own(op, s, x, dt, A, B, C, ids)
        for t, role in ((s, "s"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C")):
            types(op, t, {F32}, role)
        types(op, ids, {I32}, "ids")
        k = int32(op, "snapshots", snapshots, 1)
        for t, role in ((s, "s"), (dt, "dt"), (A, "A")):
            contiguous(op, t, role=role)
        for t, role in ((x, "x"), (B, "B"), (C, "C")):
            need(t.nb[0] == 4 and t.nb[1] == t.ne[0] * 4, op, f"{role} must be contiguous in its two inner dims", t)
        rows_contiguous(op, ids)
        d_state, head_dim, n_head, n_tok, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
        need(B.ne == C.ne, op, "B and C must have the same shape", B, C)
        need(dt.ne == (n_head, n_tok, n_seqs, 1), op, "dt must be [seqs, T, H] for x [seqs, T, H, dim]", x, dt)
        need(s.ne[1] == head_dim and s.ne[2] == n_head, op, "s must be [states, H, dim, N] for x's H and dim", s, x)
        need(B.ne[0] == d_state and B.ne[2] == n_tok and B.ne[3] == n_seqs and B.ne[1] >= 1
             and n_head % B.ne[1] == 0, op, "B and C must be [seqs, T, G, N] with G dividing H", s, x, B)
        need(is_vector(ids) and ids.ne[0] == n_seqs, op, "ids must hold one state index per sequence", x, ids)
        need(is_matrix(A) and A.ne[1] == n_head and A.ne[0] in (1, d_state), op, "A must be [H, N] or [H, 1]", s, A)
        need(A.ne[0] == 1 or k == 1, op, "more than one snapshot needs Mamba-2's A [H, 1]", A)
        self._bound_indices(op, ids, s.ne[3])
        return self._node(lib.ggml_ssm_scan(self.ptr, s.ptr, x.ptr, dt.ptr, A.ptr, B.ptr, C.ptr, ids.ptr, k))

    def rwkv_wkv6(self, k: Tensor, v: Tensor, r: Tensor, tf: Tensor, td: Tensor, state: Tensor) -> Tensor:
        """RWKV-6's WKV: k, v, r, td [T, H, S], tf [H, S] (time_first), state [n_seqs, H S S]. Per token, head and
        key i, value j: ``kv = k_i v_j``, ``out_j += (tf_i kv + M_ij) r_i``, ``M_ij = M_ij td_i + kv``."""
        op = "rwkv_wkv6"
        self._own(op, k, v, r, tf, td, state)
        for t, role in ((k, "k"), (v, "v"), (r, "r"), (tf, "tf"), (td, "td"), (state, "state")):
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
        S, H, _, _ = _tokens(op, k, state, (v, "v"), (r, "r"), (td, "td"))
        need(tf.nelements == H * S and tf.ne[0] == S, op, "tf must be [H, S]", k, tf)
        return self._node(lib.ggml_rwkv_wkv6(self.ptr, k.ptr, v.ptr, r.ptr, tf.ptr, td.ptr, state.ptr))

    def gated_linear_attn(self, k: Tensor, v: Tensor, q: Tensor, g: Tensor, state: Tensor, scale: float) -> Tensor:
        """Gated linear attention: k, v, q, g [T, H, S], state [n_seqs, H S S]. Per token and head, with the state M
        [key i, value j]: ``M = diag(g) M + k v^T`` (g the decay itself, not its log), ``out = scale q^T M``."""
        op = "gated_linear_attn"
        self._own(op, k, v, q, g, state)
        for t, role in ((k, "k"), (v, "v"), (q, "q"), (g, "g"), (state, "state")):
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
        _tokens(op, k, state, (v, "v"), (q, "q"), (g, "g"))
        return self._node(lib.ggml_gated_linear_attn(self.ptr, k.ptr, v.ptr, q.ptr, g.ptr, state.ptr,
                                                     finite(op, "scale", scale)))

    def rwkv_wkv7(self, r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, state: Tensor) -> Tensor:
        """RWKV-7's WKV: r, w, k, v, a, b [T, H, S], state [n_seqs, H S S]. Per token and head, with the state M
        [value j, key i]: ``M = M diag(w) + (M a) b^T + v k^T``, ``out = M r``."""
        op = "rwkv_wkv7"
        self._own(op, r, w, k, v, a, b, state)
        for t, role in ((r, "r"), (w, "w"), (k, "k"), (v, "v"), (a, "a"), (b, "b"), (state, "state")):
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
        S, _, _, _ = _tokens(op, k, state, (r, "r"), (w, "w"), (v, "v"), (a, "a"), (b, "b"))
        # the CPU's SIMD kernel walks each head's rows in steps of GGML_F32_STEP floats (64 with AVX-512) and has no
        # remainder loop that runs: a head size not a multiple reads and writes past the state
        need(S % _WKV7_STEP == 0, op, f"the head size S must be a multiple of {_WKV7_STEP} (GGML's SIMD kernel)", k)
        return self._node(lib.ggml_rwkv_wkv7(self.ptr, r.ptr, w.ptr, k.ptr, v.ptr, a.ptr, b.ptr, state.ptr))

    def solve_tri(self, a: Tensor, b: Tensor) -> Tensor:
        """``x`` with ``a @ x = b`` for lower-triangular a [.., n, n] (diagonal nonzero) and b [.., n, m] ->
        [.., n, m], by forward substitution (``scipy.linalg.solve_triangular(a, b, lower=True)``). F32,
        contiguous."""
        op = "solve_tri"
        self._own(op, a, b)
        types(op, a, {F32}, "a")
        types(op, b, {F32}, "b")
        contiguous(op, a, b, role="a and b")
        need(a.ne[0] == a.ne[1], op, "a's two innermost sizes must be equal (square matrices)", a)
        need(a.ne[1] == b.ne[1] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], op,
             "b must be [.., n, m] with a's n and batch dims", a, b)
        return self._node(lib.ggml_solve_tri(self.ptr, a.ptr, b.ptr, True, True, False))

    def dsv4_hc_comb(self, mixes: Tensor, scale: Tensor, base: Tensor, eps: float = 1e-6,
                     n_iter: int = 20) -> Tensor:
        """DeepSeek V4 hyper-connections' combination matrices: mixes [T, (2 + hc) hc] (hc = 4), scale [>= 3],
        base [(2 + hc) hc] -> [T, hc, hc]: ``logits[t, src, dst] = mixes[t, 2 hc + dst + hc src] scale[2] +
        base[2 hc + dst + hc src]``, softmax over dst plus eps, normalised over src, then ``n_iter - 1`` more
        rounds of normalising over dst then src (Sinkhorn)."""
        op = "dsv4_hc_comb"
        self._own(op, mixes, scale, base)
        for t, role in ((mixes, "mixes"), (scale, "scale"), (base, "base")):
            types(op, t, {F32}, role)
            rows_contiguous(op, t)
        n = int32(op, "n_iter", n_iter, 1)
        need(mixes.ne[0] == 24 and is_matrix(mixes), op, "mixes must be [T, 24] ((2 + hc) hc with hc = 4)", mixes)
        need(is_vector(scale) and scale.ne[0] >= 3, op, "scale must be a vector of at least 3", scale)
        need(is_vector(base) and base.ne[0] == mixes.ne[0], op, "base must be a vector of mixes' row length",
             mixes, base)
        return self._node(lib.ggml_dsv4_hc_comb(self.ptr, mixes.ptr, scale.ptr, base.ptr, finite(op, "eps", eps), n))

    def dsv4_hc_pre(self, x: Tensor, weights: Tensor) -> Tensor:
        """Hyper-connections' read: x [T, hc, n], weights [T, hc] -> [T, n], ``sum_h x[t, h] weights[t, h]``."""
        op = "dsv4_hc_pre"
        self._own(op, x, weights)
        self._hc_check(op, x, weights)
        need(weights.ne == (x.ne[1], x.ne[2], 1, 1), op, "weights must be [T, hc] for x [T, hc, n]", x, weights)
        return self._node(lib.ggml_dsv4_hc_pre(self.ptr, x.ptr, weights.ptr))

    def dsv4_hc_pre_gated(self, x: Tensor, gate: Tensor, scale: float = 1.0) -> Tensor:
        """Gated read: x, gate [T, hc, n] -> [T, n], ``scale sum_h x[t, h] sigmoid(gate[t, h])``."""
        op = "dsv4_hc_pre_gated"
        self._own(op, x, gate)
        self._hc_check(op, x, gate)
        need(gate.ne == x.ne, op, "gate must have x's shape [T, hc, n]", x, gate)
        return self._node(lib.ggml_dsv4_hc_pre_gated(self.ptr, x.ptr, gate.ptr, finite(op, "scale", scale)))

    def _hc_check(self, op: str, x: Tensor, w: Tensor) -> None:
        types(op, x, {F32}, "x")
        types(op, w, {F32}, "weights")
        rows_contiguous(op, x, w)
        need(x.ne[3] == 1 and x.ne[1] > 0, op, "x must be 3-D [T, hc, n]", x)

    def dsv4_hc_post(self, x: Tensor, residual: Tensor, post: Tensor, comb: Tensor | None = None) -> Tensor:
        """Hyper-connections' write: x [T, n], residual [T, hc, n], post [T, hc], comb [T, hc, hc] or None ->
        [T, hc, n]: ``x[t] post[t, d] + sum_s comb[t, s, d] residual[t, s]`` (comb None: ``residual[t, d]``)."""
        op = "dsv4_hc_post"
        tensors = [x, residual, post] + ([comb] if comb is not None else [])
        self._own(op, *tensors)
        for t in tensors:
            types(op, t, {F32}, t.name or "input")
            rows_contiguous(op, t)
        n, T, hc = x.ne[0], x.ne[1], residual.ne[1]
        need(is_matrix(x), op, "x must be a matrix [T, n]", x)
        need(hc > 0 and residual.ne == (n, hc, T, 1), op, "residual must be [T, hc, n] for x [T, n]", x, residual)
        need(post.ne == (hc, T, 1, 1), op, "post must be [T, hc]", residual, post)
        if comb is not None:
            need(comb.ne == (hc, hc, T, 1), op, "comb must be [T, hc, hc]", residual, comb)
        return self._node(lib.ggml_dsv4_hc_post(self.ptr, x.ptr, residual.ptr, post.ptr,
                                                comb.ptr if comb is not None else ffi.NULL))

