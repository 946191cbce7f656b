"""The rules every op module checks with, and the base of the op mixins.

Every rule mirrors a ``GGML_ASSERT`` of ggml.c (the op's constructor) or of the CPU kernel (ggml-cpu/ops.cpp,
unary-ops.cpp, binary-ops.cpp) that would end the process in ``abort()``: it is raised here instead, as a typed
exception naming the op, the rule and the tensors (name, numpy-order shape, type).
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from typing import TYPE_CHECKING, Any

from ..._native import ffi, lib
from ...checks import ErrorClass, check_int, check_real
from ...errors import ArgumentError, DTypeError, ShapeError
from ..dtypes import GGMLType
from ..tensor import Tensor, ne_of

F32, F16, BF16, I32, I64 = GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32, GGMLType.I64
FLOATS = frozenset({F32, F16, BF16})
# weight types the CPU matmul kernels take (Q8_1 and Q8_K only exist as activation formats)
MATMUL_WEIGHTS = frozenset(t for t in GGMLType if t not in {I32, GGMLType.I8, GGMLType.I16, GGMLType.I64,
                                                           GGMLType.F64, GGMLType.Q8_1, GGMLType.Q8_K})
# quantized types the CPU can also write (a from_float routine; ggml-cpu.cpp's supports_op for CPY lists the others)
QUANT_WRITABLE = frozenset(t for t in MATMUL_WEIGHTS if t.is_quantized) - {
    GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ1_S,
    GGMLType.IQ1_M}


def desc(t: Tensor) -> str:
    return f"{t.name or '<unnamed>'}{list(t.shape)}:{t.dtype.name}"


def need(cond: bool, op: str, rule: str, *tensors: Tensor, exc: ErrorClass = ShapeError) -> None:
    """Raise ``exc`` naming the op, the rule and the tensors unless ``cond``."""
    if not cond:
        got = f" (got {', '.join(desc(t) for t in tensors)})" if tensors else ""
        raise exc(f"{op}: {rule}{got}")


def types(op: str, t: Tensor, allowed: Set[GGMLType], role: str = "input") -> None:
    if t.dtype not in allowed:
        names = ", ".join(sorted(a.name for a in allowed))
        raise DTypeError(f"{op}: {role} {desc(t)} must be one of {names}")


def same_type(op: str, a: Tensor, b: Tensor, roles: str = "a and b") -> None:
    need(a.dtype == b.dtype, op, f"{roles} must have the same type", a, b, exc=DTypeError)


def same_shape(op: str, a: Tensor, b: Tensor, roles: str = "a and b") -> None:
    need(a.ne == b.ne, op, f"{roles} must have the same shape", a, b)


def finite(op: str, name: str, value: float) -> float:
    return check_real(value, f"{op}: {name}")


def not_nan(op: str, name: str, value: float) -> float:
    """A real that may be infinite (a clamp bound, a fill value), but not NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ArgumentError(f"{op}: {name} must be a number (+-inf allowed, NaN not), got {value!r}")
    return float(value)


def integer(op: str, name: str, value: int, lo: int | None = None, hi: int | None = None) -> int:
    return check_int(value, f"{op}: {name}", lo, hi)


INT32_MAX = 2**31 - 1


def int32(op: str, name: str, value: int, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX) -> int:
    """An int GGML keeps as an int32 op parameter."""
    return check_int(value, f"{op}: {name}", lo, hi)


def pair(op: str, name: str, value: int | Sequence[int], lo: int, hi: int = INT32_MAX) -> tuple[int, int]:
    """``value`` as (outer, inner) ints in lo..hi: one int means the same for both (numpy order, as PyTorch's
    (height, width) pairs)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        vals = tuple(value)
        if len(vals) != 2:
            raise ArgumentError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
        return int32(op, f"{name}[0]", vals[0], lo, hi), int32(op, f"{name}[1]", vals[1], lo, hi)
    v = int32(op, name, value, lo, hi)  # type: ignore[arg-type]
    return v, v


def triple(op: str, name: str, value: int | Sequence[int], lo: int) -> tuple[int, int, int]:
    """``value`` as (depth, height, width) ints >= lo; one int means the same for all three."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        vals = tuple(value)
        if len(vals) != 3:
            raise ArgumentError(f"{op}: {name} must be an int or three ints, got {value!r}")
        return (int32(op, f"{name}[0]", vals[0], lo), int32(op, f"{name}[1]", vals[1], lo),
                int32(op, f"{name}[2]", vals[2], lo))
    v = int32(op, name, value, lo)  # type: ignore[arg-type]
    return v, v, v


