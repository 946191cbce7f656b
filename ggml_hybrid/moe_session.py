"""A session over a stack of MoE FFN layers from a GGUF file, in every placement mode.

Each layer is ``cur + moe(rms_norm(cur) * ffn_norm)``. The mode comes from the
session options:

- *resident* (default): every expert tensor is loaded into device memory; the plain graph;
- ``cpu_moe`` / ``n_cpu_moe=N``: the expert tensors of all / the first N layers stay on the
  memory-mapped file, a host buffer, so the scheduler runs their ``mul_mat_id`` where they live
  (llama.cpp's ``--cpu-moe`` / ``--n-cpu-moe``), without a region;
- ``disk_experts``: the expert tensors stay on the mapped file and each layer's routed experts
  are a region run by an :class:`ExpertCacheExecutor` with ``expert_cache_slots`` device slots.

A session owns its backends, scheduler, caches, buffers and counters: two sessions
never share state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from .backend import Backend, cpu, cuda, cuda_available
from .context import Context
from .errors import ShapeError
from .cpu_worker import CPUWorker
from .expert_executor import ExpertCacheExecutor, LayerCounters
from .moe import ExpertWeights, build_moe_ffn
from .options import OptionError, SessionOptions
from .sched import Scheduler
from .store import GGUFStore, ModelFileError, load_into
from .traces import TraceWriter


@dataclass
class SessionCounters:
    layers: list[LayerCounters] = field(default_factory=list)

    @property
    def total(self) -> LayerCounters:
        t = LayerCounters()
        for c in self.layers:
            t.add(c)
        return t

    def to_dict(self) -> dict:
        return {"total": self.total.to_dict(), "layers": [c.to_dict() for c in self.layers]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _hparams(store: GGUFStore):
    """Hyperparameters from the metadata, checked against the tensors before anything is allocated."""
    arch = store.arch
    if not isinstance(arch, str):
        raise ModelFileError(f"{store.path!r}: general.architecture is {arch!r}, not a name")
    hp = {}
    for key in ("block_count", "embedding_length", "expert_count", "expert_used_count"):
        v = store.meta(f"{arch}.{key}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelFileError(f"{store.path!r}: {arch}.{key} = {v!r} must be a positive integer")
        hp[key] = v
    n_layer, n_embd, n_expert, n_used = (hp[k] for k in ("block_count", "embedding_length", "expert_count",
                                                            "expert_used_count"))
    if n_used > n_expert:
        raise ModelFileError(f"{store.path!r}: {n_used} experts used per token but only {n_expert} exist")
    if f"blk.{n_layer - 1}.ffn_gate_inp.weight" not in store or f"blk.{n_layer}.ffn_gate_inp.weight" in store:
        raise ModelFileError(f"{store.path!r}: {arch}.block_count = {n_layer} does not match the blk.N tensors")
    if "blk.0.ffn_gate_inp.weight" not in store:
        raise ModelFileError(f"{store.path!r} is not a MoE model: it has no routed experts (blk.0.ffn_gate_inp)")
    for i in range(n_layer):
        for name, want in ((f"blk.{i}.ffn_gate_inp.weight", (n_expert, n_embd)), (f"blk.{i}.ffn_norm.weight", (n_embd,))):
            shape = store.info(name).shape
            if shape != want:
                raise ModelFileError(f"{store.path!r}: {name} has shape {shape}, expected {want} from the metadata")
    eps = store.meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        raise ModelFileError(f"{store.path!r}: rms epsilon {eps!r} must be a number in [0, 1)")
    return n_layer, n_embd, n_expert, n_used, float(eps)


class MoEStackSession:
    def __init__(self, path, options: SessionOptions | None = None, device: Backend | None = None,
                 simulated_bus_bytes_per_s: float | None = None):
        self.options = opts = options or SessionOptions()
        self.store = store = GGUFStore(path)
        self.n_layer, self.n_embd, self.n_expert, self.n_used, self.eps = _hparams(store)
        if opts.disk_experts and opts.expert_cache_slots < 1:
            raise OptionError(f"expert_cache_slots={opts.expert_cache_slots}: disk_experts needs at least 1 slot")
        if opts.expert_cache_slots > self.n_expert:
            raise OptionError(f"expert_cache_slots={opts.expert_cache_slots}: the model has only "
                              f"{self.n_expert} experts per layer")
        if opts.n_cpu_moe > self.n_layer:
            raise OptionError(f"n_cpu_moe={opts.n_cpu_moe}: the model has only {self.n_layer} layers")
        if opts.moe_cpu_share != 0.0 and not opts.disk_experts:
            raise OptionError(f"moe_cpu_share={opts.moe_cpu_share}: a CPU share of cache misses needs "
                              "disk_experts=true (with resident or CPU-placed experts there are no misses)")
        n_threads = opts.n_threads or os.cpu_count() or 1
        self.simulated_bus = simulated_bus_bytes_per_s
        # the session's own CPU worker, started on first use
        self.worker = CPUWorker(n_threads) if opts.moe_cpu_share != 0.0 else None
        if opts.trace_path is not None and not opts.disk_experts:
            raise OptionError(f"trace_path={opts.trace_path}: routing traces are recorded by the expert cache "
                              "(disk_experts=true)")
        self.trace = (TraceWriter(opts.trace_path, self.n_layer, self.n_expert, self.n_used)
                      if opts.trace_path is not None else None)
        self._own_device = device is None
        # without an accelerator a CPU backend instance plays the device, with its own buffers
        self.device = device or (cuda(0) if cuda_available() else cpu(n_threads))
        self.host = cpu(n_threads)
        self.sched = Scheduler([self.device, self.host], graph_size=64 * self.n_layer + 64)
        self._load_weights()
        self._graphs: dict[int, tuple] = {}
        self._active: int | None = None  # token count whose graph's regions are registered

    # -- weights --------------------------------------------------------------

    def _expert_names(self, i: int) -> dict[str, str]:
        fused = f"blk.{i}.ffn_gate_up_exps.weight" in self.store
        kinds = ("gate_up", "down") if fused else ("gate", "up", "down")
        return {k: f"blk.{i}.ffn_{k}_exps.weight" for k in kinds}

    def mode_of(self, i: int) -> str:
        o = self.options
        if o.disk_experts:
            return "disk"
        if o.cpu_moe or i < o.n_cpu_moe:
            return "cpu"
        return "resident"

    def _load_weights(self) -> None:
        store = self.store
        dense = [f"blk.{i}.{n}.weight" for i in range(self.n_layer) for n in ("ffn_norm", "ffn_gate_inp")]
        for name in dense + [n for i in range(self.n_layer) for n in self._expert_names(i).values()]:
            store.info(name)  # every required tensor exists, before anything is allocated
        for i in range(self.n_layer):
            names = self._expert_names(i)
            shapes = {k: store.info(n).shape for k, n in names.items()}
            down = shapes["down"]
            n_ff = down[2] if len(down) == 3 else -1
            want = {"down": (self.n_expert, self.n_embd, n_ff), "gate": (self.n_expert, n_ff, self.n_embd),
                    "up": (self.n_expert, n_ff, self.n_embd), "gate_up": (self.n_expert, 2 * n_ff, self.n_embd)}
            for kind, shape in shapes.items():
                if shape != want[kind]:
                    raise ModelFileError(f"{store.path!r}: {names[kind]} has shape {shape}, expected {want[kind]} "
                                         f"for {self.n_expert} experts of width {self.n_embd}")
        self.dense_ctx, self.dense = load_into(store, dense, self.device)
        resident = [n for i in range(self.n_layer) if self.mode_of(i) == "resident"
                    for n in self._expert_names(i).values()]
        self.expert_ctx, experts = load_into(store, resident, self.device)
        self.mapped_ctx = Context(n_tensors=4 * self.n_layer)
        self.experts: list[ExpertWeights] = []
        self.executors: list[ExpertCacheExecutor | None] = []
        for i in range(self.n_layer):
            names = self._expert_names(i)
            if self.mode_of(i) == "resident":
                tensors = {k: experts[n] for k, n in names.items()}
            else:
                tensors = {k: store.new_tensor(self.mapped_ctx, n) for k, n in names.items()}
                for t in tensors.values():
                    store.place(t)
            self.experts.append(ExpertWeights(**tensors))
            self.executors.append(ExpertCacheExecutor(
                store, i, names, self.device, self.options.expert_cache_slots, self.options.expert_eviction,
                self.n_used, worker=self.worker, share=self.options.moe_cpu_share, host_experts=self.experts[i],
                simulated_bus_bytes_per_s=self.simulated_bus, trace=self.trace) if self.mode_of(i) == "disk" else None)

    # -- graphs ---------------------------------------------------------------

    def _graph(self, n_tokens: int):
        """The graph for a token count, built once and reused."""
        if n_tokens in self._graphs:
            return self._graphs[n_tokens]
        size = 64 * self.n_layer + 64
        c = Context(n_tensors=size, graph_size=size)
        g = c.new_graph(size)
        x = c.new_tensor("f32", (n_tokens, self.n_embd), "x").set_input()
        cur, regions = x, []
        for i in range(self.n_layer):
            h = c.mul(c.rms_norm(cur, self.eps), self.dense[f"blk.{i}.ffn_norm.weight"])
            r = build_moe_ffn(c, g, h, self.dense[f"blk.{i}.ffn_gate_inp.weight"], self.experts[i], self.n_used,
                              name=f"blk.{i}.moe")
            regions.append(r)
            cur = c.add(r.out, cur)
        cur.set_output()
        g.expand(cur)
        self._graphs[n_tokens] = entry = (c, g, x, cur, regions)
        return entry

    def _use_graph(self, n_tokens: int):
        """Register this graph's regions with the scheduler when switching graphs."""
        entry = self._graph(n_tokens)
        if self._active != n_tokens:
            self.sched.clear_regions()
            for i, r in enumerate(entry[4]):
                if self.executors[i] is not None:
                    self.sched.add_region(r.inputs, [r.out], self.executors[i], backend=self.device,
                                          name=f"blk.{i}.experts")
            self._active = n_tokens
        return entry

    def forward(self, x) -> np.ndarray:
        """Run the stack on ``x`` [tokens, n_embd] (float32); returns the output of the same shape."""
        x = np.asarray(x)
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.n_embd or x.shape[0] < 1:
            raise ShapeError(f"forward: x must be float32 [tokens >= 1, {self.n_embd}], got {x.dtype} {x.shape}")
        c, g, xin, out, _ = self._use_graph(x.shape[0])
        self.sched.prepare(g)  # split and allocate only when this graph is not the allocated one
        xin.set(x.reshape(xin.shape))
        self.sched.compute(g)
        return out.numpy().reshape(x.shape)

    @property
    def counters(self) -> SessionCounters:
        return SessionCounters([e.counters if e is not None else LayerCounters() for e in self.executors])

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()  # first: a job in flight may still read the mapped experts
        if self.trace is not None:
            self.trace.close()
        for e in self.executors:
            if e is not None:
                e.close()
        for c, *_ in self._graphs.values():
            c.close()
        self._graphs.clear()
        self.sched.close()
        for ctx in (self.dense_ctx, self.expert_ctx, self.mapped_ctx):
            ctx.close()
        self.store.close()
        self.host.close()
        if self._own_device:
            self.device.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["MoEStackSession", "SessionCounters", "ModelFileError"]
