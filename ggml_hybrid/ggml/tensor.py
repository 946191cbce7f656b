"""A borrowed view of a ``struct ggml_tensor`` that keeps its context alive."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, SupportsInt, cast

import numpy as np
import numpy.typing as npt

from .._native import CData, cstr, ffi, lib
from ..checks import check_int
from ..errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    ClosedError,
    DTypeError,
    IndexRangeError,
    ShapeError,
)
from .dtypes import GGMLType
from .rpc import check_buffer

if TYPE_CHECKING:
    from .context import Context


def ne_of(shape: Iterable[SupportsInt]) -> tuple[int, int, int, int]:
    """numpy-order shape -> GGML ne (innermost first), padded to 4 dims."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise ArgumentTypeError(f"a shape must be a sequence of ints, got {shape!r} of type {type(shape).__name__}")
    # negative sizes are the callers' to refuse (with their own words); 2**62 keeps GGML's int64 sizes sane
    dims = tuple(check_int(s, "a shape's size", hi=2**62, error=ShapeError) for s in shape)
    if not 1 <= len(dims) <= 4:
        raise ShapeError(f"GGML tensors have 1 to 4 dimensions, got shape {dims}")
    return cast("tuple[int, int, int, int]", tuple(reversed(dims)) + (1,) * (4 - len(dims)))


def shape_of(ne: Sequence[int]) -> tuple[int, ...]:
    """GGML ne -> numpy-order shape, dropping trailing size-1 dims beyond the first."""
    n = 4
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return tuple(int(ne[i]) for i in reversed(range(n)))


