"""GGML contexts: the arena that owns tensor structs (and, optionally, their data)."""

from __future__ import annotations

import mmap
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from .._native import CData, cstr, ffi, lib
from .._native.managed import Managed, check_closable
from .._native.status import check_status
from ..checks import check_int
from ..errors import AllocationError, ArgumentError, IndexRangeError, ShapeError
from .backend import Backend, Buffer
from .dtypes import GGMLTypeLike, as_ggml_type
from .graph import Graph, track_context
from .graph import all_contexts as _all_contexts
from .ops import OpsMixin
from .tensor import BorrowedScope, Tensor, check_indices, ne_of

if TYPE_CHECKING:
    from .tensor import _ArrayView

# Python < 3.13 does not export it; without it Linux counts the mapping against the commit limit
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)

def _owner_of(view: Tensor) -> Context | BorrowedScope:
    """The context of a view's base tensor: the view's own context when that is where the base lives."""
    base = view.ptr.view_src
    for ctx in _all_contexts():
        if not ctx.closed and ctx._holds(base):
            return ctx
    return view.context


DEFAULT_GRAPH_SIZE = 2048  # GGML_DEFAULT_GRAPH_SIZE

# ggml_new_object aligns every object; leave room for that padding per tensor
_ALIGN_SLACK = 64
_TENSOR_OVERHEAD = int(lib.ggml_tensor_overhead())  # a constant of the library: asked once, not per op


class Arena:
    """Host memory that contexts are built in one after another (at most one at a time)."""

    def __init__(self, size: int) -> None:
        self.size = check_int(size, "Arena: size", 1)
        self._mem = np.empty(self.size, np.uint8)
        self.in_use = False

    def claim(self, need: int) -> CData:
        if self.in_use:
            raise AllocationError("Arena.claim: the arena already holds a live context")
        if need > self.size:
            raise AllocationError(f"Arena.claim: a {need}-byte context does not fit the {self.size}-byte arena")
        self.in_use = True
        mem: CData = ffi.from_buffer(self._mem)
        return mem

    def release(self) -> None:
        self.in_use = False


def _freeing_into(arena: Arena) -> Callable[[CData], None]:
    def free(ptr: CData) -> None:
        lib.ggml_free(ptr)
        arena.release()
    return free


