"""The device expert cache as a region executor: one MoE layer's routed experts.

Each layer owns ``n_slots`` expert slots on the device (plus one zeroed pad
slot) for each expert tensor (gate, up, down or the fused gate_up). A call reads
the routed expert ids and places them: with ``moe_cpu_share`` > 0 a share of the
misses goes to the session's CPU worker (started first, so it overlaps the device
work); the rest asks the :class:`~ggml_hybrid.expert_cache.SlotCache` for a plan
(hits first, then misses loaded into slots, in rounds when the call needs more
experts than there are slots). A single round with no CPU rows runs ``mul_mat_id``
over the slot tensors with the ids remapped to slots (rows of other experts point at
the pad slot); otherwise each round computes only its own rows, compacted (see
:mod:`ggml_hybrid.row_graphs`) on a CPU backend, and on any other device through the call's
own graph with the other rows on the pad slot (a GPU backend picks ``mul_mat_id``'s kernel by
the token count), and the rows merge on the host. Either way every
expert sees exactly the rows, in the same order, as in the resident ``mul_mat_id``,
which makes the result bit-identical on the CPU. The weighted sum over the selected
experts is then built with the same ops as the resident graph.

A call runs as a list of steps (:meth:`ExpertCacheExecutor.__call__`), one method each; the native
executor (``_native/src/moe_exec.c``) has a function of the same name for each, so that the two read
side by side: ``read_ids``, ``count_rows``, ``settle_prefetch``, ``cpu_split``, ``submit_cpu``, ``plan``,
``run_round`` (``load``, ``compute_full`` or ``compute_rows``), ``merge``, ``weighted_sum``, ``prefetch``,
``count_call``.

Lookahead prefetch (``moe_prefetch``, :meth:`ExpertCacheExecutor.set_prefetch`): after a call, the layer
applies the next disk layer's router to the call's input and loads the predicted misses into that layer's
slots; the next layer's call commits them and scores the prediction (``settle_prefetch``). Only where and
when an expert is loaded changes, never a result.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._native import CData, ffi, lib
from .._native.cstruct import Counters
from .._native.status import check_status
from ..checks import check_real
from ..errors import CpuShareError, ModelFileError
from ..ggml import rpc
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Arena, Context
from ..ggml.graph_cache import GraphCache, SharedBuffer
from ..ggml.regions import RegionCall
from ..ggml.repack import repack_buffer_type
from ..ggml.tensor import Tensor
from ..gguf.store import GGUFStore
from .cpu_share import COEFFICIENTS, CostModel, MissSplit, link_prior, split_misses
from .cpu_worker import CPUWorker
from .ffn import ExpertWeights, expert_ffn, weighted_sum
from .row_graphs import RowGraphs
from .slot_cache import Round, SlotCache

if TYPE_CHECKING:
    from .traces.format import TraceWriter


class LayerCounters(Counters, struct="hy_moe_counters"):
    """A layer's counters, summed over its calls, kept by both executors: the fields of the C struct
    ``hy_moe_counters`` (``_native/src/moe_exec.h`` lists and documents them), in its order."""

    @property
    def share_applied(self) -> float:
        """Mean share of misses the CPU took, over calls with misses."""
        return self.share_sum / self.share_calls if self.share_calls else 0.0

    @property
    def orchestration_ns(self) -> int:
        """Executor time that is neither loading nor computing: the Python side."""
        return int(self.device_ns - self.load_ns - self.compute_ns)

    @property
    def recall(self) -> float:
        """Of the experts the predicted calls routed to, the share the lookahead predicted (moe_prefetch)."""
        return self.predicted_right / self.predicted_of if self.predicted_of else 0.0

    @property
    def precision(self) -> float:
        """Of the experts the lookahead predicted, the share the call routed to."""
        return self.predicted_right / self.predicted if self.predicted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "share_applied": self.share_applied, "orchestration_ns": self.orchestration_ns,
                "recall": self.recall, "precision": self.precision}


MAX_BUCKETS = 8  # token-count graphs kept per layer
_BUCKET_TENSORS, _BUCKET_GRAPH = 32, 64


class _Bucket:
    """Preallocated graphs for one token count: expert FFN over the slots, and the weighted sum.

    The hot path uses raw pointers and preallocated host arrays: the graphs are
    checked once here, and each call then costs a handful of C calls. The tensors live
    in the layer's shared compute buffer, the structs in an arena of its graph cache,
    the host arrays are views of the layer's scratch: a new token count allocates nothing
    once those have grown to the largest count seen.
    """

    def __init__(self, slots: ExpertWeights, device: Backend, n_tokens: int, n_used: int, n_embd: int, glu: str,
                 arena: Arena, host: _HostScratch):
        self.ctx = c = Context(n_tensors=_BUCKET_TENSORS, graph_size=_BUCKET_GRAPH, arena=arena)
        self.x = c.new_tensor("f32", (n_tokens, 1, n_embd), "x")
        self.ids = c.new_tensor("i32", (n_tokens, n_used), "slot_ids")
        self.down = expert_ffn(c, slots, self.x, self.ids, glu)
        self.g_experts = c.new_graph(32).expand(self.down)
        self.experts_in = c.new_tensor("f32", (n_tokens, n_used, n_embd), "experts")
        self.w = c.new_tensor("f32", (n_tokens, n_used, 1), "weights")
        self.out = weighted_sum(c, self.experts_in, self.w)
        self.g_sum = c.new_graph(32).expand(self.out)
        for g in (self.g_experts, self.g_sum):
            g.check_supported([device], id(device))
        self.slot_ids, self.merged = host.views(n_tokens)
        self.b_slot_ids, self.b_merged = ffi.from_buffer(self.slot_ids), ffi.from_buffer(self.merged)

    def pointers(self) -> None:
        """Raw pointers for the hot path, once the tensors have their memory."""
        p = lambda t: t.ptr
        self.p_x, self.p_ids, self.p_down, self.p_experts, self.p_w, self.p_out = map(
            p, (self.x, self.ids, self.down, self.experts_in, self.w, self.out))
        self.pg_experts, self.pg_sum = self.g_experts.ptr, self.g_sum.ptr

    def close(self) -> None:
        self.ctx.close()


class SyntheticClock:
    """Durations computed from the work instead of measured, so that ``auto`` decides the same way on every
    run: the native and the Python executors are compared with it, decision by decision. Its costs are the cost
    model's coefficients (:data:`~.cpu_share.COEFFICIENTS`, seconds), each given by name."""

    def __init__(self, **coefficients: float) -> None:
        if set(coefficients) != set(COEFFICIENTS):
            raise CpuShareError(f"SyntheticClock: the coefficients must be exactly {', '.join(COEFFICIENTS)}, "
                                f"got {', '.join(coefficients) or 'none'}")
        self.coefficients = {k: check_real(coefficients[k], f"SyntheticClock: {k}", 0.0, error=CpuShareError)
                             for k in COEFFICIENTS}

    def seconds(self, kind: str, nbytes: int, rows: int) -> float:
        """The duration of a piece of work: ``load`` (bytes), ``device`` (rows), ``cpu`` (bytes and rows), ``job``."""
        c = self.coefficients
        if kind == "load":
            return c["load_per_byte"] * nbytes
        if kind == "device":
            return c["device_per_row"] * rows
        if kind == "cpu":
            return c["cpu_per_byte"] * nbytes + c["cpu_per_row"] * rows
        return c["cpu_per_job"]


