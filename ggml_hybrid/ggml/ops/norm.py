"""Normalisation and softmax: norm, rms_norm, rms_norm_back, group_norm, l2_norm, soft_max, soft_max_back.

Row ops normalise along the innermost (numpy's last) axis; sums are accumulated in double, the rest in float32.
"""

from __future__ import annotations

from ..._native import ffi, lib
from ...checks import check_real
from ..tensor import Tensor
from .rules import (
    F16,
    F32,
    OpsBase,
    check_sinks,
    contiguous,
    finite,
    int32,
    need,
    rows_contiguous,
    same_shape,
    types,
)


class NormOps(OpsBase):
    """Normalisations and softmax."""

    def _row_norm(self, op: str, fn: object, a: Tensor, eps: float) -> Tensor:
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        e = check_real(eps, f"{op}: eps", 0.0)
        return self._node(fn(self.ptr, a.ptr, e))  # type: ignore[operator]

    def norm(self, a: Tensor, eps: float = 1e-5) -> Tensor:
        """Each row centred and scaled to unit variance: ``(a - mean) / sqrt(var + eps)`` (var without Bessel's
        correction), as layer norm without its weight and bias. F32."""
        return self._row_norm("norm", lib.ggml_norm, a, eps)

    def rms_norm(self, a: Tensor, eps: float = 1e-6) -> Tensor:
        """Each row divided by its root mean square: ``a / sqrt(mean(a^2) + eps)``. F32."""
        return self._row_norm("rms_norm", lib.ggml_rms_norm, a, eps)

    def l2_norm(self, a: Tensor, eps: float = 1e-12) -> Tensor:
        """Each row divided by its L2 norm: ``a / max(||a||, eps)``. F32."""
        return self._row_norm("l2_norm", lib.ggml_l2_norm, a, eps)

    def rms_norm_back(self, grad: Tensor, x: Tensor, eps: float = 1e-6) -> Tensor:
        """The gradient of :meth:`rms_norm` at ``x`` for the output gradient ``grad`` (per row, with
        ``r = sqrt(mean(x^2) + eps)``: ``grad / r - x * sum(grad * x) / (n r^3)``). F32, one shape."""
        op = "rms_norm_back"
        self._own(op, grad, x)
        types(op, grad, {F32}, "grad")
        types(op, x, {F32}, "x")
        same_shape(op, grad, x, "grad and x")
        rows_contiguous(op, grad, x)
        e = check_real(eps, f"{op}: eps", 0.0)
        return self._node(lib.ggml_rms_norm_back(self.ptr, grad.ptr, x.ptr, e))

    def group_norm(self, a: Tensor, n_groups: int, eps: float = 1e-6) -> Tensor:
        """Group norm of a [N, C, H, W]: the C channels cut into ``n_groups`` runs of ceil(C / n_groups), each run
        of each sample centred and scaled to unit variance over its channels, rows and columns together. F32."""
        op = "group_norm"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        g = int32(op, "n_groups", n_groups, 1, max(a.ne[2], 1))
        e = check_real(eps, f"{op}: eps", 0.0)
        return self._node(lib.ggml_group_norm(self.ptr, a.ptr, g, e))

    def soft_max(self, a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0,
                 sinks: Tensor | None = None) -> Tensor:
        """softmax(a * scale + mask) over the innermost dim.

        ``sinks`` [H] (attention sinks, a [H, T, n]): head h's logit ``sinks[h]`` joins every row of that
        head's softmax as an extra entry that takes probability but has no value.
        """
        op = "soft_max_ext"
        self._own(op, a, *(t for t in (mask, sinks) if t is not None))
        if sinks is not None:
            check_sinks(op, sinks, a)
        types(op, a, {F32})
        need(a.is_contiguous, op, "a must be contiguous", a)
        if mask is not None:
            types(op, mask, {F32, F16}, "mask")
            need(mask.is_contiguous, op, "mask must be contiguous", mask)
            need(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], op,
                 "mask must have a's row length and at least a's number of rows", a, mask)
            need(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, op,
                 "mask's outer dims must divide a's", a, mask)
        mb = finite(op, "max_bias", max_bias)
        need(mb == 0 or mask is not None, op, "max_bias (ALiBi) needs a mask", a)
        out = self._node(lib.ggml_soft_max_ext(self.ptr, a.ptr, mask.ptr if mask is not None else ffi.NULL,
                                               finite(op, "scale", scale), mb))
        if sinks is not None:
            lib.ggml_soft_max_add_sinks(out.ptr, sinks.ptr)
        return out

    soft_max_ext = soft_max

    def soft_max_back(self, grad: Tensor, y: Tensor, scale: float = 1.0) -> Tensor:
        """The gradient of ``y = soft_max(a, scale=scale)`` with respect to a, for the output gradient ``grad``:
        ``scale * y * (grad - sum(grad * y))`` per row. F32, one shape, contiguous."""
        op = "soft_max_back"
        self._own(op, grad, y)
        types(op, grad, {F32}, "grad")
        types(op, y, {F32}, "y")
        same_shape(op, grad, y, "grad and y")
        contiguous(op, grad, role="grad")
        contiguous(op, y, role="y")
        return self._node(lib.ggml_soft_max_ext_back(self.ptr, grad.ptr, y.ptr, finite(op, "scale", scale), 0.0))
