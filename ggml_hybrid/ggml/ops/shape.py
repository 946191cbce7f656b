"""Ops that make a tensor of another shape from one: repeat, repeat_back, concat, pad, pad_reflect_1d, roll, tri,
diag, diag_mask_inf, diag_mask_zero, arange, win_part, win_unpart.

Shapes and axes are numpy-order; GGML's own dims are the reverse (dim 0 innermost).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..._native import lib
from ...checks import check_choice
from ...errors import ArgumentError
from ..dtypes import GGMLType
from ..tensor import Tensor, can_repeat, ne_of
from .rules import (
    BF16,
    F16,
    F32,
    FLOATS,
    I32,
    OpsBase,
    contiguous,
    finite,
    int32,
    integer,
    need,
    rows_contiguous,
    same_type,
    types,
)

# the CPU repeat kernels' cases
REPEAT_TYPES = frozenset({F32, F16, BF16, I32, GGMLType.I16, GGMLType.I64})
TRI_KINDS = {"lower": lib.GGML_TRI_TYPE_LOWER, "lower_diag": lib.GGML_TRI_TYPE_LOWER_DIAG,
             "upper": lib.GGML_TRI_TYPE_UPPER, "upper_diag": lib.GGML_TRI_TYPE_UPPER_DIAG}


def _per_axis(op: str, name: str, values: Sequence[int], ndim: int, lo: int) -> list[int]:
    """Numpy-order per-axis ints (at most 4), as GGML's dims 0..3 (innermost first), zero-filled."""
    vals = [int32(op, name, v, lo) for v in values]
    if not 1 <= len(vals) <= 4:
        raise ArgumentError(f"{op}: {name} must give 1 to 4 axes (numpy order), got {list(values)}")
    if len(vals) < ndim:
        vals = [0] * (ndim - len(vals)) + vals
    return list(reversed(vals)) + [0] * (4 - len(vals))