def rows_contiguous(op: str, *tensors: Tensor) -> None:
    """CPU kernels read each row as one run of elements (GGML_ASSERT(nb0 == type size))."""
    for t in tensors:
        p = t.ptr
        if p.nb[0] != lib.ggml_type_size(p.type):
            need(False, op, "rows must be contiguous (use cont() first)", t)


def contiguous(op: str, *tensors: Tensor, role: str = "a") -> None:
    for t in tensors:
        need(t.is_contiguous, op, f"{role} must be contiguous (use cont() first)", t)


def contiguous_1(op: str, t: Tensor, role: str = "a") -> None:
    """Each row one run of elements and the rows dense in the outer dims (ggml_is_contiguous_1)."""
    need(bool(lib.ggml_is_contiguous_1(t.ptr)), op, f"{role} must be contiguous in its rows (use cont() first)", t)


def padded_1d(t: Tensor) -> bool:
    ne, nb = t.ne, t.nb
    return nb[0] == t.dtype.type_size and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]


def is_matrix(t: Tensor) -> bool:
    return t.ne[2] == 1 and t.ne[3] == 1


def is_vector(t: Tensor) -> bool:
    return t.ne[1] == 1 and t.ne[2] == 1 and t.ne[3] == 1


def check_sinks(op: str, sinks: Tensor, scores: Tensor) -> None:
    """One F32 sink logit per head: ``sinks`` [H] against scores (or queries) [H, T, n]."""
    types(op, sinks, {F32}, "sinks")
    need(sinks.ndim == 1 and sinks.ne[0] == scores.ne[2], op, "sinks must hold one value per head", sinks, scores)
    need(sinks.is_contiguous, op, "sinks must be contiguous", sinks)


def infer_size(op: str, a: Tensor, shape: Sequence[int]) -> tuple[int, ...]:
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
    need(known > 0 and a.nelements % known == 0, op,
         f"shape {dims}: the other sizes ({known} elements) must divide the {a.nelements} elements", a)
    return tuple(a.nelements // known if s == -1 else s for s in dims)


def conv_out(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """GGML's output length of a convolution (ggml_calc_conv_output_size), floor division as C's on positives."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1
    return span // stride + 1 if span >= 0 else 0


class OpsBase:
    """What every op mixin needs of its context: ``self`` is the context that owns the new nodes."""

    if TYPE_CHECKING:  # provided by Context
        @property
        def ptr(self) -> Any: ...
        def _node(self, ptr: Any) -> Tensor: ...
        def _reserve(self, op: str, n_tensors: int, data_bytes: int = 0) -> None: ...
        def _bound_indices(self, op: str, idx: Tensor, bound: int) -> None: ...

    def _shape_of(self, op: str, shape: Sequence[int]) -> Tensor:
        """A data-less F32 tensor that only carries the numpy-order ``shape``, for GGML ops that take a shape as a
        tensor (repeat_back, get_rows_back, im2col_back): it is no source of the new node and never enters a
        graph."""
        ne = ne_of(shape)
        if any(n <= 0 for n in ne):
            raise ShapeError(f"{op}: sizes must be positive, got shape {tuple(shape)}")
        self._reserve(op, 1)
        return self._node(lib.ggml_new_tensor(self.ptr, F32, 4, ffi.new("int64_t[4]", list(ne))))

    def _own(self, op: str, *tensors: Tensor) -> None:
        """Every operand is alive (its context open) and the pool has room for the new node."""
        for t in tensors:
            _ = t.ptr  # raises if its context is closed
        self._reserve(op, 2)
