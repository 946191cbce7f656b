"""Computation graphs."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from .._native import CData, ffi, lib
from .._native.status import check_status
from ..checks import check_int, check_real
from ..errors import AllocationError, BackendError, GradientError, IndexRangeError
from . import autograd, graph_view, index_errors
from .dtypes import GGMLType
from .tensor import Tensor, _buffer_of

if TYPE_CHECKING:
    from .backend import Backend
    from .context import Context
    from .sched import Scheduler

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

    def __init__(self, ctx: Context, size: int = 2048, grads: bool = False) -> None:
        """``grads``: the graph can hold gradients (:meth:`backward`)."""
        check_int(size, "Graph: size", 1)
        need = lib.ggml_graph_overhead_custom(size, bool(grads)) + 64
        if ctx.used + need > ctx.mem_size:
            raise AllocationError(f"Graph: a {size}-node graph needs {need} bytes but the context has "
                                  f"{ctx.mem_size - ctx.used} left; create the Context with graph_size={size}"
                                  + (" and grads=True" if grads else ""))
        self._ctx = ctx
        self.size = size
        self.grads = bool(grads)
        self._loss_grad: Tensor | None = None  # the loss's gradient seed (1) once backward() ran
        self._p = lib.ggml_new_graph_custom(ctx.ptr, size, bool(grads))
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

    # -- gradients ----------------------------------------------------------------------------------------------

    def backward(self, loss: Tensor) -> Graph:
        """Add the backward pass: the gradient of ``loss`` (one F32 value, a node of this graph) with respect to
        every parameter (:meth:`Tensor.set_param`) it depends on (``ggml_build_backward_expand``).

        An op on the way that GGML cannot differentiate is refused by name (:class:`GradientError`) before GGML
        would abort. Before each compute, :meth:`seed` the loss's gradient; read gradients with :meth:`grad`.
        """
        if self._loss_grad is not None:
            raise GradientError("Graph.backward: this graph has its backward pass already")
        params = autograd.check_backward(self, loss)
        extra = autograd.room_needed(self)
        used = lib.ggml_graph_n_nodes(self.ptr) + lib.hy_graph_n_leafs(self.ptr)
        if used + 2 * extra > self.size:
            raise GradientError(f"Graph.backward: the backward pass may add {2 * extra} nodes and leafs to the "
                                f"{used} of this graph of {self.size}; create a graph of size >= {used + 2 * extra}")
        self._ctx._reserve("Graph.backward", extra)
        lib.ggml_set_loss(loss.ptr)
        lib.ggml_set_output(loss.ptr)  # readable after the compute
        lib.ggml_build_backward_expand(self._ctx.ptr, self.ptr, ffi.NULL)
        seed = lib.ggml_graph_get_grad_acc(self.ptr, loss.ptr)
        self._loss_grad = Tensor(seed, self._ctx)
        self._loss_grad.name = "loss gradient seed"
        self._loss_grad.set_input()
        for p in params:  # kept after the compute (the allocator may reuse what no one reads)
            g = lib.ggml_graph_get_grad(self.ptr, p)
            if g != ffi.NULL:
                lib.ggml_set_output(g)
        self._checked_for.clear()
        self.version += 1
        return self

    def seed(self, value: float = 1.0) -> None:
        """Set the loss's own gradient (1: the gradients are d loss / d parameter) after the graph is allocated,
        before each compute (an input like any other: a compute consumes it)."""
        if self._loss_grad is None:
            raise GradientError("Graph.seed: the graph has no backward pass; call backward(loss) first")
        if not self.contains(self._loss_grad):
            return  # no parameter's gradient reads it (each depends on the loss through piecewise-constant ops)
        self._loss_grad.set(np.array([check_real(value, "Graph.seed: value")], np.float32).reshape(
            self._loss_grad.shape))

    def grad(self, t: Tensor) -> Tensor | None:
        """The gradient node of ``t`` (a parameter, or any node on the way), or None where the loss does not depend
        on it; read it with ``numpy()`` after a compute."""
        if self._loss_grad is None:
            raise GradientError("Graph.grad: the graph has no backward pass; call backward(loss) first")
        g = lib.ggml_graph_get_grad(self.ptr, t.ptr)
        return None if g == ffi.NULL else Tensor(g, self._ctx)

    # -- seeing it ---------------------------------------------------------------------------------------------

    def describe(self, sched: Scheduler | None = None) -> str:
        """The nodes as a table: op, numpy-order shape, type, the backend ``sched`` gave each (after its alloc),
        flags and sources (:mod:`.graph_view`)."""
        return graph_view.describe(self, sched)

    def __str__(self) -> str:
        return self.describe()

    def dot(self, path: str | os.PathLike[str] | None = None, forward: Graph | None = None) -> str:
        """GGML's dot text of the graph (``ggml_graph_dump_dot``), also written to ``path`` if given; render it with
        Graphviz. ``forward``: the forward part of a graph with gradients (coloured apart)."""
        return graph_view.dot(self, path, forward)

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