class _HostScratch:
    """The host arrays of a layer's calls, sized for the most tokens seen (grown by powers of two)."""

    def __init__(self, n_used: int, n_embd: int) -> None:
        self.n_used, self.n_embd, self.rows = n_used, n_embd, 0
        self.slot_ids = np.empty((0, n_used), np.int32)
        self.merged = np.empty((0, n_used, n_embd), np.float32)

    def views(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        if n_tokens > self.rows:
            self.rows = 1 << (n_tokens - 1).bit_length()
            self.slot_ids = np.empty((self.rows, self.n_used), np.int32)
            self.merged = np.empty((self.rows, self.n_used, self.n_embd), np.float32)
        return self.slot_ids[:n_tokens], self.merged[:n_tokens]


def allocate_slots(ctx: Context, slots: dict[str, Tensor], device: Backend, repack: bool, virtual: bool,
                   clear: bool) -> list[Buffer]:
    """Memory for a layer's slot tensors on ``device``, zeroed when ``clear`` (the pad slot's zeros absorb
    padding rows). On a CPU device with ``repack`` (the session's option), a kind whose experts GGML's CPU
    extra buffer types take goes there, as its resident experts would: a slot then computes with the same
    kernels, and a load repacks one expert (vendor patch 0003)."""
    groups: dict[int, tuple[CData, list[Tensor]]] = {}
    rest = []
    for t in slots.values():
        buft = repack_buffer_type(t.dtype, t.shape, "mul_mat_id") if repack and device.is_cpu and t.ndim == 3 \
            else None
        if buft is None:
            rest.append(t)
        else:
            groups.setdefault(int(ffi.cast("uintptr_t", buft)), (buft, []))[1].append(t)
    buffers = [ctx.allocate_group(group, buft, "weights", virtual=virtual) for buft, group in groups.values()]
    if rest:
        buffers.append(ctx.allocate(device, "weights", virtual=virtual))
    if clear:
        for b in buffers:
            b.clear(0)
    return buffers


def _compute(backend_ptr: CData, graph_ptr: CData) -> None:
    status = lib.ggml_backend_graph_compute(backend_ptr, graph_ptr)
    check_status(status, "expert cache graph")


def _read_rows(t: Tensor, n_rows: int, n_cols: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A [rows, cols] tensor that may be a strided view (top-k ids are one), read from any backend."""
    p = t.ptr
    nb1 = p.nb[1]
    raw = np.empty(int(lib.ggml_nbytes(p)), np.uint8)
    lib.ggml_backend_tensor_get(p, ffi.from_buffer(raw), 0, raw.nbytes)
    item = np.dtype(dtype).itemsize
    if nb1 == n_cols * item:
        return raw.view(dtype).reshape(n_rows, n_cols)
    padded = np.empty(n_rows * nb1, np.uint8)
    padded[:raw.nbytes] = raw
    return padded.view(dtype).reshape(n_rows, nb1 // item)[:, :n_cols]


class _Call:
    """The state of one layer call, handed from step to step (the C executor's ``hy_call``)."""

    __slots__ = ("t0", "x", "ids_t", "w", "out", "n_tokens", "ids", "counts", "experts", "split", "checked", "cpu_rows",
                 "xv", "t_submit", "job", "rounds", "bucket", "on_host", "d0", "d1")

    ids: np.ndarray          # [T, k] routed expert ids
    counts: np.ndarray       # [n_expert] rows of each expert
    experts: np.ndarray      # the distinct experts, in id order
    split: MissSplit | None  # where the misses go (None: no CPU share)
    cpu_rows: np.ndarray     # [T, k]: the rows the CPU computes
    t_submit: int
    rounds: list[Round]
    bucket: _Bucket          # the graphs and host arrays of this token count
    on_host: bool            # rounds compute their own rows, compacted, merged on the host
    d0: int                  # the device rounds' start and end
    d1: int

    def __init__(self, region: RegionCall) -> None:
        self.t0 = time.perf_counter_ns()
        self.x, self.ids_t, self.w = region.inputs
        self.out = region.outputs[0]
        self.n_tokens: int = self.x.ptr.ne[2]
        self.checked = False  # the model file was found unchanged in this call
        self.xv: np.ndarray | None = None  # x on the host, [T, n_embd]
        self.job: cf.Future[tuple[np.ndarray, int, int]] | None = None  # the CPU worker's: rows, start, end


class ExpertCacheExecutor:
    """Region executor for one layer: resident hits, misses loaded into device slots."""

    def __init__(self, store: GGUFStore, layer: int, names: dict[str, str], device: Backend, n_slots: int,
                 policy: str, n_used: int, glu: str = "swiglu", worker: CPUWorker | None = None,
                 share: float | str = 0.0, host_experts: ExpertWeights | None = None,
                 simulated_bus_bytes_per_s: float | None = None, trace: TraceWriter | None = None, clear: bool = True,
                 shared: tuple[SharedBuffer, SharedBuffer] | None = None, repack: bool = True,
                 route: np.ndarray | None = None) -> None:
        """``clear=False`` (planning only: nothing will run) only reserves the slot memory.

        ``route`` (``moe_route_trace``, benchmarks): ``[n, n_used]`` expert ids that replace the router's
        choice, one row per token, cycling (the weights stay the router's).

        ``shared``: the compute buffers (slot graphs, row graphs) to place the graphs in, shared with the
        other layers' executors on this device (layers never run at the same time); default: its own.
        ``repack``: slots on a CPU device in GGML's CPU extra buffer types where the experts' type allows
        (:func:`allocate_slots`).
        """
        self.store, self.layer, self.names, self.device = store, layer, names, device
        self.n_used, self.glu = n_used, glu
        # the CPU share: a fixed fraction of the misses, or "auto" (an online cost model)
        self.worker, self.share, self.host_experts = worker, share, host_experts
        self.cost = CostModel(prior=link_prior(rpc.link_of(device.endpoint))) if share == "auto" else None
        self.clock: SyntheticClock | None = None  # set by tests and replays that need repeatable decisions
        # benchmarks on a machine without a bus: each load also waits bytes / bandwidth
        self.simulated_bus = simulated_bus_bytes_per_s
        self.trace = trace  # a TraceWriter shared by the session's layers, or None
        infos = {k: store.info(n) for k, n in names.items()}
        self.n_expert, self.n_embd = infos["down"].shape[0], infos["down"].shape[1]
        self.n_slots = n_slots
        self.cache = SlotCache(self.n_expert, n_slots, policy)
        self.pad_slot = n_slots  # the extra, zeroed slot that absorbs rows outside a round
        self.ctx = Context(n_tensors=len(names))
        self.slot_tensors = {k: self.ctx.new_tensor(info.dtype, (n_slots + 1,) + info.shape[1:], f"slots.{k}")
                             for k, info in infos.items()}
        self.buffers = allocate_slots(self.ctx, self.slot_tensors, device, repack, virtual=not clear, clear=clear)
        self.slots = ExpertWeights(**self.slot_tensors)
        # per expert (slot): 3-D matrices and 2-D biases alike
        self.expert_nbytes = {k: t.nbytes // (n_slots + 1) for k, t in self.slot_tensors.items()}
        # per kind: (slot tensor, first byte of the expert tensor in the mapping, bytes per expert)
        self._raw = {k: np.asarray(store.raw(n)) for k, n in names.items()}
        self._copies = [(self.slot_tensors[k].ptr, ffi.cast("char *", self._raw[k].ctypes.data), self.expert_nbytes[k])
                        for k in names]
        self._slot_of = np.empty(self.n_expert, np.int32)
        self.expert_bytes = sum(self.expert_nbytes.values())
        self._own_shared = shared is None
        shared = shared or (SharedBuffer(device), SharedBuffer(device))
        self._slot_rows = RowGraphs(self.slots, device, self.n_embd, glu, shared[1])  # compacted rounds
        self._compact = device.is_cpu  # rounds compute compacted rows (else the call's graph, see _compute_rows)
        self.counters = LayerCounters()
        # one graph pair per token count, the least recently used dropped first: prompts of ever new
        # lengths must not grow memory (decode and recent lengths stay warm); all share one buffer
        self._buckets: GraphCache[_Bucket] = GraphCache(
            MAX_BUCKETS, Context.size_for(_BUCKET_TENSORS, graph_size=_BUCKET_GRAPH))
        self._shared = shared[0]
        self._host = _HostScratch(n_used, self.n_embd)
        # moe_route_trace (benchmarks): [n, n_used] ids that replace the router's, token by token, cycling
        self.route = None if route is None else np.ascontiguousarray(route, np.int32)
        self._route_pos = 0
        # lookahead prefetch, as the predicting layer (set_prefetch) and as the predicted one
        self._next: ExpertCacheExecutor | None = None
        self._router: np.ndarray | None = None  # float64 [n_expert of next, n_embd]
        self._router_bias: np.ndarray | None = None
        self._select_bias: np.ndarray | None = None
        self._pf_max = self._pf_max_tokens = 0
        self._prediction: np.ndarray | None = None  # a prediction for the coming call, not yet judged
        self.predicted: tuple[int, ...] = ()  # the last prediction for this layer, in id order
        self._pf_marked: set[int] = set()  # prefetched, not yet judged
        self._pf_pending: list[tuple[int, int]] = []  # (expert, slot) loads to commit when the call starts

    @property
    def shared_buffers(self) -> tuple[SharedBuffer, SharedBuffer]:
        """The compute buffers its graphs are placed in (perhaps shared with other executors)."""
        return self._shared, self._slot_rows.shared

    @property
    def compute_bytes(self) -> int:
        """Device compute memory of the executor's own graphs (grown to the largest token count seen)."""
        return self._shared.size + self._slot_rows.buffer_bytes

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the slots, the pad slot included."""
        return sum(t.nbytes for t in self.slot_tensors.values())

    def set_prefetch(self, next_layer: ExpertCacheExecutor | None, router: np.ndarray | None,
                     router_bias: np.ndarray | None = None, select_bias: np.ndarray | None = None,
                     max_experts: int = 0, max_tokens: int = 0) -> None:
        """Predict ``next_layer``'s experts after each call of at most ``max_tokens`` tokens and load up to
        ``max_experts`` predicted misses into its slots (``moe_exec.h: hy_moe_exec_set_prefetch`` states the
        rule). ``router`` [next's n_expert, n_embd]; None with a ``next_layer`` that follows a route trace:
        the trace's coming rows (an oracle, benchmarks). ``next_layer=None``: off."""
        self._next = None
        if next_layer is None or next_layer is self or (router is None and next_layer.route is None):
            return
        self._next = next_layer
        self._router = None if router is None else np.asarray(router, np.float64)
        self._router_bias = None if router_bias is None else np.asarray(router_bias, np.float64)
        self._select_bias = None if select_bias is None else np.asarray(select_bias, np.float64)
        self._pf_max, self._pf_max_tokens = max_experts, max_tokens

    def reserve(self, n_tokens: int) -> None:
        """Grow the compute memory to what a call of ``n_tokens`` tokens needs, the most a call can need:
        its graphs over the slots, and on a CPU backend the row graphs of all its rows (every (token, expert) pair;
        another device runs a round through the call's graph)."""
        self._bucket(n_tokens)
        if self._compact:
            self._slot_rows.reserve(n_tokens * self.n_used)

    def _bucket(self, n_tokens: int) -> _Bucket:
        def build(arena: Arena) -> _Bucket:
            b = _Bucket(self.slots, self.device, n_tokens, self.n_used, self.n_embd, self.glu, arena, self._host)
            if self._shared.place(b.ctx):  # grown: the graphs placed in the old buffer go
                self._buckets.clear()
            b.pointers()
            return b

        return self._buckets.get(n_tokens, build)

    # -- a call: one method per step, the C executor's functions of the same names (moe_exec.c) ----------

    def __call__(self, region: RegionCall) -> None:
        call = _Call(region)
        self._read_ids(call)
        self._count_rows(call)
        self._settle_prefetch(call)
        call.split = self._cpu_split(call.experts, call.counts[call.experts])
        self._submit_cpu(call)
        self._plan(call)
        call.d0 = time.perf_counter_ns()
        for rnd in call.rounds:
            self._run_round(call, rnd)
        call.d1 = time.perf_counter_ns()
        self._merge(call)
        self._weighted_sum(call)
        self._prefetch(call)
        self._count_call(call)

    def _read_ids(self, call: _Call) -> None:
        """The routed ids, read (from any backend, strides included) and traced."""
        call.ids = _read_rows(call.ids_t, call.n_tokens, self.n_used, np.int32)
        if self.route is not None:  # moe_route_trace: the trace's routing, token by token, instead of the router's
            rows = (self._route_pos + np.arange(call.n_tokens)) % len(self.route)
            call.ids = self.route[rows]
            self._route_pos += call.n_tokens
        if self.trace is not None:
            self.trace.record(self.layer, call.ids, self.predicted if self._prediction is not None else None)

    def _count_rows(self, call: _Call) -> None:
        """The distinct experts, in id order, and the rows of each."""
        call.counts = np.bincount(call.ids.ravel(), minlength=self.n_expert)
        call.experts = np.flatnonzero(call.counts)

    def _cpu_split(self, experts: np.ndarray, rows: np.ndarray) -> MissSplit | None:
        """Which misses the CPU computes; None when every expert goes through the cache."""
        if self.worker is None or self.share == 0.0:
            return None
        resident = self.cache.resident()
        if self.cost is not None:
            split = self.cost.choose(experts.tolist(), rows.tolist(), resident, self.expert_bytes,
                                      self.cache.reuse_key)
        else:
            assert isinstance(self.share, float)  # "auto" has a model
            split = split_misses(experts.tolist(), rows.tolist(), resident, self.share, self.cache.reuse_key)
        if split.n_misses:
            self.counters.share_calls += 1
            self.counters.share_sum += split.share
        return split

    def _submit_cpu(self, call: _Call) -> None:
        """The CPU's rows handed to the worker first, so that it computes them while the device works."""
        split = call.split
        if split is None or not split.cpu_misses or self.worker is None or self.host_experts is None:
            return
        self.store.check_unchanged()  # the worker reads the mapping: a truncated file would kill us (SIGBUS)
        call.checked = True
        on_cpu = np.zeros(self.n_expert, bool)
        on_cpu[list(split.cpu_misses)] = True
        call.cpu_rows = on_cpu[call.ids]
        call.xv = call.x.numpy().reshape(call.n_tokens, self.n_embd)
        tok = np.nonzero(call.cpu_rows)[0]  # row-major (token, expert) order, as mul_mat_id groups rows
        call.t_submit = time.perf_counter_ns()
        call.job = self.worker.submit(self.layer, self.host_experts, call.xv[tok], call.ids[call.cpu_rows], self.glu)
        self.counters.cpu_misses += len(split.cpu_misses)
        self.counters.cpu_rows += int(call.cpu_rows.sum())

    def _plan(self, call: _Call) -> None:
        """The device's experts (those the CPU does not take) planned in the slot cache: hits, then loads by round."""
        if call.job is not None and call.split is not None:
            device = np.array(sorted(call.split.device_hits + call.split.device_misses), np.int64)
        else:
            device = call.experts
        # experts come from a bincount: distinct, in range, with positive row counts
        call.rounds = self.cache.plan(device.tolist(), call.counts[device].tolist(), checked=False,
                                      deferred_loads=True)
        if call.job is not None and call.split is not None:
            self.cache.note_cpu(call.split.cpu_misses)  # the CPU's requests count in the layer's history
        if not call.checked and any(rnd.loads for rnd in call.rounds):
            self.store.check_unchanged()  # loads read the mapping: a truncated file would kill us (SIGBUS)
        call.bucket = self._bucket(call.n_tokens)
        # one round and no CPU rows: the full graph over the slots, nothing leaves the device; otherwise
        # each round computes only its own rows (compacted) and the rows merge on the host
        call.on_host = call.job is not None or len(call.rounds) > 1
        if call.on_host and call.xv is None:
            call.xv = call.x.numpy().reshape(call.n_tokens, self.n_embd)

    def _run_round(self, call: _Call, rnd: Round) -> None:
        """One round of the plan: load its misses into their slots, then compute the experts it holds."""
        c = self.counters
        t1 = time.perf_counter_ns()
        for expert, slot in rnd.loads:
            c.bytes_loaded += self._load(expert, slot)
            self.cache.commit(slot, expert)  # only now does the cache count it as resident
        t2 = time.perf_counter_ns()
        # each expert's slot in this round; experts of other rounds (and the CPU's) read the pad slot
        slot_of = self._slot_of
        slot_of.fill(self.pad_slot)
        for expert, slot in rnd.hits + rnd.loads:
            slot_of[expert] = slot
        np.take(slot_of, call.ids, out=call.bucket.slot_ids)
        n_rows, ns = self._compute_rows(call) if call.on_host else self._compute_full(call)
        c.load_ns += t2 - t1
        c.compute_ns += ns
        c.hits += len(rnd.hits)
        c.misses += len(rnd.loads)
        c.evictions += len(rnd.evicted)
        if self.cost is not None:
            loaded = len(rnd.loads) * self.expert_bytes
            if loaded:
                self.cost.observe_load(loaded, self._seconds("load", loaded, 0, t2 - t1))
            self.cost.observe_device(n_rows, self._seconds("device", 0, n_rows, ns))

    def _load(self, expert: int, slot: int) -> int:
        """Copy ``expert`` from the mapping into ``slot`` of every expert tensor; the bytes copied."""
        n = 0
        for slots, src, nbytes in self._copies:
            lib.ggml_backend_tensor_set(slots, src + expert * nbytes, slot * nbytes, nbytes)
            n += nbytes
        if self.simulated_bus:
            time.sleep(n / self.simulated_bus)  # releases the GIL, like a DMA the CPU need not wait for
        return n

    def _compute_full(self, call: _Call) -> tuple[int, int]:
        """The layer's whole graph over the slots: every row of the call, the ids remapped to slots.
        Its rows, and the compute's nanoseconds."""
        b = call.bucket
        lib.ggml_backend_tensor_copy(call.x.ptr, b.p_x)  # device to device: the input never comes to the host
        lib.ggml_backend_tensor_set(b.p_ids, b.b_slot_ids, 0, b.slot_ids.nbytes)
        t = time.perf_counter_ns()
        _compute(self.device.ptr, b.pg_experts)
        ns = time.perf_counter_ns() - t
        lib.ggml_backend_tensor_copy(b.p_down, b.p_experts)
        return int(call.ids.size), ns

    def _compute_rows(self, call: _Call) -> tuple[int, int]:
        """This round's rows only, compacted (:class:`RowGraphs` pads them to their row bucket, the padding on the
        zeroed pad slot); the results go to their places in ``merged``. Its rows, and the nanoseconds.

        On a device that is not a CPU backend the round runs the call's own graph instead (every row, those of
        other rounds on the pad slot): a GPU backend picks ``mul_mat_id``'s kernel by the call's token count
        (GGML's Vulkan backend: its mat-vec kernel up to 8 tokens, its tiled kernel, which rounds F32 operands
        to F16, above), so compacted rows would get another kernel than the resident graph gives them."""
        b = call.bucket
        if not self._compact:
            sel = b.slot_ids != self.pad_slot
            n = int(np.count_nonzero(sel))
            t = time.perf_counter_ns()
            if n:
                lib.ggml_backend_tensor_copy(call.x.ptr, b.p_x)
                lib.ggml_backend_tensor_set(b.p_ids, b.b_slot_ids, 0, b.slot_ids.nbytes)
                _compute(self.device.ptr, b.pg_experts)
                rows = _read_rows(b.down, sel.size, self.n_embd, np.float32).reshape(b.merged.shape)
                b.merged[sel] = rows[sel]
            return n, time.perf_counter_ns() - t
        assert call.xv is not None  # read by _plan for every call that computes on the host
        sel = b.slot_ids != self.pad_slot
        t = time.perf_counter_ns()
        b.merged[sel] = self._slot_rows.compute(call.xv[np.nonzero(sel)[0]], b.slot_ids[sel], self.pad_slot)
        return int(np.count_nonzero(sel)), time.perf_counter_ns() - t

    def _merge(self, call: _Call) -> None:
        """The worker's rows, waited for, merged with the device's."""
        if call.job is None or call.split is None:
            return
        rows_out, c0, c1 = call.job.result()  # re-raises a failure of the worker here
        call.bucket.merged[call.cpu_rows] = rows_out
        c = self.counters
        c.cpu_ns += c1 - c0
        c.overlap_ns += max(0, min(call.d1, c1) - max(call.d0, c0)) if call.rounds else 0
        if self.cost is not None:
            cpu_bytes = len(call.split.cpu_misses) * self.expert_bytes
            cpu_s = self._seconds("cpu", cpu_bytes, len(rows_out), c1 - c0)
            self.cost.observe_cpu(cpu_bytes, len(rows_out), cpu_s)
            self.cost.observe_cpu_job(self._seconds("job", 0, 0, c0 - call.t_submit))

    def _weighted_sum(self, call: _Call) -> None:
        """The weighted sum over each token's experts, with the resident graph's ops, into the region's output."""
        b = call.bucket
        # the worker and the loads read the mapping: a read past the end of a file truncated meanwhile gave
        # zeros (the mapping's guard), which must not reach the output
        self.store.check_reads()
        if call.on_host:
            lib.ggml_backend_tensor_set(b.p_experts, b.b_merged, 0, b.merged.nbytes)
        lib.ggml_backend_tensor_copy(call.w.ptr, b.p_w)
        t = time.perf_counter_ns()
        _compute(self.device.ptr, b.pg_sum)
        self.counters.compute_ns += time.perf_counter_ns() - t
        lib.ggml_backend_tensor_copy(b.p_out, call.out.ptr)

    def _settle_prefetch(self, call: _Call) -> None:
        """The previous layer's prefetch into this layer: its loads committed, its prediction scored."""
        for expert, slot in self._pf_pending:
            self.cache.commit(slot, expert)
        self._pf_pending = []
        if self._prediction is None:
            return
        c = self.counters
        actual = set(call.experts.tolist())
        c.predicted += len(self._prediction)
        c.predicted_of += len(actual)
        c.predicted_right += len(actual.intersection(self._prediction.tolist()))
        c.prefetch_used += len(self._pf_marked & actual)
        c.prefetch_wasted += len(self._pf_marked - actual)
        self._pf_marked = set()
        self._prediction = None

    def _votes(self, call: _Call) -> np.ndarray:
        """How many of the call's tokens predict each expert of the next layer: each token's top k."""
        nx = self._next
        assert nx is not None
        votes = np.zeros(nx.n_expert, np.int64)
        if self._router is None:  # the oracle: the next layer's coming rows of its route trace
            assert nx.route is not None
            rows = (nx._route_pos + np.arange(call.n_tokens)) % len(nx.route)
            np.add.at(votes, nx.route[rows].ravel(), 1)
            return votes
        x = call.x.numpy().reshape(call.n_tokens, self.n_embd).astype(np.float64)
        with np.errstate(all="ignore"):  # a non-finite input predicts, it does not fail
            scores = x @ self._router.T
            if self._router_bias is not None:
                scores += self._router_bias
            if self._select_bias is not None:
                scores = 1.0 / (1.0 + np.exp(-scores)) + self._select_bias
        scores[np.isnan(scores)] = -np.inf
        top = np.argsort(-scores, axis=1, kind="stable")[:, :nx.n_used]  # ties: the lower id
        np.add.at(votes, top.ravel(), 1)
        return votes

    def _prefetch(self, call: _Call) -> None:
        """After the call: predict the next layer's experts from this call's x and load the predicted misses."""
        nx = self._next
        if nx is None or call.n_tokens > self._pf_max_tokens:
            return
        t0 = time.perf_counter_ns()
        if nx._prediction is not None:  # never judged (the next layer's call did not run): its loads are wasted
            nx.counters.prefetch_wasted += len(nx._pf_marked)
            nx._pf_marked = set()
        votes = self._votes(call)
        pred = np.flatnonzero(votes)
        nx._prediction = pred
        # most-voted first, ties by the lower id: the order the misses among it load in (and the trace's)
        nx.predicted = tuple(sorted(pred.tolist(), key=lambda e: (-votes[e], e)))
        keep = frozenset(nx.predicted)
        misses = [e for e in nx.predicted if not nx.cache.holds(e)]
        if misses and self._pf_max > 0 and self._file_readable(call):
            for e in misses[:self._pf_max]:
                placed = nx.cache.prefetch(e, keep)
                if placed is None:
                    break
                nx.counters.bytes_prefetched += nx._load(e, placed[0])
                nx.counters.prefetched += 1
                nx._pf_marked.add(e)
                nx._pf_pending.append((e, placed[0]))
        nx.counters.prefetch_ns += time.perf_counter_ns() - t0

    def _file_readable(self, call: _Call) -> bool:
        """Whether loads may read the mapping now (a changed file is left to the next call to report)."""
        if call.checked:
            return True
        try:
            self.store.check_unchanged()
        except ModelFileError:
            return False
        return True

    def _count_call(self, call: _Call) -> None:
        c = self.counters
        c.calls += 1
        c.routed += call.ids.size
        c.distinct += len(call.experts)
        c.rounds += len(call.rounds)
        c.invalidated = self.cache.counters.invalidated
        c.device_ns += time.perf_counter_ns() - call.t0

    def _seconds(self, kind: str, nbytes: int, rows: int, measured_ns: int) -> float:
        """What the cost model observes: the measured time, or the synthetic clock's (deterministic runs)."""
        if self.clock is None:
            return measured_ns / 1e9
        return self.clock.seconds(kind, nbytes, rows)

    def close(self) -> None:
        self._slot_rows.close()
        self._buckets.clear()
        if self._own_shared:
            self._shared.close()
            self._slot_rows.shared.close()
        self.ctx.close()
