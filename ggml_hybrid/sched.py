"""A thin owner of ``ggml_backend_sched``: multi-backend allocation and compute."""

from __future__ import annotations

from ._lib import ffi, lib
from ._managed import Managed
from .backend import Backend
from .errors import AllocationError, BackendError, ComputeError, GgmlHybridError
from .graph import Graph
from .tensor import Tensor


class Scheduler(Managed):
    """Schedules graphs over ``backends`` (highest priority first; the last must be a CPU backend).

    ``graph_size`` bounds the nodes plus leafs of any graph given to it.
    """

    _kind = "scheduler"

    def __init__(self, backends: list[Backend], graph_size: int = 2048, parallel: bool = False,
                 op_offload: bool = False):
        backends = list(backends)
        if not backends:
            raise BackendError("Scheduler: needs at least one backend")
        if not backends[-1].is_cpu:
            raise BackendError(f"Scheduler: the last backend must be the CPU, got {backends[-1].name}")
        if len({id(b) for b in backends}) != len(backends):
            raise BackendError("Scheduler: the same backend object is listed twice")
        if isinstance(graph_size, bool) or not isinstance(graph_size, int) or graph_size < 1:
            raise ValueError(f"Scheduler: graph_size must be a positive integer, got {graph_size!r}")
        arr = ffi.new("ggml_backend_t[]", [b.ptr for b in backends])
        ptr = lib.ggml_backend_sched_new(arr, ffi.NULL, len(backends), graph_size, bool(parallel), bool(op_offload))
        super().__init__(ptr, lib.ggml_backend_sched_free)
        self._backends = backends  # kept alive for as long as the scheduler
        self.graph_size = graph_size
        self._eval_fn = self._eval_handle = None
        self._pending_error: BaseException | None = None

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
        for t in graph.leafs:
            if t.ptr.data == ffi.NULL and t.ptr.view_src == ffi.NULL and t.ptr.flags & lib.GGML_TENSOR_FLAG_INPUT == 0:
                raise AllocationError(f"leaf {t.name!r} has no memory; allocate its context in a backend buffer "
                                      "(or mark it as an input with set_input())")

    def reserve(self, graph: Graph) -> None:
        """Size the compute buffers for the largest graph you will run."""
        self._check_graph(graph)
        if not lib.ggml_backend_sched_reserve(self.ptr, graph.ptr):
            raise AllocationError("Scheduler.reserve: could not allocate the compute buffers")

    def alloc(self, graph: Graph) -> None:
        """Split and allocate ``graph``; inputs can then be set before :meth:`compute`."""
        self._check_graph(graph)
        self.reset()
        if not lib.ggml_backend_sched_alloc_graph(self.ptr, graph.ptr):
            raise AllocationError("Scheduler.alloc: could not allocate the graph")

    def compute(self, graph: Graph) -> None:
        """Compute ``graph`` (allocating it first if :meth:`alloc` was not called) and wait for it."""
        self._check_graph(graph)
        status = lib.ggml_backend_sched_graph_compute(self.ptr, graph.ptr)
        self._raise_pending()
        if status != lib.GGML_STATUS_SUCCESS:
            raise ComputeError(f"Scheduler.compute failed: {ffi.string(lib.ggml_status_to_string(status)).decode()}")

    def reset(self) -> None:
        lib.ggml_backend_sched_reset(self.ptr)

    def synchronize(self) -> None:
        lib.ggml_backend_sched_synchronize(self.ptr)

    def set_eval_callback(self, fn) -> None:
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
        lib.ggml_backend_sched_set_eval_callback(self.ptr, lib._ggml_hybrid_eval_callback, self._eval_handle)

    def _raise_pending(self) -> None:
        err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err


@ffi.def_extern()
def _ggml_hybrid_eval_callback(t, ask, user_data):
    sched = ffi.from_handle(user_data)
    if sched._pending_error is not None:
        return bool(ask)  # ask for the data, then stop on the data call
    try:
        return bool(sched._eval_fn(Tensor(t, _Borrowed()), bool(ask)))
    except BaseException as exc:  # noqa: BLE001 - re-raised from compute()
        sched._pending_error = exc
        return bool(ask)


class _Borrowed:
    """Stands in for a context when a tensor belongs to the scheduler (valid during the callback)."""

    closed = False


__all__ = ["Scheduler", "GgmlHybridError"]
