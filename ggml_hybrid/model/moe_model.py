"""A MoE language model loaded from GGUF: weights placed per the session options, a KV cache, logits.

    with MoEModel("model.gguf", SessionOptions.parse(["moe_cpu_share=0.5", "disk_experts=1",
                                                      "expert_cache_slots=16"])) as m:
        logits = m.eval(m.tokenizer.encode("Hello"))   # [1, n_vocab]: the last position

Dense weights (attention, norms, routers, shared experts, embeddings, output)
go to the device; routed experts are placed by :class:`ExpertLayers` (resident,
``cpu_moe``/``n_cpu_moe``, or disk-backed with the expert cache and the hybrid
CPU share). One sequence: ``eval`` appends tokens to the KV cache, ``reset``
starts over.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from .._native import CData, ffi
from ..checks import check_callable, check_choice, check_type
from ..deploy.devices import open_devices
from ..deploy.layout import CPU, Layout, is_expert_tensor, plan_layout
from ..errors import (
    ArgumentError,
    ArgumentTypeError,
    ClosedError,
    GgmlHybridError,
    IndexRangeError,
    ModelFileError,
    RPCError,
    ShapeError,
)
from ..ggml import rpc
from ..ggml.backend import Backend, cpu, cpu_instance
from ..ggml.context import Arena, Context
from ..ggml.graph_cache import GraphCache
from ..ggml.repack import repack_buffer_type
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..machine import default_threads
from ..moe.expert_layers import ExpertLayers, check_moe_options
from ..moe.stack_session import SessionCounters
from ..options import MAX_DEVICES, OptionError, SessionOptions
from ..serial import Serial
from .decoder import DecoderGraph, build_decoder, context_size, graph_size
from .families.hybrid import check_cuda
from .gguf_store import GGUFStore, load_into, repack_rule
from .hparams import HParams, read_hparams, tensor_shapes
from .kv_cache import KVCache, rotation_sizes
from .recurrent_state import RecurrentState
from .rope import positions
from .tokenizer import Tokenizer

DEFAULT_MAX_CTX = 4096
MAX_GRAPHS = 8  # decoder graphs kept per model (one per ubatch shape), least recently used dropped first


def check_options(opts: SessionOptions, hp: HParams) -> None:
    check_moe_options(opts, hp.n_layer, hp.n_expert)
    if opts.ubatch_size > opts.batch_size:
        raise OptionError(f"ubatch_size={opts.ubatch_size}: must not exceed batch_size={opts.batch_size}")
    if opts.n_ctx > hp.n_ctx_train:
        raise OptionError(f"n_ctx={opts.n_ctx}: the model was trained for at most {hp.n_ctx_train} tokens")
    if opts.cache_type_v == "q8_0" and opts.flash_attn is False:
        raise OptionError("cache_type_v=q8_0: a quantized V cache needs flash_attn=true (as in llama.cpp)")
    if hp.mla is not None and opts.cache_type_k != opts.cache_type_v:
        # the latent cache has no V, but llama.cpp still refuses different K and V types for it
        raise OptionError(f"cache_type_k={opts.cache_type_k} cache_type_v={opts.cache_type_v}: {hp.arch}'s latent KV "
                          "cache needs the same type for both (as in llama.cpp)")
    for key, head in (("cache_type_k", hp.head_dim), ("cache_type_v", hp.head_dim_v)):
        if getattr(opts, key) == "q8_0" and head % 32:
            raise OptionError(f"{key}=q8_0: the head size {head} is not a multiple of 32")


def _device_names(names: object) -> list[str]:
    """The planner's stand-in device names: a list of 1..MAX_DEVICES distinct non-empty strs."""
    what = "MoEModel: dry_run_devices"
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise ArgumentTypeError(f"{what} must be a list of device names (non-empty strs), got {names!r}")
    if not 1 <= len(names) <= MAX_DEVICES or len(set(names)) != len(names) or CPU in names:
        raise ArgumentError(f"{what} must name 1..{MAX_DEVICES} distinct devices other than {CPU}, got {names!r}")
    return list(names)


