"""A persistent CPU worker that computes MoE experts from host (memory-mapped) weights.

One thread, started on first use and stopped by :meth:`CPUWorker.close` (also at
interpreter exit and when the owner is collected), with its own GGML CPU backend and
threadpool. GGML runs with the GIL released (cffi drops it around C calls), so the
worker's experts really compute while the device path runs in the calling thread.

Jobs compute the rows of a set of experts with ``mul_mat_id`` over the *full* host
expert tensors, the rows compacted (each row names its own expert) into a
preallocated graph (exact row count up to 32 rows, else the next power of two, the
padding rows routed to an expert outside the job). Every expert sees exactly its rows,
in the same order, so GGML picks the same kernel for it (the CPU ``mul_mat_id`` chooses
a tiled path per expert from its row count) and the rows are bit-identical to the
default path. Graphs, contexts and buffers are made per
(layer, row bucket) on first use and reused: after warm-up a steady loop allocates
nothing (``allocations`` counts what was made).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
import weakref

import numpy as np

from ._lib import cstr, ffi, lib
from .backend import cpu
from .context import Context
from .errors import ClosedError, ComputeError
from .moe import ExpertWeights, expert_ffn

_STOP = object()


def _run(jobs: "queue.Queue") -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        fn, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(exc)


def _stop(jobs: "queue.Queue", thread: threading.Thread) -> None:
    jobs.put(_STOP)
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join()


class _RowGraph:
    """expert_ffn over host experts for ``n_rows`` compacted rows (one expert per row)."""

    def __init__(self, experts: ExpertWeights, backend, n_rows: int, n_embd: int, glu: str):
        self.ctx = c = Context(n_tensors=16, graph_size=32)
        self.x = c.new_tensor("f32", (n_rows, 1, n_embd), "cpu.x")
        self.ids = c.new_tensor("i32", (n_rows, 1), "cpu.ids")
        self.down = expert_ffn(c, experts, self.x, self.ids, glu)
        self.graph = c.new_graph(32).expand(self.down)
        self.buffer = c.allocate(backend, "compute")
        self.graph.check_supported([backend], id(backend))
        self.x_host = np.zeros((n_rows, n_embd), np.float32)
        self.ids_host = np.zeros(n_rows, np.int32)
        self.down_host = np.empty((n_rows, n_embd), np.float32)
        self.px, self.pids, self.pdown, self.pg = self.x.ptr, self.ids.ptr, self.down.ptr, self.graph.ptr
        self.bx, self.bids, self.bdown = (ffi.from_buffer(a) for a in (self.x_host, self.ids_host, self.down_host))


# exact-size graphs up to here (decode never pads); above, power-of-two buckets
_EXACT_ROWS = 32


def _bucket(n: int, expert_of_row: np.ndarray, n_expert: int) -> tuple[int, int]:
    """Graph row count for n rows, and the expert id padding rows use.

    mul_mat_id picks its kernel per expert from that expert's row count (a tiled
    path takes over above a threshold), so padding must never add rows to an expert
    the job computes: padding rows go to an expert outside the job, or there is none.
    """
    if n <= _EXACT_ROWS:
        return n, 0
    bucket = 1 << (n - 1).bit_length()
    if bucket == n:
        return n, 0
    used = np.zeros(n_expert, bool)
    used[expert_of_row] = True
    free = np.flatnonzero(~used)
    return (bucket, int(free[0])) if len(free) else (n, 0)


class CPUWorker:
    def __init__(self, n_threads: int):
        self.n_threads = n_threads
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._finalizer = None
        self._backend = None
        self._graphs: dict[tuple[int, int], _RowGraph] = {}
        self._closed = False
        self.allocations = 0  # contexts/buffers made; constant once warm
        self.fault: BaseException | None = None  # tests inject a failure into the next job

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        self._backend = cpu(self.n_threads)
        self._thread = threading.Thread(target=_run, args=(self._jobs,), name="ggml-hybrid-cpu-worker", daemon=True)
        self._thread.start()
        # stops the thread at interpreter exit, or when the worker is dropped without close()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread)

    def submit(self, layer: int, experts: ExpertWeights, x: np.ndarray, expert_of_row: np.ndarray,
               glu: str = "swiglu") -> cf.Future:
        """Compute ``expert_ffn`` rows: row i uses token row ``x[i]`` and expert ``expert_of_row[i]``.

        Returns a future of (rows [n, n_embd] float32, started_ns, finished_ns).
        """
        if self._closed:
            raise ClosedError("the CPU worker of this session is closed")
        if self._thread is None:
            self._start()
        future: cf.Future = cf.Future()
        self._jobs.put((lambda: self._compute(layer, experts, x, expert_of_row, glu), future))
        return future

    def _compute(self, layer, experts, x, expert_of_row, glu):
        t0 = time.perf_counter_ns()
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        n = len(expert_of_row)
        bucket, pad_id = _bucket(n, expert_of_row, experts.n_expert)
        g = self._graphs.get((layer, bucket))
        if g is None:
            g = self._graphs[(layer, bucket)] = _RowGraph(experts, self._backend, bucket, x.shape[1], glu)
            self.allocations += 1
        g.x_host[:n] = x
        g.x_host[n:] = 0.0
        g.ids_host[:n] = expert_of_row
        g.ids_host[n:] = pad_id  # padding rows go to an expert this job does not compute; dropped
        lib.ggml_backend_tensor_set(g.px, g.bx, 0, g.x_host.nbytes)
        lib.ggml_backend_tensor_set(g.pids, g.bids, 0, g.ids_host.nbytes)
        status = lib.ggml_backend_graph_compute(self._backend.ptr, g.pg)
        if status != lib.GGML_STATUS_SUCCESS:
            raise ComputeError(f"CPU expert graph failed: {cstr(lib.ggml_status_to_string(status))}")
        lib.ggml_backend_tensor_get(g.pdown, g.bdown, 0, g.down_host.nbytes)
        return g.down_host[:n].copy(), t0, time.perf_counter_ns()

    def close(self) -> None:
        """Stop the thread (waiting for the job in flight) and free the backend; safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        for g in self._graphs.values():
            g.ctx.close()
        self._graphs.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None