class ShapeOps(OpsBase):
    """Repeats, joins, pads, rolls and triangular masks."""

    def repeat(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """``a`` tiled to the numpy-order ``shape`` (``ggml_repeat_4d``, numpy's ``np.tile``): each size a multiple of
        a's."""
        op = "repeat_4d"
        self._own(op, a)
        ne = ne_of(shape)
        types(op, a, REPEAT_TYPES)
        rows_contiguous(op, a)
        need(a.nelements > 0 and all(n > 0 and n % m == 0 for n, m in zip(ne, a.ne)), op,
             f"shape {tuple(shape)} must be a multiple of a's in every dim", a)
        return self._node(lib.ggml_repeat_4d(self.ptr, a.ptr, *ne))

    def repeat_like(self, a: Tensor, b: Tensor) -> Tensor:
        """``a`` tiled to b's shape (``ggml_repeat``; b's data is not read)."""
        op = "repeat"
        self._own(op, a, b)
        types(op, a, REPEAT_TYPES)
        rows_contiguous(op, a)
        need(a.nelements > 0 and can_repeat(a, b), op, "b's sizes must be multiples of a's", a, b)
        return self._node(lib.ggml_repeat(self.ptr, a.ptr, b.ptr))

    def repeat_back(self, a: Tensor, shape: Sequence[int]) -> Tensor:
        """The repetitions of ``a`` summed into the numpy-order ``shape`` (the gradient of :meth:`repeat`): each size
        of ``a`` a multiple of the shape's. F32."""
        op = "repeat_back"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        like = self._shape_of(op, shape)
        need(can_repeat(like, a), op, f"a's sizes must be multiples of shape {tuple(shape)}", a)
        return self._node(lib.ggml_repeat_back(self.ptr, a.ptr, like.ptr))

    def concat(self, a: Tensor, b: Tensor, axis: int = 0, ndim: int | None = None) -> Tensor:
        """numpy.concatenate along a numpy-order axis.

        GGML does not record leading size-1 dims, so a (1, n) tensor has shape (n,)
        here. A negative axis counts from the innermost dim and is unambiguous; a
        non-negative one counts within ``ndim`` dims (default: the larger of the two
        shapes' lengths), so pass ``ndim=2`` to join two (1, n) tensors into (2, n).
        """
        op = "concat"
        self._own(op, a, b)
        nd = max(a.ndim, b.ndim) if ndim is None else integer(op, "ndim", ndim, max(a.ndim, b.ndim), 4)
        axis = integer(op, "axis", axis, -nd, nd - 1) % nd
        dim = nd - 1 - axis
        types(op, a, FLOATS | {I32})
        same_type(op, a, b)
        need(all(a.ne[d] == b.ne[d] for d in range(4) if d != dim), op,
             f"a and b must agree on every dim but axis {axis}", a, b)
        return self._node(lib.ggml_concat(self.ptr, a.ptr, b.ptr, dim))

    def pad(self, a: Tensor, before: Sequence[int], after: Sequence[int] | None = None,
            circular: bool = False) -> Tensor:
        """``a`` padded per numpy-order axis with ``before[i]`` leading and ``after[i]`` trailing zeros (``after``
        defaults to zeros; fewer axes than a's pad the innermost ones): ``np.pad(a, list(zip(before, after)))``.
        ``circular``: the padding wraps around (``np.pad(..., mode="wrap")``). F32."""
        op = "pad"
        self._own(op, a)
        types(op, a, {F32})
        after = [0] * len(before) if after is None else after
        need(len(after) == len(before), op, "before and after must name the same axes", a)
        lo = _per_axis(op, "before", before, len(before), 0)
        hi = _per_axis(op, "after", after, len(before), 0)
        if circular:
            need(all(p <= n for p, n in zip(lo + hi, list(a.ne) * 2)), op,
                 "circular padding must not be wider than the axis it wraps", a)
        fn = lib.ggml_pad_ext_circular if circular else lib.ggml_pad_ext
        return self._node(fn(self.ptr, a.ptr, lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3]))

    def pad_reflect_1d(self, a: Tensor, before: int, after: int) -> Tensor:
        """Each row of ``a`` padded by reflection (``np.pad(a, [(0, 0)]*(a.ndim-1) + [(before, after)],
        mode="reflect")``); each pad shorter than the row. F32, contiguous."""
        op = "pad_reflect_1d"
        self._own(op, a)
        types(op, a, {F32})
        contiguous(op, a)
        p0, p1 = int32(op, "before", before, 0), int32(op, "after", after, 0)
        need(p0 < a.ne[0] and p1 < a.ne[0], op, f"the pads ({p0}, {p1}) must be shorter than a row", a)
        return self._node(lib.ggml_pad_reflect_1d(self.ptr, a.ptr, p0, p1))

    def roll(self, a: Tensor, shifts: Sequence[int]) -> Tensor:
        """``np.roll`` along the numpy-order axes: ``shifts[i]`` for axis i (fewer shifts than axes roll the
        innermost); each |shift| smaller than its axis. F32, rows contiguous."""
        op = "roll"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        sh = _per_axis(op, "shifts", shifts, len(shifts), -(2**31))
        need(all(abs(s) < n for s, n in zip(sh, a.ne)), op, f"each |shift| of {list(shifts)} must be smaller than "
             "its axis", a)
        return self._node(lib.ggml_roll(self.ptr, a.ptr, sh[0], sh[1], sh[2], sh[3]))

    def tri(self, a: Tensor, kind: str = "lower_diag") -> Tensor:
        """The square matrices of ``a`` with the part outside a triangle zeroed: ``lower_diag`` np.tril(a),
        ``lower`` np.tril(a, -1), ``upper_diag`` np.triu(a), ``upper`` np.triu(a, 1). F32, contiguous."""
        op = "tri"
        check_choice(kind, f"{op}: kind", sorted(TRI_KINDS))
        self._own(op, a)
        types(op, a, {F32})
        contiguous(op, a)
        need(a.ne[0] == a.ne[1], op, "a's two innermost sizes must be equal (square matrices)", a)
        return self._node(lib.ggml_tri(self.ptr, a.ptr, TRI_KINDS[kind]))

    def diag(self, a: Tensor) -> Tensor:
        """Diagonal matrices from the rows of ``a`` [.., 1, n] -> [.., n, n] (``np.diag`` per row). F32."""
        op = "diag"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        need(a.ne[1] == 1, op, "a must hold one row per matrix ([.., 1, n])", a)
        return self._node(lib.ggml_diag(self.ptr, a.ptr))

    def _diag_mask(self, op: str, a: Tensor, n_past: int, fn: object) -> Tensor:
        self._own(op, a)
        types(op, a, {F32})
        contiguous(op, a)
        n = int32(op, "n_past", n_past, 0)
        return self._node(fn(self.ptr, a.ptr, n))  # type: ignore[operator]

    def diag_mask_inf(self, a: Tensor, n_past: int = 0) -> Tensor:
        """``a`` with ``-inf`` where column > n_past + row in each matrix (a causal mask). F32, contiguous."""
        return self._diag_mask("diag_mask_inf", a, n_past, lib.ggml_diag_mask_inf)

    def diag_mask_zero(self, a: Tensor, n_past: int = 0) -> Tensor:
        """``a`` with 0 where column > n_past + row in each matrix. F32, contiguous."""
        return self._diag_mask("diag_mask_zero", a, n_past, lib.ggml_diag_mask_zero)

    def arange(self, start: float, stop: float, step: float = 1.0) -> Tensor:
        """``np.arange(start, stop, step)`` in float32: ``ceil((stop - start) / step)`` values ``start + i step``;
        stop > start and step > 0."""
        op = "arange"
        s0, s1, st = finite(op, "start", start), finite(op, "stop", stop), finite(op, "step", step)
        f0, f1, fs = (float(np.float32(v)) for v in (s0, s1, st))
        if not (f1 > f0 and fs > 0):
            raise ArgumentError(f"{op}: needs stop > start and step > 0 (as float32), got {start}, {stop}, {step}")
        steps = math.ceil(float(np.float32(np.float32(f1 - f0) / np.float32(fs))))
        if steps > 2**31 - 1:
            raise ArgumentError(f"{op}: {steps} values is more than GGML's int32 limit")
        self._reserve(op, 2)
        return self._node(lib.ggml_arange(self.ptr, f0, f1, fs))

    def win_part(self, a: Tensor, w: int) -> Tensor:
        """SAM's window partition: a [H, W, C] cut into (H/w x W/w, rounded up) windows [w, w, C], zero-padded at
        the bottom and right: [n_windows, w, w, C]. F32, contiguous."""
        op = "win_part"
        self._own(op, a)
        types(op, a, {F32})
        contiguous(op, a)
        need(a.ne[3] == 1, op, "a must be 3-D [H, W, C]", a)
        int32(op, "w", w, 1)
        return self._node(lib.ggml_win_part(self.ptr, a.ptr, w))

    def win_unpart(self, a: Tensor, h0: int, w0: int, w: int) -> Tensor:
        """The inverse of :meth:`win_part`: windows [n_windows, w, w, C] back into [h0, w0, C] (the padding
        dropped); n_windows must be ceil(h0/w) ceil(w0/w). F32, contiguous."""
        op = "win_unpart"
        self._own(op, a)
        types(op, a, {F32})
        contiguous(op, a)
        w = int32(op, "w", w, 1)
        h0, w0 = int32(op, "h0", h0, 1), int32(op, "w0", w0, 1)
        need(a.ne[1] == w and a.ne[2] == w and a.ne[3] == -(-h0 // w) * -(-w0 // w), op,
             f"a must be [ceil(h0/w) * ceil(w0/w), w, w, C] for h0={h0}, w0={w0}, w={w}", a)
        return self._node(lib.ggml_win_unpart(self.ptr, a.ptr, w0, h0, w))
