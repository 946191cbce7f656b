"""A thin owner of ``ggml_backend_sched``: multi-backend allocation and compute."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._native import CData, ffi, lib
from .._native.callbacks import escaped, take_escaped
from .._native.managed import Managed, check_closable, enter_compute, leave_compute
from .._native.status import check_status
from ..checks import check_int
from ..errors import AllocationError, ArgumentTypeError, BackendError, ClosedError, GgmlHybridError, RegionError
from . import index_errors
from .backend import Backend, user_buffers
from .context import Context
from .graph import Graph, live_pools
from .regions import NativeExecutor, Region, RegionCall, raise_region_status
from .rpc import raise_if_lost
from .step_io import StepIO
from .tensor import BorrowedScope, Tensor

if TYPE_CHECKING:
    from .context import Context


# the contexts of a graph's pinned tensors, and each (tensor, backend) as pointers
_Pinned = tuple[list["Context | BorrowedScope"], CData, CData, int]  # contexts, the tensors, their backends, n


class _Kept:
    """What :func:`_unalloc` keeps: the user buffers and the open contexts' pools, as native arrays, taken once for
    every graph a scheduler forgets in one allocation."""

    def __init__(self) -> None:
        keep = user_buffers()
        pools = live_pools()
        self.keep = ffi.new("ggml_backend_buffer_t[]", keep) if keep else ffi.NULL
        self.n_keep = len(keep)
        self.pools = ffi.new("uintptr_t[]", pools)
        self.n_pools = len(pools) // 2


def _unalloc(graph: Graph, kept: _Kept | None = None) -> int:
    """Forget the memory a scheduler gave ``graph``'s tensors, keeping user buffers' tensors (``kept``: taken now
    unless given).

    Returns how many of the graph's tensors belong to no open context (freed with theirs).
    """
    if graph.context.closed:
        return 0  # its tensors are gone with their context: nothing to touch
    k = _Kept() if kept is None else kept
    dangling = lib.hy_graph_unalloc(graph.ptr, k.keep, k.n_keep, k.pools, k.n_pools)
    graph._alloc_token += 1
    return int(dangling)


class Scheduler(Managed):
    """Schedules graphs over ``backends`` (highest priority first; the last must be a CPU backend).

    ``graph_size`` bounds the nodes plus leafs of any graph given to it.
    """

    _kind = "scheduler"

    def __init__(self, backends: list[Backend], graph_size: int = 2048, parallel: bool = False,
                 op_offload: bool = False) -> None:
        backends = list(backends)
        if not backends:
            raise BackendError("Scheduler: needs at least one backend")
        if not backends[-1].is_cpu:
            raise BackendError(f"Scheduler: the last backend must be the CPU, got {backends[-1].name}")
        if len({id(b) for b in backends}) != len(backends):
            raise BackendError("Scheduler: the same backend object is listed twice")
        check_int(graph_size, "Scheduler: graph_size", 1)
        arr = ffi.new("ggml_backend_t[]", [b.ptr for b in backends])
        ptr = lib.ggml_backend_sched_new(arr, ffi.NULL, len(backends), graph_size, bool(parallel), bool(op_offload))
        super().__init__(ptr, lib.ggml_backend_sched_free)
        self._backends = backends  # kept alive for as long as the scheduler
        self._remote = [b for b in backends if b.endpoint is not None]  # RPC devices, whose server may be lost
        self.graph_size = graph_size
        self._eval_fn: Callable[[Tensor, bool], object] | None = None
        self._eval_handle: CData | None = None
        self._pending_error: BaseException | None = None
        self._computing: Graph | None = None  # the graph of the compute in progress
        self._regions: list[Region] = []
        self._graphs: weakref.WeakSet[Graph] = weakref.WeakSet()  # graphs whose nodes live in our compute buffers
        self._handle = ffi.new_handle(self)  # user_data of region executors
        # (graph, version, allocation token) of the graph split and allocated last
        self._allocated: tuple[Graph, int, int] | None = None
        # graph -> the contexts of its pinned tensors and their (tensor, backend) pointers: assignments re-applied
        # whenever GGML's are reset (at each allocation: the pointers taken once, not per tensor and allocation)
        self._pins: weakref.WeakKeyDictionary[Graph, _Pinned] = weakref.WeakKeyDictionary()

    def _idle(self, op: str) -> None:
        """Scheduler state must not change under a running compute (from a region executor or eval callback)."""
        if self._computing:
            raise BackendError(f"Scheduler.{op}: called while this scheduler computes (from one of its region "
                               "executors or its eval callback); an executor runs its own graphs on its own "
                               "scheduler or backend, never on the one that called it")

    def blocks_close(self, obj: Managed) -> str | None:
        """Why ``obj`` must not be freed now: this scheduler is computing with it (else None)."""
        graph = self._computing
        if graph is None:
            return None
        if obj is self:
            return "the scheduler is computing (close it after compute() returns)"
        if any(obj is b for b in self._backends):
            return f"backend {obj} is in use by a scheduler that is computing"
        if isinstance(obj, Context):
            if graph.context is obj or any(obj._holds(t.ptr) for t in graph.leafs):
                return "tensors of this context are in a graph that a scheduler is computing"
        return None

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends)

    @property
    def n_splits(self) -> int:
        return int(lib.ggml_backend_sched_get_n_splits(self.ptr))

    @property
    def n_copies(self) -> int:
        return int(lib.ggml_backend_sched_get_n_copies(self.ptr))

    def buffer_size(self, backend: Backend) -> int:
        return int(lib.ggml_backend_sched_get_buffer_size(self.ptr, self._index_check(backend).ptr))

    def _index_check(self, backend: Backend) -> Backend:
        if not any(backend is b for b in self._backends):
            raise BackendError(f"backend {backend.name} is not one of this scheduler's "
                               f"{[b.name for b in self._backends]}")
        return backend

    def set_tensor_backend(self, tensor: Tensor, backend: Backend) -> None:
        lib.ggml_backend_sched_set_tensor_backend(self.ptr, tensor.ptr, self._index_check(backend).ptr)

    def tensor_backend(self, tensor: Tensor) -> Backend | None:
        p = lib.ggml_backend_sched_get_tensor_backend(self.ptr, tensor.ptr)
        return next((b for b in self._backends if b.ptr == p), None)

    def _check_graph(self, graph: Graph) -> None:
        total = graph.n_nodes + graph.n_leafs
        if total > self.graph_size:
            raise AllocationError(f"graph has {total} nodes+leafs but the scheduler was made for "
                                  f"graph_size={self.graph_size}")
        graph.check_supported(self._backends, id(self))
        bare = lib.hy_graph_bare_leaf(graph.ptr)  # the leafs scanned in one native call: this runs every alloc
        if bare >= 0:
            name = ffi.string(lib.hy_graph_leaf(graph.ptr, bare).name).decode(errors="replace")
            raise AllocationError(f"leaf {name!r} has no memory; allocate its context in a backend buffer "
                                  "(or mark it as an input with set_input())")

    def _check_inputs_set(self, graph: Graph) -> None:
        # GGML reuses the memory of graph inputs once their last consumer ran, so an input
        # holds garbage after a compute; stale expert or row ids would crash a kernel
        marks = graph.input_marks
        stale = [name for fresh, key, name in marks if key not in fresh]
        if stale:
            raise BackendError(f"graph inputs {stale} were not set since the last compute (or alloc); a compute "
                               "consumes its inputs, so set every input before each compute")
        graph.consume_inputs()

    def _forget_allocation(self, graph: Graph) -> None:
        # tensors a scheduler allocated point into its compute buffers, which may be freed
        # or reused by now; GGML would read those stale pointers while splitting
        kept = _Kept()
        if _unalloc(graph, kept):
            raise ClosedError("the graph uses tensors of a closed context (e.g. weights whose context was closed); "
                              "GGML would read freed memory")
        # the graphs this scheduler allocated before share (and may outgrow) the same buffers:
        # their tensors lose their memory now rather than point into reused or freed memory
        for other in list(self._graphs):
            if other is not graph:
                _unalloc(other, kept)
        self._graphs.add(graph)

    def set_pins(self, graph: Graph, pins: Iterable[tuple[Tensor, Backend]]) -> None:
        """Run each ``(node, backend)`` of ``graph`` on that backend, in every later alloc and reserve.

        GGML forgets tensor assignments on each reset; these are applied again after it.
        Needed where backends share a buffer type (CPU instances playing devices), in which
        case GGML would put every node on the first of them.
        """
        self._idle("set_pins")
        pins = [(t, self._index_check(b)) for t, b in pins]
        contexts = list({id(t.context): t.context for t, _ in pins}.values())
        # native arrays, applied in one call after each reset (a prompt's graph pins hundreds of nodes)
        self._pins[graph] = (contexts, ffi.new("struct ggml_tensor *[]", [t.ptr for t, _ in pins]),
                             ffi.new("ggml_backend_t[]", [b.ptr for _, b in pins]), len(pins))
        self._allocated = None

    def _apply_pins(self, graph: Graph) -> None:
        pinned = self._pins.get(graph)
        if pinned is None:
            return
        contexts, tensors, backends, n = pinned
        for c in contexts:
            if c.closed:
                raise ClosedError("Scheduler: a pinned tensor belongs to a closed context")
        lib.hy_sched_pin(self.ptr, tensors, backends, n)

    def reserve(self, graph: Graph) -> None:
        """Size the compute buffers for the largest graph you will run."""
        self._idle("reserve")
        self._allocated = None
        self._forget_allocation(graph)  # first: it refuses graphs with tensors of closed contexts
        self._check_graph(graph)
        lib.ggml_backend_sched_reset(self.ptr)
        self._apply_pins(graph)
        if not lib.ggml_backend_sched_reserve(self.ptr, graph.ptr):
            raise_region_status(self)
            raise AllocationError("Scheduler.reserve: could not allocate the compute buffers")

    def alloc(self, graph: Graph) -> None:
        """Split and allocate ``graph``; inputs can then be set before :meth:`compute`."""
        self._idle("alloc")
        self.reset()
        self._forget_allocation(graph)  # first: it refuses graphs with tensors of closed contexts
        self._check_graph(graph)
        self._apply_pins(graph)
        if not lib.ggml_backend_sched_alloc_graph(self.ptr, graph.ptr):
            raise_region_status(self)
            raise AllocationError("Scheduler.alloc: could not allocate the graph")
        self._allocated = (graph, graph.version, graph._alloc_token)
        for t in graph.inputs:  # allocation may have moved them: their data must be set anew
            cast("Context", t.context)._fresh.discard(int(ffi.cast("uintptr_t", t.ptr)))

    def prepare(self, graph: Graph) -> bool:
        """Allocate ``graph`` unless it is still allocated here; returns whether it was (re)allocated.

        Inputs are set after this and before :meth:`compute`; a graph computed again and
        again skips the split and allocation.
        """
        if self._allocated == (graph, graph.version, graph._alloc_token):
            return False
        self.alloc(graph)
        return True

    def compute(self, graph: Graph) -> None:
        """Compute ``graph`` and wait for it.

        The graph is split and allocated on first use (or call :meth:`alloc`
        first to set inputs); computing it again reuses that allocation.
        """
        self._idle("compute")
        if self._allocated != (graph, graph.version, graph._alloc_token):
            self.alloc(graph)
        self._check_inputs_set(graph)
        self._run(graph, "Scheduler.compute", None, lib.ggml_backend_sched_graph_compute, self.ptr, graph.ptr)

    def compute_read(self, graph: Graph, read: Callable[[], np.ndarray]) -> np.ndarray:
        """:meth:`compute`, then ``read()`` (e.g. a :meth:`Tensor.reader` of the graph's output) before the servers
        of RPC devices are asked how their graphs went: their replies carry that, so over RPC the read is the
        only round trip after the compute, as upstream's client has it (:meth:`compute` then a read costs one
        more per server whose graph no reply followed)."""
        self._idle("compute")
        if self._allocated != (graph, graph.version, graph._alloc_token):
            self.alloc(graph)
        self._check_inputs_set(graph)
        out: list[np.ndarray] = []
        self._run(graph, "Scheduler.compute", None, lib.ggml_backend_sched_graph_compute, self.ptr, graph.ptr,
                  read=lambda: out.append(read()))
        return out[0]

    def step(self, graph: Graph, io: StepIO) -> np.ndarray:
        """:meth:`compute` for a graph whose every input ``io`` sets: the inputs set from ``io``'s arrays,
        the graph computed and a copy of ``io``'s output returned, in one native call (a decode step).

        A tensor without memory raises :class:`BackendError` before anything is set or computed.
        """
        if self._computing:
            self._idle("step")
        for ctx in io.contexts:
            if ctx.closed:
                raise ClosedError("Scheduler.step: a tensor of the StepIO belongs to a closed context")
        if self._allocated != (graph, graph.version, graph._alloc_token):
            self.alloc(graph)
        out = np.empty(io.out_shape, io.out_dtype)
        self._run(graph, "Scheduler.step", io.raise_refused, lib.hy_sched_step, self.ptr, graph.ptr,
                  io.c_in, io.n_in, io.out_ptr, ffi.from_buffer(out), io.out_size, io.bad)
        graph.consume_inputs()  # the step consumed every input, set through it or before it
        return out

    def _run(self, graph: Graph, what: str, refused: Callable[[], None] | None, fn: Callable[..., int],
             *args: Any, read: Callable[[], None] | None = None) -> None:
        """Call ``fn(*args)``, a native compute of ``graph``, as this scheduler's one compute in progress; raise
        what its region executors or eval callback raised, then ``refused()``'s error, then its status; then
        ``read()`` (the compute succeeded), then what the servers of RPC devices say of it."""
        take_escaped()  # a stray exception of an earlier call on this thread is not this compute's
        self._computing = graph
        enter_compute(self)
        try:
            status = fn(*args)
        finally:
            leave_compute(self)
            self._computing = None
        try:
            self._raise_pending()
            if status != lib.GGML_STATUS_SUCCESS:
                if refused is not None:
                    refused()
                raise_region_status(self)
                index_errors.raise_local(self._backends, graph.ptr)  # a CPU kernel met an index out of range
                check_status(status, what)
        except Exception as exc:
            raise_if_lost(self._remote, exc)  # a lost RPC server is why it failed: say so
            raise
        if read is not None:
            try:
                read()  # its replies carry the statuses of the graphs before it
            except Exception as exc:
                raise_if_lost(self._remote, exc)  # a server lost: said as for the compute
                raise
        if self._remote:
            # a server's kernel met one (patch 0014): the connection stays. First, since it reads the statuses no
            # reply read yet (patch 0017: a synchronize waits for nothing from a server), which also finds a
            # connection lost since its last reply
            index_errors.raise_remote(self._remote)
            raise_if_lost(self._remote)  # lost after its last reply: the results never came

    def reset(self) -> None:
        self._idle("reset")
        lib.ggml_backend_sched_reset(self.ptr)
        self._allocated = None

    def close(self) -> None:
        """Free the scheduler; the graphs it allocated lose their node memory (no dangling pointers)."""
        if self.closed:
            return
        check_closable(self)
        for g in list(self._graphs):
            _unalloc(g)
        self._graphs.clear()
        super().close()

    # -- regions --------------------------------------------------------------

    def add_region(self, inputs: Iterable[Tensor], outputs: Iterable[Tensor],
                   executor: Callable[[RegionCall], object] | NativeExecutor, backend: Backend | None = None,
                   name: str = "") -> Region:
        """Register a region: every node on a path from ``inputs`` to ``outputs``.

        At compute time ``executor(call)`` runs instead of those nodes; it writes
        ``call.outputs`` in place, or returns :data:`~ggml_hybrid.regions.DECLINE`
        to have the nodes run as usual. ``backend`` pins the region (default:
        where the scheduler places its last output). Regions stay registered
        across computes until :meth:`clear_regions`. A :class:`~ggml_hybrid.ggml.regions.NativeExecutor`
        registers its C function itself: the scheduler calls it without Python.
        """
        self._idle("add_region")
        inputs, outputs = list(inputs), list(outputs)
        if not inputs or not outputs:
            raise RegionError(f"add_region: a region needs at least one input and one output "
                             f"(got {len(inputs)} inputs, {len(outputs)} outputs)")
        for what, ts in (("inputs", inputs), ("outputs", outputs)):
            bad = [t for t in ts if not isinstance(t, Tensor)]
            if bad:
                raise ArgumentTypeError(f"add_region: {what} must be Tensors, got {bad[0]!r}")
        native = isinstance(executor, NativeExecutor)
        if not native and not callable(executor):
            raise ArgumentTypeError(f"add_region: executor must be callable or a NativeExecutor, got {executor!r}")
        if backend is not None:
            self._index_check(backend)
        ins = ffi.new("struct ggml_tensor *[]", [t.ptr for t in inputs])
        outs = ffi.new("struct ggml_tensor *[]", [t.ptr for t in outputs])
        fn, data = ((executor.c_function, executor.c_user_data) if isinstance(executor, NativeExecutor)
                    else (lib._hy_region_exec, self._handle))
        rid = lib.ggml_backend_sched_add_region(self.ptr, ins, len(inputs), outs, len(outputs),
                                                backend.ptr if backend is not None else ffi.NULL, fn, data)
        if rid < 0:
            raise RegionError("add_region: the scheduler rejected the region's arguments")
        region = Region(rid, inputs, outputs, executor, backend, name)
        self._regions.append(region)
        self._allocated = None  # the next compute must split the graph again
        return region

    @property
    def regions(self) -> list[Region]:
        return list(self._regions)

    def clear_regions(self) -> None:
        self._idle("clear_regions")
        lib.ggml_backend_sched_clear_regions(self.ptr)
        self._regions.clear()
        self._allocated = None

    def check_regions(self, graph: Graph) -> None:
        """Validate the registered regions against ``graph`` now; raises the typed RegionError."""
        self._idle("check_regions")
        lib.ggml_backend_sched_check_regions(self.ptr, graph.ptr)
        raise_region_status(self)

    def splits(self) -> list[dict[str, Any]]:
        """The last split: backend, region id (-1: none), node ops and number of copied inputs."""
        out = []
        b, r, n, k = (ffi.new("int *") for _ in range(4))
        for i in range(self.n_splits):
            lib.ggml_backend_sched_get_split(self.ptr, i, b, r, n, k)
            nodes = [Tensor(lib.ggml_backend_sched_get_split_node(self.ptr, i, j), BorrowedScope())
                     for j in range(n[0])]
            out.append({"backend": self._backends[b[0]].name, "region": r[0], "n_inputs": k[0],
                        "nodes": [t.name for t in nodes], "ops": [t.op for t in nodes]})
        return out

    def synchronize(self) -> None:
        lib.ggml_backend_sched_synchronize(self.ptr)

    def set_eval_callback(self, fn: Callable[[Tensor, bool], object] | None) -> None:
        """``fn(tensor, ask) -> bool`` is called around nodes (GGML's eval callback); None removes it.

        With ``ask=True`` return whether you want to see the node's data; with
        ``ask=False`` the data is ready, return False to stop the computation.
        An exception raised by ``fn`` stops the computation and is re-raised
        from :meth:`compute`.
        """
        if fn is None:
            lib.ggml_backend_sched_set_eval_callback(self.ptr, ffi.NULL, ffi.NULL)
            self._eval_fn = self._eval_handle = None
            return
        self._eval_fn = fn
        self._eval_handle = ffi.new_handle(self)
        lib.ggml_backend_sched_set_eval_callback(self.ptr, lib._hy_eval_callback, self._eval_handle)

    def _raise_pending(self) -> None:
        err, self._pending_error = self._pending_error, None
        stray = take_escaped()
        if err is not None:
            raise err
        if stray is not None:
            raise stray


# error=False: an escaped exception stops the computation (or skips the node's data when GGML only asks)
@ffi.def_extern(error=False, onerror=escaped)
def _hy_eval_callback(t: CData, ask: CData, user_data: CData) -> bool:
    sched: Scheduler = ffi.from_handle(user_data)
    if sched._pending_error is not None:
        return bool(ask)  # ask for the data, then stop on the data call
    try:
        fn = cast("Callable[[Tensor, bool], object]", sched._eval_fn)  # set while the callback is registered
        return bool(fn(Tensor(t, BorrowedScope()), bool(ask)))
    except BaseException as exc:
        sched._pending_error = exc
        return bool(ask)


__all__ = ["Scheduler", "GgmlHybridError"]
