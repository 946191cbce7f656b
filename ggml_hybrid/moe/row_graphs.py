"""Compacted expert rows: ``expert_ffn`` over a list of (token row, expert) pairs.

Both the CPU worker (host experts) and the device cache's later rounds (slot tensors) on a CPU
backend compute only the rows they own this way, instead of every row of the call (on another
device a round runs the call's own graph: a GPU backend picks ``mul_mat_id``'s kernel by the
token count, see :mod:`.executor`). Row i of a
graph uses token row ``x[i]`` and expert ``ids[i]``; each expert sees exactly its rows,
in call order, so GGML's CPU ``mul_mat_id`` picks the same kernel for it as in the
resident graph (it chooses a tiled path per expert from that expert's row count) and
the rows are bit-identical. Graphs are made per row bucket on first use and reused: the
most recent ones are kept, their tensors in one buffer shared by the graphs of a set (they
never run at the same time), their host arrays views of one scratch: once warm, a long run
allocates nothing, whatever row counts it meets.
"""

from __future__ import annotations

import numpy as np

from .._native import ffi, lib
from .._native.status import check_status
from ..ggml.backend import Backend
from ..ggml.context import Arena, Context
from ..ggml.graph_cache import GraphCache, SharedBuffer
from .ffn import ExpertWeights, expert_ffn

_MAX_GRAPHS = 16  # row-count graphs kept per set of experts (every decode size fits)
_TENSORS, _GRAPH = 16, 32


class _RowGraph:
    """expert_ffn over host experts for ``n_rows`` compacted rows (one expert per row)."""

    def __init__(self, experts: ExpertWeights, backend: Backend, n_rows: int, n_embd: int, glu: str,
                 arena: Arena, shared: SharedBuffer, host: _Scratch) -> None:
        self.ctx = c = Context(n_tensors=_TENSORS, graph_size=_GRAPH, arena=arena)
        self.x = c.new_tensor("f32", (n_rows, 1, n_embd), "cpu.x")
        self.ids = c.new_tensor("i32", (n_rows, 1), "cpu.ids")
        self.down = expert_ffn(c, experts, self.x, self.ids, glu)
        self.graph = c.new_graph(_GRAPH).expand(self.down)
        self.graph.check_supported([backend], id(backend))
        self.grew = shared.place(c)
        self.x_host, self.ids_host, self.down_host = host.views(n_rows)
        self.px, self.pids, self.pdown, self.pg = self.x.ptr, self.ids.ptr, self.down.ptr, self.graph.ptr
        self.bx, self.bids, self.bdown = (ffi.from_buffer(a) for a in (self.x_host, self.ids_host, self.down_host))

    def close(self) -> None:
        self.ctx.close()


class _Scratch:
    """Host arrays for the largest row count seen (grown by powers of two); graphs use prefix views."""

    def __init__(self, n_embd: int) -> None:
        self.n_embd, self.rows = n_embd, 0
        self._x = np.zeros((0, n_embd), np.float32)
        self._ids = np.zeros(0, np.int32)
        self._down = np.empty((0, n_embd), np.float32)

    def views(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if n > self.rows:
            self.rows = 1 << (n - 1).bit_length()
            self._x = np.zeros((self.rows, self.n_embd), np.float32)
            self._ids = np.zeros(self.rows, np.int32)
            self._down = np.empty((self.rows, self.n_embd), np.float32)
        return self._x[:n], self._ids[:n], self._down[:n]


def row_bucket(n: int) -> int:
    """The row count of the graph that computes ``n`` rows: the one rule, C's ``hy_row_bucket``
    (``_native/src/moe_graphs.h`` states it), which both executors and both CPU workers use."""
    return int(lib.hy_row_bucket(n))


def bucket_rows(n: int, ids: np.ndarray, n_expert: int, pad_id: int | None = None) -> tuple[int, int]:
    """Graph row count for n rows (:func:`row_bucket`), and the expert id its padding rows use.

    Padding must never add rows to an expert the graph computes, so padding rows go to
    ``pad_id`` (e.g. a cache's pad slot) or to an expert absent from ``ids``; when there is
    none, the graph has exactly n rows.
    """
    bucket = row_bucket(n)
    if bucket == n:
        return n, 0
    if pad_id is not None:
        return bucket, pad_id
    used = np.zeros(n_expert, bool)
    used[ids] = True
    free = np.flatnonzero(~used)
    return (bucket, int(free[0])) if len(free) else (n, 0)


class RowGraphs:
    """The row graphs of one set of experts on one backend, by row count."""

    def __init__(self, experts: ExpertWeights, backend: Backend, n_embd: int, glu: str,
                 shared: SharedBuffer | None = None) -> None:
        self.experts, self.backend, self.n_embd, self.glu = experts, backend, n_embd, glu
        self._graphs: GraphCache[_RowGraph] = GraphCache(_MAX_GRAPHS, Context.size_for(_TENSORS, graph_size=_GRAPH))
        self.shared = self._shared = shared or SharedBuffer(backend)  # given: shared with other row graph sets
        self._scratch = _Scratch(n_embd)

    @property
    def allocations(self) -> int:
        """Graphs made so far; constant once warm."""
        return self._graphs.builds

    def _build(self, n_rows: int, arena: Arena) -> _RowGraph:
        g = _RowGraph(self.experts, self.backend, n_rows, self.n_embd, self.glu, arena, self._shared, self._scratch)
        if g.grew:  # the graphs placed in the smaller buffer go
            self._graphs.clear()
        return g

    def compute(self, x: np.ndarray, ids: np.ndarray, pad_id: int | None = None) -> np.ndarray:
        """Rows [n, n_embd] of expert_ffn for x [n, n_embd] and ids [n] (a view, valid until the next call)."""
        n = len(ids)
        bucket, pad = bucket_rows(n, ids, self.experts.n_expert, pad_id)
        g = self._graphs.get(bucket, lambda arena: self._build(bucket, arena))
        if g.x_host.base is not self._scratch._x:  # the scratch grew since this graph was made
            g.x_host, g.ids_host, g.down_host = self._scratch.views(bucket)
            g.bx, g.bids, g.bdown = (ffi.from_buffer(a) for a in (g.x_host, g.ids_host, g.down_host))
        g.x_host[:n] = x
        g.x_host[n:] = 0.0
        g.ids_host[:n] = ids
        g.ids_host[n:] = pad
        lib.ggml_backend_tensor_set(g.px, g.bx, 0, g.x_host.nbytes)
        lib.ggml_backend_tensor_set(g.pids, g.bids, 0, g.ids_host.nbytes)
        status = lib.ggml_backend_graph_compute(self.backend.ptr, g.pg)
        check_status(status, "expert row graph")
        lib.ggml_backend_tensor_get(g.pdown, g.bdown, 0, g.down_host.nbytes)
        return g.down_host[:n]

    def reserve(self, n: int) -> None:
        """Grow the shared buffer now to what a call of ``n`` rows needs (the largest graph it can use)."""
        bucket = row_bucket(n)
        self._graphs.get(bucket, lambda arena: self._build(bucket, arena))

    @property
    def buffer_bytes(self) -> int:
        """Compute memory of the row graphs (grown to the largest row count seen)."""
        return self._shared.size

    def close(self) -> None:
        self._graphs.clear()  # the buffer is closed by its owner (the executor, or the session sharing it)