class Tensor:
    """A tensor of a :class:`~ggml_hybrid.context.Context`.

    The context owns the memory of the tensor struct; this object only keeps the
    context alive. Shapes are given in numpy order (outermost first); ``ne`` is
    GGML's order (innermost first).
    """

    __slots__ = ("_p", "_ctx", "__weakref__")

    def __init__(self, ptr: CData, ctx: Context | BorrowedScope) -> None:
        self._p = ptr
        self._ctx = ctx

    @property
    def ptr(self) -> CData:
        if self._ctx.closed:
            # the struct (and its name) went with the context's memory: do not read it
            raise ClosedError("this tensor belongs to a closed context")
        return self._p

    @property
    def context(self) -> Context | BorrowedScope:
        return self._ctx

    @property
    def ne(self) -> tuple[int, int, int, int]:
        p = self.ptr
        return (p.ne[0], p.ne[1], p.ne[2], p.ne[3])

    @property
    def nb(self) -> tuple[int, int, int, int]:
        p = self.ptr
        return (p.nb[0], p.nb[1], p.nb[2], p.nb[3])

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.ne)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> GGMLType:
        return _TYPES[self.ptr.type]  # a dict lookup: GGMLType(value) costs microseconds per op

    @property
    def name(self) -> str:
        return cstr(self.ptr.name)

    @name.setter
    def name(self, value: str) -> None:
        raw = value.encode()
        if len(raw) >= lib.GGML_MAX_NAME:
            raise ArgumentError(f"tensor name {value!r} is longer than GGML's limit of {lib.GGML_MAX_NAME - 1} bytes")
        lib.ggml_set_name(self.ptr, raw)

    @property
    def op(self) -> str:
        return cstr(lib.ggml_op_desc(self.ptr))

    @property
    def nbytes(self) -> int:
        return int(lib.ggml_nbytes(self.ptr))

    @property
    def nelements(self) -> int:
        return int(lib.ggml_nelements(self.ptr))

    @property
    def is_contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self.ptr))

    @property
    def is_view(self) -> bool:
        return bool(self.ptr.view_src != ffi.NULL)

    @property
    def is_allocated(self) -> bool:
        return bool(self.ptr.data != ffi.NULL)

    @property
    def is_host(self) -> bool:
        """Whether the data is addressable from the CPU (False when unallocated)."""
        p = self.ptr
        buf = _buffer_of(p)
        if buf == ffi.NULL:
            return bool(p.data != ffi.NULL)  # context-allocated memory
        return bool(lib.ggml_backend_buffer_is_host(buf))

    @property
    def src(self) -> list[Tensor]:
        p = self.ptr
        return [Tensor(p.src[i], self._ctx) for i in range(lib.GGML_MAX_SRC) if p.src[i] != ffi.NULL]

    def set_input(self) -> Tensor:
        lib.ggml_set_input(self.ptr)
        return self

    def set_output(self) -> Tensor:
        lib.ggml_set_output(self.ptr)
        return self

    def set_param(self) -> Tensor:
        """Mark a leaf as a trainable parameter: :meth:`Graph.backward` computes the loss's gradient for it, and an
        optimizer step updates it (``ggml_set_param``). F32 leaves with memory of their own (a weights context)."""
        p = self.ptr
        if p.op != lib.GGML_OP_NONE or self.is_view:
            raise ArgumentError(f"set_param: {self!r} is computed by an op or is a view; only leaves (tensors made by "
                                "new_tensor) are parameters")
        if self.dtype != GGMLType.F32:
            raise DTypeError(f"set_param: {self!r} must be F32 (the gradients and optimizer states are F32)")
        lib.ggml_set_param(p)
        return self

    @property
    def is_param(self) -> bool:
        return bool(self.ptr.flags & lib.GGML_TENSOR_FLAG_PARAM)

    def set_loss(self) -> Tensor:
        """Mark a one-value F32 node as the loss a backward pass differentiates (``ggml_set_loss``)."""
        if self.nelements != 1 or self.dtype != GGMLType.F32:
            raise ShapeError(f"set_loss: a loss is one F32 value, got {self!r}")
        lib.ggml_set_loss(self.ptr)
        return self

    # -- numpy/PyTorch-style operators: nodes in this tensor's context ------------------------------

    def __len__(self) -> int:
        return self.shape[0]

    def __bool__(self) -> bool:
        return True  # a tensor is an object, not its data: len() == 0 must not make it false

    def _ops(self, op: str, *others: object) -> Context:
        """The context the operator builds in: this tensor's, which every operand must share."""
        ctx = self._ctx
        if isinstance(ctx, BorrowedScope):
            raise ArgumentError(f"{op}: {self!r} belongs to GGML (a scheduler copy or a region argument), not to a "
                                "Context; operators build nodes in the operands' context")
        for o in others:
            if isinstance(o, Tensor) and o._ctx is not ctx:
                raise ArgumentError(f"{op}: {self!r} and {o!r} belong to different contexts; operators need tensors "
                                    "of one context")
        return ctx

    def _broadcast(self, op: str, other: Tensor, commutative: bool) -> tuple[Tensor, Tensor]:
        # GGML broadcasts the second operand into the first; numpy broadcasts either way
        if can_repeat(other, self):
            return self, other
        if commutative and can_repeat(self, other):
            return other, self
        raise ShapeError(f"{op}: shapes {self.shape} and {other.shape} do not broadcast (GGML repeats the second "
                         "operand: each of its sizes must divide the first's)")

    def __add__(self, other: object) -> Tensor:
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self._broadcast("a + b", other, True)
        return self._ops("a + b", other).add(a, b)

    def __sub__(self, other: object) -> Tensor:
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self._broadcast("a - b", other, False)
        return self._ops("a - b", other).sub(a, b)

    def __mul__(self, other: object) -> Tensor:
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            return self._ops("a * s").scale(self, float(other))
        if not isinstance(other, Tensor):
            return NotImplemented
        a, b = self._broadcast("a * b", other, True)
        return self._ops("a * b", other).mul(a, b)

    def __rmul__(self, other: object) -> Tensor:
        return self.__mul__(other)

    def __neg__(self) -> Tensor:
        return self._ops("-a").neg(self)

    def __matmul__(self, other: object) -> Tensor:
        """``a @ b`` as numpy: a [.., m, k] @ b [.., k, n] -> [.., m, n] (F32).

        GGML's matmul takes its second factor transposed; ``a @ w.mT`` (``w.T`` in 2-D), the usual
        product with a weight stored [n, k], uses ``w`` as it is, and any other ``b`` is made
        contiguous transposed first.
        """
        if not isinstance(other, Tensor):
            return NotImplemented
        ctx = self._ops("a @ b", other)
        if self.shape[-1:] != other.shape[-2:-1]:
            raise ShapeError(f"a @ b: shapes {self.shape} and {other.shape} do not multiply (a's last size must equal "
                             "b's second to last)")
        p = other.ptr
        if p.op == lib.GGML_OP_TRANSPOSE and p.src[0] != ffi.NULL:
            weights = Tensor(p.src[0], other._ctx)  # b is w.mT: multiply by w directly
        else:
            weights = ctx.cont(ctx.transpose(other))
        return ctx.mul_mat(weights, self)

    @property
    def mT(self) -> Tensor:
        """The two innermost axes swapped, as a view (numpy/PyTorch ``.mT``)."""
        return self._ops("a.mT").transpose(self)

    @property
    def T(self) -> Tensor:
        """The transpose of a 1-D or 2-D tensor, as a view (``.mT`` swaps the innermost two of more)."""
        if self.ndim > 2:
            raise ShapeError(f"a.T: {self!r} has {self.ndim} dimensions; numpy's .T would reverse them all, which "
                             "GGML cannot view; use .mT (the two innermost) or permute()")
        return self.mT

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """``a.reshape(2, -1)`` or ``a.reshape((2, -1))``: a view with a new numpy-order shape."""
        dims = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return self._ops("reshape").reshape(self, cast("Sequence[int]", dims))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tensor) and bool(self._p == other._p)

    def __hash__(self) -> int:
        return hash(int(ffi.cast("uintptr_t", self._p)))

    def __repr__(self) -> str:
        if self._ctx.closed:
            return "<Tensor (closed context)>"
        return f"<Tensor {self.name!r} {self.dtype.name} shape={self.shape} op={self.op}>"

    # -- data -----------------------------------------------------------------

    def _require_data(self, what: str) -> None:
        if not self.is_allocated:
            raise BackendError(f"{what}: tensor {self.name!r} has no memory yet "
                               "(allocate its context in a backend buffer, or compute the graph first)")

    def set(self, array: npt.ArrayLike) -> Tensor:
        """Copy a numpy array into the tensor (any backend).

        Plain types take an array of the matching dtype and shape; quantized
        types take the raw bytes as a uint8 array of exactly ``nbytes``.
        """
        self._require_data("Tensor.set")
        if not self.is_contiguous:
            raise ShapeError(f"Tensor.set: tensor {self.name!r} is not contiguous; set its base tensor instead")
        arr = np.asarray(array)
        dt = self.dtype
        if dt.is_quantized:
            if arr.dtype != np.uint8 or arr.nbytes != self.nbytes:
                raise DTypeError(f"Tensor.set: {dt.name} tensor {self.name!r} takes {self.nbytes} raw bytes as uint8, "
                                 f"got {arr.dtype} with {arr.nbytes} bytes (use quantize() to make them)")
        else:
            if arr.dtype != dt.numpy_dtype:
                raise DTypeError(f"Tensor.set: {dt.name} tensor {self.name!r} takes dtype {dt.numpy_dtype}, "
                                 f"got {arr.dtype}")
            if ne_of(arr.shape if arr.ndim else (1,)) != self.ne:
                raise ShapeError(f"Tensor.set: array shape {arr.shape} does not match tensor {self.name!r} "
                                 f"shape {self.shape}")
            self._ctx._check_index_data(self, arr)
        arr = np.ascontiguousarray(arr)
        self._ctx._mark_set(self)
        p = self.ptr
        if _buffer_of(p) == ffi.NULL:
            ffi.memmove(p.data, ffi.from_buffer(arr), arr.nbytes)  # memory of a data-owning context
        else:
            lib.ggml_backend_tensor_set(p, ffi.from_buffer(arr), 0, arr.nbytes)
        return self

    def _set_trusted(self, arr: np.ndarray) -> None:
        """:meth:`set` without its checks, for graph inputs the library built itself.

        The caller guarantees a C-contiguous array of the tensor's dtype, shape and
        index range, and that the tensor is allocated in a backend buffer.
        """
        p = self.ptr
        if p.buffer == ffi.NULL:  # GGML would abort
            self._require_data("Tensor._set_trusted")
            raise BackendError(f"Tensor._set_trusted: tensor {self.name!r} is not in a backend buffer")
        self._ctx._mark_set(self)
        lib.ggml_backend_tensor_set(p, ffi.from_buffer(arr), 0, arr.nbytes)

    def reader(self) -> Callable[[], np.ndarray]:
        """For a contiguous, readable result of plain type that the library reads after every compute (the
        logits): a function that returns a copy as :meth:`numpy` does, with the dtype, shape and size taken
        now. Each call still refuses a tensor without memory and a lost RPC server's zeros, and leaves anything
        unusual (host memory of a data-owning context, a buffer that cannot be read back) to :meth:`numpy`."""
        dt = self.dtype
        if dt.is_quantized or not self.is_contiguous:
            raise ShapeError(f"Tensor.reader: tensor {self.name!r} is quantized or not contiguous; use numpy()")
        p, shape, np_dtype, nbytes = self.ptr, self.shape, dt.numpy_dtype, self.nbytes

        def read() -> np.ndarray:
            buf = _buffer_of(p)
            if buf == ffi.NULL or not lib.hy_buffer_readable(buf):
                return self.numpy()  # says why, or reads the data the way numpy() does
            out = np.empty(shape, np_dtype)
            lib.ggml_backend_tensor_get(p, ffi.from_buffer(out), 0, nbytes)
            check_buffer(buf)  # from a lost RPC server the data reads as zeros
            return out

        return read

    def numpy(self) -> np.ndarray:
        """A copy of the data as numpy (uint8 raw bytes for quantized types)."""
        self._require_data("Tensor.numpy")
        dt = self.dtype
        if not self.is_contiguous:
            if not self.is_host:
                raise ShapeError(f"Tensor.numpy: tensor {self.name!r} is a non-contiguous view on a device; "
                                 "make it contiguous with cont() in the graph")
            return cast("np.ndarray", self.view_numpy().copy())  # numpy types copy() as Any
        p = self.ptr
        buf = _buffer_of(p)
        if buf != ffi.NULL and not lib.hy_buffer_readable(buf):
            raise BackendError(f"Tensor.numpy: tensor {self.name!r} lives in a "
                               f"{cstr(lib.ggml_backend_buffer_name(buf))} buffer: its weights were repacked for "
                               "GGML's CPU kernels and cannot be read back (load it with repack=false to read it)")
        out = np.empty(self.nbytes if dt.is_quantized else self.shape,
                       dtype=np.uint8 if dt.is_quantized else dt.numpy_dtype)
        if buf == ffi.NULL:
            ffi.memmove(ffi.from_buffer(out), p.data, out.nbytes)
        else:
            lib.ggml_backend_tensor_get(p, ffi.from_buffer(out), 0, out.nbytes)
            check_buffer(buf)  # from a lost RPC server the data reads as zeros
        return out

    def view_numpy(self, writable: bool = True) -> np.ndarray:
        """A zero-copy numpy view of host data; the array keeps this tensor's memory alive,
        even across ``close()`` of its context. Views of index tensors (row or expert ids)
        are read-only: writes must go through :meth:`set`, which checks the range."""
        self._require_data("Tensor.view_numpy")
        writable = writable and not self._ctx._has_index_bound(self)
        if not self.is_host:
            raise BackendError(f"Tensor.view_numpy: tensor {self.name!r} lives in device memory; use numpy()")
        dt = self.dtype
        if dt.is_quantized:
            if not self.is_contiguous:
                raise ShapeError(f"Tensor.view_numpy: quantized tensor {self.name!r} is not contiguous")
            return np.asarray(_ArrayView(self, (self.nbytes,), (1,), "|u1", writable))
        shape = self.shape
        strides = tuple(self.nb[i] for i in reversed(range(len(shape))))
        return np.asarray(_ArrayView(self, shape, strides, dt.numpy_dtype.str, writable))


