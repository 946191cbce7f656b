"""The persistent CPU workers that compute MoE experts from host (memory-mapped) weights: the Python executor's
(:class:`CPUWorker`) and the native executor's (:class:`NativeWorker`, a C thread: ``_native/src/moe_worker.c``).

One thread, started on first use and stopped by :meth:`CPUWorker.close` (also at
interpreter exit and when the owner is collected), with its own GGML CPU backend and
threadpool. GGML runs with the GIL released (cffi drops it around C calls), so the
worker's experts really compute while the device path runs in the calling thread.

Jobs compute the rows of a set of experts with ``mul_mat_id`` over the *full* host
expert tensors, compacted (see :mod:`ggml_hybrid.row_graphs`), bit-identical to the
default path. Graphs, contexts and buffers are made per (layer, row bucket) on first use
and reused: after warm-up a steady loop allocates nothing (``allocations`` counts them).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from .._native import ffi, lib
from .._native.managed import Managed
from ..errors import BackendError, ClosedError
from ..ggml.backend import Backend, cpu
from .ffn import ExpertWeights
from .row_graphs import RowGraphs

_STOP = object()


def _run(jobs: queue.Queue[Any]) -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        fn, future = item
        # the job (a closure over the worker and its experts) must not outlive its run: this frame would
        # keep the worker alive, and so the thread its finalizer stops, forever
        item = None
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
        fn = future = None


def _stop(jobs: queue.Queue[Any], thread: threading.Thread) -> None:
    jobs.put(_STOP)
    if thread is threading.current_thread():
        return
    # a Ctrl-C that interrupted an earlier put() between queueing its item and notifying the worker leaves
    # the worker asleep on a queue that is not empty: wake it again until it has seen the stop
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive():
            with jobs.not_empty:
                jobs.not_empty.notify()


class CPUWorker:
    def __init__(self, n_threads: int):
        self.n_threads = n_threads
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize[..., CPUWorker] | None = None
        self._backend: Backend | None = None
        self._graphs: dict[int, RowGraphs] = {}  # by layer
        self._closed = False

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
               glu: str = "swiglu") -> cf.Future[tuple[np.ndarray, int, int]]:
        """Compute ``expert_ffn`` rows: row i uses token row ``x[i]`` and expert ``expert_of_row[i]``.

        Returns a future of (rows [n, n_embd] float32, started_ns, finished_ns).
        """
        if self._closed:
            raise ClosedError("the CPU worker of this session is closed")
        if self._thread is None:
            self._start()
        future: cf.Future[tuple[np.ndarray, int, int]] = cf.Future()
        self._jobs.put((lambda: self._compute(layer, experts, x, expert_of_row, glu), future))
        return future

    def _compute(self, layer: int, experts: ExpertWeights, x: np.ndarray, expert_of_row: np.ndarray,
                 glu: str) -> tuple[np.ndarray, int, int]:
        t0 = time.perf_counter_ns()
        graphs = self._graphs.get(layer)
        if graphs is None:
            assert self._backend is not None  # jobs run only once _start made it
            graphs = self._graphs[layer] = RowGraphs(experts, self._backend, x.shape[1], glu)
        rows = graphs.compute(x, expert_of_row).copy()
        return rows, t0, time.perf_counter_ns()

    @property
    def allocations(self) -> int:
        """Graphs (each a context and a buffer) made so far; constant once warm."""
        return sum(g.allocations for g in self._graphs.values())

    def close(self) -> None:
        """Stop the thread (waiting for the job in flight) and free the backend; safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        if self._backend is not None:
            self._backend.close()
            self._backend = None


class NativeWorker(Managed):
    """A session's native CPU worker: a C thread with its own CPU backend and threadpool."""

    _kind = "native_worker"

    def __init__(self, n_threads: int) -> None:
        ptr = lib.hy_worker_new(n_threads)
        if ptr == ffi.NULL:
            raise BackendError(f"could not start the native CPU worker with {n_threads} threads")
        super().__init__(ptr, lib.hy_worker_free)
        self.n_threads = n_threads

    @property
    def allocations(self) -> int:
        """Graphs built so far (constant once warm)."""
        return int(lib.hy_worker_graph_builds(self.ptr))

    def fail_next_job(self) -> None:
        """Make the next job fail (tests: a worker error must reach the caller, the next call must work)."""
        self.ptr.fail_next = 1
