"""Computation graphs."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from .._native import CData, ffi, lib
from .._native.status import check_status
from ..checks import check_int
from ..errors import AllocationError, BackendError, IndexRangeError
from . import index_errors
from .dtypes import GGMLType
from .tensor import Tensor, _buffer_of

if TYPE_CHECKING:
    from .backend import Backend
    from .context import Context

_contexts: weakref.WeakSet[Context] = weakref.WeakSet()
# sessions in several threads create contexts while another thread lists them: a WeakSet defers the
# removals its collector makes during a listing, but an addition would change it under the listing
_contexts_lock = threading.Lock()


def track_context(ctx: Context) -> None:
    with _contexts_lock:
        _contexts.add(ctx)


def all_contexts() -> list[Context]:
    with _contexts_lock:
        return list(_contexts)


def live_pools() -> list[int]:
    """[start, end) address pairs of every open context's memory pool (where its tensor structs live)."""
    out = []
    for c in all_contexts():
        if not c.closed:
            base = int(ffi.cast("uintptr_t", c._pool_base))
            out += [base, base + c.mem_size]
    return out


def _tensor_upper_bound() -> int:
    """More than the number of tensors alive in every context (each takes at least one overhead)."""
    overhead = lib.ggml_tensor_overhead()
    return sum(c.used // overhead + 1 for c in all_contexts() if not c.closed)


# GGML's CPU computes products of these weight types with tiled kernels from this many rows of the second
# operand (per expert in mul_mat_id), and with the one-row path below (ggml-cpu/tiled/tiled.cpp:
# ggml_tiled_min_batch and its type list); rows of an unmarked product are bit-identical to one-row products only
# below the threshold
TILED_MIN_ROWS = 8
# GGML's repacked CPU products (ggml-cpu/repack.cpp forward_mul_mat) take gemm from this many rows, gemv below;
# those of this extra buffer type take gemv for every row of a rowwise product (patch 0006)
REPACK_GEMM_MIN_ROWS = 4
ROWWISE_REPACK_TYPE = "CPU_REPACK"
# GGML's Vulkan matrix products take their mat-vec kernels up to this many rows of the second operand (token rows
# of a mul_mat_id: ggml-vulkan's mul_mat_vec_max_cols and ggml_vk_use_mul_mat_vec_id), a tiled kernel above that
# rounds its operands to F16: a row's result among more rows is then another number than alone (1e-3 relative)
VULKAN_MAT_VEC_ROWS = 8
TILED_TYPES = frozenset({GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q2_K, GGMLType.IQ4_XS,
                         GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S,
                         GGMLType.IQ1_S, GGMLType.IQ1_M})


class Graph:
    """A GGML compute graph living in a context (which it keeps alive)."""

    def __init__(self, ctx: Context, size: int = 2048) -> None:
        check_int(size, "Graph: size", 1)
        need = lib.ggml_graph_overhead_custom(size, False) + 64
        if ctx.used + need > ctx.mem_size:
            raise AllocationError(f"Graph: a {size}-node graph needs {need} bytes but the context has "
                                  f"{ctx.mem_size - ctx.used} left; create the Context with graph_size={size}")
        self._ctx = ctx
        self.size = size
        self._p = lib.ggml_new_graph_custom(ctx.ptr, size, False)
        self._checked_for: set[int] = set()  # backends whose support was verified, by sched pointer
        self._inputs: tuple[int, list[Tensor]] | None = None
        # (version, input_marks, per context of the inputs: its set of freshly set inputs and this graph's keys)
        self._input_marks: tuple[int, list[tuple[set[int], int, str]], list[tuple[set[int], set[int]]]] | None = None
        self.version = 0  # bumped by expand(), so a scheduler knows to split again
        self._alloc_token = 0  # bumped whenever a scheduler (re)allocates this graph

    @property
    def ptr(self) -> CData:
        _ = self._ctx.ptr  # raises once the context is closed
        return self._p

    @property
    def context(self) -> Context:
        return self._ctx

    @property
    def n_nodes(self) -> int:
        return int(lib.ggml_graph_n_nodes(self.ptr))

    @property
    def n_leafs(self) -> int:
        return int(lib.hy_graph_n_leafs(self.ptr))

    def node(self, i: int) -> Tensor:
        n = self.n_nodes
        if not -n <= i < n:
            raise IndexRangeError(f"graph node {i} out of range (graph has {n} nodes)")
        return Tensor(lib.ggml_graph_node(self.ptr, i), self._ctx)

    @property
    def nodes(self) -> list[Tensor]:
        p = self.ptr
        return [Tensor(lib.ggml_graph_node(p, i), self._ctx) for i in range(lib.ggml_graph_n_nodes(p))]

    @property
    def leafs(self) -> list[Tensor]:
        p = self.ptr
        return [Tensor(lib.hy_graph_leaf(p, i), self._ctx) for i in range(lib.hy_graph_n_leafs(p))]

    @property
    def inputs(self) -> list[Tensor]:
        """Leafs flagged as inputs (set_input()): the scheduler allocates them, you set them."""
        if self._inputs is None or self._inputs[0] != self.version:
            flag = lib.GGML_TENSOR_FLAG_INPUT
            self._inputs = (self.version, [t for t in self.leafs if t.ptr.flags & flag])
        return self._inputs[1]

    @property
    def input_marks(self) -> list[tuple[set[int], int, str]]:
        """For each input: the set of its context's freshly set inputs, its key there, its name (the
        scheduler's check that every input was set since the last compute, without a lookup per input)."""
        return self._marks()[1]

    def consume_inputs(self) -> None:
        """Forget that the inputs were set (a compute consumed them): the next compute needs them set again."""
        for fresh, keys in self._marks()[2]:
            if fresh:
                fresh -= keys

    def _marks(self) -> tuple[int, list[tuple[set[int], int, str]], list[tuple[set[int], set[int]]]]:
        if self._input_marks is None or self._input_marks[0] != self.version:
            # graph inputs belong to a Context
            marks = [(cast("Context", t.context)._fresh, int(ffi.cast("uintptr_t", t.ptr)), t.name or "<unnamed>")
                     for t in self.inputs]
            by_set: dict[int, tuple[set[int], set[int]]] = {}
            for fresh, key, _ in marks:
                by_set.setdefault(id(fresh), (fresh, set()))[1].add(key)
            self._input_marks = (self.version, marks, list(by_set.values()))
        return self._input_marks

    def contains(self, t: Tensor) -> bool:
        return bool(lib.hy_graph_contains(self.ptr, t.ptr))

    def expand(self, *tensors: Tensor) -> Graph:
        """Add the tensors and everything they depend on (ggml_build_forward_expand)."""
        p = self.ptr
        for t in tensors:
            tp = t.ptr
            # GGML aborts when a graph overflows; count what the expansion would add first,
            # unless even every live tensor would fit
            used = lib.ggml_graph_n_nodes(p) + lib.hy_graph_n_leafs(p)
            if used + _tensor_upper_bound() > self.size:
                new = self._count_new(tp)
                if used + new > self.size:
                    raise AllocationError(f"Graph.expand: adding {t.name or 'the tensor'!r} needs {new} more "
                                          f"nodes/leafs but the graph holds {used} of {self.size}; "
                                          "create a larger graph")
            lib.ggml_build_forward_expand(p, tp)
            self._checked_for.clear()
            self.version += 1
        return self

    def _count_new(self, root: CData) -> int:
        seen, stack = set(), [root]
        while stack:
            t = stack.pop()
            key = int(ffi.cast("uintptr_t", t))
            if key in seen or lib.hy_graph_contains(self._p, t):
                continue
            seen.add(key)
            stack.extend(t.src[i] for i in range(lib.GGML_MAX_SRC) if t.src[i] != ffi.NULL)
        return len(seen)

    def set_rowwise(self) -> int:
        """Make every matrix product of the graph compute each row of its second operand as a product of
        that one row would: the CPU then never takes a kernel chosen by the number of rows (llamafile's
        sgemm from 2 rows, the tiled K-quant kernels from 8, the repacked gemm from 4), so a row's result does
        not depend on the rows batched with it. ``GGML_HINT_ROWWISE`` of our patch series (0005, and 0006 for
        repacked weights); products with another
        hint (the Hadamard rotation) keep theirs. Returns how many products were marked."""
        n = 0
        for node in self.nodes:
            p = node.ptr
            if p.op in (lib.GGML_OP_MUL_MAT, lib.GGML_OP_MUL_MAT_ID) and p.op_params[1] == lib.GGML_HINT_NONE:
                lib.ggml_mul_mat_set_hint(p, lib.GGML_HINT_ROWWISE)
                n += 1
        return n

    def check_supported(self, backends: Sequence[Backend], key: int) -> None:
        """Raise unless every node can run on at least one of ``backends`` (GGML would abort)."""
        if key in self._checked_for:
            return
        for node in self.nodes:
            p = node.ptr
            if p.op == lib.GGML_OP_NONE or p.view_src != ffi.NULL and p.op == lib.GGML_OP_VIEW:
                continue
            if not any(lib.ggml_backend_supports_op(b.ptr, p) for b in backends):
                raise BackendError(f"no backend among {[b.name for b in backends]} supports node "
                                   f"{node.name!r} (op {node.op}, {node.dtype.name}, shape {node.shape})")
        self._checked_for.add(key)

    def compute(self, backend: Backend) -> None:
        """Compute on one backend; every tensor must already have memory (e.g. a data-owning context)."""
        self.check_supported([backend], id(backend))
        for t in self.nodes + self.leafs:
            if t.ptr.data == ffi.NULL and _buffer_of(t.ptr) == ffi.NULL:
                raise BackendError(f"Graph.compute: tensor {t.name!r} has no memory; use a Scheduler to "
                                   "allocate graph nodes, or a Context(no_alloc=False)")
        status = lib.ggml_backend_graph_compute(backend.ptr, self.ptr)
        if status != lib.GGML_STATUS_SUCCESS:
            index_errors.raise_local([backend], self.ptr)  # an index out of range (vendor patch 0013)
        check_status(status, f"graph compute on {backend.name}")
        index_errors.raise_remote([backend])  # an RPC server's kernel met one (patch 0014)