class MoEModel:
    # set by _load; close() releases whichever of them a failed load got to
    devices: dict[str, Backend]
    host: Backend
    device: Backend
    sched: Scheduler
    experts: ExpertLayers
    kv: KVCache
    rs: RecurrentState | None = None  # the delta-net layers' states (hybrid models)
    layout: Layout
    def __init__(self, path: str | os.PathLike[str], options: SessionOptions | None = None,
                 device: Backend | None = None, progress: Callable[[int, int], object] | None = None,
                 dry_run_devices: list[str] | None = None) -> None:
        """Load ``path``; ``progress(done, total)`` is called as tensors are loaded.

        ``dry_run_devices`` (planning): allocate everything as a load would, on CPU backend
        instances standing in for the named devices, but read no tensor data; such a model
        must not be evaluated.
        """
        if device is not None:
            check_type(device, "MoEModel: device", Backend)
        if progress is not None:
            check_callable(progress, "MoEModel: progress")
        if dry_run_devices is not None:
            dry_run_devices = _device_names(dry_run_devices)
        self.dry_run = dry_run_devices is not None
        t0 = time.perf_counter()
        self.options = opts = options if options is not None else SessionOptions()
        if not isinstance(opts, SessionOptions):
            raise OptionError(f"options must be SessionOptions, got {type(opts).__name__}")
        self.store = store = GGUFStore(path)
        try:
            self.hp = hp = read_hparams(store)
            check_options(opts, hp)
            self.tokenizer = Tokenizer.from_gguf(store)
            if self.tokenizer.n_vocab != hp.n_vocab:
                raise ModelFileError(f"{store.path!r}: tokenizer.ggml.tokens has {self.tokenizer.n_vocab} entries but "
                                     f"token_embd.weight has {hp.n_vocab} rows; they must agree")
            if opts.check_tensors and not self.dry_run:  # a plan reads no tensor data
                store.validate_data(list(tensor_shapes(hp)), opts.n_threads or os.cpu_count() or 1)
        except Exception:
            store.close()
            raise
        # without a thread count, the idle cores now (see ggml/threads.py: GGML's barrier spins)
        n_threads = opts.n_threads or (1 if self.dry_run else default_threads())
        # llama.cpp's -t / -tb: one thread count for single-token steps, one for batches (the prompt)
        self._threads = {False: n_threads, True: opts.n_threads_batch or n_threads}
        self._threads_now = n_threads
        self.n_threads = n_threads
        self._own_devices = device is None
        self.devices = {}
        self._serial = Serial("MoEModel")
        self.weight_ctxs: list[tuple[str, Context]] = []
        self.repacked: set[str] = set()  # tensors in a CPU extra buffer type (llama.cpp's repacked weights)
        # one decoder graph per ubatch shape, the least recently used dropped first (prompts of many lengths)
        self._graphs: GraphCache[DecoderGraph] = GraphCache(MAX_GRAPHS, context_size(hp), self._forget_graph)
        self._active: tuple[int, int, int] | None = None  # key of the graph whose regions are registered
        try:
            self._load(opts, hp, n_threads, device, dry_run_devices, progress)
            rpc.raise_if_lost(self.devices.values())  # a server lost while loading: the weights are not there
        except BaseException as exc:
            lost = rpc.lost(self.devices.values()) if isinstance(exc, Exception) and not isinstance(exc, RPCError) \
                else None  # a load that failed because a server was lost says so
            self.close()
            if lost is not None:
                raise lost from exc
            raise
        self.load_seconds = time.perf_counter() - t0

    def _load(self, opts: SessionOptions, hp: HParams, n_threads: int, device: Backend | None,
              dry_run_devices: list[str] | None, progress: Callable[[int, int], object] | None) -> None:
        store = self.store
        # without accelerators, CPU backend instances play the devices (DEV0, ...), with their own buffers
        if self.dry_run:
            for i, name in enumerate(cast("list[str]", dry_run_devices)):  # given when dry_run
                self.devices[name] = cpu_instance(i, 1)
        elif device is not None:
            name = device.kind if device.endpoint is not None else "DEV0" if device.is_cpu else "CUDA0"
            self.devices = {name: device}
        else:
            self.devices = open_devices(opts, n_threads)
        self.host = cpu(n_threads, opts.poll)
        self.device = next(iter(self.devices.values()))
        check_cuda(store.path, hp, list(self.devices))
        required = list(tensor_shapes(hp))
        self.layout = plan_layout(required, hp.n_layer, opts, list(self.devices), hp.tied_output)
        self.sched = Scheduler(list(self.devices.values()) + [self.host], graph_size=2 * graph_size(hp))
        dense = [n for n in required if not is_expert_tensor(n)]
        total = len(required) + (1 if hp.tied_output else 0)
        done = [0]

        def tick(_name: str) -> None:
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

        self._load_dense(dense, tick)
        lay = self.layout
        self.experts = ExpertLayers(store, hp.n_layer, hp.n_used, opts, self.device, n_threads, on_tensor=tick,
                                    modes=list(lay.expert_mode), backend_of=lambda n: self.devices.get(lay.tensors[n]),
                                    load=not self.dry_run, moe_layers=hp.moe_layers, glu=hp.routing.glu)
        n_ctx = opts.n_ctx or min(hp.n_ctx_train, DEFAULT_MAX_CTX)
        self.flash_attn = self._resolve_flash_attn(opts, hp)
        # latent attention has no Hadamard rotation (llama.cpp's K-only cache input has none)
        rot = (0, 0) if hp.mla is not None else rotation_sizes(opts.cache_type_k, opts.cache_type_v, hp.head_dim,
                                                               hp.head_dim_v)
        kv_backends = [self.backend(d) for d in lay.kv_device]
        self.kv = KVCache(hp.n_layer, n_ctx, hp.kv_k, hp.kv_v, opts.cache_type_k, opts.cache_type_v, kv_backends,
                          v_trans=not self.flash_attn, clear=not self.dry_run, rot=rot,
                          n_swa=hp.swa.n_swa if hp.swa is not None else 0, layers=hp.kv_layers)
        dn = hp.delta_net
        # a hybrid model's delta-net layers keep recurrent states where their KV cache would be (llama.cpp's rule)
        self.rs = None if dn is None else RecurrentState(hp.n_layer, dn.layers, dn.conv_state, dn.ssm_state,
                                                         kv_backends, clear=not self.dry_run)
        # like llama.cpp: size the compute buffers for the largest ubatch once, at load; the expert caches'
        # own graphs too, so that a run never allocates more than the load (and the planner's dry run) did
        ub = min(opts.ubatch_size, n_ctx)
        self.sched.reserve(self._graph(ub, n_ctx, ub).graph)
        self.experts.reserve(ub)

    def _resolve_flash_attn(self, opts: SessionOptions, hp: HParams) -> bool:
        """``flash_attn`` as a bool; ``auto`` is llama.cpp's rule: on when every backend that runs
        attention (where the KV cache lives) supports the fused op for this model's shapes and types."""
        if opts.flash_attn != "auto":
            return bool(opts.flash_attn)
        with Context(n_tensors=8) as ctx:
            q = ctx.new_tensor("f32", (hp.n_head, 1, hp.head_dim))
            k = ctx.new_tensor(opts.cache_type_k, (hp.n_head_kv, 256, hp.head_dim))
            v = ctx.new_tensor(opts.cache_type_v, (hp.n_head_kv, 256, hp.head_dim_v))
            mask = ctx.new_tensor("f16", (1, 256))
            try:
                probe = ctx.flash_attn(q, k, v, mask)
            except GgmlHybridError:  # shapes or types the fused op does not take: no
                on = False
            else:
                on = all(self.backend(d).supports(probe) for d in set(self.layout.kv_device))
        if not on and opts.cache_type_v == "q8_0":
            raise OptionError("cache_type_v=q8_0 with flash_attn=auto: the backends cannot run flash attention for "
                              "this model, and a quantized V cache needs it")
        return on

    def backend(self, name: str) -> Backend:
        """The backend of a device name of this session (``CPU``: the host backend)."""
        if isinstance(name, str) and name == CPU:
            return self.host
        return self.devices[self._device_name(name, "MoEModel.backend: name")]

    def _device_name(self, name: object, what: str) -> str:
        """``name`` if it names one of this session's devices."""
        check_type(name, what, str)
        if name not in self.devices:
            raise ArgumentError(f"{what} {name!r} is not a device of this session; they are "
                                f"{', '.join(self.devices)}")
        return name

    def _repack_rule(self, backend: Backend) -> Callable[[str], CData | None]:
        """Which tensors on ``backend`` go to a CPU extra buffer type; recorded in ``self.repacked``."""
        rule = repack_rule(self.store, self.options.repack and backend.is_cpu)

        def record(name: str) -> CData | None:
            buft = rule(name)
            if buft is not None:
                self.repacked.add(name)
            return buft

        return record

    def _load_dense(self, dense: list[str], tick: Callable[[str], None]) -> None:
        """Dense weights into each device's buffer; CPU ones used in place from the mapped file, but for those
        repacked into a CPU extra buffer type (copies, as llama.cpp makes them)."""
        by_dev: dict[str, list[str]] = {}
        for n in dense:
            by_dev.setdefault(self.layout.tensors[n], []).append(n)
        self.weights: dict[str, Tensor] = {}
        for dev, names in by_dev.items():
            backend = self.backend(dev)
            ctx, tensors = load_into(self.store, names, None if dev == CPU else backend, on_tensor=tick,
                                     load=not self.dry_run, repack=self._repack_rule(backend))
            self.weights.update(tensors)
            self.weight_ctxs.append((dev, ctx))
        out_dev = self.layout.tensors.get("output.weight(tied)")
        if out_dev is not None and out_dev != CPU:
            # a tied head gets its own copy on the output device, as llama.cpp duplicates it (for the product)
            info = self.store.info("token_embd.weight")
            ctx = Context(n_tensors=1)
            t = ctx.new_tensor(info.dtype, info.shape, "output.weight")
            backend = self.devices[out_dev]
            buft = repack_buffer_type(info.dtype, info.shape, "mul_mat") \
                if self.options.repack and backend.is_cpu else None
            if buft is not None:
                ctx.allocate_group([t], buft, "weights", virtual=self.dry_run)
                self.repacked.add("output.weight(tied)")
            else:
                ctx.allocate(backend, "weights", virtual=self.dry_run)
            if not self.dry_run:
                self.store.load(t, source="token_embd.weight")
            self.weights["output.weight"] = t
            self.weight_ctxs.append((out_dev, ctx))
            tick("output.weight")

    # -- state ----------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    def reset(self) -> None:
        """Forget the sequence: the next eval starts at position 0."""
        with self._serial.turn("reset"):
            self.kv.clear()
            if self.rs is not None:
                self.rs.clear()

    # -- evaluation -----------------------------------------------------------

    def _graph(self, n_tokens: int, n_kv: int, n_out: int) -> DecoderGraph:
        key = (n_tokens, n_kv, n_out)

        def build(arena: Arena) -> DecoderGraph:
            entry = build_decoder(self.hp, self.weights, self.experts.weights, self.kv, n_tokens, n_kv, n_out,
                                  self.flash_attn, arena, self.rs)
            self.sched.set_pins(entry.graph, self._pins(entry))
            return entry

        entry = self._graphs.get(key, build)
        if self._active != key:
            self.sched.clear_regions()
            self.experts.register(self.sched, entry.regions)
            self._active = key
        return entry

    def _forget_graph(self, key: Hashable, entry: DecoderGraph) -> None:
        if self._active == key:  # its regions are registered with the scheduler
            self.sched.clear_regions()
            self._active = None

    def _pins(self, entry: DecoderGraph) -> list[tuple[Tensor, Backend]]:
        """Each node's backend: where its weight lives, else its layer's device (attention: its KV's)."""
        addr: Callable[[Tensor], int] = lambda t: int(ffi.cast("uintptr_t", t.ptr))
        lay, home = self.layout, {}
        for name, t in self.weights.items():
            home[addr(t)] = self.backend(lay.tensors.get(name) or lay.tensors["output.weight(tied)"])
        for i, ew in enumerate(self.experts.weights):
            if ew is None:
                continue
            for t in ew.kinds.values():
                cache_on = self.experts.layer_backends[i]
                if cache_on is not None:  # a disk layer: the region runs on its cache's device
                    home[addr(t)] = cache_on
                else:
                    home[addr(t)] = self.backend(lay.tensors[t.name])
        pins = []
        for node in entry.graph.nodes:
            if node.ptr.view_src != ffi.NULL:
                # a view lives where its source does (GGML places it so); pinned elsewhere, GGML would hand
                # that device a tensor in another device's memory without a copy
                continue
            b = None
            for src in node.src:
                p = src.ptr
                base = p.view_src if p.view_src != ffi.NULL else p
                b = home.get(int(ffi.cast("uintptr_t", base)))
                if b is not None:
                    break
            if b is None:
                kind, il = entry.owner(node)
                if kind == "attn":
                    b = self.backend(lay.kv_device[il])
                elif kind == "layer":
                    b = self.backend(lay.layer_device[il])
                elif kind == "output":
                    b = self.backend(lay.output_device)
                else:
                    b = self.host
            # an op the chosen backend cannot run is left to the scheduler, which falls back (to the CPU)
            if b.supports(node):
                pins.append((node, b))
        return pins

    def _check_tokens(self, tokens: npt.ArrayLike) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ShapeError(f"eval: tokens must be a non-empty 1-D sequence of integers, got {arr.dtype} "
                             f"{arr.shape}")
        bad = (arr < 0) | (arr >= self.hp.n_vocab)
        if bad.any():
            raise IndexRangeError(f"eval: token id {int(arr[bad][0])} is outside the vocabulary "
                                  f"0..{self.hp.n_vocab - 1}")
        return arr.astype(np.int32)

    def _use_threads(self, batch: bool) -> None:
        """The CPU backends this model owns run ``n_threads_batch`` threads on batches, else ``n_threads``."""
        n = self._threads[batch]
        if n == self._threads_now:
            return
        owned = list(self.devices.values()) if self._own_devices else []
        for b in [self.host, *owned]:
            if b.is_cpu:
                b.set_threads(n, self.options.poll)
        self._threads_now = n

    def _ubatch(self, tokens: np.ndarray, n_out: int) -> np.ndarray:
        n = len(tokens)
        self._use_threads(n > 1)
        n_kv = self.kv.n_kv_for(n)
        g = self._graph(n, n_kv, n_out)
        self.sched.prepare(g.graph)
        feed = self.kv.inputs(n, n_kv, np.float16 if self.flash_attn else np.float32)
        feed["pos"] = positions(self.hp.rope, feed["pos"])
        feed["tokens"] = tokens
        if self.rs is not None:
            feed.update(self.rs.inputs())
        if "out_ids" in g.inputs:
            feed["out_ids"] = np.arange(n - n_out, n, dtype=np.int32)
        # every input was built here from checked tokens and the cache's own positions
        for name, t in g.inputs.items():
            t._set_trusted(feed[name])
        self.sched.compute(g.graph)
        self.experts.flush_traces()
        self.kv.n_past += n
        if self.rs is not None:
            self.rs.advance()
        return g.logits.numpy().reshape(n_out, self.hp.n_vocab)

    def eval(self, tokens: npt.ArrayLike, logits: str = "last") -> np.ndarray:
        """Append ``tokens`` to the sequence; the logits of the last (``"last"``) or every (``"all"``) one."""
        check_choice(logits, "eval: logits", ("last", "all"))
        if self.dry_run:
            raise ClosedError("eval: this model was opened for planning (dry run) and holds no weights")
        if getattr(self, "_closed", False):
            raise ClosedError("eval: the model is closed")
        arr = self._check_tokens(tokens)
        with self._serial.turn("eval"):
            self.kv.n_kv_for(len(arr))  # the whole call fits, or nothing is evaluated
            start = self.kv.n_past
            if self.rs is not None:
                self.rs.begin()
            try:
                out = self._eval(arr, logits)
            except BaseException:
                # all or nothing: a failed ubatch leaves the sequence as it was (the cells written past
                # n_past are masked out and overwritten by the next eval; the recurrent states were
                # written to rows the sequence does not read)
                self.kv.n_past = start
                if self.rs is not None:
                    self.rs.abandon()
                raise
            if self.rs is not None:
                self.rs.commit()
            return out

    def _eval(self, arr: np.ndarray, logits: str) -> np.ndarray:
        ub = self.options.ubatch_size
        out = []
        for b0 in range(0, len(arr), self.options.batch_size):
            batch = arr[b0:b0 + self.options.batch_size]
            for u0 in range(0, len(batch), ub):
                part = batch[u0:u0 + ub]
                last = b0 + u0 + len(part) == len(arr)
                if logits == "all":
                    out.append(self._ubatch(part, len(part)))
                elif last:
                    out.append(self._ubatch(part, 1))
                else:
                    self._ubatch(part, 1)  # the logits of a prompt's inner positions are not needed
        return np.concatenate(out, axis=0)

    # -- reporting ------------------------------------------------------------

    @property
    def counters(self) -> SessionCounters:
        return SessionCounters(self.experts.counters)

    def device_memory(self, device: str | None = None) -> dict[str, int]:
        """Bytes held on the devices (one device, if named) by purpose: what GPUs would hold."""
        names = [self._device_name(device, "MoEModel.device_memory: device")] if device is not None \
            else list(self.devices)
        out = {"weights": 0, "experts": 0, "kv_cache": 0, "recurrent": 0, "compute": 0}
        for name in names:
            b = self.devices[name]
            out["weights"] += sum(t.nbytes for dev, ctx in self.weight_ctxs if dev == name for t in ctx.tensors())
            out["experts"] += self.experts.device_bytes(b)
            out["kv_cache"] += self.kv.nbytes(b)
            out["recurrent"] += self.rs.nbytes(b) if self.rs is not None else 0
            out["compute"] += self.sched.buffer_size(b) + self.experts.compute_bytes(b)
        return out

    def layout_report(self) -> dict[str, Any]:
        """Where each tensor class ended up: bytes per device (``CPU``: copies in host RAM, the repacked weights;
        ``mapped``: used in place from the file)."""
        infos = {n: self.store.info(n).nbytes for n in self.layout.tensors if n in self.store}
        if "output.weight(tied)" in self.layout.tensors:
            infos["output.weight(tied)"] = self.store.info("token_embd.weight").nbytes
        host = {n for n in self.repacked if self.layout.tensors.get(n) == CPU} | self.experts.host_copies
        classes = self.layout.classes(infos, host)
        return {"tensors": classes, "layers": list(self.layout.layer_device), "kv": list(self.layout.kv_device),
                "experts": list(self.layout.expert_mode), "output": self.layout.output_device}

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Release everything; safe twice, and on a model whose load failed half way."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if hasattr(self, "experts"):
            self.experts.close()  # first: its CPU worker may still read the mapped experts
        self._graphs.clear()
        if hasattr(self, "sched"):
            self.sched.close()
        if hasattr(self, "kv"):
            self.kv.close()
        rs = getattr(self, "rs", None)
        if rs is not None:
            rs.close()
        for _, ctx in self.weight_ctxs:
            ctx.close()
        self.store.close()
        if hasattr(self, "host"):
            self.host.close()
        if self._own_devices:
            for b in self.devices.values():
                b.close()

    def __enter__(self) -> MoEModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MoEModel", "check_options"]
