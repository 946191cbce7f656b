"""Matrix products and gathers: mul_mat, mul_mat_f32, mul_mat_hadamard, mul_mat_id, out_prod, get_rows,
get_rows_back.

GGML multiplies by rows: ``mul_mat(a, b)`` is ``b @ a.T`` in numpy terms (both operands' rows hold the shared k),
batched over the outer dims with a's batches broadcast.
"""

from __future__ import annotations

from ..._native import lib
from ..dtypes import GGMLType
from ..tensor import Tensor
from .layout import LayoutOps
from .rules import F16, F32, I32, MATMUL_WEIGHTS, integer, is_matrix, is_vector, need, rows_contiguous, types


class MatmulOps(LayoutOps):
    """Products and gathers."""

    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        """``b @ a.T`` in numpy terms: a [.., n, k], b [.., m, k] -> [.., m, n] (F32)."""
        op = "mul_mat"
        self._own(op, a, b)
        need(a.ne[0] == b.ne[0], op, "a and b must have the same innermost (k) dimension", a, b)
        need(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, op,
              "the batch dims of b must be multiples of those of a", a, b)
        need(not lib.ggml_is_transposed(a.ptr), op, "a must not be transposed", a)
        types(op, b, {F32} | ({F16} if a.dtype == F16 else set()), "b")
        types(op, a, MATMUL_WEIGHTS, "a")
        rows_contiguous(op, a, b)
        need(a.ne[0] % a.dtype.block_size == 0, op, f"k must be a multiple of the {a.dtype.name} block size", a)
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
        types(op, rot, {F32}, "rot")
        types(op, x, {F32, F16}, "x")
        n = rot.ne[0]
        need(rot.shape == (n, n) and n >= 2 and n & (n - 1) == 0, op, "rot must be square, of a power-of-two size",
              rot)
        need(x.nelements % n == 0 and x.ne[0] % n == 0, op, f"x's rows must be whole runs of {n}", rot, x)
        need(x.is_contiguous, op, "x must be contiguous (use cont() first)", x)
        self._reserve(op, 3)
        flat = self.reshape(x, (x.nelements // n, n))
        out = self._node(lib.ggml_mul_mat(self.ptr, rot.ptr, flat.ptr))
        lib.ggml_mul_mat_set_hint(out.ptr, lib.GGML_HINT_SRC0_IS_HADAMARD)
        return self.reshape(out, x.shape)

    def mul_mat_id(self, experts: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """Per-token expert matmul: experts [E, n, k], b [T, u, k], ids [T, used] -> [T, used, n]."""
        op = "mul_mat_id"
        self._own(op, experts, b, ids)
        types(op, ids, {I32}, "ids")
        types(op, b, {F32}, "b")
        types(op, experts, MATMUL_WEIGHTS, "experts")
        rows_contiguous(op, experts, b)
        need(experts.ne[3] == 1, op, "experts must be 3-D [n_expert, n, k]", experts)
        need(b.ne[3] == 1, op, "b must be 3-D [tokens, used or 1, k]", b)
        need(ids.ne[2] == 1 and ids.ne[3] == 1, op, "ids must be 2-D [tokens, used]", ids)
        need(ids.ne[1] == b.ne[2], op, "ids and b must have the same number of tokens", ids, b)
        need(experts.ne[0] == b.ne[0], op, "experts and b must have the same innermost (k) dimension", experts, b)
        need(ids.ne[0] % b.ne[1] == 0, op, "b's middle dim must divide the number of used experts", ids, b)
        need(not lib.ggml_is_transposed(experts.ptr), op, "experts must not be transposed", experts)
        self._bound_indices(op, ids, experts.ne[2])
        return self._node(lib.ggml_mul_mat_id(self.ptr, experts.ptr, b.ptr, ids.ptr))

    def get_rows(self, a: Tensor, rows: Tensor) -> Tensor:
        """Gather rows of a by index: a [.., R, n], rows [.., m] -> [.., m, n] (F32 unless a is I32)."""
        op = "get_rows"
        self._own(op, a, rows)
        types(op, rows, {I32}, "rows")
        need(a.ne[2] == rows.ne[1] and a.ne[3] == rows.ne[2] and rows.ne[3] == 1, op,
              "rows must be [a.dims[-3], m] batched like a", a, rows)
        types(op, a, MATMUL_WEIGHTS | {I32}, "a")
        self._bound_indices(op, rows, a.ne[1])
        return self._node(lib.ggml_get_rows(self.ptr, a.ptr, rows.ptr))

    def out_prod(self, a: Tensor, b: Tensor) -> Tensor:
        """The sum of outer products of rows: a [.., k, n], b [.., k, m] -> [.., m, n], ``out = b.T @ a`` per batch
        (``np.swapaxes(b, -1, -2) @ a``; a's batches broadcast). F32 result; b F32; a F32, or F16 or quantized
        with b's batch dims."""
        op = "out_prod"
        self._own(op, a, b)
        types(op, b, {F32}, "b")
        types(op, a, MATMUL_WEIGHTS - {GGMLType.BF16}, "a")
        need(a.ne[1] == b.ne[1], op, "a and b must have the same number of rows (k)", a, b)
        need(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, op,
             "the batch dims of b must be multiples of those of a", a, b)
        if a.dtype != F32:
            need(a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], op, f"an {a.dtype.name} a must have b's batch dims", a, b)
        need(not lib.ggml_is_transposed(a.ptr), op, "a must not be transposed", a)
        rows_contiguous(op, a)
        return self._node(lib.ggml_out_prod(self.ptr, a.ptr, b.ptr))

    def get_rows_back(self, grad: Tensor, rows: Tensor, n_rows: int) -> Tensor:
        """The gradient of :meth:`get_rows` for a matrix of ``n_rows`` rows: grad [m, n] (F32 or F16), rows [m]
        (I32) -> out [n_rows, n] F32 with ``out[rows[i]] += grad[i]`` (``np.add.at``)."""
        op = "get_rows_back"
        self._own(op, grad, rows)
        types(op, grad, {F32, F16}, "grad")
        types(op, rows, {I32}, "rows")
        need(is_matrix(grad) and is_vector(rows) and grad.ne[1] == rows.ne[0], op,
             "grad must be a matrix [m, n] and rows a vector [m]", grad, rows)
        rows_contiguous(op, grad)
        like = self._shape_of(op, (integer(op, "n_rows", n_rows, 1), grad.ne[0]))
        self._bound_indices(op, rows, like.ne[1])
        return self._node(lib.ggml_get_rows_back(self.ptr, grad.ptr, rows.ptr, like.ptr))
