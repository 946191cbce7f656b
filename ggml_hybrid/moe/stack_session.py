"""A session over a stack of MoE FFN layers from a GGUF file, in every expert mode.

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
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..checks import check_real, check_type
from ..errors import ModelFileError, NotMoEError, OptionError, ShapeError
from ..ggml.backend import Backend, cpu, gpu, gpu_device_names
from ..ggml.context import Arena, Context
from ..ggml.graph import Graph
from ..ggml.graph_cache import GraphCache
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..gguf.metadata import MAX_EXPERTS, MAX_LAYERS, architecture, meta_float, meta_int
from ..gguf.store import GGUFStore, load_into, repack_rule, same_shape
from ..machine import default_threads
from ..options import SessionOptions
from ..serial import Serial
from .expert_layers import ExpertLayers, check_expert_shapes, check_moe_options
from .ffn import MoERegion, Router, build_moe_ffn
from .layer_cache import LayerCounters


@dataclass(frozen=True)
class StackHParams:
    """What a stack of MoE FFN layers (:class:`~ggml_hybrid.moe.stack_session.MoEStackSession`) needs."""

    arch: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_used: int
    rms_eps: float


def read_stack_hparams(store: GGUFStore) -> StackHParams:
    """Hyperparameters of an FFN-only MoE stack, checked against its tensors before anything is allocated."""
    arch = architecture(store)
    n_layer = meta_int(store, f"{arch}.block_count", hi=MAX_LAYERS)
    n_embd = meta_int(store, f"{arch}.embedding_length")
    n_expert = meta_int(store, f"{arch}.expert_count", hi=MAX_EXPERTS)
    n_used = meta_int(store, f"{arch}.expert_used_count")
    if n_used > n_expert:
        raise ModelFileError(f"{store.path!r}: {n_used} experts used per token but only {n_expert} exist")
    if "blk.0.ffn_gate_inp.weight" not in store:
        raise NotMoEError(f"{store.path!r} is not a MoE model: it has no routed experts (blk.0.ffn_gate_inp)")
    if f"blk.{n_layer - 1}.ffn_gate_inp.weight" not in store or f"blk.{n_layer}.ffn_gate_inp.weight" in store:
        raise ModelFileError(f"{store.path!r}: {arch}.block_count = {n_layer} does not match the blk.N tensors")
    for i in range(n_layer):
        for name, want in ((f"blk.{i}.ffn_gate_inp.weight", (n_expert, n_embd)),
                           (f"blk.{i}.ffn_norm.weight", (n_embd,))):
            shape = store.info(name).shape
            if not same_shape(shape, want):
                raise ModelFileError(f"{store.path!r}: {name} has shape {shape}, expected {want} from the metadata")
    eps = meta_float(store, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, 0.0, 0.5)
    return StackHParams(arch, n_layer, n_embd, n_expert, n_used, eps)


@dataclass
class SessionCounters:
    layers: list[LayerCounters] = field(default_factory=list)

    @property
    def total(self) -> LayerCounters:
        t = LayerCounters()
        for c in self.layers:
            t.add(c)
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total.to_dict(), "layers": [c.to_dict() for c in self.layers]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


class StackGraph(NamedTuple):
    """The graph of one token count: its context, the graph, the input, the output, each layer's region."""

    ctx: Context
    graph: Graph
    x: Tensor
    out: Tensor
    regions: list[MoERegion]

    def close(self) -> None:
        self.ctx.close()


MAX_GRAPHS = 8  # token-count graphs kept per session


