"""The graph operations an MoE decoder needs, checked before GGML sees them.

Every rule here mirrors a ``GGML_ASSERT`` in ggml.c or a type a CPU kernel
aborts on: breaking it in C would kill the process, so it is raised here as a
typed exception naming the op, the shapes (numpy order) and the rule.
Methods live on :class:`OpsMixin`, which :class:`~ggml_hybrid.context.Context`
inherits: nodes are created in the context the method is called on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING, Any

from .._native import CData, ffi, lib
from ..checks import ErrorClass, check_choice, check_int, check_real
from ..errors import ArgumentError, DTypeError, ShapeError
from .dtypes import GGMLType, GGMLTypeLike, as_ggml_type
from .tensor import Tensor, can_repeat, ne_of

F32, F16, BF16, I32 = GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32
FLOATS = frozenset({F32, F16, BF16})
# weight types the CPU matmul kernels take (Q8_1 and Q8_K only exist as activation formats)
MATMUL_WEIGHTS = frozenset(t for t in GGMLType if t not in {I32, GGMLType.I8, GGMLType.I16, GGMLType.I64,
                                                           GGMLType.F64, GGMLType.Q8_1, GGMLType.Q8_K})
# (a, b) type pairs the CPU binary kernels implement (add, mul, div)
BINARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)})
GLU_OPS = {"reglu": lib.GGML_GLU_OP_REGLU, "geglu": lib.GGML_GLU_OP_GEGLU, "swiglu": lib.GGML_GLU_OP_SWIGLU,
           "geglu_erf": lib.GGML_GLU_OP_GEGLU_ERF, "geglu_quick": lib.GGML_GLU_OP_GEGLU_QUICK}


def _desc(t: Tensor) -> str:
    return f"{t.name or '<unnamed>'}{list(t.shape)}:{t.dtype.name}"


def _need(cond: bool, op: str, rule: str, *tensors: Tensor, exc: ErrorClass = ShapeError) -> None:
    if not cond:
        raise exc(f"{op}: {rule} (got {', '.join(_desc(t) for t in tensors)})")


def _types(op: str, t: Tensor, allowed: Set[GGMLType], role: str = "input") -> None:
    if t.dtype not in allowed:
        names = ", ".join(sorted(a.name for a in allowed))
        raise DTypeError(f"{op}: {role} {_desc(t)} must be one of {names}")


def _finite(op: str, name: str, value: float) -> float:
    return check_real(value, f"{op}: {name}")


def _not_nan(op: str, name: str, value: float) -> float:
    """A real that may be infinite (a clamp bound, a fill value), but not NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ArgumentError(f"{op}: {name} must be a number (+-inf allowed, NaN not), got {value!r}")
    return float(value)


def _int(op: str, name: str, value: int, lo: int | None = None, hi: int | None = None) -> int:
    return check_int(value, f"{op}: {name}", lo, hi)


def _rows_contiguous(op: str, *tensors: Tensor) -> None:
    """CPU kernels read each row as one run of elements (GGML_ASSERT(nb0 == type size))."""
    for t in tensors:
        _need(t.nb[0] == t.dtype.type_size, op, "rows must be contiguous (use cont() first)", t)


def _padded_1d(t: Tensor) -> bool:
    ne, nb = t.ne, t.nb
    return nb[0] == t.dtype.type_size and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]


def _check_sinks(op: str, sinks: Tensor, scores: Tensor) -> None:
    """One F32 sink logit per head: ``sinks`` [H] against scores (or queries) [H, T, n]."""
    _types(op, sinks, {F32}, "sinks")
    _need(sinks.ndim == 1 and sinks.ne[0] == scores.ne[2], op, "sinks must hold one value per head", sinks, scores)
    _need(sinks.is_contiguous, op, "sinks must be contiguous", sinks)


