"""Convolutions, numpy-order (PyTorch's NCHW): im2col, im2col_back, im2col_3d, col2im_1d, conv_1d, conv_2d,
conv_2d_direct, conv_2d_dw_direct, conv_3d_direct, conv_transpose_1d, conv_transpose_2d.

``stride``, ``padding`` and ``dilation`` are an int or a (height, width) pair (three ints for 3-D: depth, height,
width), as PyTorch's; GGML's own parameters are the reverse (s0 the width's). Outputs follow GGML's length rule
``(n + 2 p - d (k - 1) - 1) // s + 1``, which must be at least 1. Kernels are cross-correlations (PyTorch's conv).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..._native import ffi, lib
from ..dtypes import GGMLTypeLike, as_ggml_type
from ..tensor import Tensor
from .layout import LayoutOps
from .matmul import MatmulOps
from .rules import (
    BF16,
    F16,
    F32,
    contiguous,
    conv_out,
    int32,
    need,
    pair,
    rows_contiguous,
    triple,
    types,
)

# GGML_IM2COL_WORK_SIZE (ggml-cpu/ops.h): the CPU's direct 2-D and 3-D convolutions hold one patch in it
_WORK = 16 * 1024 * 1024


class ConvOps(MatmulOps, LayoutOps):
    """Convolutions and their im2col building blocks."""

    def im2col(self, kernel: Tensor, data: Tensor, stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, *, is_2d: bool = True,
               dtype: GGMLTypeLike = F32) -> Tensor:
        """The patches a convolution with ``kernel``'s shape reads (kernel's data is not read), one row each.

        2-D: kernel [OC, IC, KH, KW], data [N, IC, H, W] -> [N, OH, OW, IC KH KW]; 1-D (``is_2d=False``): kernel
        [OC, IC, K], data [N, IC, L] -> [N, OL, IC K]. Zero outside the padded data. ``dtype`` F32 (data F32) or
        F16 (data F16 or F32)."""
        op = "im2col"
        self._own(op, kernel, data)
        t = as_ggml_type(dtype)
        types(op, data, {F32} if t == F32 else {F16, F32}, "data")
        need(t in (F32, F16), op, f"the result type must be F32 or F16, got {t.name}", data)
        rows_contiguous(op, data)
        (sh, sw), (ph, pw), (dh, dw) = (pair(op, "stride", stride, 1), pair(op, "padding", padding, 0),
                                        pair(op, "dilation", dilation, 1))
        if is_2d:
            need(kernel.ne[2] == data.ne[2], op, "kernel and data must have the same input channels (IC)", kernel,
                 data)
            need(conv_out(data.ne[1], kernel.ne[1], sh, ph, dh) > 0, op, "the data is too small for the kernel "
                 "(no output row)", kernel, data)
        else:
            need(kernel.ne[1] == data.ne[1] and data.ne[3] == 1, op, "a 1-D data [N, IC, L] must have kernel's IC",
                 kernel, data)
            sh, ph, dh = 1, 0, 1
        need(conv_out(data.ne[0], kernel.ne[0], sw, pw, dw) > 0, op, "the data is too small for the kernel (no "
             "output column)", kernel, data)
        return self._node(lib.ggml_im2col(self.ptr, kernel.ptr, data.ptr, sw, sh, pw, ph, dw, dh, bool(is_2d),
                                          int(t)))

    def im2col_back(self, grad: Tensor, kernel: Tensor, shape: Sequence[int], stride: int | Sequence[int] = 1,
                    padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, *,
                    is_2d: bool = True) -> Tensor:
        """The gradient of :meth:`im2col` for data of numpy-order ``shape``: each patch element of ``grad`` (im2col's
        output, F32, contiguous) summed back into the data position it was read from. kernel F32 or F16 (only its
        shape is used)."""
        op = "im2col_back"
        self._own(op, grad, kernel)
        types(op, grad, {F32}, "grad")
        types(op, kernel, {F32, F16}, "kernel")
        contiguous(op, grad, role="grad")
        (sh, sw), (ph, pw), (dh, dw) = (pair(op, "stride", stride, 1), pair(op, "padding", padding, 0),
                                        pair(op, "dilation", dilation, 1))
        like = self._shape_of(op, shape)
        ne = like.ne
        if is_2d:
            kh, kw, ic = kernel.ne[1], kernel.ne[0], kernel.ne[2]
            want = (ic * kh * kw, conv_out(ne[0], kw, sw, pw, dw), conv_out(ne[1], kh, sh, ph, dh), ne[3])
            need(ne[2] == ic, op, f"shape {tuple(shape)} must be [N, IC, H, W] with kernel's IC", kernel)
        else:
            sh, ph, dh = 1, 0, 1
            kw, ic = kernel.ne[0], kernel.ne[1]
            want = (ic * kw, conv_out(ne[0], kw, sw, pw, dw), ne[2], 1)
            need(ne[1] == ic and ne[3] == 1, op, f"shape {tuple(shape)} must be [N, IC, L] with kernel's IC", kernel)
        need(grad.ne == want, op, f"grad must be im2col's output for shape {tuple(shape)}", grad, kernel)
        return self._node(lib.ggml_im2col_back(self.ptr, grad.ptr, kernel.ptr, ffi.new("int64_t[4]", list(ne)), sw,
                                               sh, pw, ph, dw, dh, bool(is_2d)))

    def im2col_3d(self, kernel: Tensor, data: Tensor, in_channels: int, stride: int | Sequence[int] = 1,
                  padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, *,
                  dtype: GGMLTypeLike = F32) -> Tensor:
        """3-D patches: kernel [OC IC, KD, KH, KW], data [N IC, D, H, W] (channels folded into the outer dim,
        ``in_channels`` = IC) -> [N OD, OH, OW, IC KD KH KW]. data F32; ``dtype`` F32 or F16."""
        op = "im2col_3d"
        self._own(op, kernel, data)
        t = as_ggml_type(dtype)
        need(t in (F32, F16), op, f"the result type must be F32 or F16, got {t.name}", data)
        types(op, data, {F32}, "data")
        rows_contiguous(op, data)
        ic = int32(op, "in_channels", in_channels, 1)
        need(data.ne[3] % ic == 0 and kernel.ne[3] % ic == 0, op, f"data's and kernel's outer dims must be multiples "
             f"of in_channels={ic}", kernel, data)
        s, p, d = (triple(op, "stride", stride, 1), triple(op, "padding", padding, 0),
                   triple(op, "dilation", dilation, 1))
        for axis, (n, k) in enumerate(((data.ne[2], kernel.ne[2]), (data.ne[1], kernel.ne[1]),
                                       (data.ne[0], kernel.ne[0]))):
            need(conv_out(n, k, s[axis], p[axis], d[axis]) > 0, op, "the data is too small for the kernel", kernel,
                 data)
        return self._node(lib.ggml_im2col_3d(self.ptr, kernel.ptr, data.ptr, ic, s[2], s[1], s[0], p[2], p[1], p[0],
                                             d[2], d[1], d[0], int(t)))

    def col2im_1d(self, cols: Tensor, stride: int, out_channels: int, padding: int = 0) -> Tensor:
        """The scatter-add of a transposed 1-D convolution: cols [T_in, K OC] -> [OC, T_out] with ``out[oc, t s + k -
        padding] += cols[t, oc K + k]``, ``T_out = (T_in - 1) s + K - 2 padding``. F32, F16 or BF16, contiguous."""
        op = "col2im_1d"
        self._own(op, cols)
        types(op, cols, {F32, F16, BF16}, "cols")
        contiguous(op, cols, role="cols")
        need(cols.ne[2] == cols.ne[3] == 1, op, "cols must be a matrix [T_in, K OC]", cols)
        s, oc, p = int32(op, "stride", stride, 1), int32(op, "out_channels", out_channels, 1), \
            int32(op, "padding", padding, 0)
        k = cols.ne[0] // oc
        need(cols.ne[0] == k * oc and k > 0, op, f"the row length must be K * out_channels ({oc})", cols)
        need((cols.ne[1] - 1) * s + k - 2 * p > 0, op, "the padding leaves no output", cols)
        return self._node(lib.ggml_col2im_1d(self.ptr, cols.ptr, s, oc, p))

    def conv_1d(self, kernel: Tensor, data: Tensor, stride: int = 1, padding: int = 0, dilation: int = 1) -> Tensor:
        """1-D convolution (im2col + mul_mat, as ``ggml_conv_1d`` for one sample, and right for a batch): kernel
        [OC, IC, K] (F16 or F32), data [N, IC, L] -> [N, OC, OL]. The patches are F16, so data and kernel are
        multiplied as F16 values (the product summed in float32)."""
        op = "conv_1d"
        types(op, kernel, {F16, F32}, "kernel")
        cols = self.im2col(kernel, data, stride, padding, dilation, is_2d=False, dtype=F16)  # [N, OL, IC K]
        n, ol = cols.ne[2], cols.ne[1]
        w = self.reshape(kernel, (kernel.ne[2], kernel.ne[0] * kernel.ne[1]))
        out = self.mul_mat(self.reshape(cols, (n * ol, cols.ne[0])), w)  # [OC, N OL]
        return self.cont(self.permute(self.reshape(out, (kernel.ne[2], n, ol)), (1, 0, 2)))

    def conv_2d(self, kernel: Tensor, data: Tensor, stride: int | Sequence[int] = 1,
                padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1) -> Tensor:
        """2-D convolution (GGML's im2col + mul_mat, F16 patches): kernel [OC, IC, KH, KW] (F16 or F32), data [N, IC,
        H, W] -> [N, OC, OH, OW]."""
        op = "conv_2d"
        types(op, kernel, {F16, F32}, "kernel")
        cols = self.im2col(kernel, data, stride, padding, dilation, is_2d=True, dtype=F16)  # [N, OH, OW, IC KH KW]
        n, oh, ow, kk = cols.ne[3], cols.ne[2], cols.ne[1], cols.ne[0]
        w = self.reshape(kernel, (kernel.ne[3], kk))
        out = self.mul_mat(self.reshape(cols, (n * oh * ow, kk)), w)  # [OC, N OH OW] as ne
        out = self.reshape(out, (kernel.ne[3], n, oh, ow))
        return self.cont(self.permute(out, (1, 0, 2, 3)))

    def conv_2d_direct(self, kernel: Tensor, data: Tensor, stride: int | Sequence[int] = 1,
                       padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1) -> Tensor:
        """2-D convolution in one op (``GGML_OP_CONV_2D``): kernel [OC, IC, KH, KW] (F32 or F16, contiguous), data
        [N, IC, H, W] (F32) -> [N, OC, OH, OW], each output a float sum over IC, KH, KW."""
        op = "conv_2d_direct"
        self._own(op, kernel, data)
        types(op, kernel, {F32, F16}, "kernel")
        types(op, data, {F32}, "data")
        contiguous(op, kernel, role="kernel")
        need(kernel.ne[2] == data.ne[2], op, "kernel and data must have the same input channels (IC)", kernel, data)
        s, p, d = pair(op, "stride", stride, 1), pair(op, "padding", padding, 0), pair(op, "dilation", dilation, 1)
        self._conv_fits(op, kernel, data, s, p, d)
        patch = kernel.ne[0] * kernel.ne[1] * kernel.ne[2] * kernel.dtype.type_size + kernel.ne[3] * 4
        need(patch <= _WORK, op, "one patch (KH KW IC kernel values and OC outputs) must fit GGML's 16 MiB work "
             "buffer", kernel)
        return self._node(lib.ggml_conv_2d_direct(self.ptr, kernel.ptr, data.ptr, s[1], s[0], p[1], p[0], d[1],
                                                  d[0]))

    def _conv_fits(self, op: str, kernel: Tensor, data: Tensor, s: tuple[int, int], p: tuple[int, int],
                   d: tuple[int, int]) -> None:
        need(conv_out(data.ne[1], kernel.ne[1], s[0], p[0], d[0]) > 0
             and conv_out(data.ne[0], kernel.ne[0], s[1], p[1], d[1]) > 0, op,
             "the data is too small for the kernel (no output)", kernel, data)

    def conv_2d_dw_direct(self, kernel: Tensor, data: Tensor, stride: int | Sequence[int] = 1,
                          padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1) -> Tensor:
        """Depthwise 2-D convolution (``GGML_OP_CONV_2D_DW``): kernel [C, 1, KH, KW] (F32 or F16), data [N, C, H, W]
        (F32, contiguous) -> [N, C, OH, OW]: channel c convolved with its own kernel."""
        op = "conv_2d_dw_direct"
        self._own(op, kernel, data)
        types(op, kernel, {F32, F16}, "kernel")
        types(op, data, {F32}, "data")
        contiguous(op, kernel, role="kernel")
        contiguous(op, data, role="data")
        need(kernel.ne[2] == 1 and kernel.ne[3] == data.ne[2], op, "kernel must be [C, 1, KH, KW] for data [N, C, H, "
             "W]", kernel, data)
        s, p, d = pair(op, "stride", stride, 1), pair(op, "padding", padding, 0), pair(op, "dilation", dilation, 1)
        self._conv_fits(op, kernel, data, s, p, d)
        return self._node(lib.ggml_conv_2d_dw_direct(self.ptr, kernel.ptr, data.ptr, s[1], s[0], p[1], p[0], d[1],
                                                     d[0]))

    def conv_3d_direct(self, kernel: Tensor, data: Tensor, channels: Sequence[int],
                       stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                       dilation: int | Sequence[int] = 1) -> Tensor:
        """3-D convolution (``GGML_OP_CONV_3D``), channels folded into the outer dim: ``channels`` = (N, IC, OC),
        kernel [OC IC, KD, KH, KW] (F32 or F16, contiguous), data [N IC, D, H, W] (F32) -> [N OC, OD, OH, OW]."""
        op = "conv_3d_direct"
        self._own(op, kernel, data)
        types(op, kernel, {F32, F16}, "kernel")
        types(op, data, {F32}, "data")
        contiguous(op, kernel, role="kernel")
        n, ic, oc = triple(op, "channels", channels, 1)
        need(kernel.ne[3] == ic * oc and data.ne[3] == ic * n, op,
             f"kernel must be [OC IC, ..] and data [N IC, ..] for (N, IC, OC) = {(n, ic, oc)}", kernel, data)
        s, p, d = triple(op, "stride", stride, 1), triple(op, "padding", padding, 0), triple(op, "dilation",
                                                                                               dilation, 1)
        for axis, dim in enumerate((2, 1, 0)):
            need(conv_out(data.ne[dim], kernel.ne[dim], s[axis], p[axis], d[axis]) > 0, op,
                 "the data is too small for the kernel (no output)", kernel, data)
        patch = kernel.ne[0] * kernel.ne[1] * kernel.ne[2] * ic * kernel.dtype.type_size + oc * 4
        need(patch <= _WORK, op, "one patch must fit GGML's 16 MiB work buffer", kernel)
        return self._node(lib.ggml_conv_3d_direct(self.ptr, kernel.ptr, data.ptr, s[2], s[1], s[0], p[2], p[1],
                                                  p[0], d[2], d[1], d[0], ic, n, oc))

    def conv_transpose_1d(self, kernel: Tensor, data: Tensor, stride: int = 1) -> Tensor:
        """Transposed 1-D convolution (no padding, no dilation): kernel [IC, OC, K] (F32 or F16), data [IC, L] (F32)
        -> [OC, (L - 1) stride + K] with ``out[oc, l s + k] += kernel[ic, oc, k] data[ic, l]``."""
        op = "conv_transpose_1d"
        self._own(op, kernel, data)
        types(op, kernel, {F32, F16}, "kernel")
        types(op, data, {F32}, "data")
        rows_contiguous(op, kernel, data)
        need(data.ne[2] == data.ne[3] == 1, op, "data must be a matrix [IC, L]", data)
        need(kernel.ne[2] == data.ne[1] and kernel.ne[3] == 1, op, "kernel must be [IC, OC, K] with data's IC",
             kernel, data)
        s = int32(op, "stride", stride, 1)
        return self._node(lib.ggml_conv_transpose_1d(self.ptr, kernel.ptr, data.ptr, s, 0, 1))

    def conv_transpose_2d(self, kernel: Tensor, data: Tensor, stride: int = 1) -> Tensor:
        """Transposed 2-D convolution (no padding): kernel [IC, OC, KH, KW] (F32 or F16), data [N, IC, H, W] (F32) ->
        [N, OC, (H - 1) s + KH, (W - 1) s + KW] with ``out[n, oc, h s + i, w s + j] += kernel[ic, oc, i, j] data[n,
        ic, h, w]``."""
        op = "conv_transpose_2d"
        self._own(op, kernel, data)
        types(op, kernel, {F32, F16}, "kernel")
        types(op, data, {F32}, "data")
        rows_contiguous(op, kernel, data)
        need(kernel.ne[3] == data.ne[2], op, "kernel must be [IC, OC, KH, KW] with data's IC", kernel, data)
        s = int32(op, "stride", stride, 1)
        return self._node(lib.ggml_conv_transpose_2d_p0(self.ptr, kernel.ptr, data.ptr, s))

