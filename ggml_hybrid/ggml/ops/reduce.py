"""Reductions and selections: sum, sum_rows, mean, cumsum, argmax, count_equal, argsort, argsort_top_k, top_k.

Row reductions work on the innermost (numpy's last) axis and keep it as size 1: a [.., n] -> [.., 1].
"""

from __future__ import annotations

from ..._native import lib
from ..tensor import Tensor
from .rules import (
    F32,
    FLOATS,
    I32,
    INT32_MAX,
    OpsBase,
    integer,
    is_matrix,
    need,
    rows_contiguous,
    same_shape,
    types,
)


class ReduceOps(OpsBase):
    """Sums, means, arg-max and sorting along rows."""

    def sum(self, a: Tensor) -> Tensor:
        """The sum of every element of ``a`` as a 1-element tensor of a's type (accumulated in float)."""
        op = "sum"
        self._own(op, a)
        types(op, a, FLOATS)
        rows_contiguous(op, a)
        return self._node(lib.ggml_sum(self.ptr, a.ptr))

    def sum_rows(self, a: Tensor) -> Tensor:
        """``a.sum(axis=-1, keepdims=True)``. F32."""
        self._own("sum_rows", a)
        types("sum_rows", a, {F32})
        rows_contiguous("sum_rows", a)
        return self._node(lib.ggml_sum_rows(self.ptr, a.ptr))

    def mean(self, a: Tensor) -> Tensor:
        """``a.mean(axis=-1, keepdims=True)`` (the row sum in float, divided by the row length). F32."""
        op = "mean"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        return self._node(lib.ggml_mean(self.ptr, a.ptr))

    def cumsum(self, a: Tensor) -> Tensor:
        """``np.cumsum(a, axis=-1)``, running sums along each row. F32."""
        op = "cumsum"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        return self._node(lib.ggml_cumsum(self.ptr, a.ptr))

    def argmax(self, a: Tensor) -> Tensor:
        """The index of each row's maximum, a matrix [m, n] -> [m] (I32; of equal maxima the last, where numpy's
        argmax takes the first). F32."""
        op = "argmax"
        self._own(op, a)
        types(op, a, {F32})
        rows_contiguous(op, a)
        need(is_matrix(a), op, "a must be a matrix (at most 2-D)", a)
        need(a.ne[0] <= INT32_MAX, op, "rows must be shorter than 2**31", a)
        return self._node(lib.ggml_argmax(self.ptr, a.ptr))

    def count_equal(self, a: Tensor, b: Tensor) -> Tensor:
        """``np.sum(a == b)`` as a 1-element I64 tensor. I32, one shape."""
        op = "count_equal"
        self._own(op, a, b)
        types(op, a, {I32}, "a")
        types(op, b, {I32}, "b")
        same_shape(op, a, b)
        return self._node(lib.ggml_count_equal(self.ptr, a.ptr, b.ptr))

    def argsort(self, a: Tensor, descending: bool = False) -> Tensor:
        """``np.argsort(a, axis=-1)`` (I32; ``descending`` largest first); equal values in any order. F32."""
        self._own("argsort", a)
        types("argsort", a, {F32})
        rows_contiguous("argsort", a)
        need(a.ne[0] <= INT32_MAX, "argsort", "rows must be shorter than 2**31", a)
        order = lib.GGML_SORT_ORDER_DESC if descending else lib.GGML_SORT_ORDER_ASC
        return self._node(lib.ggml_argsort(self.ptr, a.ptr, order))

    def argsort_top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest entries of each row, largest first (a view of a descending argsort)."""
        integer("argsort_top_k", "k", k, 1, a.ne[0])
        order = self.argsort(a, descending=True)
        # ggml_argsort_top_k's view: the argsort's strides in every dimension, even a dimension of size 1 (GGML's
        # Vulkan top-k MoE fusion requires the row stride to be the argsort's)
        ne, nb = order.ne, order.nb
        return self._node(lib.ggml_view_4d(self.ptr, order.ptr, k, ne[1], ne[2], ne[3], nb[1], nb[2], nb[3], 0))

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """Indices (I32) of the k largest entries of each row; their order among themselves is unspecified."""
        self._own("top_k", a)
        types("top_k", a, {F32})
        rows_contiguous("top_k", a)
        integer("top_k", "k", k, 1, a.ne[0])
        return self._node(lib.ggml_top_k(self.ptr, a.ptr, k))