def _infer_size(op: str, a: Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with its one ``-1`` replaced by what keeps ``a``'s elements (numpy's rule)."""
    dims = tuple(int(s) for s in shape)
    unknown = [i for i, s in enumerate(dims) if s == -1]
    if len(unknown) > 1:
        raise ShapeError(f"{op}: shape {dims} has more than one -1 (at most one size can be inferred)")
    if any(s < -1 for s in dims):
        raise ShapeError(f"{op}: negative size in shape {dims} (only -1, to infer one size)")
    if not unknown:
        return dims
    known = math.prod(s for s in dims if s != -1)
    _need(known > 0 and a.nelements % known == 0, op,
          f"shape {dims}: the other sizes ({known} elements) must divide the {a.nelements} elements", a)
    return tuple(a.nelements // known if s == -1 else s for s in dims)


class OpsMixin:
    """Graph-building operations; ``self`` is the context that owns the new nodes."""

    if TYPE_CHECKING:  # provided by Context
        @property
        def ptr(self) -> Any: ...
        def _node(self, ptr: Any) -> Tensor: ...
        def _reserve(self, op: str, n_tensors: int) -> None: ...
        def _bound_indices(self, op: str, idx: Tensor, bound: int) -> None: ...

    def _own(self, op: str, *tensors: Tensor) -> None:
        for t in tensors:
            _ = t.ptr  # raises if its context is closed
        self._reserve(op, 2)

    # -- matrix products ------------------------------------------------------

    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        """``b @ a.T`` in numpy terms: a [.., n, k], b [.., m, k] -> [.., m, n] (F32)."""
        op = "mul_mat"
        self._own(op, a, b)
        _need(a.ne[0] == b.ne[0], op, "a and b must have the same innermost (k) dimension", a, b)
        _need(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, op,
              "the batch dims of b must be multiples of those of a", a, b)
        _need(not lib.ggml_is_transposed(a.ptr), op, "a must not be transposed", a)
        _types(op, b, {F32} | ({F16} if a.dtype == F16 else set()), "b")
        _types(op, a, MATMUL_WEIGHTS, "a")
        _rows_contiguous(op, a, b)
        _need(a.ne[0] % a.dtype.block_size == 0, op, f"k must be a multiple of the {a.dtype.name} block size", a)
        return self._node(lib.ggml_mul_mat(self.ptr, a.ptr, b.ptr))

    def mul_mat_f32(self, a: Tensor, b: Tensor) -> Tensor:
        """:meth:`mul_mat` asking for F32 accumulation (GPU backends otherwise may use F16)."""
        out = self.mul_mat(a, b)
        lib.ggml_mul_mat_set_prec(out.ptr, lib.GGML_PREC_F32)
        return out

    def mul_mat_hadamard(self, rot: Tensor, x: Tensor) -> Tensor:
        """``x`` rotated by the Walsh-Hadamard matrix ``rot`` [n, n], per run of n values (llama.cpp's
        ``llama_mul_mat_hadamard``): x is viewed as rows of n, multiplied, and given its shape back.

        The product carries GGML's hint that ``rot`` is a Hadamard matrix, so the CPU computes it as a
        fast Walsh-Hadamard transform (and never reads ``rot``), exactly as llama.cpp's graph does.
        """
        op = "mul_mat_hadamard"
        self._own(op, rot, x)
        _types(op, rot, {F32}, "rot")
        _types(op, x, {F32, F16}, "x")
        n = rot.ne[0]
        _need(rot.shape == (n, n) and n >= 2 and n & (n - 1) == 0, op, "rot must be square, of a power-of-two size",
              rot)
        _need(x.nelements % n == 0 and x.ne[0] % n == 0, op, f"x's rows must be whole runs of {n}", rot, x)
        _need(x.is_contiguous, op, "x must be contiguous (use cont() first)", x)
        self._reserve(op, 3)
        flat = self.reshape(x, (x.nelements // n, n))
        out = self._node(lib.ggml_mul_mat(self.ptr, rot.ptr, flat.ptr))
        lib.ggml_mul_mat_set_hint(out.ptr, lib.GGML_HINT_SRC0_IS_HADAMARD)
        return self.reshape(out, x.shape)

    def mul_mat_id(self, experts: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """Per-token expert matmul: experts [E, n, k], b [T, u, k], ids [T, used] -> [T, used, n]."""
        op = "mul_mat_id"
        self._own(op, experts, b, ids)
        _types(op, ids, {I32}, "ids")
        _types(op, b, {F32}, "b")
        _types(op, experts, MATMUL_WEIGHTS, "experts")
        _rows_contiguous(op, experts, b)
        _need(experts.ne[3] == 1, op, "experts must be 3-D [n_expert, n, k]", experts)
        _need(b.ne[3] == 1, op, "b must be 3-D [tokens, used or 1, k]", b)
        _need(ids.ne[2] == 1 and ids.ne[3] == 1, op, "ids must be 2-D [tokens, used]", ids)
        _need(ids.ne[1] == b.ne[2], op, "ids and b must have the same number of tokens", ids, b)
        _need(experts.ne[0] == b.ne[0], op, "experts and b must have the same innermost (k) dimension", experts, b)
        _need(ids.ne[0] % b.ne[1] == 0, op, "b's middle dim must divide the number of used experts", ids, b)
        _need(not lib.ggml_is_transposed(experts.ptr), op, "experts must not be transposed", experts)
        self._bound_indices(op, ids, experts.ne[2])
        return self._node(lib.ggml_mul_mat_id(self.ptr, experts.ptr, b.ptr, ids.ptr))

    def get_rows(self, a: Tensor, rows: Tensor) -> Tensor:
        """Gather rows of a by index: a [.., R, n], rows [.., m] -> [.., m, n] (F32 unless a is I32)."""
        op = "get_rows"
        self._own(op, a, rows)
        _types(op, rows, {I32}, "rows")
        _need(a.ne[2] == rows.ne[1] and a.ne[3] == rows.ne[2] and rows.ne[3] == 1, op,
              "rows must be [a.dims[-3], m] batched like a", a, rows)
        _types(op, a, MATMUL_WEIGHTS | {I32}, "a")
        self._bound_indices(op, rows, a.ne[1])
        return self._node(lib.ggml_get_rows(self.ptr, a.ptr, rows.ptr))

    # -- elementwise ----------------------------------------------------------

    def _binary(self, op: str, fn: Callable[[CData, CData, CData], CData], a: Tensor, b: Tensor) -> Tensor:
        self._own(op, a, b)
        if (a.dtype, b.dtype) not in BINARY_TYPES:
            raise DTypeError(f"{op}: type pair ({a.dtype.name}, {b.dtype.name}) is not supported; "
                             f"supported: {sorted((x.name, y.name) for x, y in BINARY_TYPES)}")
        _need(can_repeat(b, a), op, "b must broadcast to a (each dim of b divides a's)", a, b)
        _rows_contiguous(op, a, b)
        return self._node(fn(self.ptr, a.ptr, b.ptr))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("add", lib.ggml_add, a, b)

    def add_id(self, a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """``a[t, j] + b[ids[t, j]]``: a row of b chosen per (token, slot), e.g. each selected expert's bias.

        a [T, k, n] F32, b [n_rows, n] F32, ids [T, k] I32 -> [T, k, n].
        """
        op = "add_id"
        self._own(op, a, b, ids)
        for t, role in ((a, "a"), (b, "b")):
            _types(op, t, {F32}, role)  # the CPU kernel has no other case
        _types(op, ids, {I32}, "ids")
        _need(a.ne[0] == b.ne[0], op, "a's rows and b's rows must have the same length", a, b)
        _need(a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1] and a.ne[3] == 1 and ids.ne[2] == ids.ne[3] == 1, op,
              "ids must be [T, k] for a [T, k, n]", a, ids)
        _need(b.ne[2] == b.ne[3] == 1, op, "b must be 2-D [n_rows, n]", b)
        _rows_contiguous(op, a, b)
        self._bound_indices(op, ids, b.ne[1])
        return self._node(lib.ggml_add_id(self.ptr, a.ptr, b.ptr, ids.ptr))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("mul", lib.ggml_mul, a, b)

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("sub", lib.ggml_sub, a, b)

    def div(self, a: Tensor, b: Tensor) -> Tensor:
        return self._binary("div", lib.ggml_div, a, b)

    def scale(self, a: Tensor, s: float) -> Tensor:
        self._own("scale", a)
        _types("scale", a, {F32})  # the CPU kernel has no F16 case
        _need(_padded_1d(a), "scale", "a must be contiguous in its rows and outer dims (use cont() first)", a)
        return self._node(lib.ggml_scale(self.ptr, a.ptr, _finite("scale", "s", s)))

    def clamp(self, a: Tensor, lo: float, hi: float) -> Tensor:
        """``min(max(a, lo), hi)``; the bounds may be infinite."""
        op = "clamp"
        self._own(op, a)
        _types(op, a, {F32, F16})
        _rows_contiguous(op, a)
        lo, hi = _not_nan(op, "lo", lo), _not_nan(op, "hi", hi)
        return self._node(lib.ggml_clamp(self.ptr, a.ptr, lo, hi))

    def fill(self, a: Tensor, value: float) -> Tensor:
        """A new tensor shaped like ``a`` with every element ``value`` (a's data is not read)."""
        op = "fill"
        self._own(op, a)
        _types(op, a, {F32, F16})
        _need(a.is_contiguous, op, "a must be contiguous", a)
        return self._node(lib.ggml_fill(self.ptr, a.ptr, _not_nan(op, "value", value)))

    def _unary(self, op: str, fn: Callable[[CData, CData], CData], a: Tensor) -> Tensor:
        self._own(op, a)
        _types(op, a, {F32, F16})
        _need(bool(lib.ggml_is_contiguous_1(a.ptr)), op, "a must be contiguous (use cont() first)", a)
        return self._node(fn(self.ptr, a.ptr))

    def neg(self, a: Tensor) -> Tensor:
        return self._unary("neg", lib.ggml_neg, a)

    def silu(self, a: Tensor) -> Tensor:
        return self._unary("silu", lib.ggml_silu, a)

    def gelu(self, a: Tensor) -> Tensor:
        return self._unary("gelu", lib.ggml_gelu, a)

    def sigmoid(self, a: Tensor) -> Tensor:
        return self._unary("sigmoid", lib.ggml_sigmoid, a)

    def softplus(self, a: Tensor) -> Tensor:
        """``log(1 + exp(x))`` (x itself above 20), GGML's float32 formula."""
        return self._unary("softplus", lib.ggml_softplus, a)

    def glu(self, a: Tensor, b: Tensor | None = None, kind: str = "swiglu", swapped: bool = False) -> Tensor:
        """Gated unit: act(a) * b, or with b omitted, the halves of a's rows (first half gated)."""
        op = kind
        check_choice(kind, "glu: kind", sorted(GLU_OPS))
        self._own(op, a, *([b] if b is not None else []))
        _types(op, a, {F32, F16})
        _need(bool(lib.ggml_is_contiguous_rows(a.ptr)), op, "a must have contiguous rows", a)
        if b is None:
            _need(a.ne[0] % 2 == 0, op, "a fused gate/up row must have even length", a)
            return self._node(lib.ggml_glu(self.ptr, a.ptr, GLU_OPS[kind], bool(swapped)))
        _need(a.dtype == b.dtype, op, "gate and up must have the same type", a, b, exc=DTypeError)
        _need(a.ne == b.ne, op, "gate and up must have the same shape", a, b)
        _need(bool(lib.ggml_is_contiguous_rows(b.ptr)), op, "b must have contiguous rows", b)
        if swapped:
            a, b = b, a
        return self._node(lib.ggml_glu_split(self.ptr, a.ptr, b.ptr, GLU_OPS[kind]))

    def swiglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        return self.glu(a, b, "swiglu")

    def geglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        return self.glu(a, b, "geglu")

    def swiglu_oai(self, gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
        """gpt-oss's clamped SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
        ``g * sigmoid(alpha * g) * (u + 1)``."""
        op = "swiglu_oai"
        self._own(op, gate, up)
        for t, role in ((gate, "gate"), (up, "up")):
            _types(op, t, {F32}, role)  # the CPU kernel has no F16 case
            _need(bool(lib.ggml_is_contiguous_1(t.ptr)), op, f"{role} must have contiguous rows", t)
        _need(gate.ne == up.ne, op, "gate and up must have the same shape", gate, up)
        return self._node(lib.ggml_swiglu_oai(self.ptr, gate.ptr, up.ptr, _finite(op, "alpha", alpha),
                                              _finite(op, "limit", limit)))

    # -- normalisation, softmax, rope, attention ------------------------------

    def rms_norm(self, a: Tensor, eps: float = 1e-6) -> Tensor:
        self._own("rms_norm", a)
        _types("rms_norm", a, {F32})
        _rows_contiguous("rms_norm", a)
        eps = check_real(eps, "rms_norm: eps", 0.0)
        return self._node(lib.ggml_rms_norm(self.ptr, a.ptr, eps))

    def soft_max(self, a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0,
                 sinks: Tensor | None = None) -> Tensor:
        """softmax(a * scale + mask) over the innermost dim.

        ``sinks`` [H] (attention sinks, a [H, T, n]): head h's logit ``sinks[h]`` joins every row of that
        head's softmax as an extra entry that takes probability but has no value.
        """
        op = "soft_max_ext"
        self._own(op, a, *(t for t in (mask, sinks) if t is not None))
        if sinks is not None:
            _check_sinks(op, sinks, a)
        _types(op, a, {F32})
        _need(a.is_contiguous, op, "a must be contiguous", a)
        if mask is not None:
            _types(op, mask, {F32, F16}, "mask")
            _need(mask.is_contiguous, op, "mask must be contiguous", mask)
            _need(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], op,
                  "mask must have a's row length and at least a's number of rows", a, mask)
            _need(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, op,
                  "mask's outer dims must divide a's", a, mask)
        mb = _finite(op, "max_bias", max_bias)
        _need(mb == 0 or mask is not None, op, "max_bias (ALiBi) needs a mask", a)
        out = self._node(lib.ggml_soft_max_ext(self.ptr, a.ptr, mask.ptr if mask is not None else ffi.NULL,
                                               _finite(op, "scale", scale), mb))
        if sinks is not None:
            lib.ggml_soft_max_add_sinks(out.ptr, sinks.ptr)
        return out

    soft_max_ext = soft_max

    def rope(self, a: Tensor, pos: Tensor, n_dims: int, mode: str = "normal", freq_base: float = 10000.0,
             freq_scale: float = 1.0, n_ctx_orig: int = 0, ext_factor: float = 0.0, attn_factor: float = 1.0,
             beta_fast: float = 32.0, beta_slow: float = 1.0, freq_factors: Tensor | None = None) -> Tensor:
        """Rotary embedding of a [T, heads, head_dim] at positions pos [T] (llama.cpp's rope_ext)."""
        op = "rope_ext"
        modes = {"normal": lib.GGML_ROPE_TYPE_NORMAL, "neox": lib.GGML_ROPE_TYPE_NEOX}
        check_choice(mode, f"{op}: mode", sorted(modes))
        self._own(op, a, pos, *([freq_factors] if freq_factors is not None else []))
        _types(op, a, {F32, F16})
        _rows_contiguous(op, a)
        _types(op, pos, {I32}, "pos")
        _need(pos.ne[1] == 1 and pos.ne[2] == 1 and pos.ne[3] == 1, op, "pos must be a vector", pos)
        _need(a.ne[2] == pos.ne[0], op, "pos must hold one position per token (a's outermost-but-one dim)", a, pos)
        _int(op, "n_dims", n_dims, 2, a.ne[0])
        _need(n_dims % 2 == 0, op, f"n_dims={n_dims} must be even", a)
        if freq_factors is not None:
            _types(op, freq_factors, {F32}, "freq_factors")
            _need(freq_factors.ne[0] >= n_dims // 2, op, "freq_factors needs n_dims/2 entries", freq_factors)
        _int(op, "n_ctx_orig", n_ctx_orig, 0)
        return self._node(lib.ggml_rope_ext(
            self.ptr, a.ptr, pos.ptr, freq_factors.ptr if freq_factors is not None else ffi.NULL, n_dims,
            modes[mode], n_ctx_orig, _finite(op, "freq_base", freq_base), _finite(op, "freq_scale", freq_scale),
            _finite(op, "ext_factor", ext_factor), _finite(op, "attn_factor", attn_factor),
            _finite(op, "beta_fast", beta_fast), _finite(op, "beta_slow", beta_slow)))

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
        modes = {"mrope": lib.GGML_ROPE_TYPE_MROPE, "imrope": lib.GGML_ROPE_TYPE_IMROPE}
        check_choice(mode, f"{op}: mode", sorted(modes))
        self._own(op, a, pos)
        _types(op, a, {F32, F16})
        _rows_contiguous(op, a)
        _types(op, pos, {I32}, "pos")
        _need(pos.ne[1] == 1 and pos.ne[2] == 1 and pos.ne[3] == 1, op, "pos must be a vector", pos)
        _need(pos.ne[0] == 4 * a.ne[2], op, "pos must hold four positions per token (t, h, w and e rows)", a, pos)
        _int(op, "n_dims", n_dims, 2, a.ne[0])
        _need(n_dims % 2 == 0, op, f"n_dims={n_dims} must be even", a)
        secs = [_int(op, "sections", x, 0) for x in sections]
        if len(secs) != lib.GGML_MROPE_SECTIONS:
            raise ShapeError(f"{op}: sections must hold {lib.GGML_MROPE_SECTIONS} counts, got {list(sections)}")
        if not any(secs[:3]):
            raise ShapeError(f"{op}: sections {secs}: one of the first three must be positive")
        _need(sum(secs) <= a.ne[0], op, f"sections {secs} must sum to at most the head size {a.ne[0]}", a)
        _int(op, "n_ctx_orig", n_ctx_orig, 0)
        return self._node(lib.ggml_rope_multi(
            self.ptr, a.ptr, pos.ptr, ffi.NULL, n_dims, ffi.new("int[4]", secs), modes[mode], n_ctx_orig,
            _finite(op, "freq_base", freq_base), _finite(op, "freq_scale", freq_scale),
            _finite(op, "ext_factor", ext_factor), _finite(op, "attn_factor", attn_factor),
            _finite(op, "beta_fast", beta_fast), _finite(op, "beta_slow", beta_slow)))

    def flash_attn(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                   max_bias: float = 0.0, logit_softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
        """Fused attention. q [H, T, d], k/v [Hkv, S, d]; mask [T_pad, S] F16; sinks [H] as in
        :meth:`soft_max`. Result [T, H, d_v]."""
        op = "flash_attn_ext"
        self._own(op, q, k, v, *(t for t in (mask, sinks) if t is not None))
        if sinks is not None:
            _check_sinks(op, sinks, q)
        _types(op, q, {F32}, "q")
        for t, role in ((k, "k"), (v, "v")):
            _types(op, t, {F16, F32, GGMLType.Q8_0, GGMLType.Q4_0}, role)
        _need(k.ne[0] == q.ne[0], op, "q and k must have the same head size", q, k)
        _need(q.ne[2] % k.ne[2] == 0 and q.ne[3] % k.ne[3] == 0, op, "q heads must be a multiple of kv heads", q, k)
        _need(q.ne[3] == k.ne[3] == v.ne[3], op, "q, k and v must share the outermost dim", q, k, v)
        _need(k.ne[1] == v.ne[1] and k.ne[2] == v.ne[2], op, "k and v must have the same length and heads", k, v)
        if mask is not None:
            _types(op, mask, {F16}, "mask")
            _need(mask.is_contiguous, op, "mask must be contiguous", mask)
            _need(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1], op,
                  "mask must be [>= query tokens, kv length]", q, k, mask)
            _need(q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0, op, "mask's outer dims must divide q's",
                  q, mask)
        out = self._node(lib.ggml_flash_attn_ext(
            self.ptr, q.ptr, k.ptr, v.ptr, mask.ptr if mask is not None else ffi.NULL, _finite(op, "scale", scale),
            _finite(op, "max_bias", max_bias), _finite(op, "logit_softcap", logit_softcap)))
        if sinks is not None:
            lib.ggml_flash_attn_ext_add_sinks(out.ptr, sinks.ptr)
        return out

    flash_attn_ext = flash_attn

    # -- selection and reduction ----------------------------------------------

    def argsort(self, a: Tensor, descending: bool = False) -> Tensor:
        self._own("argsort", a)
        _types("argsort", a, {F32})
        order = lib.GGML_SORT_ORDER_DESC if descending else lib.GGML_SORT_ORDER_ASC
        return self._node(lib.ggml_argsort(self.ptr, a.ptr, order))

    def argsort_top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest entries of each row, largest first (a view of a descending argsort)."""
        _int("argsort_top_k", "k", k, 1, a.ne[0])
        order = self.argsort(a, descending=True)
        # ggml_argsort_top_k's view: the argsort's strides in every dimension, even a dimension of size 1 (GGML's
        # Vulkan top-k MoE fusion requires the row stride to be the argsort's)
        ne, nb = order.ne, order.nb
        return self._node(lib.ggml_view_4d(self.ptr, order.ptr, k, ne[1], ne[2], ne[3], nb[1], nb[2], nb[3], 0))

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest entries of each row; their order among themselves is unspecified."""
        self._own("top_k", a)
        _types("top_k", a, {F32})
        _int("top_k", "k", k, 1, a.ne[0])
        return self._node(lib.ggml_top_k(self.ptr, a.ptr, k))

    def sum_rows(self, a: Tensor) -> Tensor:
        self._own("sum_rows", a)
        _types("sum_rows", a, {F32})
        _rows_contiguous("sum_rows", a)
        return self._node(lib.ggml_sum_rows(self.ptr, a.ptr))

    # -- layout ---------------------------------------------------------------

    def view(self, a: Tensor, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> Tensor:
        """A view of a with a numpy-order shape, byte strides (numpy order, outer dims only) and byte offset."""
        op = "view"
        self._own(op, a)
        ne = ne_of(shape)
        nd = len(tuple(shape))
        if any(n < 0 for n in ne):
            raise ShapeError(f"{op}: negative size in shape {tuple(shape)}")
        blck = a.dtype.block_size
        _need(ne[0] % blck == 0, op, f"the innermost size must be a multiple of the {a.dtype.name} block size", a)
        row = a.dtype.row_size(ne[0])
        if strides is None:
            nb = [row]
            for i in range(1, 3):
                nb.append(nb[-1] * ne[i])
        else:
            strides = tuple(int(s) for s in strides)
            if len(strides) != nd - 1:
                raise ShapeError(f"{op}: {nd}-D shape needs {nd - 1} outer strides, got {strides}")
            nb = list(reversed(strides)) + [0] * (3 - len(strides))
            for i in range(len(strides), 3):
                nb[i] = (nb[i - 1] if i else row) * ne[i]
        offset = _int(op, "offset", offset, 0)
        if all(ne):
            # GGML's rule (ggml_new_tensor_impl): the dense size from the base's start must fit the base;
            # ours on top: the last byte the strides reach must too
            base_off = offset + (a.ptr.view_offs if a.is_view else 0)
            base_bytes = int(lib.ggml_nbytes(a.ptr.view_src)) if a.is_view else a.nbytes
            dense = row * ne[1] * ne[2] * ne[3]
            extent = offset + row + sum((ne[i + 1] - 1) * nb[i] for i in range(3))
            _need(dense + base_off <= base_bytes and extent <= a.nbytes, op,
                  f"the view (offset {offset}, shape {tuple(shape)}) reaches past the end of a", a)
        p = lib.ggml_view_4d(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3], nb[0], nb[1], nb[2], offset)
        return self._node(p)

    def reshape(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """A view of contiguous ``a`` with a numpy-order ``shape``; one size may be -1 (inferred, as numpy)."""
        op = "reshape"
        self._own(op, a)
        shape = _infer_size(op, a, shape)
        ne = ne_of(shape)
        _need(a.is_contiguous, op, "a must be contiguous (use cont() first)", a)
        _need(math.prod(ne) == a.nelements, op, f"shape {tuple(shape)} must keep the {a.nelements} elements", a)
        _need(ne[0] % a.dtype.block_size == 0, op, "the innermost size must be a multiple of the block size", a)
        return self._node(lib.ggml_reshape_4d(self.ptr, a.ptr, *ne))

    def permute(self, a: Tensor, axes: Sequence[int]) -> Tensor:
        """numpy.transpose semantics over the tensor's numpy-order axes (padded to 4-D)."""
        op = "permute"
        self._own(op, a)
        axes = tuple(int(x) for x in axes)
        nd = len(axes)
        if sorted(axes) != list(range(nd)) or nd > 4 or nd < a.ndim:
            raise ShapeError(f"{op}: axes {axes} must be a permutation of 0..{max(nd, a.ndim) - 1}")
        # numpy axis i of the result is numpy axis axes[i] of a; GGML's permute says where each source
        # dim goes: source ggml dim d (numpy axis nd-1-d) lands at ggml dim nd-1-i where axes[i] == nd-1-d
        where = [0, 1, 2, 3]
        for i, src_axis in enumerate(axes):
            where[nd - 1 - src_axis] = nd - 1 - i
        return self._node(lib.ggml_permute(self.ptr, a.ptr, *where))

    def transpose(self, a: Tensor) -> Tensor:
        """Swap the two innermost dims (GGML's transpose), as a view."""
        self._own("transpose", a)
        return self._node(lib.ggml_transpose(self.ptr, a.ptr))

    def cont(self, a: Tensor) -> Tensor:
        self._own("cont", a)
        _types("cont", a, FLOATS | {I32} | {t for t in GGMLType if t.is_quantized and a.is_contiguous})
        return self._node(lib.ggml_cont(self.ptr, a.ptr))

    def cpy(self, a: Tensor, b: Tensor) -> Tensor:
        """Copy (and convert) a into b's memory; returns a view of b to add to the graph."""
        op = "cpy"
        self._own(op, a, b)
        _need(a.nelements == b.nelements, op, "a and b must have the same number of elements", a, b)
        _types(op, a, FLOATS | {I32}, "a")
        if b.dtype.is_quantized:
            _types(op, a, {F32}, "a (quantizing copy)")
            _need(a.is_contiguous, op, "a quantizing copy needs a contiguous source (use cont() first)", a)
            _need(b.ne[0] % b.dtype.block_size == 0, op, "b's rows must be whole quantization blocks", b)
        else:
            _types(op, b, FLOATS | ({I32} if a.dtype == I32 else set()), "b")
        return self._node(lib.ggml_cpy(self.ptr, a.ptr, b.ptr))

    def cast(self, a: Tensor, dtype: GGMLTypeLike) -> Tensor:
        """A contiguous copy of ``a`` (which may be a strided view) converted to ``dtype`` (float types)."""
        op = "cast"
        self._own(op, a)
        t = as_ggml_type(dtype)
        _types(op, a, FLOATS, "a")
        if t not in FLOATS:
            raise DTypeError(f"cast: to {t.name} is not supported; a float type (F32, F16, BF16) is")
        return self._node(lib.ggml_cast(self.ptr, a.ptr, int(t)))

    def set_rows(self, a: Tensor, b: Tensor, rows: Tensor) -> Tensor:
        """Write row i of b into row rows[i] of a (converting to a's type); returns a view of a to expand.

        a [.., R, n], b [.., m, n] (F32 or F16), rows [.., m] (I32 or I64). Nothing orders this
        write before other readers of a: expand it into the graph before building them.
        """
        op = "set_rows"
        self._own(op, a, b, rows)
        _types(op, b, {F32, F16}, "b")
        _types(op, rows, {I32, GGMLType.I64}, "rows")
        _need(a.ne[0] == b.ne[0] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], op,
              "a and b must agree on every dim but the row count", a, b)
        _need(b.ne[1] == rows.ne[0] and rows.ne[3] == 1 and rows.ne[1] > 0 and b.ne[2] % rows.ne[1] == 0
              and rows.ne[2] > 0 and b.ne[3] % rows.ne[2] == 0, op, "rows must hold one index per row of b", b, rows)
        _rows_contiguous(op, a, b)
        if a.dtype.is_quantized:
            _need(a.ne[0] % a.dtype.block_size == 0, op, "a's rows must be whole quantization blocks", a)
        else:
            _types(op, a, FLOATS, "a")
        self._bound_indices(op, rows, a.ne[1])
        return self._node(lib.ggml_set_rows(self.ptr, a.ptr, b.ptr, rows.ptr))

    def repeat(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """``a`` tiled to the numpy-order ``shape`` (``ggml_repeat_4d``): each size a multiple of a's."""
        op = "repeat_4d"
        self._own(op, a)
        ne = ne_of(shape)
        _types(op, a, {F32, F16, BF16, I32})  # the CPU kernel's cases (I16 aside)
        _rows_contiguous(op, a)
        _need(a.nelements > 0 and all(n > 0 and n % m == 0 for n, m in zip(ne, a.ne)), op,
              f"shape {tuple(shape)} must be a multiple of a's in every dim", a)
        return self._node(lib.ggml_repeat_4d(self.ptr, a.ptr, *ne))

    def concat(self, a: Tensor, b: Tensor, axis: int = 0, ndim: int | None = None) -> Tensor:
        """numpy.concatenate along a numpy-order axis.

        GGML does not record leading size-1 dims, so a (1, n) tensor has shape (n,)
        here. A negative axis counts from the innermost dim and is unambiguous; a
        non-negative one counts within ``ndim`` dims (default: the larger of the two
        shapes' lengths), so pass ``ndim=2`` to join two (1, n) tensors into (2, n).
        """
        op = "concat"
        self._own(op, a, b)
        nd = max(a.ndim, b.ndim) if ndim is None else _int(op, "ndim", ndim, max(a.ndim, b.ndim), 4)
        axis = _int(op, "axis", axis, -nd, nd - 1) % nd
        dim = nd - 1 - axis
        _types(op, a, FLOATS | {I32})
        _need(a.dtype == b.dtype, op, "a and b must have the same type", a, b, exc=DTypeError)
        _need(all(a.ne[d] == b.ne[d] for d in range(4) if d != dim), op,
              f"a and b must agree on every dim but axis {axis}", a, b)
        return self._node(lib.ggml_concat(self.ptr, a.ptr, b.ptr, dim))


    # -- linear attention (gated delta-net) -------------------------------------

    def ssm_conv(self, sx: Tensor, c: Tensor) -> Tensor:
        """Short causal convolution: sx [seqs, channels, d_conv - 1 + T] (each channel's history then its T
        inputs, time innermost), c [channels, d_conv] -> [seqs, T, channels], output t of a channel the sum
        over j of ``sx[.., t + j] * c[.., j]`` (float, j ascending)."""
        op = "ssm_conv"
        self._own(op, sx, c)
        _types(op, sx, {F32}, "sx")  # the CPU kernel has no other case
        _types(op, c, {F32}, "c")
        _need(sx.nb[0] == 4 and sx.nb[1] == sx.ne[0] * 4, op, "sx must be contiguous in its two inner dims", sx)
        _need(c.nb[0] == 4, op, "c must have contiguous rows", c)
        _need(sx.ne[3] == 1, op, "sx must be 3-D [seqs, channels, d_conv - 1 + tokens]", sx)
        _need(c.ne[2] == 1 and c.ne[3] == 1, op, "c must be 2-D [channels, d_conv]", c)
        _need(sx.ne[1] == c.ne[1], op, "sx and c must have the same number of channels", sx, c)
        _need(sx.ne[0] >= c.ne[0], op, "sx must hold d_conv - 1 history steps and at least one token", sx, c)
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
            _types(op, t, {F32}, role)
        for t, role in ((q, "q"), (k, "k"), (v, "v")):
            _need(bool(lib.ggml_is_contiguous_rows(t.ptr)), op, f"{role} must have contiguous rows", t)
        for t, role in ((g, "g"), (beta, "beta"), (state, "state")):
            _need(t.is_contiguous, op, f"{role} must be contiguous", t)
        S, H, T, n_seqs = v.ne
        _need(q.ne == k.ne, op, "q and k must have the same shape", q, k)
        _need(q.ne[0] == S, op, "q, k and v must have the same head size", q, v)
        _need(q.ne[1] > 0 and H % q.ne[1] == 0, op, "the query/key heads must divide the value heads", q, v)
        _need(q.ne[2] == T and q.ne[3] > 0 and n_seqs % q.ne[3] == 0, op,
              "q and k must have v's tokens and a number of sequences dividing v's", q, v)
        _need(g.ne[0] in (1, S) and g.ne[1:] == (H, T, n_seqs), op, "g must be [seqs, T, H, 1 or S] like v", g, v)
        _need(beta.ne == (1, H, T, n_seqs), op, "beta must be [seqs, T, H, 1] like v", beta, v)
        _need(state.ne == (S, S, H, n_seqs), op, "state must be [seqs, H, S, S] for v [seqs, T, H, S]", state, v)
        snapshots = _int(op, "snapshots", snapshots, 1)
        return self._node(lib.ggml_gated_delta_net(self.ptr, q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, state.ptr,
                                                   snapshots))