class Context(OpsMixin, Managed):
    """A GGML context.

    ``no_alloc=True`` (the default) makes tensor structs only: allocate their
    data in a backend buffer with :meth:`allocate`, or let a scheduler allocate
    graph nodes. ``no_alloc=False`` also reserves ``mem_size`` bytes of data in
    the context itself (host memory).
    """

    _kind = "context"

    def __init__(self, n_tensors: int = 1024, mem_size: int = 0, no_alloc: bool = True,
                 graph_size: int = 0, arena: Arena | None = None, grads: bool = False) -> None:
        """``arena``: build the context in this reusable host memory instead of allocating its own (graph
        builds repeated for ever, e.g. one per prompt length, must not churn the allocator). ``grads``: room for a
        graph with gradients (``new_graph(grads=True)``, :meth:`Graph.backward`)."""
        self.mem_size: int = Context.size_for(n_tensors, mem_size, graph_size, grads)
        self.graph_size = graph_size  # what new_graph() makes when given no size: the size is given once
        self.grads = bool(grads)
        mem_buffer = ffi.NULL
        if arena is not None:
            mem_buffer = arena.claim(self.mem_size)
        params = ffi.new("struct ggml_init_params *", {"mem_size": self.mem_size, "mem_buffer": mem_buffer,
                                                        "no_alloc": bool(no_alloc)})
        ptr = lib.ggml_init(params[0])
        if ptr == ffi.NULL:
            if arena is not None:
                arena.release()
            raise AllocationError(f"ggml_init failed for a {self.mem_size}-byte context")
        # ggml_free never frees a mem_buffer it was given: the arena is handed back after it
        super().__init__(ptr, lib.ggml_free if arena is None else _freeing_into(arena))
        self._arena = arena  # kept alive while GGML's structs live in it
        self._pool_base = lib.ggml_get_mem_buffer(ptr)
        self.no_alloc = bool(no_alloc)
        self._buffers: list[Buffer] = []  # owned: closed with the context
        self._keep: list[Buffer] = []  # shared (e.g. a mapped file's buffer): only kept alive
        self._views: weakref.WeakSet[_ArrayView] = weakref.WeakSet()  # live numpy views into this context's memory
        # index tensor -> (op, exclusive upper bound) for checking data set into it
        self._index_bounds: dict[int, tuple[str, int]] = {}
        # graph inputs set since the last compute that used them (GGML reuses input memory)
        self._fresh: set[int] = set()
        track_context(self)

    @staticmethod
    def size_for(n_tensors: int, mem_size: int = 0, graph_size: int = 0, grads: bool = False) -> int:
        """Bytes of context memory for ``n_tensors`` tensor structs, ``mem_size`` bytes of data and a graph (one
        that holds gradients with ``grads``)."""
        for name, v in (("n_tensors", n_tensors), ("mem_size", mem_size), ("graph_size", graph_size)):
            check_int(v, f"Context: {name}", 0)
        overhead = n_tensors * (lib.ggml_tensor_overhead() + _ALIGN_SLACK)
        if graph_size:
            overhead += lib.ggml_graph_overhead_custom(graph_size, bool(grads)) + _ALIGN_SLACK
        return int(overhead + mem_size)

    # -- pool accounting ------------------------------------------------------

    @property
    def used(self) -> int:
        return int(lib.ggml_used_mem(self.ptr))

    def _reserve(self, op: str, n_tensors: int, data_bytes: int = 0) -> None:
        need = n_tensors * (_TENSOR_OVERHEAD + _ALIGN_SLACK) + data_bytes
        if lib.ggml_used_mem(self.ptr) + need > self.mem_size:
            raise AllocationError(f"{op}: the context's pool is full ({self.used} of {self.mem_size} bytes used, "
                                  f"{need} more needed); create the Context with a larger n_tensors or mem_size")

    def _node(self, ptr: CData) -> Tensor:
        if ptr == ffi.NULL:
            raise AllocationError("GGML returned no tensor")
        return Tensor(ptr, self)

    def _bound_indices(self, op: str, idx: Tensor, bound: int) -> None:
        p = idx.ptr
        # data is set into the base tensor, so the bound is recorded there (GGML keeps view_src
        # pointing at the base, never at an intermediate view)
        base = p.view_src if p.view_src != ffi.NULL else p
        if base.op in (lib.GGML_OP_ARGSORT, lib.GGML_OP_TOP_K):
            # indices computed in the graph: their range is the row length they were sorted from
            reach = base.src[0].ne[0]
            if reach > bound:
                raise IndexRangeError(f"{op}: index tensor {idx.name!r} comes from "
                                      f"{ffi.string(lib.ggml_op_desc(base)).decode()} "
                                      f"over rows of {reach}, but selects from only {bound} rows")
            return
        # the tensors of an op belong to a Context (borrowed ones are never operands)
        owner = cast("Context", idx.context if base == p else _owner_of(idx))
        key = int(ffi.cast("uintptr_t", base))
        prev = owner._index_bounds.get(key)
        if prev is None or bound < prev[1]:
            owner._index_bounds[key] = (op, bound)
        # data already there (a constant) is checked now
        if base.data != ffi.NULL and idx.is_host:
            check_indices(op, idx.name, Tensor(base, owner).view_numpy(writable=False), bound)

    def _check_index_data(self, t: Tensor, arr: np.ndarray) -> None:
        bound = self._index_bounds.get(int(ffi.cast("uintptr_t", t.ptr)))
        if bound is not None:
            check_indices(bound[0], t.name, arr, bound[1])

    def _has_index_bound(self, t: Tensor) -> bool:
        return int(ffi.cast("uintptr_t", t.ptr)) in self._index_bounds

    def _holds(self, p: CData) -> bool:
        """Whether tensor struct ``p`` lives in this context's memory pool."""
        base = int(ffi.cast("uintptr_t", self._pool_base))
        return base <= int(ffi.cast("uintptr_t", p)) < base + self.mem_size

    def offset_of(self, t: Tensor) -> int:
        """Where tensor ``t``'s struct sits in this context's pool: creation order, comparable with ``used``."""
        if not self._holds(t.ptr):
            raise ArgumentError(f"offset_of: tensor {t.name!r} was not created in this context")
        return int(ffi.cast("uintptr_t", t.ptr)) - int(ffi.cast("uintptr_t", self._pool_base))

    def _mark_set(self, t: Tensor) -> None:
        self._fresh.add(int(ffi.cast("uintptr_t", t.ptr)))

    # -- tensors --------------------------------------------------------------

    def new_tensor(self, dtype: GGMLTypeLike, shape: Sequence[int], name: str | None = None) -> Tensor:
        """A new tensor of GGML type ``dtype`` (GGMLType, name or numpy dtype) and numpy-order ``shape``."""
        t = as_ggml_type(dtype)
        ne = ne_of(shape)
        if any(n < 0 for n in ne):
            raise ShapeError(f"new_tensor: negative size in shape {tuple(shape)}")
        if ne[0] % t.block_size:
            raise ShapeError(f"new_tensor: {t.name} rows must be a multiple of {t.block_size} elements, "
                             f"shape {tuple(shape)} has rows of {ne[0]}")
        nbytes = t.row_size(ne[0]) * ne[1] * ne[2] * ne[3]
        self._reserve("new_tensor", 1, 0 if self.no_alloc else nbytes)
        arr = ffi.new("int64_t[4]", list(ne))
        tensor = self._node(lib.ggml_new_tensor(self.ptr, t, len(tuple(shape)), arr))
        if name is not None:
            tensor.name = name
        return tensor

    def tensor(self, array: npt.ArrayLike, name: str | None = None, dtype: GGMLTypeLike | None = None) -> Tensor:
        """A new tensor shaped like ``array``; its data is set now when the context owns data."""
        arr = np.asarray(array)
        t = self.new_tensor(dtype if dtype is not None else arr.dtype, arr.shape or (1,), name)
        if not self.no_alloc:
            t.set(arr)
        return t

    def tensors(self) -> list[Tensor]:
        out, p = [], lib.ggml_get_first_tensor(self.ptr)
        while p != ffi.NULL:
            out.append(Tensor(p, self))
            p = lib.ggml_get_next_tensor(self.ptr, p)
        return out

    def get(self, name: str) -> Tensor:
        p = lib.ggml_get_tensor(self.ptr, name.encode())
        if p == ffi.NULL:
            raise ArgumentError(f"Context.get: no tensor named {name!r} in this context")
        return Tensor(p, self)

    # -- allocation -----------------------------------------------------------

    def allocate(self, backend: Backend, usage: str = "any", virtual: bool = False) -> Buffer:
        """Allocate every unallocated tensor of this context in one buffer of ``backend``.

        The buffer is owned by the context (and so kept alive by its tensors);
        it is also returned for inspection. ``virtual=True`` (planning) gives a buffer
        of the same size and layout over reserved, never-committed host memory, so
        that sizes can be measured for more memory than the machine has; its
        tensors must not be read or computed.
        """
        if not self.no_alloc:
            raise AllocationError("Context.allocate: this context owns its data already (no_alloc=False)")
        if virtual:
            return self._allocate_virtual(backend, usage)
        ptr = lib.ggml_backend_alloc_ctx_tensors(self.ptr, backend.ptr)
        if ptr == ffi.NULL:
            pending = [t for t in self.tensors() if not t.is_allocated and not t.is_view and t.nbytes]
            if not pending:
                raise AllocationError("Context.allocate: nothing to allocate (every tensor has memory or is empty)")
            raise AllocationError(f"Context.allocate: {backend.name} could not allocate "
                                  f"{sum(t.nbytes for t in pending)} bytes")
        buf = Buffer(ptr, backend)
        if usage != "any":
            buf.set_usage(usage)
        self._buffers.append(buf)
        return buf

    def _allocate_virtual(self, backend: Backend, usage: str) -> Buffer:
        buft = lib.ggml_backend_get_default_buffer_type(backend.ptr)
        size = int(lib.ggml_backend_alloc_ctx_tensors_from_buft_size(self.ptr, buft))
        if size == 0:
            raise AllocationError("Context.allocate: nothing to allocate (every tensor has memory or is empty)")
        align = int(lib.ggml_backend_buft_get_alignment(buft))
        # address space only: no page is committed unless written, and nothing here writes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        mem = mmap.mmap(-1, size, flags=flags)
        buf = Buffer.from_host_memory(np.frombuffer(mem, np.uint8), usage if usage != "any" else "weights")
        if usage == "any":
            buf.set_usage("any")
        self._place_all(buf, buft, align)
        self._buffers.append(buf)
        return buf

    def bytes_needed(self, backend: Backend) -> int:
        """Bytes a buffer of ``backend`` needs for this context's unallocated tensors (alignment included)."""
        buft = lib.ggml_backend_get_default_buffer_type(backend.ptr)
        return int(lib.ggml_backend_alloc_ctx_tensors_from_buft_size(self.ptr, buft))

    def allocate_group(self, tensors: Sequence[Tensor], buffer_type: CData, usage: str = "any",
                       virtual: bool = False) -> Buffer:
        """Allocate ``tensors`` (unallocated tensors of this context) in one new buffer of ``buffer_type``,
        such as a CPU extra buffer type (:mod:`.repack`); the rest of the context is left unallocated.

        The buffer is owned by the context, as :meth:`allocate`'s is; ``virtual`` as there.
        """
        if not self.no_alloc:
            raise AllocationError("Context.allocate_group: this context owns its data already (no_alloc=False)")
        for t in tensors:
            if not self._holds(t.ptr) or t.is_allocated or t.is_view:
                raise AllocationError(f"Context.allocate_group: tensor {t.name!r} is not an unallocated tensor of "
                                      "this context")
        align = int(lib.ggml_backend_buft_get_alignment(buffer_type))
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            size += -(-int(lib.ggml_backend_buft_get_alloc_size(buffer_type, t.ptr)) // align) * align
        if size == 0:
            raise AllocationError("Context.allocate_group: nothing to allocate (no tensors, or only empty ones)")
        if virtual:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            buf = Buffer.from_host_memory(np.frombuffer(mmap.mmap(-1, size, flags=flags), np.uint8), "weights")
        else:
            ptr = lib.ggml_backend_buft_alloc_buffer(buffer_type, size)
            if ptr == ffi.NULL:
                raise AllocationError(f"Context.allocate_group: could not allocate {size} bytes of "
                                      f"{cstr(lib.ggml_backend_buft_name(buffer_type))}")
            buf = Buffer(ptr)
        self._buffers.append(buf)
        for t, off in zip(tensors, offsets):
            buf.place(t, off)
        buf.set_usage(usage)
        return buf

    def allocate_in(self, buffer: Buffer) -> None:
        """Give every unallocated tensor memory in ``buffer`` (not owned: contexts may share it, e.g. graphs
        that never compute at the same time), laid out from its start as :meth:`allocate` would."""
        buft = lib.ggml_backend_buffer_get_type(buffer.ptr)
        need = int(lib.ggml_backend_alloc_ctx_tensors_from_buft_size(self.ptr, buft))
        if need > buffer.size:
            raise AllocationError(f"Context.allocate_in: the tensors need {need} bytes, the buffer has {buffer.size}")
        self._place_all(buffer, buft, int(lib.ggml_backend_buft_get_alignment(buft)))

    def _place_all(self, buf: Buffer, buft: CData, align: int) -> None:
        offset = 0
        views = []
        for t in self.tensors():
            p = t.ptr
            if p.view_src != ffi.NULL:
                views.append(p)
            if p.data != ffi.NULL or p.view_src != ffi.NULL:
                continue
            buf.place(t, offset)
            need = int(lib.ggml_backend_buft_get_alloc_size(buft, p))
            offset += -(-need // align) * align
        for p in views:  # a view's memory is its source's, known only now (as ggml_backend_alloc_ctx_tensors does)
            if p.buffer == ffi.NULL and p.view_src.buffer != ffi.NULL:
                check_status(lib.ggml_backend_view_init(p), "Context: initialising a view", AllocationError)

    def _track_view(self, view: _ArrayView) -> None:
        self._views.add(view)

    def close(self) -> None:
        """Close the context; memory that numpy views still point into is freed with the last view."""
        if self.closed:
            return
        check_closable(self)
        views = list(self._views)
        release = self._release_memory
        if not views:
            self._ptr = None
            release()
            return
        self._ptr = None  # closed for the API now; the memory waits for the views
        remaining = [len(views)]

        def one_gone() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                release()

        for v in views:
            weakref.finalize(v, one_gone)

    def _release_memory(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        # the context is gone, so nothing can reference these buffers' memory any more
        for b in self._buffers:
            b.close()
        self._buffers.clear()
        # nor the shared ones: they go with their last user now, not whenever this object does (a
        # traceback may hold it), and a buffer on an RPC server holds that server's connection
        self._keep.clear()

    def new_graph(self, size: int | None = None, grads: bool | None = None) -> Graph:
        """A graph of ``size`` nodes; by default the context's ``graph_size`` (else 2048, if the pool has room).
        ``grads`` (default: the context's): the graph holds gradients (:meth:`Graph.backward`)."""
        return Graph(self, size if size is not None else (self.graph_size or DEFAULT_GRAPH_SIZE),
                     self.grads if grads is None else grads)
