"""Views and copies: view, reshape, permute, transpose, cont, dup, cpy, cast, set, set_rows.

A view shares its source's memory (no node is computed); a copy writes new memory, converting the element type
where asked. GGML's CPU copies convert between F32, F16 and BF16, F32 <-> I32, float -> the quantized types that have
a CPU quantizer (:data:`~.rules.QUANT_WRITABLE`) and quantized -> F32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..._native import lib
from ...errors import DTypeError, ShapeError
from ..dtypes import GGMLType, GGMLTypeLike, as_ggml_type
from ..tensor import Tensor, ne_of
from .rules import (
    F16,
    F32,
    FLOATS,
    I32,
    INT32_MAX,
    QUANT_WRITABLE,
    OpsBase,
    contiguous,
    infer_size,
    integer,
    need,
    rows_contiguous,
    types,
)


def copy_rule(op: str, src: Tensor, dst_type: GGMLType) -> None:
    """Whether the CPU copies ``src`` into a tensor of ``dst_type`` (ggml-cpu/ops.cpp: ggml_compute_forward_dup)."""
    s = src.dtype
    if s == dst_type:
        need(not s.is_quantized or src.is_contiguous, op, "a quantized copy of its own type needs a contiguous source",
             src)
        return
    if (s in FLOATS and dst_type in FLOATS) or {s, dst_type} == {F32, I32}:
        return
    if s in FLOATS and dst_type in QUANT_WRITABLE:
        need(src.nb[0] == s.type_size and src.ne[0] % dst_type.block_size == 0, op,
             f"a quantizing copy reads whole rows of {dst_type.block_size} (whole {dst_type.name} blocks)", src)
        return
    if s.is_quantized and dst_type == F32:
        return
    raise DTypeError(f"{op}: GGML's CPU does not copy {s.name} into {dst_type.name} (float types convert among "
                     f"themselves and to F32<->I32, to a quantized type with a CPU quantizer, and quantized to F32)")


class LayoutOps(OpsBase):
    """Views and copies."""

    def view(self, a: Tensor, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> Tensor:
        """A view of a with a numpy-order shape, byte strides (numpy order, outer dims only) and byte offset."""
        op = "view"
        self._own(op, a)
        ne = ne_of(shape)
        nd = len(tuple(shape))
        if any(n < 0 for n in ne):
            raise ShapeError(f"{op}: negative size in shape {tuple(shape)}")
        blck = a.dtype.block_size
        need(ne[0] % blck == 0, op, f"the innermost size must be a multiple of the {a.dtype.name} block size", a)
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
        offset = integer(op, "offset", offset, 0)
        if all(ne):
            # GGML's rule (ggml_new_tensor_impl): the dense size from the base's start must fit the base;
            # ours on top: the last byte the strides reach must too
            base_off = offset + (a.ptr.view_offs if a.is_view else 0)
            base_bytes = int(lib.ggml_nbytes(a.ptr.view_src)) if a.is_view else a.nbytes
            dense = row * ne[1] * ne[2] * ne[3]
            extent = offset + row + sum((ne[i + 1] - 1) * nb[i] for i in range(3))
            need(dense + base_off <= base_bytes and extent <= a.nbytes, op,
                 f"the view (offset {offset}, shape {tuple(shape)}) reaches past the end of a", a)
        p = lib.ggml_view_4d(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3], nb[0], nb[1], nb[2], offset)
        return self._node(p)

    def reshape(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """A view of contiguous ``a`` with a numpy-order ``shape``; one size may be -1 (inferred, as numpy)."""
        op = "reshape"
        self._own(op, a)
        shape = infer_size(op, a, shape)
        ne = ne_of(shape)
        contiguous(op, a)
        need(math.prod(ne) == a.nelements, op, f"shape {tuple(shape)} must keep the {a.nelements} elements", a)
        need(ne[0] % a.dtype.block_size == 0, op, "the innermost size must be a multiple of the block size", a)
        return self._node(lib.ggml_reshape_4d(self.ptr, a.ptr, *ne))

    def permute(self, a: Tensor, axes: Sequence[int]) -> Tensor:
        """numpy.transpose semantics over the tensor's numpy-order axes (padded to 4-D), as a view."""
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

    def cont(self, a: Tensor, shape: Sequence[int] | None = None) -> Tensor:
        """A contiguous copy of ``a`` (a strided or permuted view made dense), in numpy's element order; with
        ``shape``, given that numpy-order shape (``ggml_cont_4d``: the same elements, one size may be -1)."""
        op = "cont"
        self._own(op, a)
        copy_rule(op, a, a.dtype)
        if shape is None:
            return self._node(lib.ggml_cont(self.ptr, a.ptr))
        ne = ne_of(infer_size(op, a, shape))
        need(math.prod(ne) == a.nelements, op, f"shape {tuple(shape)} must keep the {a.nelements} elements", a)
        need(ne[0] % a.dtype.block_size == 0, op, "the innermost size must be a multiple of the block size", a)
        return self._node(lib.ggml_cont_4d(self.ptr, a.ptr, *ne))

    def dup(self, a: Tensor) -> Tensor:
        """A copy of ``a`` with its shape and strides (``ggml_dup``: the same as cont() for a dense ``a``)."""
        op = "dup"
        self._own(op, a)
        copy_rule(op, a, a.dtype)
        need(a.is_contiguous or a.dtype in FLOATS | {I32}, op, "a strided copy needs a float or I32 source", a)
        return self._node(lib.ggml_dup(self.ptr, a.ptr))

    def cpy(self, a: Tensor, b: Tensor) -> Tensor:
        """Copy (and convert) a into b's memory; returns a view of b to add to the graph."""
        op = "cpy"
        self._own(op, a, b)
        need(a.nelements == b.nelements, op, "a and b must have the same number of elements", a, b)
        copy_rule(op, a, b.dtype)
        if b.dtype.is_quantized and a.dtype != b.dtype:
            contiguous(op, b, role="b (quantized)")
            need(a.ne[0] == b.ne[0], op, "a quantizing copy writes a's rows as b's rows", a, b)
        if a.dtype.is_quantized and b.dtype == F32:
            need(b.nb[0] == 4 and (b.ne[0] % a.dtype.block_size == 0 or b.is_contiguous), op,
                 "a dequantizing copy writes whole blocks into b's rows", a, b)
        return self._node(lib.ggml_cpy(self.ptr, a.ptr, b.ptr))

    def cast(self, a: Tensor, dtype: GGMLTypeLike) -> Tensor:
        """A contiguous copy of ``a`` (which may be a strided view) converted to ``dtype``: among F32, F16 and
        BF16, F32 <-> I32 (toward zero), a float ``a`` quantized, or a quantized ``a`` dequantized to F32."""
        op = "cast"
        self._own(op, a)
        t = as_ggml_type(dtype)
        copy_rule(op, a, t)
        if t.is_quantized and t != a.dtype:
            need(a.ne[0] % t.block_size == 0, op, f"rows must be whole {t.name} blocks of {t.block_size}", a)
        return self._node(lib.ggml_cast(self.ptr, a.ptr, int(t)))

    def set(self, a: Tensor, b: Tensor, offset: int = 0, strides: Sequence[int] | None = None) -> Tensor:
        """A copy of ``a`` with ``b`` written into the view of it at byte ``offset`` with byte ``strides`` (numpy
        order, b's outer dims; default a's): ``out = a.copy(); view(out, b.shape, strides, offset)[...] = b``.

        F32 or I32, a and b of one type, both contiguous; the view must lie inside a.
        """
        op = "set"
        self._own(op, a, b)
        types(op, a, {F32, I32}, "a")
        need(a.dtype == b.dtype, op, "a and b must have the same type", a, b, exc=DTypeError)
        contiguous(op, a)
        rows_contiguous(op, b)
        nb = self._view_strides(op, a, b, offset, strides)
        return self._node(lib.ggml_set(self.ptr, a.ptr, b.ptr, nb[1], nb[2], nb[3], offset))

    def _view_strides(self, op: str, a: Tensor, b: Tensor, offset: int,
                      strides: Sequence[int] | None) -> tuple[int, int, int, int]:
        """The byte strides of b's view into a (GGML keeps them and the offset as int32 op parameters), checked to
        lie inside a and to fall on whole elements."""
        esize = a.dtype.type_size
        offset = integer(op, "offset", offset, 0, 2**30 - 1)
        if strides is None:
            nb = [esize, a.nb[1], a.nb[2], a.nb[3]]
        else:
            given = [integer(op, "strides", s, 0, INT32_MAX) for s in strides]
            need(len(given) == b.ndim - 1, op, f"strides must give b's {b.ndim - 1} outer strides (numpy order)", b)
            # b's dims beyond its ndim have size 1: their stride moves nothing
            nb = [esize, *reversed(given), *([0] * (3 - len(given)))]
        need(all(n <= INT32_MAX for n in nb), op, "strides must fit GGML's int32 op parameters", a)
        need(offset % esize == 0 and all(n % esize == 0 for n in nb), op,
             f"the offset and strides must be multiples of the element size {esize}", a)
        need(b.nelements <= a.nelements, op, "b must not have more elements than a", a, b)
        if b.nelements:
            last = offset + sum((b.ne[i] - 1) * nb[i] for i in range(4)) + esize
            need(last <= a.nbytes, op, f"b's view (offset {offset}, strides {nb[1:]}) must lie inside a", a, b)
        return nb[0], nb[1], nb[2], nb[3]

    def set_rows(self, a: Tensor, b: Tensor, rows: Tensor) -> Tensor:
        """Write row i of b into row rows[i] of a (converting to a's type); returns a view of a to expand.

        a [.., R, n], b [.., m, n] (F32 or F16), rows [.., m] (I32 or I64). Nothing orders this
        write before other readers of a: expand it into the graph before building them.
        """
        op = "set_rows"
        self._own(op, a, b, rows)
        types(op, b, {F32, F16}, "b")
        types(op, rows, {I32, GGMLType.I64}, "rows")
        need(a.ne[0] == b.ne[0] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], op,
             "a and b must agree on every dim but the row count", a, b)
        need(b.ne[1] == rows.ne[0] and rows.ne[3] == 1 and rows.ne[1] > 0 and b.ne[2] % rows.ne[1] == 0
             and rows.ne[2] > 0 and b.ne[3] % rows.ne[2] == 0, op, "rows must hold one index per row of b", b, rows)
        rows_contiguous(op, a, b)
        if a.dtype.is_quantized:
            types(op, a, QUANT_WRITABLE, "a")
            need(a.ne[0] % a.dtype.block_size == 0, op, "a's rows must be whole quantization blocks", a)
        else:
            types(op, a, FLOATS, "a")
        self._bound_indices(op, rows, a.ne[1])
        return self._node(lib.ggml_set_rows(self.ptr, a.ptr, b.ptr, rows.ptr))