_TYPES = {int(t): t for t in GGMLType}


def can_repeat(b: Tensor, a: Tensor) -> bool:
    """GGML broadcasting (``ggml_can_repeat``): every dim of b divides the same dim of a."""
    return all(bn > 0 and an % bn == 0 for an, bn in zip(a.ne, b.ne)) if b.nelements else a.nelements == 0


class BorrowedScope:
    """Stands in for the owning context of tensors that belong to GGML (a scheduler's
    copies, a region call's arguments): valid until ``closed`` is set."""

    closed = False

    def _check_index_data(self, t: Tensor, arr: np.ndarray) -> None:
        pass

    def _has_index_bound(self, t: Tensor) -> bool:
        return False

    def _track_view(self, view: _ArrayView) -> None:
        pass

    def _mark_set(self, t: Tensor) -> None:
        pass


def _buffer_of(p: CData) -> CData:
    # GGML's own rule: a view's memory belongs to the buffer of its source
    buf: CData = p.view_src.buffer if p.view_src != ffi.NULL else p.buffer
    return buf


class _ArrayView:
    """Exposes tensor memory through ``__array_interface__``; numpy keeps it as ``.base``."""

    __slots__ = ("tensor", "__array_interface__", "__weakref__")

    def __init__(self, tensor: Tensor, shape: Iterable[int], strides: Iterable[int], typestr: str,
                 writable: bool) -> None:
        self.tensor = tensor
        tensor._ctx._track_view(self)
        addr = int(ffi.cast("uintptr_t", tensor.ptr.data))
        self.__array_interface__ = {"version": 3, "shape": tuple(shape), "strides": tuple(strides),
                                    "typestr": typestr, "data": (addr, not writable)}


def check_indices(op: str, name: str, arr: np.ndarray, bound: int) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= bound):
        bad = arr[(arr < 0) | (arr >= bound)].ravel()[0]
        raise IndexRangeError(f"{op}: index tensor {name!r} holds {int(bad)}, outside 0..{bound - 1} "
                              f"(the number of rows it selects from)")
