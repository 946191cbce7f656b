"""Pooling and resampling: pool_1d, pool_2d, pool_2d_back, interpolate, upscale.

Windows slide over the innermost axes (numpy's last, or last two); the other axes are planes pooled apart. The
output length is ``(n + 2 padding - kernel) // stride + 1``; the window must fit the padded input.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._native import lib
from ...checks import check_choice
from ...errors import ShapeError
from ..tensor import Tensor, ne_of
from .rules import F16, F32, OpsBase, contiguous, int32, need, pair, types

POOL_KINDS = {"max": lib.GGML_OP_POOL_MAX, "avg": lib.GGML_OP_POOL_AVG}
SCALE_MODES = {"nearest": lib.GGML_SCALE_MODE_NEAREST, "bilinear": lib.GGML_SCALE_MODE_BILINEAR,
               "bicubic": lib.GGML_SCALE_MODE_BICUBIC}


def _pool_out(op: str, n: int, k: int, s: int, p: int, t: Tensor) -> int:
    need(n + 2 * p >= k, op, f"the window {k} must fit the padded length {n} + 2*{p}", t)
    return (n + 2 * p - k) // s + 1


class PoolOps(OpsBase):
    """Max and average pooling, and interpolation."""

    def pool_1d(self, a: Tensor, kind: str, kernel: int, stride: int | None = None, padding: int = 0) -> Tensor:
        """Pooling along each row of ``a`` [.., n] -> [.., (n + 2 padding - kernel) // stride + 1] (stride defaults to
        the kernel): ``max`` (padding ignored) or ``avg`` (the mean of the window's elements inside the row). F32 or
        F16 in, F32 out; contiguous."""
        op = "pool_1d"
        check_choice(kind, f"{op}: kind", sorted(POOL_KINDS))
        self._own(op, a)
        types(op, a, {F32, F16})
        contiguous(op, a)
        k = int32(op, "kernel", kernel, 1)
        s = int32(op, "stride", k if stride is None else stride, 1)
        p = int32(op, "padding", padding, 0)
        _pool_out(op, a.ne[0], k, s, p, a)
        return self._node(lib.ggml_pool_1d(self.ptr, a.ptr, POOL_KINDS[kind], k, s, p))

    def pool_2d(self, a: Tensor, kind: str, kernel: int | Sequence[int], stride: int | Sequence[int] | None = None,
                padding: int | Sequence[int] = 0) -> Tensor:
        """Pooling over the two innermost axes of ``a`` [.., H, W] with (height, width) ``kernel``, ``stride`` (default
        the kernel) and ``padding``: ``max`` (padding ignored) or ``avg`` (the window's sum divided by the full
        window size, padding counted as zeros). F32 or F16 in, F32 out; contiguous."""
        op = "pool_2d"
        check_choice(kind, f"{op}: kind", sorted(POOL_KINDS))
        self._own(op, a)
        types(op, a, {F32, F16})
        contiguous(op, a)
        k, s, p = self._pool_2d_params(op, a, kernel, stride, padding)
        return self._node(lib.ggml_pool_2d(self.ptr, a.ptr, POOL_KINDS[kind], k[1], k[0], s[1], s[0], p[1], p[0]))

    def _pool_2d_params(self, op: str, a: Tensor, kernel: int | Sequence[int], stride: int | Sequence[int] | None,
                        padding: int | Sequence[int]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        k = pair(op, "kernel", kernel, 1)
        s = pair(op, "stride", k if stride is None else stride, 1)
        p = pair(op, "padding", padding, 0)
        _pool_out(op, a.ne[1], k[0], s[0], p[0], a)
        _pool_out(op, a.ne[0], k[1], s[1], p[1], a)
        return k, s, p

    def pool_2d_back(self, grad: Tensor, x: Tensor, kind: str, kernel: int | Sequence[int],
                     stride: int | Sequence[int] | None = None, padding: int | Sequence[int] = 0) -> Tensor:
        """The gradient of :meth:`pool_2d` at its input ``x`` for the output gradient ``grad``: ``max`` sends each
        output's gradient to the first largest element of its window, ``avg`` spreads it over the window (divided by
        the window size). F32, contiguous; grad has pool_2d(x)'s shape."""
        op = "pool_2d_back"
        check_choice(kind, f"{op}: kind", sorted(POOL_KINDS))
        self._own(op, grad, x)
        types(op, grad, {F32}, "grad")
        types(op, x, {F32}, "x")
        contiguous(op, grad, role="grad")
        contiguous(op, x, role="x")
        k, s, p = self._pool_2d_params(op, x, kernel, stride, padding)
        out = ((x.ne[0] + 2 * p[1] - k[1]) // s[1] + 1, (x.ne[1] + 2 * p[0] - k[0]) // s[0] + 1, x.ne[2], x.ne[3])
        need(grad.ne == out, op, "grad must have pool_2d(x)'s shape", grad, x)
        return self._node(lib.ggml_pool_2d_back(self.ptr, grad.ptr, x.ptr, POOL_KINDS[kind], k[1], k[0], s[1], s[0],
                                                p[1], p[0]))

    def interpolate(self, a: Tensor, shape: Sequence[int], mode: str = "nearest", align_corners: bool = False,
                    antialias: bool = False) -> Tensor:
        """``a`` resampled to the numpy-order ``shape`` (same number of axes): the two innermost axes by ``mode``
        (``nearest``, ``bilinear`` or ``bicubic``, half-pixel centres unless ``align_corners``; ``antialias`` for
        bilinear downsampling, as PyTorch's), the outer ones by nearest index. F32."""
        op = "interpolate"
        check_choice(mode, f"{op}: mode", sorted(SCALE_MODES))
        self._own(op, a)
        types(op, a, {F32})
        ne = ne_of(shape)
        if any(n <= 0 for n in ne):
            raise ShapeError(f"{op}: sizes must be positive, got shape {tuple(shape)}")
        need(not antialias or mode == "bilinear", op, "antialias needs mode='bilinear'", a)
        flags = SCALE_MODES[mode] | (lib.GGML_SCALE_FLAG_ALIGN_CORNERS if align_corners else 0) \
            | (lib.GGML_SCALE_FLAG_ANTIALIAS if antialias else 0)
        return self._node(lib.ggml_interpolate(self.ptr, a.ptr, ne[0], ne[1], ne[2], ne[3], flags))

    def upscale(self, a: Tensor, factor: int, mode: str = "nearest") -> Tensor:
        """:meth:`interpolate` to the two innermost sizes times ``factor`` (an int > 1)."""
        f = int32("upscale", "factor", factor, 2)
        shape = list(a.shape) if a.ndim >= 2 else [1, *a.shape]
        shape[-1] *= f
        shape[-2] *= f
        return self.interpolate(a, shape, mode)

