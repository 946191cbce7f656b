"""Where each layer's routed experts live, per the session options, and who runs them.

- *resident* (default): the expert tensors are loaded into device memory; the plain graph;
- ``cpu_moe`` / ``n_cpu_moe=N``: the expert tensors of all / the first N layers stay on the
  memory-mapped file, a host buffer, so the scheduler runs their ``mul_mat_id`` where they live
  (llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe``), without a region;
- ``disk_experts``: the expert tensors stay on the mapped file and each layer's routed experts
  are a region run by an :class:`ExpertCacheExecutor` with ``expert_cache_slots`` device slots
  (and, with ``moe_cpu_share``, a CPU worker for a share of the misses).

Layers without routed experts (a model's leading dense layers) have none of this: their entries
are ``None`` and they are never traced (trace layer i is the model's i-th MoE layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, cast

import numpy as np

from .._native import CData, ffi, lib
from ..files import check_output
from ..ggml.backend import Backend
from ..ggml.context import Context
from ..ggml.graph_cache import SharedBuffer
from ..ggml.quant import dequantize
from ..ggml.regions import NativeExecutor, RegionCall
from ..ggml.repack import repack_buffer_type
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..gguf.store import GGUFStore, ModelFileError, load_into, repack_rule, same_shape
from ..machine import available_memory
from ..options import OptionError, SessionOptions
from .cpu_worker import CPUWorker, NativeWorker
from .executor import ExpertCacheExecutor
from .ffn import ExpertWeights, MoERegion
from .host_tier import HostTier, check_tier_budget, frame_bytes, resolve_budget
from .layer_cache import LayerCacheConfig, LayerCounters, LayerExecutor
from .native_executor import NativeExpertExecutor, Scratch
from .traces import TraceWriter, read_trace

# lookahead prefetch predicts after calls of at most this many tokens: decode steps and small batches (a prompt's
# call routes to most experts anyway, and its prediction would cost a matrix product of the router per token)
PREFETCH_MAX_TOKENS = 16

# where a layer's routed experts live and run: on the device (resident), in place on the mapped file (cpu), streamed
# into the device's expert cache (disk); a dense layer has none
ExpertMode = Literal["resident", "cpu", "disk", "dense"]


def suggested_slots(n_expert: int, n_used: int = 0) -> int:
    """A first expert cache size to try: a quarter of the experts, at least the experts used per token."""
    return min(n_expert, max(n_expert // 4, n_used, 1))


def slots_needed(opts: SessionOptions, n_expert: int, n_used: int = 0) -> OptionError:
    """The refusal of a disk-experts session without expert cache slots where its layers use them."""
    s = suggested_slots(n_expert, n_used)
    used = f", at least the {n_used} used per token" if n_used else ""
    tier = (" (a CPU playing the device computes straight from the host tier's frames, without slots, only without "
            "a CPU share and with experts it does not repack: --no-repack or a type it does not repack)"
            if opts.host_tier_bytes != 0 else "")
    return OptionError(f"expert_cache_slots={opts.expert_cache_slots}: disk_experts=true (--disk-experts; a non-zero "
                       f"--moe-cpu-share or --host-tier implies it) needs expert cache slots per layer{tier}: give "
                       f"--expert-cache-slots N (-o expert_cache_slots=N), e.g. {s} (a quarter of the model's "
                       f"{n_expert} experts{used}; `ggml-hybrid plan --vram ...` sizes it)")


def check_moe_options(opts: SessionOptions, n_layer: int, n_expert: int, n_used: int = 0) -> None:
    """Reject option combinations that cannot work for this model, before anything is loaded."""
    if opts.expert_cache_slots == "auto":
        raise OptionError("expert_cache_slots=auto: the slot count is chosen from the devices' free memory when a "
                          "model loads (MoEModel, `ggml-hybrid plan`); this session needs a number of slots")
    slots = cast(int, opts.expert_cache_slots)
    # with the host tier, a CPU playing the device may not use slots at all: ExpertLayers decides (_cache_slots)
    if opts.disk_experts and slots < 1 and opts.host_tier_bytes == 0:
        raise slots_needed(opts, n_expert, n_used)
    if slots > n_expert:
        raise OptionError(f"expert_cache_slots={opts.expert_cache_slots}: the model has only "
                          f"{n_expert} experts per layer")
    if opts.n_cpu_moe > n_layer:
        raise OptionError(f"n_cpu_moe={opts.n_cpu_moe}: the model has only {n_layer} layers")
    if opts.moe_cpu_share != 0.0 and not opts.disk_experts:
        raise OptionError(f"moe_cpu_share={opts.moe_cpu_share}: a CPU share of cache misses needs "
                          "disk_experts=true (with resident or CPU-placed experts there are no misses)")
    if opts.host_tier_bytes != 0 and not opts.disk_experts:
        raise OptionError(f"host_tier_bytes={opts.host_tier_bytes}: the host tier feeds the expert cache's loads, "
                          "which needs disk_experts=true (--disk-experts; --expert-cache-slots implies it)")
    if opts.trace_path is not None and not opts.disk_experts:
        raise OptionError(f"trace_path={opts.trace_path}: routing traces are recorded by the expert cache "
                          "(disk_experts=true)")
    # an option that would silently do nothing is refused
    if slots and not opts.disk_experts:
        raise OptionError(f"expert_cache_slots={opts.expert_cache_slots}: the slots belong to the expert cache, "
                          "which needs disk_experts=true (--disk-experts; --expert-cache-slots implies it)")
    for name, on in (("moe_prefetch", opts.moe_prefetch), ("moe_route_trace", opts.moe_route_trace is not None)):
        if on and not opts.disk_experts:
            raise OptionError(f"{name}={getattr(opts, name)}: it acts on the expert cache's loads, which needs "
                              "disk_experts=true")
    if opts.moe_prefetch_bytes and not opts.moe_prefetch:
        raise OptionError(f"moe_prefetch_bytes={opts.moe_prefetch_bytes}: it bounds the lookahead prefetch, "
                          "which needs moe_prefetch=true")
    if opts.expert_eviction != SessionOptions().expert_eviction and not opts.disk_experts:
        raise OptionError(f"expert_eviction={opts.expert_eviction}: the eviction order belongs to the expert cache, "
                          "which needs disk_experts=true")


def route_rows(path: str, n_moe_layers: int, n_expert: int, n_used: int) -> list[np.ndarray]:
    """``moe_route_trace``: for each of the model's MoE layers, the token rows ``[n, n_used]`` of its trace layer
    (MoE layer i reads trace layer i modulo the trace's layers), in the trace's call order."""
    trace = read_trace(path)
    if (trace.n_expert, trace.n_used) != (n_expert, n_used):
        raise OptionError(f"moe_route_trace={path}: the trace routes {trace.n_used} of {trace.n_expert} experts per "
                          f"token, the model {n_used} of {n_expert}; generate a model with the trace's "
                          "n_expert and n_expert_used")
    by_layer: list[list[np.ndarray]] = [[] for _ in range(trace.n_layer)]
    for layer, ids in trace.calls:
        by_layer[layer].append(ids)
    if any(not rows for rows in by_layer):
        raise OptionError(f"moe_route_trace={path}: a layer of the trace has no call")
    return [np.concatenate(by_layer[i % trace.n_layer]).astype(np.int32) for i in range(n_moe_layers)]


def router_f32(store: GGUFStore, name: str) -> np.ndarray:
    """A dense tensor of the file as float32 (the router's weights and biases, for the prefetch's prediction)."""
    info = store.info(name)
    raw = np.ascontiguousarray(store.raw(name))
    if info.dtype.name in ("F32", "F16"):
        return raw.view(info.dtype.numpy_dtype).astype(np.float32).reshape(info.shape)
    return dequantize(raw.reshape(-1), info.dtype, info.shape[-1]).reshape(info.shape)  # bf16, quantized


def expert_names(store: GGUFStore, i: int) -> dict[str, str]:
    """Layer i's routed-expert tensors by :class:`ExpertWeights` field: the matrices, and their biases if any."""
    fused = f"blk.{i}.ffn_gate_up_exps.weight" in store
    kinds = ("gate_up", "down") if fused else ("gate", "up", "down")
    names = {k: f"blk.{i}.ffn_{k}_exps.weight" for k in kinds}
    names.update({f"{k}_b": f"blk.{i}.ffn_{k}_exps.bias" for k in kinds if f"blk.{i}.ffn_{k}_exps.bias" in store})
    return names


def check_expert_shapes(store: GGUFStore, layers: Sequence[int], n_expert: int, n_embd: int) -> None:
    for i in layers:
        names = expert_names(store, i)
        shapes = {k: store.info(n).shape for k, n in names.items()}
        down = shapes["down"]
        n_ff = down[2] if len(down) == 3 else -1
        want = {"down": (n_expert, n_embd, n_ff), "gate": (n_expert, n_ff, n_embd),
                "up": (n_expert, n_ff, n_embd), "gate_up": (n_expert, 2 * n_ff, n_embd),
                "gate_b": (n_expert, n_ff), "up_b": (n_expert, n_ff), "down_b": (n_expert, n_embd)}
        for kind, shape in shapes.items():
            if not same_shape(shape, want[kind]):
                raise ModelFileError(f"{store.path!r}: {names[kind]} has shape {shape}, expected {want[kind]} "
                                     f"for {n_expert} experts of width {n_embd}")


class ExpertLayers:
    """The routed experts of ``n_layer`` layers, placed and (for disk layers) cached per ``options``.

    ``moe_layers`` are the layers with routed experts (default: all); the lists here have one entry
    per layer, ``None`` for the others. A draft head's block is one more of them (the lookahead leaves it out).
    ``modes`` gives each layer's expert mode (resident, cpu or disk) and ``backend_of`` maps a tensor name to the
    backend holding it (resident tensors) or serving its cache (disk layers); without them every layer follows
    ``options`` with ``device`` (the FFN-stack session's single device). ``glu`` is the experts' gated unit.
    """

    def __init__(self, store: GGUFStore, n_layer: int, n_used: int, options: SessionOptions, device: Backend,
                 n_threads: int, simulated_bus_bytes_per_s: float | None = None,
                 on_tensor: Callable[[str], None] | None = None,
                 modes: list[ExpertMode] | None = None, backend_of: Callable[[str], Backend | None] | None = None,
                 load: bool = True, moe_layers: Sequence[int] | None = None, glu: str = "swiglu",
                 benchmark: bool = False) -> None:
        self.store, self.options, self.device = store, options, device
        self.n_layer, self.n_used, self.glu, self.load = n_layer, n_used, glu, load
        self.moe_layers = list(range(n_layer)) if moe_layers is None else list(moe_layers)
        self.named = {i: expert_names(store, i) for i in self.moe_layers}
        self.names: list[dict[str, str] | None] = [self.named.get(i) for i in range(n_layer)]
        self.n_expert = store.info(self.named[self.moe_layers[0]]["down"]).shape[0]
        self.modes = list(modes) if modes is not None else [self._mode_from_options(i) for i in range(n_layer)]
        self.disk_layers = [i for i in self.moe_layers if self.modes[i] == "disk"]
        self.backend_of: Callable[[str], Backend | None] = backend_of or (lambda name: device)
        self.route_trace = options.moe_route_trace
        routes = self._routes(benchmark)
        # the native executor runs every call in C; the Python one is the reference (and simulates a bus)
        self.native = (options.moe_executor == "native" and simulated_bus_bytes_per_s is None
                       and all(NativeExpertExecutor.supports(n, glu) for n in self.named.values()))
        self.worker = self._start_worker(n_threads)
        self.direct = {i: self._tier_direct(self.named[i], b) for i in self.disk_layers
                       if (b := self.backend_of(self.named[i]["down"])) is not None}
        self.n_slots = self._cache_slots()
        #: the disk layers read through a host tier (opened below; a dry run opens none but plans as if it were)
        self.tier_on = options.host_tier_bytes != 0 and bool(self.disk_layers)
        self.tier = self._open_tier()
        self.trace = self._open_trace()
        # tensors in a CPU extra buffer type (repacked), and those of them copied into host RAM
        self.repacked: set[str] = set()
        self.host_copies: set[str] = set()
        self.resident_ctxs: list[tuple[Backend, Context]] = []
        loaded = self._load_resident(on_tensor)
        loaded.update(self._load_host(on_tensor, loaded))
        self.weights: list[ExpertWeights | None] = [
            None if names is None else ExpertWeights(**{k: loaded[n] for k, n in names.items()})
            for names in self.names]
        self._scratch: dict[int, Scratch] = {}  # the native executors' compute buffer, one per device
        # one pair of compute buffers per device for the Python executors' graphs: layers run one at a time
        self._shared: dict[int, tuple[SharedBuffer, SharedBuffer]] = {}
        self._trace_seq = ffi.new("int64_t *")  # orders the native executors' trace records
        self.layer_backends: list[Backend | None] = [
            self.backend_of(names["down"]) if names is not None and self.modes[i] == "disk" else None
            for i, names in enumerate(self.names)]
        self.executors: list[LayerExecutor | None] = [
            self._executor(i, routes, simulated_bus_bytes_per_s) if self.modes[i] == "disk" else None
            for i in range(n_layer)]
        if options.moe_prefetch and load:
            self._link_prefetch(store, routes is not None)
        # the host tier reads every disk layer's experts (the slots' loads, the CPU worker's rows, a CPU playing the
        # device): nothing reads them through the mapping, which lets them go (no page cache beyond the budget)
        self.unmapped = 0
        if self.tier is not None:
            self.unmapped = store.unmap([n for i in self.disk_layers for n in self.named[i].values()])

    # -- the steps of __init__ ------------------------------------------------------------------------------

    def _routes(self, benchmark: bool) -> list[np.ndarray] | None:
        """``moe_route_trace``: each MoE layer's token rows of the trace (benchmarks only: the routing comes from a
        trace, so the output is not the model's own)."""
        trace = self.options.moe_route_trace
        if trace is not None and not benchmark:
            raise OptionError(f"moe_route_trace={trace}: benchmark-only (the routing comes from a trace, so the "
                              "output is not the model's own); use it with `ggml-hybrid bench` or the tools under "
                              "tools/bench")
        if trace is None or not self.load:
            return None
        return route_rows(trace, len(self.moe_layers), self.n_expert, self.n_used)

    def _start_worker(self, n_threads: int) -> CPUWorker | NativeWorker | None:
        """The session's own CPU worker, for the CPU's share of the misses."""
        if self.options.moe_cpu_share == 0.0 or not self.disk_layers:
            return None
        return NativeWorker(n_threads) if self.native else CPUWorker(n_threads)

    def _cache_slots(self) -> int:
        """The slots of each disk layer's cache: ``expert_cache_slots``, or, when no disk layer uses its slots (each
        computes straight from the host tier's frames: a CPU playing the device, :meth:`_tier_direct`), as many as
        a token uses (address space only). The one place the option is derived."""
        slots = cast(int, self.options.expert_cache_slots)  # a number here: auto is chosen before a model loads
        if slots or not self.disk_layers:
            return slots
        if self.options.host_tier_bytes != 0 and all(self.direct.get(i, False) for i in self.disk_layers):
            return self.n_used
        raise slots_needed(self.options, self.n_expert, self.n_used)

    def _open_tier(self) -> HostTier | None:
        """The host expert tier between the disk layers' slots and the file (``host_tier_bytes``), its budget
        checked before any I/O thread starts."""
        opts, store = self.options, self.store
        if opts.host_tier_bytes == 0 or not self.disk_layers or not self.load:
            return None
        per_expert = self._per_expert()
        frame = frame_bytes(list(per_expert.values()))  # the tier holds experts in equal frames
        n_of = {i: store.info(self.named[i]["down"]).shape[0] for i in self.disk_layers}
        need = frame * sum(n_of.values())
        # `auto` leaves room for the slots a CPU playing the device allocates next, in the same host memory
        host_slots = sum((self.n_slots + 1) * sum(per_expert[i]) for i in self.disk_layers
                         if (b := self.backend_of(self.named[i]["down"])) is not None and b.is_cpu
                         and not self.direct.get(i, False))
        budget = resolve_budget(opts.host_tier_bytes, need, host_slots)
        check_tier_budget(budget, frame * max(n_of.values()), opts.host_tier_bytes)
        devices = [self.backend_of(self.named[i]["down"]) for i in self.disk_layers]
        return HostTier(store, budget, opts.expert_eviction, buffer_type=self._pinned_host_type(devices))

    def _per_expert(self) -> dict[int, list[int]]:
        """Each disk layer's bytes of one expert, kind by kind (matrices and biases)."""
        info = self.store.info
        return {i: [info(n).nbytes // info(n).shape[0] for n in self.named[i].values()] for i in self.disk_layers}

    @property
    def tier_least(self) -> int:
        """The least host tier the disk layers accept (``check_tier_budget``): one layer's experts in the tier's
        equal frames; 0 without disk layers."""
        if not self.disk_layers:
            return 0
        n_of = [self.store.info(self.named[i]["down"]).shape[0] for i in self.disk_layers]
        return frame_bytes(list(self._per_expert().values())) * max(n_of)

    @property
    def tier_need(self) -> int:
        """Bytes of every disk layer's experts in the tier's frames: the most a tier can hold."""
        if not self.disk_layers:
            return 0
        frame = frame_bytes(list(self._per_expert().values()))
        return frame * sum(self.store.info(self.named[i]["down"]).shape[0] for i in self.disk_layers)

    def _open_trace(self) -> TraceWriter | None:
        """The routing trace (``trace_path``); a dry run (planning) writes nothing."""
        path = self.options.trace_path
        if path is None:
            return None
        check_output(path, [self.store.path], "trace_path")
        if not self.load:
            return None
        return TraceWriter(path, len(self.moe_layers), self.n_expert, self.n_used,
                           predictions=self.options.moe_prefetch)

    def _load_resident(self, on_tensor: Callable[[str], None] | None) -> dict[str, Tensor]:
        """The resident layers' experts, loaded onto the backends the layout gives them (repacked on a CPU)."""
        by_backend: dict[int, tuple[Backend, list[str]]] = {}
        for i, layer_names in self.named.items():
            if self.modes[i] != "resident":
                continue
            for n in layer_names.values():
                b = self.backend_of(n)
                if b is not None:
                    by_backend.setdefault(id(b), (b, []))[1].append(n)
        rule = repack_rule(self.store, self.options.repack)
        loaded: dict[str, Tensor] = {}
        for b, tensor_names in by_backend.values():
            ctx, tensors = load_into(self.store, tensor_names, b, on_tensor=on_tensor, load=self.load,
                                     repack=self._recording(rule, b.is_cpu, False))
            self.resident_ctxs.append((b, ctx))
            loaded.update(tensors)
        return loaded

    def _load_host(self, on_tensor: Callable[[str], None] | None, loaded: dict[str, Tensor]) -> dict[str, Tensor]:
        """The rest (cpu layers' experts, tensors a layout put on the CPU, disk layers' experts: the CPU worker's host
        experts) on the host: used in place from the mapped file, or repacked into host RAM as llama.cpp does for CPU
        weights (--no-repack: not)."""
        store, named = self.store, self.named
        rule = repack_rule(store, self.options.repack)
        host_names = [n for layer_names in named.values() for n in layer_names.values() if n not in loaded]
        # fed by the host tier, the CPU worker computes from the tier's frames: no copy of its host experts
        copy_disk = self.worker is not None and not self.tier_on and self._host_copies_fit(store, rule, named)
        disk = {n for i in self.disk_layers for n in named[i].values()}
        host_rule = self._recording(lambda n: rule(n) if n not in disk or copy_disk else None, True, True)
        self.mapped_ctx, mapped = load_into(store, host_names, None, on_tensor=on_tensor, load=self.load,
                                            repack=host_rule, n_extra=1)
        return dict(mapped)

    def _executor(self, i: int, routes: list[np.ndarray] | None,
                  simulated_bus_bytes_per_s: float | None) -> LayerExecutor:
        """Disk layer i's executor, native or the Python reference, on the device its cache is on."""
        names, opts = self.named[i], self.options
        cache_on = self.layer_backends[i]
        if cache_on is None:  # the layout puts disk layers' experts on a device, never on the CPU
            raise OptionError(f"disk_experts: layer {i}'s expert cache has no device")
        # the executor's layer number keys its trace records and the worker's graphs: the MoE layer's
        moe_layer = self.moe_layers.index(i)
        config = LayerCacheConfig(
            layer=moe_layer, n_slots=self.n_slots, n_used=self.n_used, policy=opts.expert_eviction, glu=self.glu,
            share=cast("float | Literal['auto']", opts.moe_cpu_share), worker=self.worker,
            host_experts=self.weights[i], trace=self.trace, route=routes[moe_layer] if routes is not None else None,
            tier=self.tier, tier_direct=self.tier_on and self.direct.get(i, False), repack=opts.repack,
            clear=self.load)
        if self.native:
            scratch = self._scratch.get(id(cache_on))
            if scratch is None:
                scratch = self._scratch[id(cache_on)] = Scratch(cache_on)
            return NativeExpertExecutor(self.store, names, cache_on, config, scratch=scratch,
                                        trace_seq=self._trace_seq)
        shared = self._shared.setdefault(id(cache_on), (SharedBuffer(cache_on), SharedBuffer(cache_on)))
        return ExpertCacheExecutor(self.store, names, cache_on, config, shared=shared,
                                   simulated_bus_bytes_per_s=simulated_bus_bytes_per_s)

    def _link_prefetch(self, store: GGUFStore, oracle: bool) -> None:
        """Each disk layer predicts and prefetches the next MoE layer's experts when that one is a disk layer too:
        by its router (``blk.N.ffn_gate_inp.weight``, its bias, ``exp_probs_b``), or, following a route trace, by
        the trace (an oracle: benchmarks measure what a prediction can give at most)."""
        opts = self.options
        # a draft head's block (next-token prediction) does not run after the last layer: no lookahead into or out
        linked = [i for i in self.moe_layers if f"blk.{i}.nextn.eh_proj.weight" not in store]
        for a, b in zip(linked, linked[1:]):
            src, dst = self.executors[a], self.executors[b]
            if src is None or dst is None:
                continue
            p = f"blk.{b}."
            router, bias, select = (None if oracle or p + n not in store else router_f32(store, p + n)
                                    for n in ("ffn_gate_inp.weight", "ffn_gate_inp.bias", "exp_probs_b.bias"))
            budget = opts.moe_prefetch_bytes or dst.config.n_used * dst.expert_bytes
            max_experts = min(budget // dst.expert_bytes, dst.config.n_slots)
            # with a host tier, as many predicted misses are read ahead into it
            ahead = budget // dst.expert_bytes if self.tier is not None else 0
            src.set_prefetch(dst, router, bias, select, max_experts, PREFETCH_MAX_TOKENS, ahead)

    @property
    def slots_unused(self) -> bool:
        """Every disk layer computes straight from the host tier's frames (tier_direct): the cache slots never
        hold an expert, so their hits and misses say nothing."""
        return self.tier is not None and bool(self.direct) and all(self.direct.values())

    def tier_held(self) -> list[str]:
        """The expert tensors the host tier holds (every disk layer's, read from the file, no longer mapped)."""
        if not self.tier_on:
            return []
        return [n for i, names in enumerate(self.names) if names is not None and self.modes[i] == "disk"
                for n in names.values()]

    def _tier_direct(self, names: dict[str, str], device: Backend) -> bool:
        """Whether a disk layer's experts would run straight from the host tier's frames: its cache is on a CPU (one
        playing the device), no CPU share is asked for (the worker then takes misses from slots, as with a
        device), and none of its expert tensors would be repacked there (the frames are plain CPU memory; the
        repacked kernels give other bits than the plain ones, and resident experts are repacked)."""
        if not device.is_cpu or self.options.moe_cpu_share != 0.0 or self.options.host_tier_bytes == 0:
            return False
        return not self.options.repack or all(
            repack_buffer_type(self.store.info(n).dtype, self.store.info(n).shape, "mul_mat_id") is None
            for n in names.values())

    @staticmethod
    def _pinned_host_type(devices: list[Backend | None]) -> CData | None:
        """The host tier's buffer type: the pinned host type of the disk layers' first device that has one (its
        uploads read pinned memory), or ``None`` (the CPU's: a CPU playing the device, or none)."""
        for b in devices:
            if b is None or b.is_cpu:
                continue
            dev = lib.ggml_backend_get_device(b.ptr)
            buft = lib.ggml_backend_dev_host_buffer_type(dev) if dev != ffi.NULL else ffi.NULL
            if buft != ffi.NULL:
                return buft
        return None

    def _recording(self, rule: Callable[[str], CData | None], on_cpu: bool,
                   host: bool) -> Callable[[str], CData | None]:
        """``rule`` for tensors on a CPU backend (else no repacking), noting what it repacks."""
        def record(name: str) -> CData | None:
            buft = rule(name) if on_cpu else None
            if buft is not None:
                self.repacked.add(name)
                if host:
                    self.host_copies.add(name)
            return buft

        return record

    def _host_copies_fit(self, store: GGUFStore, rule: Callable[[str], CData | None],
                         named: dict[int, dict[str, str]]) -> bool:
        """Whether the disk layers' repackable host experts fit in half the memory available now.

        Repacked, the CPU worker's host experts are copies in RAM (the worker then runs GGML's faster
        kernels, and its rows equal those of repacked resident experts); but a disk layer's experts are
        on the mapped file because they may not fit in memory at all. Copied only when they take at most
        half of it, so that the page cache the expert cache's loads read through keeps the rest.
        """
        need = sum(store.info(n).nbytes for i, names in named.items() if self.modes[i] == "disk"
                   for n in names.values() if rule(n) is not None)
        if need == 0:
            return True
        avail = available_memory()
        return avail is not None and need <= avail // 2

    def _mode_from_options(self, i: int) -> ExpertMode:
        o = self.options
        if o.disk_experts:
            return "disk"
        if o.cpu_moe or i < o.n_cpu_moe:
            return "cpu"
        return "resident"

    def register(self, sched: Scheduler, regions: Sequence[MoERegion | None], prefix: str = "blk") -> None:
        """Hand the disk layers' regions of one graph to their executors (after ``sched.clear_regions()``);
        ``regions`` has one entry per layer (``None`` for a dense layer)."""
        for i, r in enumerate(regions):
            ex = self.executors[i]
            if ex is not None and r is not None:
                # the region's executor: the Python one is called, the native one's C function is
                run = cast("Callable[[RegionCall], object] | NativeExecutor", ex)
                sched.add_region(r.inputs, [r.out], run, backend=self.layer_backends[i], name=f"{prefix}.{i}.experts")

    def reserve(self, n_tokens: int) -> None:
        """Size the cache executors' compute memory for calls of up to ``n_tokens`` tokens, now."""
        for e in self.executors:
            if e is not None:
                e.reserve(n_tokens)

    def compute_bytes(self, backend: Backend | None = None) -> int:
        """Compute memory of the cache executors' own graphs (on ``backend`` only, if given)."""
        own, buffers = 0, dict[int, SharedBuffer]()
        for e, b in zip(self.executors, self.layer_backends):
            if e is None or (backend is not None and b is not backend):
                continue
            if isinstance(e, ExpertCacheExecutor):  # its buffers are shared with the device's other layers
                buffers.update((id(s), s) for s in e.shared_buffers)
            else:
                own += e.compute_bytes
        shared = sum(s.size for s in self._scratch.values() if backend is None or s.device is backend)
        return own + sum(s.size for s in buffers.values()) + shared

    def flush_traces(self) -> None:
        """Write the native executors' trace records of the calls since the last flush, in call order."""
        if self.trace is None or not self.native:
            return
        records = [r for e in self.executors if isinstance(e, NativeExpertExecutor) for r in e.drain_trace()]
        for _, layer, ids, predicted in sorted(records, key=lambda r: r[0]):
            self.trace.record(layer, ids, predicted)

    @property
    def counters(self) -> list[LayerCounters]:
        return [e.counters if e is not None else LayerCounters() for e in self.executors]

    def device_bytes(self, backend: Backend | None = None) -> int:
        """Memory of resident experts plus cache slots (on ``backend`` only, if given)."""
        total = sum(t.nbytes for b, ctx in self.resident_ctxs if backend is None or b is backend
                    for t in ctx.tensors())
        for e, b in zip(self.executors, self.layer_backends):
            # a layer computing straight from the tier's frames has slots of address space only (a dry run plans
            # it so, with no tier opened)
            if e is not None and (backend is None or b is backend) and not e.config.tier_direct:
                total += e.slot_bytes
        return total

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()  # first: a job in flight may still read the mapped experts
        if self.trace is not None:
            self.flush_traces()
            self.trace.close()
        for e in self.executors:
            if e is not None:
                e.close()
        if self.tier is not None:
            self.tier.close()  # after the executors: they point at it
        for s in self._scratch.values():
            s.close()
        for pair in self._shared.values():
            for b in pair:
                b.close()
        for _, ctx in self.resident_ctxs:
            ctx.close()
        self.mapped_ctx.close()


__all__ = ["ExpertLayers", "ExpertMode", "check_expert_shapes", "check_moe_options", "expert_names", "suggested_slots"]