class MoEStackSession:
    def __init__(self, path: str | os.PathLike[str], options: SessionOptions | None = None,
                 device: Backend | None = None, simulated_bus_bytes_per_s: float | None = None,
                 benchmark: bool = False) -> None:
        """``benchmark``: a benchmark's or a test's session, which may replace the routing by a trace
        (``moe_route_trace``)."""
        self.options = opts = SessionOptions() if options is None else check_type(
            options, "MoEStackSession: options", SessionOptions, error=OptionError)
        if device is not None:
            check_type(device, "MoEStackSession: device", Backend)
        if simulated_bus_bytes_per_s is not None:
            check_real(simulated_bus_bytes_per_s, "MoEStackSession: simulated_bus_bytes_per_s", 0, lo_open=True)
        self.store = GGUFStore(path)
        try:
            self._open(self.store, opts, device, simulated_bus_bytes_per_s, benchmark)
        except BaseException:  # a refused option or tensor must not leave the file or the buffers open
            self.close()
            raise

    def _open(self, store: GGUFStore, opts: SessionOptions, device: Backend | None,
              simulated_bus_bytes_per_s: float | None, benchmark: bool) -> None:
        hp = read_stack_hparams(store)
        self.n_layer, self.n_embd, self.n_expert, self.n_used, self.eps = (hp.n_layer, hp.n_embd, hp.n_expert,
                                                                            hp.n_used, hp.rms_eps)
        check_moe_options(opts, self.n_layer, self.n_expert, self.n_used)
        n_threads = opts.n_threads or default_threads()
        if opts.check_tensors:
            store.validate_data(n_threads=n_threads)
        self._own_device = device is None
        # without an accelerator a CPU backend instance plays the device, with its own buffers
        gpus = gpu_device_names() if device is None else []
        self.device = device or (gpu(gpus[0]) if gpus else cpu(n_threads, opts.poll))
        self.host = cpu(n_threads, opts.poll)
        self.sched = Scheduler([self.device, self.host], graph_size=64 * self.n_layer + 64)
        dense = [f"blk.{i}.{n}.weight" for i in range(self.n_layer) for n in ("ffn_norm", "ffn_gate_inp")]
        for name in dense:
            store.info(name)  # every required tensor exists, before anything is allocated
        check_expert_shapes(store, range(self.n_layer), self.n_expert, self.n_embd)
        self.dense_ctx, self.dense = load_into(store, dense, self.device,
                                               repack=repack_rule(store, opts.repack and self.device.is_cpu))
        self.layers = ExpertLayers(store, self.n_layer, self.n_used, opts, self.device, n_threads,
                                   simulated_bus_bytes_per_s, benchmark=benchmark)
        # every layer of a stack has routed experts
        self.experts = [w for w in self.layers.weights if w is not None]
        self.executors = self.layers.executors
        self.worker, self.trace = self.layers.worker, self.layers.trace
        size = 64 * self.n_layer + 64
        # one graph per token count, the least recently used dropped first
        self._graphs: GraphCache[StackGraph] = GraphCache(MAX_GRAPHS, Context.size_for(size, graph_size=size),
                                                          self._forget_graph)
        self._serial = Serial("MoEStackSession")
        self._active: int | None = None  # token count whose graph's regions are registered

    # -- graphs ---------------------------------------------------------------

    def _forget_graph(self, key: Hashable, entry: StackGraph) -> None:
        if self._active == key:  # its regions are registered with the scheduler
            self.sched.clear_regions()
            self._active = None

    def _graph(self, n_tokens: int) -> StackGraph:
        """The graph for a token count, built once and reused (while it stays among the recent ones)."""
        return self._graphs.get(n_tokens, lambda arena: self._build(n_tokens, arena))

    def _build(self, n_tokens: int, arena: Arena) -> StackGraph:
        size = 64 * self.n_layer + 64
        c = Context(n_tensors=size, graph_size=size, arena=arena)
        g = c.new_graph(size)
        x = c.new_tensor("f32", (n_tokens, self.n_embd), "x").set_input()
        cur, regions = x, []
        for i in range(self.n_layer):
            h = c.mul(c.rms_norm(cur, self.eps), self.dense[f"blk.{i}.ffn_norm.weight"])
            r = build_moe_ffn(c, g, h, Router(self.dense[f"blk.{i}.ffn_gate_inp.weight"]), self.experts[i], self.n_used,
                              name=f"blk.{i}.moe")
            regions.append(r)
            cur = c.add(r.out, cur)
        cur.set_output()
        g.expand(cur)
        return StackGraph(c, g, x, cur, regions)

    def _use_graph(self, n_tokens: int) -> StackGraph:
        """Register this graph's regions with the scheduler when switching graphs."""
        entry = self._graph(n_tokens)
        if self._active != n_tokens:
            self.sched.clear_regions()
            self.layers.register(self.sched, entry.regions)
            self._active = n_tokens
        return entry

    def forward(self, x: npt.ArrayLike) -> np.ndarray:
        """Run the stack on ``x`` [tokens, n_embd] (float32); returns the output of the same shape."""
        x = np.asarray(x)
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.n_embd or x.shape[0] < 1:
            raise ShapeError(f"forward: x must be float32 [tokens >= 1, {self.n_embd}], got {x.dtype} {x.shape}")
        with self._serial.turn("forward"):
            sg = self._use_graph(x.shape[0])
            self.sched.prepare(sg.graph)  # split and allocate only when this graph is not the allocated one
            sg.x.set(x.reshape(sg.x.shape))
            self.sched.compute(sg.graph)
            self.store.check_reads()  # a file truncated under the reads gave zeros (the mapping's guard)
            self.layers.flush_traces()
            return sg.out.numpy().reshape(x.shape)

    @property
    def counters(self) -> SessionCounters:
        return SessionCounters(self.layers.counters)

    def close(self) -> None:
        # also after a failed __init__: only what was opened is there to close
        parts = self.__dict__
        if "layers" in parts:
            self.layers.close()
        if "_graphs" in parts:
            self._graphs.clear()
        for name in ("sched", "dense_ctx", "store", "host"):
            if name in parts:
                parts[name].close()
        if parts.get("_own_device") and "device" in parts:
            self.device.close()

    def __enter__(self) -> MoEStackSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MoEStackSession", "SessionCounters"]
