"""The device expert cache as a region executor: one MoE layer's routed experts, the Python reference.

Each layer owns ``n_slots`` expert slots on the device (plus one zeroed pad slot) for each expert tensor (gate,
up, down or the fused gate_up). A call reads the routed expert ids and places them: with ``moe_cpu_share`` > 0
a share of the misses goes to the session's CPU worker (started first, so it overlaps the device work); the rest
asks the :class:`~ggml_hybrid.moe.slot_cache.SlotCache` for a plan (hits first, then misses loaded into slots,
in rounds when the call needs more experts than there are slots). A single round with no CPU rows runs
``mul_mat_id`` over the slot tensors with the ids remapped to slots (rows of other experts point at the pad
slot); otherwise each round computes only its own rows, compacted (see :mod:`ggml_hybrid.moe.row_graphs`) on a
CPU backend, and on any other device through the call's own graph with the other rows on the pad slot (a GPU
backend picks ``mul_mat_id``'s kernel by the token count), and the rows merge on the host. Either way every
expert sees exactly the rows, in the same order, as in the resident ``mul_mat_id``, which makes the result
bit-identical on the CPU. The weighted sum over the selected experts is then built with the same ops as the
resident graph.

With the host tier (``host_tier_bytes``, :mod:`.host_tier`) the loads and the CPU's rows read the tier instead
of the mapping (its reads started as soon as a call knows its experts), and a CPU playing the device computes
every expert straight from the tier's frames (``tier_direct``: no slots).

A call runs the steps of its mode (:data:`~.layer_cache.STEPS`, the one list: ``_native/src/moe_call.c``), one
method each; the native executor (``_native/src/moe_*.c``) has a function of the same name for each, so that
the two read side by side. Lookahead prefetch (``moe_prefetch``, :meth:`ExpertCacheExecutor.set_prefetch`): a
call predicts the next disk layer's experts by that layer's router (``predict``), and after the call loads the
predicted misses into its slots (``prefetch``); the next layer's call commits them and scores the prediction
(``settle_prefetch``). Only where and when an expert is loaded changes, never a result.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, ClassVar

import numpy as np

from .._native import ffi, lib
from ..errors import ModelFileError, OptionError
from ..ggml import rpc
from ..ggml.backend import Backend
from ..ggml.context import Arena, Context
from ..ggml.graph_cache import GraphCache, SharedBuffer
from ..ggml.regions import RegionCall
from ..gguf.store import GGUFStore
from .call_graphs import BUCKET_GRAPH, BUCKET_TENSORS, MAX_BUCKETS, Bucket, HostScratch, compute, read_rows
from .cpu_share import CostModel, MissSplit, split_misses
from .cpu_worker import CPUWorker
from .ffn import ExpertWeights
from .layer_cache import (
    STEPS,
    LayerCacheConfig,
    LayerCounters,
    SyntheticClock,
    allocate_slots,
    slot_tensors,
    tier_views,
)
from .row_graphs import RowGraphs
from .slot_cache import Round, SlotCache


class _Call:
    """The state of one layer call, handed from step to step (the C executor's ``hy_call``)."""

    __slots__ = ("t0", "x", "ids_t", "w", "out", "n_tokens", "ids", "counts", "experts", "split", "cpu", "checked",
                 "cpu_rows", "xv", "t_submit", "job", "job_out", "rounds", "bucket", "on_host", "d0", "d1",
                 "predicted", "cand")

    ids: np.ndarray          # [T, k] routed expert ids
    counts: np.ndarray       # [n_expert] rows of each expert
    experts: np.ndarray      # the distinct experts, in id order
    cpu_rows: np.ndarray     # [T, k]: the rows the CPU computes
    t_submit: int
    bucket: Bucket          # the graphs and host arrays of this token count
    on_host: bool            # rounds compute their own rows, compacted, merged on the host
    d0: int                  # the device rounds' start and end (tier-direct: the tier's reads' start)
    d1: int

    def __init__(self, region: RegionCall) -> None:
        self.t0 = time.perf_counter_ns()
        self.x, self.ids_t, self.w = region.inputs
        self.out = region.outputs[0]
        self.n_tokens: int = self.x.ptr.ne[2]
        self.split: MissSplit | None = None  # where the misses go (None: no CPU share)
        self.cpu: list[int] = []  # the misses the CPU computes, in id order
        self.checked = False  # the model file was found unchanged in this call
        self.xv: np.ndarray | None = None  # x on the host, [T, n_embd]
        self.job: cf.Future[tuple[np.ndarray, int, int]] | None = None  # the CPU worker's: rows, start, end
        self.job_out = False  # the worker has the CPU's rows, not yet waited for
        self.rounds: list[Round] = []
        self.predicted = False  # this call predicted the next layer's experts
        self.cand: list[int] = []  # the predicted misses of the next layer's slots, in load order


class ExpertCacheExecutor:
    """Region executor for one layer: resident hits, misses loaded into device slots (the reference of
    :class:`~.native_executor.NativeExpertExecutor`; both satisfy :class:`~.layer_cache.LayerExecutor`)."""

    native: ClassVar[bool] = False

    def __init__(self, store: GGUFStore, names: dict[str, str], device: Backend, config: LayerCacheConfig, *,
                 shared: tuple[SharedBuffer, SharedBuffer] | None = None,
                 simulated_bus_bytes_per_s: float | None = None) -> None:
        """``shared``: the compute buffers (slot graphs, row graphs) to place the graphs in, shared with the other
        layers' executors on this device (layers never run at the same time); default: its own.
        ``simulated_bus_bytes_per_s`` (benchmarks on a machine without a bus): each load also waits
        bytes / bandwidth."""
        cfg = self.config = config
        if cfg.worker is not None and not isinstance(cfg.worker, CPUWorker):
            raise OptionError("ExpertCacheExecutor: its CPU worker is a CPUWorker (the native one is C's)")
        self.store, self.names, self.device = store, names, device
        self.layer, self.n_used, self.glu, self.n_slots = cfg.layer, cfg.n_used, cfg.glu, cfg.n_slots
        self.worker: CPUWorker | None = cfg.worker if cfg.cpu_share else None
        self.cost = CostModel.for_link(rpc.link_of(device.endpoint)) if cfg.share == "auto" else None
        self.clock: SyntheticClock | None = None  # set by tests and replays that need repeatable decisions
        self.simulated_bus = simulated_bus_bytes_per_s
        self.trace = cfg.trace  # a TraceWriter shared by the session's layers, or None
        infos = {k: store.info(n) for k, n in names.items()}
        self.n_expert, self.n_embd = infos["down"].shape[0], infos["down"].shape[1]
        self.cache = SlotCache(self.n_expert, cfg.n_slots, cfg.policy)
        self.pad_slot = cfg.n_slots  # the extra, zeroed slot that absorbs rows outside a round
        self.ctx, self.slot_tensors = slot_tensors(infos, cfg.n_slots)
        direct = self.tier_direct
        self.buffers = allocate_slots(self.ctx, self.slot_tensors, device, cfg.repack and not direct,
                                      virtual=not cfg.clear or direct, clear=cfg.clear and not direct)
        self.slots = ExpertWeights(**self.slot_tensors)
        # per expert (slot): 3-D matrices and 2-D biases alike
        self.expert_nbytes = {k: t.nbytes // (cfg.n_slots + 1) for k, t in self.slot_tensors.items()}
        # per kind: (slot tensor, first byte of the expert tensor in the mapping, bytes per expert)
        self._raw = {k: np.asarray(store.raw(n)) for k, n in names.items()}
        self._copies = [(self.slot_tensors[k].ptr, ffi.cast("char *", self._raw[k].ctypes.data), self.expert_nbytes[k])
                        for k in names]
        self._slot_of = np.empty(self.n_expert, np.int32)
        self.expert_bytes = sum(self.expert_nbytes.values())
        self._own_shared = shared is None
        shared = shared or (SharedBuffer(device), SharedBuffer(device))
        self._slot_rows = RowGraphs(self.slots, device, self.n_embd, cfg.glu, shared[1])  # compacted rounds
        self._compact = device.is_cpu or rpc.computes_on_cpu(device)  # compacted rounds on a CPU, also a remote one
        self.counters = LayerCounters()
        # one graph pair per token count, the least recently used dropped first: prompts of ever new
        # lengths must not grow memory (decode and recent lengths stay warm); all share one buffer
        self._buckets: GraphCache[Bucket] = GraphCache(
            MAX_BUCKETS, Context.size_for(BUCKET_TENSORS, graph_size=BUCKET_GRAPH))
        self._shared = shared[0]
        self._host = HostScratch(cfg.n_used, self.n_embd)
        self.route = None if cfg.route is None else np.ascontiguousarray(cfg.route, np.int32)
        self._route_pos = 0
        # the host tier: this layer's index in it, and its arena seen as the layer's expert tensors (made at the
        # first call that needs them: the arena exists once every layer is registered)
        self.tier = cfg.tier
        self.tier_layer = cfg.tier.add_layer(cfg.layer, names) if cfg.tier is not None else -1
        self._frames: tuple[Context, ExpertWeights] | None = None
        self._last: dict[str, Any] = {"rounds": [], "cpu": ()}
        # lookahead prefetch, as the predicting layer (set_prefetch) and as the predicted one
        self._next: ExpertCacheExecutor | None = None
        self._router: np.ndarray | None = None  # float64 [n_expert of next, n_embd]
        self._router_bias: np.ndarray | None = None
        self._select_bias: np.ndarray | None = None
        self._pf_max = self._pf_max_tokens = self._ahead_max = 0
        self._prediction: np.ndarray | None = None  # a prediction for the coming call, not yet judged
        self.predicted: tuple[int, ...] = ()  # the last prediction for this layer, most-voted first
        self._pf_marked: set[int] = set()  # prefetched, not yet judged
        self._pf_pending: list[tuple[int, int]] = []  # (expert, slot) loads to commit when the call starts
        self._steps = tuple("_" + s for s in STEPS[cfg.mode])  # looked up per call: tests may wrap a step

    @property
    def tier_direct(self) -> bool:
        return self.config.mode == "direct"

    @property
    def mode(self) -> str:
        """Which step order its calls run (:data:`~.layer_cache.STEPS`)."""
        return self.config.mode

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
        """Device bytes of the slots, the pad slot included (none when the experts run from the tier's frames)."""
        return 0 if self.tier_direct else sum(t.nbytes for t in self.slot_tensors.values())

    def last_decision(self) -> dict[str, Any]:
        """The last call's plan: ``rounds`` of (hits, loads, evicted), ``cpu``, the experts the CPU computed."""
        return self._last

    def set_prefetch(self, next_layer: ExpertCacheExecutor | None, router: np.ndarray | None,
                     router_bias: np.ndarray | None = None, select_bias: np.ndarray | None = None,
                     max_experts: int = 0, max_tokens: int = 0, max_read_ahead: int = 0) -> None:
        """Predict ``next_layer``'s experts in each call of at most ``max_tokens`` tokens and load up to
        ``max_experts`` predicted misses into its slots after the call, reading up to ``max_read_ahead`` of them
        ahead into the host tier (``moe_exec.h: hy_moe_exec_set_prefetch`` states the rule). ``router`` [next's
        n_expert, n_embd]; None with a ``next_layer`` that follows a route trace: the trace's coming rows (an
        oracle, benchmarks). ``next_layer=None``: off."""
        self._next = None
        if next_layer is None or next_layer is self or (router is None and next_layer.route is None):
            return
        self._next = next_layer
        self._router = None if router is None else np.asarray(router, np.float64)
        self._router_bias = None if router_bias is None else np.asarray(router_bias, np.float64)
        self._select_bias = None if select_bias is None else np.asarray(select_bias, np.float64)
        self._pf_max, self._pf_max_tokens, self._ahead_max = max_experts, max_tokens, max_read_ahead

    def reserve(self, n_tokens: int) -> None:
        """Grow the compute memory to what a call of ``n_tokens`` tokens needs, the most a call can need:
        its graphs over the slots, and on a CPU backend the row graphs of all its rows (every (token, expert) pair;
        another device runs a round through the call's graph)."""
        self._bucket(n_tokens)
        if self._compact and not self.tier_direct:
            self._slot_rows.reserve(n_tokens * self.n_used)

    def _bucket(self, n_tokens: int) -> Bucket:
        experts = self._tier_views() if self.tier_direct else self.slots

        def build(arena: Arena) -> Bucket:
            b = Bucket(experts, self.device, n_tokens, self.n_used, self.n_embd, self.glu, arena, self._host)
            if self._shared.place(b.ctx):  # grown: the graphs placed in the old buffer go
                self._buckets.clear()
            b.pointers()
            return b

        return self._buckets.get(n_tokens, build)

    # -- a call: the steps of its mode, one method each, the C executor's functions of the same names -------

    def __call__(self, region: RegionCall) -> None:
        call = _Call(region)
        ok = False
        try:
            for step in self._steps:
                getattr(self, step)(call)
            ok = True
        finally:
            if not ok and call.predicted and self._next is not None:
                self._next._withdraw_prediction()  # a failed call predicts nothing
            self._clean_up(call)

    def _read_ids(self, call: _Call) -> None:
        """The routed ids, read (from any backend, strides included) and traced."""
        call.ids = read_rows(call.ids_t, call.n_tokens, self.n_used, np.int32)
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
        self._last = {"rounds": [], "cpu": ()}

    def _cpu_split(self, call: _Call) -> None:
        """Which misses the CPU computes (none when every expert goes through the cache)."""
        if self.worker is None:
            return
        experts, rows = call.experts.tolist(), call.counts[call.experts].tolist()
        resident = self.cache.resident()
        if self.cost is not None:
            split = self.cost.choose(experts, rows, resident, self.expert_bytes, self.cache.reuse_key, self.n_slots)
        else:
            assert isinstance(self.config.share, float)  # "auto" has a model
            split = split_misses(experts, rows, resident, self.config.share, self.cache.reuse_key)
        if split.n_misses:
            self.counters.share_calls += 1
            self.counters.share_sum += split.share
        call.split = split
        call.cpu = sorted(split.cpu_misses)
        self._last["cpu"] = tuple(call.cpu)

    def _fetch_cpu(self, call: _Call) -> None:
        """The host tier starts reading the CPU's experts first, before the device's loads, so that the worker,
        which waits for them, starts as early as it can."""
        self._tier_fetch(call.cpu)

    def _plan(self, call: _Call) -> None:
        """The device's experts (those the CPU does not take) planned in the slot cache: hits, then loads by round."""
        device = np.setdiff1d(call.experts, call.cpu, assume_unique=True) if call.cpu else call.experts
        # experts come from a bincount: distinct, in range, with positive row counts
        call.rounds = self.cache.plan(device.tolist(), call.counts[device].tolist(), checked=False,
                                      deferred_loads=True)
        self._last["rounds"] = [(tuple(r.hits), tuple(r.loads), tuple(r.evicted)) for r in call.rounds]
        if call.cpu:
            self.cache.note_cpu(call.cpu)  # the CPU's requests count in the layer's history
        if self.config.mode == "slots" and not call.checked and any(rnd.loads for rnd in call.rounds):
            self.store.check_unchanged()  # loads read the mapping: a truncated file would kill us (SIGBUS)
        call.bucket = self._bucket(call.n_tokens)
        # one round and no CPU rows: the full graph over the slots, nothing leaves the device; otherwise
        # each round computes only its own rows (compacted) and the rows merge on the host
        call.on_host = bool(call.cpu) or len(call.rounds) > 1

    def _fetch_loads(self, call: _Call) -> None:
        """The host tier starts reading every round's misses as soon as the plan names them, several in flight;
        each load waits for its own."""
        self._tier_fetch([e for rnd in call.rounds for e, _ in rnd.loads])

    def _submit_cpu(self, call: _Call) -> None:
        """The CPU's rows handed to the worker first, so that it computes them while the device works."""
        if not call.cpu or self.worker is None:
            return
        self.store.check_unchanged()  # the worker reads the mapping: a truncated file would kill us (SIGBUS)
        call.checked = True
        on_cpu = np.zeros(self.n_expert, bool)
        on_cpu[call.cpu] = True
        call.cpu_rows = on_cpu[call.ids]
        experts = self.config.host_experts
        expert_of_row = call.ids[call.cpu_rows]
        if self.config.mode == "tier":  # each CPU expert's frame (its read started by _fetch_cpu) is its index
            experts = self._tier_views()
            frame = np.zeros(self.n_expert, np.int32)
            for e in call.cpu:
                frame[e] = self._frame_of(e)
            expert_of_row = frame[expert_of_row]
        assert experts is not None  # a worker comes with the host experts
        call.xv = call.x.numpy().reshape(call.n_tokens, self.n_embd)
        tok = np.nonzero(call.cpu_rows)[0]  # row-major (token, expert) order, as mul_mat_id groups rows
        call.t_submit = time.perf_counter_ns()
        call.job = self.worker.submit(self.layer, experts, call.xv[tok], expert_of_row, self.glu)
        call.job_out = True
        self.counters.cpu_misses += len(call.cpu)
        self.counters.cpu_rows += int(call.cpu_rows.sum())

    def _run_rounds(self, call: _Call) -> None:
        """Every round of the plan, in order."""
        if call.on_host and call.xv is None:
            call.xv = call.x.numpy().reshape(call.n_tokens, self.n_embd)
        call.d0 = time.perf_counter_ns()
        for rnd in call.rounds:
            self._run_round(call, rnd)
        call.d1 = time.perf_counter_ns()

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
        """Copy ``expert`` from the mapping (or the host tier, which reads it first if it has not yet) into ``slot``
        of every expert tensor; the bytes copied."""
        if self.tier is None:
            sources = [src + expert * nbytes for _, src, nbytes in self._copies]
        else:
            srcs = ffi.new("const uint8_t *[]", len(self._copies))  # one source per kind: matrices and biases
            if lib.hy_tier_get(self.tier.ptr, self.tier_layer, expert, srcs, ffi.NULL) != 0:
                self.tier.raise_error()
            sources = [srcs[k] for k in range(len(self._copies))]
        n = 0
        for (slots, _, nbytes), src in zip(self._copies, sources):
            lib.ggml_backend_tensor_set(slots, src, slot * nbytes, nbytes)
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
        compute(self.device.ptr, b.pg_experts)
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
                compute(self.device.ptr, b.pg_experts)
                rows = read_rows(b.down, sel.size, self.n_embd, np.float32).reshape(b.merged.shape)
                b.merged[sel] = rows[sel]
            return n, time.perf_counter_ns() - t
        assert call.xv is not None  # read by _run_rounds for every call that computes on the host
        sel = b.slot_ids != self.pad_slot
        t = time.perf_counter_ns()
        b.merged[sel] = self._slot_rows.compute(call.xv[np.nonzero(sel)[0]], b.slot_ids[sel], self.pad_slot)
        return int(np.count_nonzero(sel)), time.perf_counter_ns() - t

    def _merge(self, call: _Call) -> None:
        """The worker's rows, waited for, merged with the device's."""
        if call.job is None or not call.job_out:
            return
        call.job_out = False
        rows_out, c0, c1 = call.job.result()  # re-raises a failure of the worker here
        call.bucket.merged[call.cpu_rows] = rows_out
        c = self.counters
        c.cpu_ns += c1 - c0
        c.overlap_ns += max(0, min(call.d1, c1) - max(call.d0, c0)) if call.rounds else 0
        if self.cost is not None:
            cpu_bytes = len(call.cpu) * self.expert_bytes
            cpu_s = self._seconds("cpu", cpu_bytes, len(rows_out), c1 - c0)
            self.cost.observe_cpu(cpu_bytes, len(rows_out), cpu_s)
            self.cost.observe_cpu_job(self._seconds("job", 0, 0, c0 - call.t_submit))

    def _weighted_sum(self, call: _Call) -> None:
        """The weighted sum over each token's experts, with the resident graph's ops, into the region's output."""
        # the worker and the loads read the mapping: a read past the end of a file truncated meanwhile gave
        # zeros (the mapping's guard), which must not reach the output
        self.store.check_reads()
        if call.on_host:
            lib.ggml_backend_tensor_set(call.bucket.p_experts, call.bucket.b_merged, 0, call.bucket.merged.nbytes)
        self._sum_into_output(call.bucket, call)

    def _sum_into_output(self, b: Bucket, call: _Call) -> None:
        lib.ggml_backend_tensor_copy(call.w.ptr, b.p_w)
        t = time.perf_counter_ns()
        compute(self.device.ptr, b.pg_sum)
        self.counters.compute_ns += time.perf_counter_ns() - t
        lib.ggml_backend_tensor_copy(b.p_out, call.out.ptr)

    def _count_call(self, call: _Call) -> None:
        c = self.counters
        c.calls += 1
        c.routed += call.ids.size
        c.distinct += len(call.experts)
        c.rounds += len(call.rounds)
        c.device_ns += time.perf_counter_ns() - call.t0

    def _clean_up(self, call: _Call) -> None:
        """What no call may leave behind, done or failed: the worker on the tier's frames (they could be evicted
        once released), the tier's experts pinned."""
        if call.job is not None and call.job_out:
            cf.wait([call.job])  # its failure is the call's failure's consequence, reported by that one
        if self.tier is not None:
            lib.hy_tier_release(self.tier.ptr)  # its reads in flight are done; its experts can be evicted again
        self.counters.invalidated = self.cache.counters.invalidated

    def _seconds(self, kind: str, nbytes: int, rows: int, measured_ns: int) -> float:
        """What the cost model observes: the measured time, or the synthetic clock's (deterministic runs)."""
        if self.clock is None:
            return measured_ns / 1e9
        return self.clock.seconds(kind, nbytes, rows)

    # -- the host tier's steps ------------------------------------------------------------------------------

    def _tier_views(self) -> ExpertWeights:
        if self._frames is None:
            assert self.tier is not None
            self._frames = tier_views(self.tier, self.tier_layer, self.slot_tensors)
        return self._frames[1]

    def _tier_fetch(self, experts: list[int]) -> None:
        assert self.tier is not None
        if experts and lib.hy_tier_fetch(self.tier.ptr, self.tier_layer, ffi.new("int32_t[]", experts),
                                         len(experts)) != 0:
            self.tier.raise_error()

    def _frame_of(self, expert: int) -> int:
        """``expert``'s frame in the tier, its read waited for."""
        assert self.tier is not None
        frame = ffi.new("int *")
        if lib.hy_tier_get(self.tier.ptr, self.tier_layer, expert, ffi.NULL, frame) != 0:
            self.tier.raise_error()
        return int(frame[0])

    def _fetch_direct(self, call: _Call) -> None:
        """Tier-direct: every expert of the call read (or found) in the tier, the reads started now."""
        self._tier_views()
        call.d0 = time.perf_counter_ns()
        self._tier_fetch(call.experts.tolist())

    def _compute_direct(self, call: _Call) -> None:
        """Tier-direct: the whole graph over the tier's frames, as the resident graph computes it, once every
        expert's read is done; no slot, no copy. The call's experts count as hits (none needed a load)."""
        slot_of = self._slot_of
        for e in call.experts.tolist():
            slot_of[e] = self._frame_of(e)
        t2 = time.perf_counter_ns()
        b = self._bucket(call.n_tokens)
        np.take(slot_of, call.ids, out=b.slot_ids)
        lib.ggml_backend_tensor_copy(call.x.ptr, b.p_x)
        lib.ggml_backend_tensor_set(b.p_ids, b.b_slot_ids, 0, b.slot_ids.nbytes)
        compute(self.device.ptr, b.pg_experts)
        lib.ggml_backend_tensor_copy(b.p_down, b.p_experts)
        compute_ns = self.counters.compute_ns
        self._sum_into_output(b, call)
        c = self.counters
        c.compute_ns = compute_ns + time.perf_counter_ns() - t2
        c.load_ns += t2 - call.d0  # waiting for the tier's reads
        c.hits += len(call.experts)

    # -- the lookahead -----------------------------------------------------------------------------------------

    def _settle_prefetch(self, call: _Call) -> None:
        """The previous layer's prefetch into this layer: its loads committed, its prediction scored (and the host
        tier's read-ahead for it judged)."""
        for expert, slot in self._pf_pending:
            self.cache.commit(slot, expert)
        self._pf_pending = []
        if self._prediction is None:
            return
        if self.tier is not None:
            experts = call.experts.astype(np.int32)
            lib.hy_tier_settle(self.tier.ptr, self.tier_layer, ffi.from_buffer("int32_t[]", experts), len(experts))
        c = self.counters
        actual = set(call.experts.tolist())
        c.predicted += len(self._prediction)
        c.predicted_of += len(actual)
        c.predicted_right += len(actual.intersection(self._prediction.tolist()))
        c.prefetch_used += len(self._pf_marked & actual)
        c.prefetch_wasted += len(self._pf_marked - actual)
        self._pf_marked = set()
        self._prediction = None

    def _withdraw_prediction(self) -> None:
        """A prediction of this layer's coming call withdrawn unjudged (its call never ran, or the predicting call
        failed): what it loaded or read ahead is wasted."""
        if self._prediction is None:
            return
        if self.tier is not None:
            lib.hy_tier_settle(self.tier.ptr, self.tier_layer, ffi.NULL, 0)
        self.counters.prefetch_wasted += len(self._pf_marked)
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

    def _predict(self, call: _Call) -> None:
        """As soon as the call's own loads are planned: predict the next layer's experts from this call's x, and
        with a host tier start reading the predicted misses it lacks (they overlap this call)."""
        nx = self._next
        if nx is None or call.n_tokens > self._pf_max_tokens:
            return
        t0 = time.perf_counter_ns()
        nx._withdraw_prediction()  # never judged (the next layer's call did not run)
        votes = self._votes(call)
        nx._prediction = np.flatnonzero(votes)
        # most-voted first, ties by the lower id: the order the misses among it load in (and the trace's)
        nx.predicted = tuple(sorted(nx._prediction.tolist(), key=lambda e: (-votes[e], e)))
        call.cand = [e for e in nx.predicted if not nx.cache.holds(e)]
        call.predicted = True
        if nx.tier is not None and call.cand and self._ahead_max > 0:
            ahead = call.cand[:self._ahead_max]
            lib.hy_tier_read_ahead(nx.tier.ptr, nx.tier_layer, ffi.new("int32_t[]", ahead), len(ahead))
        nx.counters.prefetch_ns += time.perf_counter_ns() - t0

    def _prefetch(self, call: _Call) -> None:
        """After the call: load the predicted misses (:meth:`_predict`) into the next layer's free or evictable
        slots; with a host tier, only those it holds (the others load from it in the next layer's call)."""
        nx = self._next
        if nx is None or not call.cand or self._pf_max <= 0:
            return
        t0 = time.perf_counter_ns()
        keep = frozenset(nx.predicted)
        if nx.tier is not None or self._file_readable(call):
            n_loaded = 0
            for e in call.cand:
                if n_loaded >= self._pf_max:
                    break
                if nx.tier is not None and not lib.hy_tier_holds(nx.tier.ptr, nx.tier_layer, e):
                    continue  # still being read: the call loads it from the tier, never waiting here for the disk
                placed = nx.cache.prefetch(e, keep)
                if placed is None:
                    break
                try:
                    nbytes = nx._load(e, placed[0])
                except ModelFileError:  # the tier refused (the file changed): the next call reports it
                    break
                n_loaded += 1
                nx.counters.bytes_prefetched += nbytes
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

    def close(self) -> None:
        self._slot_rows.close()
        self._buckets.clear()
        if self._own_shared:
            self._shared.close()
            self._slot_rows.shared.close()
        if self._frames is not None:
            self._frames[0].close()
        self.ctx.close()


__all__ = ["ExpertCacheExecutor"]
