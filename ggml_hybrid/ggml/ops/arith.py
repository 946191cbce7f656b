"""Arithmetic: add, sub, mul, div (b broadcast into a), add1, add_cast, add_id, acc, scale, scale_bias, clamp, fill,
leaky_relu, and GGML's elementwise ops of their own op code: sqr, sqrt, log, sin, cos.

Elementwise results have a's type and shape. The CPU computes every element in float32 (F16 and BF16 inputs are
widened, the result rounded back once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..._native import CData, lib
from ...errors import DTypeError
from ..dtypes import GGMLTypeLike, as_ggml_type
from ..tensor import Tensor, can_repeat
from .layout import LayoutOps
from .rules import (
    BF16,
    F16,
    F32,
    FLOATS,
    I32,
    QUANT_WRITABLE,
    contiguous,
    contiguous_1,
    finite,
    need,
    not_nan,
    padded_1d,
    rows_contiguous,
    same_shape,
    types,
)

# (a, b) type pairs the CPU binary kernels implement (binary-ops.cpp): the result has a's type
BINARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)})


class ArithOps(LayoutOps):
    """Elementwise arithmetic."""

    def _binary(self, op: str, fn: Callable[[CData, CData, CData], CData], a: Tensor, b: Tensor) -> Tensor:
        self._own(op, a, b)
        if (a.dtype, b.dtype) not in BINARY_TYPES:
            raise DTypeError(f"{op}: type pair ({a.dtype.name}, {b.dtype.name}) is not supported; "
                             f"supported: {sorted((x.name, y.name) for x, y in BINARY_TYPES)}")
        need(can_repeat(b, a), op, "b must broadcast to a (each dim of b divides a's)", a, b)
        rows_contiguous(op, a, b)
        return self._node(fn(self.ptr, a.ptr, b.ptr))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """``a + b``, b tiled to a's shape (each of its sizes divides a's). A quantized ``a`` (with a CPU quantizer)
        takes an F32 ``b`` of its own shape: dequantized, added, quantized again."""
        if a.dtype.is_quantized:
            op = "add"
            self._own(op, a, b)
            types(op, a, QUANT_WRITABLE, "a")
            types(op, b, {F32}, "b (added to a quantized a)")
            same_shape(op, a, b)
            rows_contiguous(op, a, b)
            return self._node(lib.ggml_add(self.ptr, a.ptr, b.ptr))
        return self._binary("add", lib.ggml_add, a, b)

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        """``a - b``, b tiled to a's shape."""
        return self._binary("sub", lib.ggml_sub, a, b)

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a * b`` elementwise, b tiled to a's shape."""
        return self._binary("mul", lib.ggml_mul, a, b)

    def div(self, a: Tensor, b: Tensor) -> Tensor:
        """``a / b`` elementwise, b tiled to a's shape."""
        return self._binary("div", lib.ggml_div, a, b)

    def add1(self, a: Tensor, b: Tensor) -> Tensor:
        """``a + b[0]``: one value added to every element (b has one element; an F16 ``a`` takes an F16 or F32
        ``b``, an F32 ``a`` an F32 one)."""
        op = "add1"
        self._own(op, a, b)
        types(op, a, FLOATS, "a")
        need(b.nelements == 1, op, "b must hold one value", b)
        types(op, b, {F32} | ({a.dtype} if a.dtype != F32 else set()), "b")
        need(padded_1d(a), op, "a must be contiguous in its rows and outer dims (use cont() first)", a)
        return self._node(lib.ggml_add1(self.ptr, a.ptr, b.ptr))

    def add_cast(self, a: Tensor, b: Tensor, dtype: GGMLTypeLike = F32) -> Tensor:
        """``a + b`` as :meth:`add`, the result of type ``dtype``: an F16 or BF16 ``a`` plus F32 rows ``b`` (b's rows
        as long as a's), the sum in a's type or F32."""
        op = "add_cast"
        self._own(op, a, b)
        t = as_ggml_type(dtype)
        types(op, a, {F16, BF16}, "a")
        types(op, b, {F32}, "b")
        need(t in (a.dtype, F32), op, f"the result type {t.name} must be a's or F32", a, exc=DTypeError)
        need(a.ne[0] == b.ne[0] and can_repeat(b, a), op, "b's rows must be as long as a's and b must broadcast "
             "to a", a, b)
        rows_contiguous(op, a, b)
        return self._node(lib.ggml_add_cast(self.ptr, a.ptr, b.ptr, int(t)))

    def add_id(self, a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """``a[t, j] + b[ids[t, j]]``: a row of b chosen per (token, slot), e.g. each selected expert's bias.

        a [T, k, n] F32, b [n_rows, n] F32, ids [T, k] I32 -> [T, k, n].
        """
        op = "add_id"
        self._own(op, a, b, ids)
        for t, role in ((a, "a"), (b, "b")):
            types(op, t, {F32}, role)  # the CPU kernel has no other case
        types(op, ids, {I32}, "ids")
        need(a.ne[0] == b.ne[0], op, "a's rows and b's rows must have the same length", a, b)
        need(a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1] and a.ne[3] == 1 and ids.ne[2] == ids.ne[3] == 1, op,
             "ids must be [T, k] for a [T, k, n]", a, ids)
        need(b.ne[2] == b.ne[3] == 1, op, "b must be 2-D [n_rows, n]", b)
        rows_contiguous(op, a, b)
        self._bound_indices(op, ids, b.ne[1])
        return self._node(lib.ggml_add_id(self.ptr, a.ptr, b.ptr, ids.ptr))

    def acc(self, a: Tensor, b: Tensor, offset: int = 0, strides: Sequence[int] | None = None) -> Tensor:
        """A copy of ``a`` with ``b`` added into the view of it at byte ``offset`` with byte ``strides`` (numpy
        order, b's outer dims; default a's): ``out = a.copy(); view(out, b.shape, strides, offset)[...] += b``.
        F32, a contiguous; the view must lie inside a."""
        op = "acc"
        self._own(op, a, b)
        types(op, a, {F32}, "a")
        types(op, b, {F32}, "b")
        contiguous(op, a)
        rows_contiguous(op, b)
        nb = self._view_strides(op, a, b, offset, strides)
        return self._node(lib.ggml_acc(self.ptr, a.ptr, b.ptr, nb[1], nb[2], nb[3], offset))

    def scale(self, a: Tensor, s: float) -> Tensor:
        """``a * s`` (s float32). F32 or BF16, contiguous."""
        return self._scale("scale", a, s, 0.0)

    def scale_bias(self, a: Tensor, s: float, b: float) -> Tensor:
        """``a * s + b`` (s and b float32). F32 or BF16, contiguous."""
        return self._scale("scale_bias", a, s, b)

    def _scale(self, op: str, a: Tensor, s: float, b: float) -> Tensor:
        self._own(op, a)
        types(op, a, {F32, BF16})
        need(a.is_contiguous, op, "a must be contiguous (use cont() first)", a)
        s, b = finite(op, "s", s), finite(op, "b", b)
        if op == "scale":
            return self._node(lib.ggml_scale(self.ptr, a.ptr, s))
        return self._node(lib.ggml_scale_bias(self.ptr, a.ptr, s, b))

    def clamp(self, a: Tensor, lo: float, hi: float) -> Tensor:
        """``min(max(a, lo), hi)``; the bounds may be infinite."""
        op = "clamp"
        self._own(op, a)
        types(op, a, {F32, F16})
        rows_contiguous(op, a)
        lo, hi = not_nan(op, "lo", lo), not_nan(op, "hi", hi)
        return self._node(lib.ggml_clamp(self.ptr, a.ptr, lo, hi))

    def fill(self, a: Tensor, value: float) -> Tensor:
        """A new tensor shaped like ``a`` with every element ``value`` (a's data is not read)."""
        op = "fill"
        self._own(op, a)
        types(op, a, {F32, F16})
        contiguous(op, a)
        return self._node(lib.ggml_fill(self.ptr, a.ptr, not_nan(op, "value", value)))

    def leaky_relu(self, a: Tensor, negative_slope: float = 0.01) -> Tensor:
        """``a`` where a > 0, ``negative_slope * a`` elsewhere. F32 or F16."""
        op = "leaky_relu"
        self._own(op, a)
        types(op, a, {F32, F16})
        contiguous_1(op, a)
        return self._node(lib.ggml_leaky_relu(self.ptr, a.ptr, finite(op, "negative_slope", negative_slope), False))

    def _elementwise(self, op: str, fn: Callable[[CData, CData], CData], a: Tensor) -> Tensor:
        self._own(op, a)
        types(op, a, FLOATS)
        contiguous_1(op, a)
        return self._node(fn(self.ptr, a.ptr))

    def sqr(self, a: Tensor) -> Tensor:
        """``a * a``."""
        return self._elementwise("sqr", lib.ggml_sqr, a)

    def sqrt(self, a: Tensor) -> Tensor:
        """``sqrtf(a)`` (NaN below 0)."""
        return self._elementwise("sqrt", lib.ggml_sqrt, a)

    def log(self, a: Tensor) -> Tensor:
        """``logf(a)``, the natural logarithm (-inf at 0, NaN below)."""
        return self._elementwise("log", lib.ggml_log, a)

    def sin(self, a: Tensor) -> Tensor:
        """``sinf(a)``."""
        return self._elementwise("sin", lib.ggml_sin, a)

    def cos(self, a: Tensor) -> Tensor:
        """``cosf(a)``."""
        return self._elementwise("cos", lib.ggml_cos, a)


