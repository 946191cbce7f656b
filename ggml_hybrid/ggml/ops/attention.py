"""Positions and attention: rope, rope_multi, rope_back, flash_attn, timestep_embedding, get_rel_pos, add_rel_pos,
lightning_indexer.

Shapes are numpy-order: a rope input is [T, heads, head_dim] (one position per token), attention's q [H, T, d].
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._native import ffi, lib
from ...checks import check_choice
from ...errors import ShapeError
from ..dtypes import GGMLType
from ..tensor import Tensor
from .catalog import OP_CODES
from .rules import (
    F16,
    F32,
    I32,
    MATMUL_WEIGHTS,
    OpsBase,
    check_sinks,
    contiguous,
    finite,
    int32,
    integer,
    need,
    rows_contiguous,
    same_shape,
    types,
)

_ROPE_MODES = {"normal": lib.GGML_ROPE_TYPE_NORMAL, "neox": lib.GGML_ROPE_TYPE_NEOX}
_MROPE_MODES = {"mrope": lib.GGML_ROPE_TYPE_MROPE, "imrope": lib.GGML_ROPE_TYPE_IMROPE}


class AttentionOps(OpsBase):
    """Rotary embeddings, fused attention and the position helpers of vision and diffusion models."""

    def rope(self, a: Tensor, pos: Tensor, n_dims: int, mode: str = "normal", freq_base: float = 10000.0,
             freq_scale: float = 1.0, n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0,
             beta_fast: float = 32.0, beta_slow: float = 1.0, freq_factors: Tensor | None = None) -> Tensor:
        """Rotary embedding of a [T, heads, head_dim] at positions pos [T] (llama.cpp's rope_ext)."""
        op = "rope_ext"
        modes = _ROPE_MODES
        check_choice(mode, f"{op}: mode", sorted(modes))
        self._own(op, a, pos, *([freq_factors] if freq_factors is not None else []))
        types(op, a, {F32, F16})
        rows_contiguous(op, a)
        types(op, pos, {I32}, "pos")
        need(pos.ne[1] == 1 and pos.ne[2] == 1 and pos.ne[3] == 1, op, "pos must be a vector", pos)
        need(a.ne[2] == pos.ne[0], op, "pos must hold one position per token (a's outermost-but-one dim)", a, pos)
        integer(op, "n_dims", n_dims, 2, a.ne[0])
        need(n_dims % 2 == 0, op, f"n_dims={n_dims} must be even", a)
        if freq_factors is not None:
            types(op, freq_factors, {F32}, "freq_factors")
            need(freq_factors.ne[0] >= n_dims // 2, op, "freq_factors needs n_dims/2 entries", freq_factors)
        integer(op, "n_ctx_orig", n_ctx_orig, 0)
        return self._node(lib.ggml_rope_ext(
            self.ptr, a.ptr, pos.ptr, freq_factors.ptr if freq_factors is not None else ffi.NULL, n_dims,
            modes[mode], n_ctx_orig, finite(op, "freq_base", freq_base), finite(op, "freq_scale", freq_scale),
            finite(op, "ext_factor", ext_factor), finite(op, "attn_factor", attn_factor),
            finite(op, "beta_fast", beta_fast), finite(op, "beta_slow", beta_slow)))

    rope_ext = rope

    def rope_multi(self, a: Tensor, pos: Tensor, n_dims: int, sections: Sequence[int], mode: str = "imrope",
                   freq_base: float = 10000.0, freq_scale: float = 1.0, n_ctx_orig: int = 0, ext_factor: float = 0.0,
                   attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> Tensor:
        """Multi-axis rotary embedding (llama.cpp's ``ggml_rope_multi``) of a [T, heads, head_dim].

        ``pos`` [4 T] holds four positions per token, one axis after the other (t, h, w, e); each rotated
        pair takes its position from the axis ``sections`` (4 counts of pairs) gives it: in runs
        (``mrope``) or interleaved t, h, w (``imrope``, Qwen3-VL and Qwen3.5). Pairs pass NEOX-style.
        """
        op = "rope_multi"
        modes = _MROPE_MODES
        check_choice(mode, f"{op}: mode", sorted(modes))
        self._own(op, a, pos)
        types(op, a, {F32, F16})
        rows_contiguous(op, a)
        types(op, pos, {I32}, "pos")
        need(pos.ne[1] == 1 and pos.ne[2] == 1 and pos.ne[3] == 1, op, "pos must be a vector", pos)
        need(pos.ne[0] == 4 * a.ne[2], op, "pos must hold four positions per token (t, h, w and e rows)", a, pos)
        integer(op, "n_dims", n_dims, 2, a.ne[0])
        need(n_dims % 2 == 0, op, f"n_dims={n_dims} must be even", a)
        secs = [integer(op, "sections", x, 0) for x in sections]
        if len(secs) != lib.GGML_MROPE_SECTIONS:
            raise ShapeError(f"{op}: sections must hold {lib.GGML_MROPE_SECTIONS} counts, got {list(sections)}")
        if not any(secs[:3]):
            raise ShapeError(f"{op}: sections {secs}: one of the first three must be positive")
        need(sum(secs) <= a.ne[0], op, f"sections {secs} must sum to at most the head size {a.ne[0]}", a)
        integer(op, "n_ctx_orig", n_ctx_orig, 0)
        return self._node(lib.ggml_rope_multi(
            self.ptr, a.ptr, pos.ptr, ffi.NULL, n_dims, ffi.new("int[4]", secs), modes[mode], n_ctx_orig,
            finite(op, "freq_base", freq_base), finite(op, "freq_scale", freq_scale),
            finite(op, "ext_factor", ext_factor), finite(op, "attn_factor", attn_factor),
            finite(op, "beta_fast", beta_fast), finite(op, "beta_slow", beta_slow)))

    def flash_attn(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                   max_bias: float = 0.0, logit_softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
        """Fused attention. q [H, T, d], k/v [Hkv, S, d]; mask [T_pad, S] F16; sinks [H] as in
        :meth:`soft_max`. Result [T, H, d_v]."""
        op = "flash_attn_ext"
        self._own(op, q, k, v, *(t for t in (mask, sinks) if t is not None))
        if sinks is not None:
            check_sinks(op, sinks, q)
        types(op, q, {F32}, "q")
        for t, role in ((k, "k"), (v, "v")):
            types(op, t, {F16, F32, GGMLType.Q8_0, GGMLType.Q4_0}, role)
        need(k.ne[0] == q.ne[0], op, "q and k must have the same head size", q, k)
        need(q.ne[2] % k.ne[2] == 0 and q.ne[3] % k.ne[3] == 0, op, "q heads must be a multiple of kv heads", q, k)
        need(q.ne[3] == k.ne[3] == v.ne[3], op, "q, k and v must share the outermost dim", q, k, v)
        need(k.ne[1] == v.ne[1] and k.ne[2] == v.ne[2], op, "k and v must have the same length and heads", k, v)
        if mask is not None:
            types(op, mask, {F16}, "mask")
            need(mask.is_contiguous, op, "mask must be contiguous", mask)
            need(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1], op,
                  "mask must be [>= query tokens, kv length]", q, k, mask)
            need(q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0, op, "mask's outer dims must divide q's",
                  q, mask)
        out = self._node(lib.ggml_flash_attn_ext(
            self.ptr, q.ptr, k.ptr, v.ptr, mask.ptr if mask is not None else ffi.NULL, finite(op, "scale", scale),
            finite(op, "max_bias", max_bias), finite(op, "logit_softcap", logit_softcap)))
        if sinks is not None:
            lib.ggml_flash_attn_ext_add_sinks(out.ptr, sinks.ptr)
        return out

    flash_attn_ext = flash_attn

    def rope_back(self, grad: Tensor, rope: Tensor) -> Tensor:
        """The gradient of the rope node ``rope`` (made by :meth:`rope` or :meth:`rope_multi`) with respect to its
        input, for the output gradient ``grad`` (rope's shape): the rotation by the opposite angles, with rope's
        positions, frequencies and scaling (``ggml_rope_ext_back`` / ``ggml_rope_multi_back``)."""
        op = "rope_back"
        self._own(op, grad, rope)
        need(rope.ptr.op == OP_CODES["ROPE"], op, "rope must be a node made by rope() or rope_multi()", rope)
        types(op, grad, {F32, F16}, "grad")
        same_shape(op, grad, rope, "grad and rope")
        rows_contiguous(op, grad)
        p = rope.ptr
        prm = ffi.cast("int32_t *", p.op_params)
        fl = ffi.cast("float *", p.op_params)
        n_dims, mode, n_ctx_orig = prm[1], prm[2], prm[4]
        floats = [fl[i] for i in range(5, 11)]
        freq = p.src[2] if p.src[2] != ffi.NULL else ffi.NULL
        if mode & lib.GGML_ROPE_TYPE_MROPE:
            sections = ffi.new("int[4]", [prm[11 + i] for i in range(4)])
            return self._node(lib.ggml_rope_multi_back(self.ptr, grad.ptr, p.src[1], freq, n_dims, sections, mode,
                                                       n_ctx_orig, *floats))
        return self._node(lib.ggml_rope_ext_back(self.ptr, grad.ptr, p.src[1], freq, n_dims, mode, n_ctx_orig,
                                                 *floats))

    def timestep_embedding(self, timesteps: Tensor, dim: int, max_period: int = 10000) -> Tensor:
        """Sinusoidal embeddings of timesteps [N] -> [N, dim]: with ``half = dim // 2`` and ``f_j =
        exp(-log(max_period) j / half)``, ``cos(t f_j)`` in columns 0..half-1, ``sin(t f_j)`` in half..2 half-1
        (and 0 in the last column of an odd dim). F32."""
        op = "timestep_embedding"
        self._own(op, timesteps)
        types(op, timesteps, {F32}, "timesteps")
        need(timesteps.ndim == 1 and timesteps.nb[0] == 4, op, "timesteps must be a contiguous vector", timesteps)
        dim = int32(op, "dim", dim, 1)
        max_period = int32(op, "max_period", max_period, 1)
        return self._node(lib.ggml_timestep_embedding(self.ptr, timesteps.ptr, dim, max_period))

    def get_rel_pos(self, a: Tensor, qh: int, kh: int) -> Tensor:
        """SAM's relative positions: a [2 k - 1, C] (F16) -> out [k, k, C] with ``out[i, j] = a[k - 1 + i - j]``
        (qh == kh == k). F16, contiguous."""
        op = "get_rel_pos"
        self._own(op, a)
        types(op, a, {F16})  # BF16 bits would land in GGML's F16 result unconverted
        contiguous(op, a)
        qh, kh = int32(op, "qh", qh, 1), int32(op, "kh", kh, 1)
        need(qh == kh and a.ne[1] == 2 * kh - 1 and a.ne[2] == a.ne[3] == 1, op,
             f"a must be [2 k - 1, C] with qh == kh == k (qh={qh}, kh={kh})", a)
        return self._node(lib.ggml_get_rel_pos(self.ptr, a.ptr, qh, kh))

    def add_rel_pos(self, a: Tensor, pw: Tensor, ph: Tensor) -> Tensor:
        """SAM's decomposed relative position bias: attention scores a [B, h w, h w] plus pw, ph [B, h, w, w]:
        ``out[b, (i1, i0), (j1, j0)] = a[...] + pw[b, i1, i0, j0] + ph[b, i1, i0, j1]`` (query (i1, i0), key
        (j1, j0), rows of length w). F32, contiguous."""
        op = "add_rel_pos"
        self._own(op, a, pw, ph)
        for t, role in ((a, "a"), (pw, "pw"), (ph, "ph")):
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
        same_shape(op, pw, ph, "pw and ph")
        need(pw.ne[3] == a.ne[2] and pw.ne[0] * pw.ne[0] == a.ne[0] and pw.ne[1] * pw.ne[2] == a.ne[1]
             and a.ne[3] == 1, op, "pw and ph must be [B, h, w, w] for a [B, h w, w w]", a, pw)
        return self._node(lib.ggml_add_rel_pos(self.ptr, a.ptr, pw.ptr, ph.ptr))

    def lightning_indexer(self, q: Tensor, k: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
        """DeepSeek's lightning indexer: q [S, T, H, d] (F32), k [S, n_kv, 1, d] (any type with a dequantizer),
        weights [S, 1, T, H] (F32), mask [S', 1, T, n_kv] (F16, S' dividing S) -> [S, 1, T, n_kv]:
        ``sum_h relu(q[s, t, h] . k[s, j]) weights[s, t, h] + mask[s, t, j]``."""
        op = "lightning_indexer"
        self._own(op, q, k, weights, mask)
        types(op, q, {F32}, "q")
        types(op, weights, {F32}, "weights")
        types(op, mask, {F16}, "mask")
        types(op, k, MATMUL_WEIGHTS | {GGMLType.F32}, "k")
        rows_contiguous(op, q, k, weights, mask)
        need(q.ne[0] == k.ne[0] and k.ne[1] == 1, op, "k must be [S, n_kv, 1, d] with q's d", q, k)
        need(mask.ne[0] == k.ne[2] and mask.ne[1] == q.ne[2] and mask.ne[2] == 1, op,
             "mask must be [S', 1, T, n_kv]", q, k, mask)
        need(q.ne[1] == weights.ne[0] and q.ne[2] == weights.ne[1] and weights.ne[2] == 1, op,
             "weights must be [S, 1, T, H]", q, weights)
        need(q.ne[3] == k.ne[3] == weights.ne[3] and weights.ne[3] % mask.ne[3] == 0, op,
             "q, k and weights must share S, and mask's S' must divide it", q, k, weights, mask)
        return self._node(lib.ggml_lightning_indexer(self.ptr, q.ptr, k.ptr, weights.ptr, mask.ptr))

