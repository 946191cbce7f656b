"""What was loaded from a GGUF file (llama.cpp's ``llama_model``): the file, its layout, its weights, its experts.

    model = LoadedModel("model.gguf", SessionOptions.parse(["disk_experts=1", "expert_cache_slots=16"]))
    main = Session(model)                                             # runtime/session.py: what a run holds
    draft = Session(model, model.options.merged(n_ctx=512))           # a second run over the same weights

A :class:`LoadedModel` holds what every run over the file shares and none of them changes: the memory-mapped
file (:class:`GGUFStore`), its hyperparameters and tokenizer, the devices and the host backend, the layout
(which device holds each tensor), the dense weights on their devices and the routed experts
(:class:`ExpertLayers`: resident, on the CPU, or behind the device expert cache with its CPU share and host tier).
What a run changes (the KV cache, recurrent states, sequences, the scheduler and the decoder graphs) is a
:class:`~ggml_hybrid.runtime.session.Session`'s; several sessions share one model's weights.

The sessions of one model take turns (:attr:`serial`): the expert cache, its CPU worker and the backends' thread
counts are the model's and single-threaded. :class:`~ggml_hybrid.runtime.moe_model.MoEModel` is the session that
loads its own model and closes it with itself.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .._native import CData, ffi
from ..checks import check_callable, check_type
from ..errors import ArgumentError, ArgumentTypeError, ClosedError, GgmlHybridError, ModelFileError, RPCError
from ..ggml import rpc
from ..ggml.backend import Backend, cpu, cpu_instance
from ..ggml.context import Context
from ..ggml.graph import REPACK_GEMM_MIN_ROWS, ROWWISE_REPACK_TYPE, TILED_MIN_ROWS, TILED_TYPES, VULKAN_MAT_VEC_ROWS
from ..ggml.repack import buffer_type_name, repack_buffer_type
from ..ggml.tensor import Tensor
from ..gguf.names import is_expert_tensor
from ..gguf.store import GGUFStore, load_into, repack_rule
from ..machine import default_threads
from ..model.decoder import DecoderGraph
from ..model.families import read_hparams, tensor_shapes
from ..model.families.recurrent import check_cuda
from ..model.hparams import HParams
from ..model.mtp import check_head, head_layer
from ..moe.expert_layers import ExpertLayers, check_moe_options
from ..moe.stack_session import SessionCounters
from ..options import MAX_DEVICES, OptionError, SessionOptions
from ..placement.devices import open_devices
from ..placement.layout import CPU, Layout, plan_layout
from ..serial import Serial
from ..text.spm import SPMTokenizer
from ..text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from .session import Session


def check_context_options(opts: SessionOptions, hp: HParams) -> None:
    """The rules of a session's own options (batch sizes, the KV cache's types) for this model."""
    if opts.ubatch_size > opts.batch_size:
        raise OptionError(f"ubatch_size={opts.ubatch_size}: must not exceed batch_size={opts.batch_size}")
    if opts.cache_type_v == "q8_0" and opts.flash_attn is False:
        raise OptionError("cache_type_v=q8_0: a quantized V cache needs flash_attn=true (as in llama.cpp)")
    if hp.mla is not None and opts.cache_type_k != opts.cache_type_v:
        # the latent cache has no V, but llama.cpp still refuses different K and V types for it
        raise OptionError(f"cache_type_k={opts.cache_type_k} cache_type_v={opts.cache_type_v}: {hp.arch}'s latent KV "
                          "cache needs the same type for both (as in llama.cpp)")
    for key, head in (("cache_type_k", hp.head_dim), ("cache_type_v", hp.head_dim_v)):
        if getattr(opts, key) == "q8_0" and head % 32:
            raise OptionError(f"{key}=q8_0: the head size {head} is not a multiple of 32")


def check_options(opts: SessionOptions, hp: HParams) -> None:
    """Every option rule for this model: the load's (the expert modes and cache) and its first session's."""
    check_moe_options(opts, hp.n_layer, hp.n_expert, hp.n_used)
    check_context_options(opts, hp)


def _device_names(names: object) -> list[str]:
    """The planner's stand-in device names: a list of 1..MAX_DEVICES distinct non-empty strs."""
    what = "MoEModel: dry_run_devices"
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise ArgumentTypeError(f"{what} must be a list of device names (non-empty strs), got {names!r}")
    if not 1 <= len(names) <= MAX_DEVICES or len(set(names)) != len(names) or CPU in names:
        raise ArgumentError(f"{what} must name 1..{MAX_DEVICES} distinct devices other than {CPU}, got {names!r}")
    return list(names)


def check_load_arguments(options: SessionOptions | None, device: Backend | None,
                         progress: Callable[[int, int], object] | None,
                         dry_run_devices: list[str] | None) -> tuple[SessionOptions, list[str] | None]:
    """A load's arguments checked before anything is opened: its options (default ones if ``None``) and the
    dry run's device names."""
    if device is not None:
        check_type(device, "MoEModel: device", Backend)
    if progress is not None:
        check_callable(progress, "MoEModel: progress")
    if dry_run_devices is not None:
        dry_run_devices = _device_names(dry_run_devices)
    opts = options if options is not None else SessionOptions()
    if not isinstance(opts, SessionOptions):
        raise OptionError(f"options must be SessionOptions, got {type(opts).__name__}")
    return opts, dry_run_devices


def lost_server(exc: BaseException, devices: dict[str, Backend]) -> RPCError | None:
    """The error to raise instead of ``exc`` when it failed because an RPC server was lost meanwhile."""
    if isinstance(exc, Exception) and not isinstance(exc, RPCError):
        return rpc.lost(devices.values())
    return None


class LoadedModel:
    """A GGUF file loaded onto its layout: weights and experts placed per ``options`` (docs/api.md).

    ``options`` are the load's: the layout flags, the expert modes and cache, the host tier, repacking, the host
    backend's threads. They also give the defaults of a :class:`Session` over this model, which may choose its own
    context options (``Session.CONTEXT_OPTIONS``). ``expert_cache_slots`` must be a number here
    (:func:`~ggml_hybrid.runtime.moe_model.auto_cache_slots` chooses one; ``MoEModel`` does it for ``auto``).

    ``device``: one backend to use as the only device (not owned: closing the model leaves it open).
    ``progress(done, total)`` is called as tensors are loaded. ``benchmark``: the only kind of load that may
    replace the routing by a trace (``moe_route_trace``; :attr:`route_trace` says so).
    ``dry_run_devices`` (planning): allocate everything as a load would, on CPU backend instances standing in for
    the named devices, but read no tensor data; sessions over such a model allocate but must not evaluate.
    ``default_n_threads``: the thread count without ``n_threads`` (default: the idle cores now).
    """

    # set by _load; close() releases whichever of them a failed load got to
    devices: dict[str, Backend]
    host: Backend
    device: Backend
    experts: ExpertLayers
    layout: Layout
    weights: dict[str, Tensor]

    def __init__(self, path: str | os.PathLike[str], options: SessionOptions | None = None,
                 device: Backend | None = None, progress: Callable[[int, int], object] | None = None,
                 dry_run_devices: list[str] | None = None, benchmark: bool = False,
                 default_n_threads: int | None = None) -> None:
        self._closed = False
        opts, dry_run_devices = check_load_arguments(options, device, progress, dry_run_devices)
        self.dry_run = dry_run_devices is not None
        t0 = time.perf_counter()
        self.options = opts
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
        # without a thread count, the idle cores now (machine.py: default_threads; GGML's barrier spins, so a busy core
        # costs every thread its wait), unless the caller counted them
        self.n_threads = opts.n_threads or (1 if self.dry_run else default_n_threads or default_threads())
        #: the thread count the CPU backends this model owns run now (a session sets its own before each ubatch)
        self.threads_now = self.n_threads
        self._own_devices = device is None
        self.devices = {}
        #: one call at a time among this model's sessions: they share the expert cache, its worker, the backends
        self.serial = Serial("MoEModel")
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self.weight_ctxs: list[tuple[str, Context]] = []
        self.repacked: set[str] = set()  # tensors in a CPU extra buffer type (llama.cpp's repacked weights)
        self.repack_types: set[str] = set()  # the names of those buffer types
        #: the draft head's block (spec_type=draft-mtp: the next-token-prediction layer, loaded as layer n_layer)
        self.head_layer: int | None = None
        try:
            if opts.spec_type == "draft-mtp":
                self.head_layer = head_layer(hp, store.path)
            self._load(opts, hp, device, dry_run_devices, progress, benchmark)
            rpc.raise_if_lost(self.devices.values())  # a server lost while loading: the weights are not there
        except BaseException as exc:
            lost = lost_server(exc, self.devices)  # a load that failed because a server was lost says so
            self.close()
            if lost is not None:
                raise lost from exc
            raise
        self.load_seconds = time.perf_counter() - t0

    def _load(self, opts: SessionOptions, hp: HParams, device: Backend | None, dry_run_devices: list[str] | None,
              progress: Callable[[int, int], object] | None, benchmark: bool) -> None:
        store = self.store
        n_threads = self.n_threads
        # without accelerators, CPU backend instances play the devices (DEV0, ...), with their own buffers
        if self.dry_run:
            for i, name in enumerate(cast("list[str]", dry_run_devices)):  # given when dry_run
                self.devices[name] = cpu_instance(i, 1)
        elif device is not None:
            name = device.kind if device.endpoint is not None else "DEV0" if device.is_cpu else device.kind
            self.devices = {name: device}
        else:
            self.devices = open_devices(opts, n_threads)
        self.host = cpu(n_threads, opts.poll)
        self.device = next(iter(self.devices.values()))
        check_cuda(store.path, hp, list(self.devices))
        required = list(tensor_shapes(hp))
        # the draft head's block is one more layer (blk.n_layer), placed and cached like any other
        if self.head_layer is not None:
            required += [n for n in check_head(store, hp) if n not in required]
        # llama.cpp's offload rule counts every block of the file, the next-token-prediction ones included (loaded or
        # not); the layers that run are the graph's and the head's
        self.layout = plan_layout(required, hp.n_layer + (self.head_layer is not None), opts, list(self.devices),
                                  hp.tied_output, n_blocks=hp.n_layer_all or hp.n_layer)
        dense = [n for n in required if not is_expert_tensor(n)]
        total = len(required) + (1 if hp.tied_output else 0)
        done = [0]

        def tick(_name: str) -> None:
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

        self._load_dense(dense, tick)
        lay = self.layout
        heads = [] if self.head_layer is None else [self.head_layer]
        self.experts = ExpertLayers(store, hp.n_layer + len(heads), hp.n_used, opts, self.device, n_threads,
                                    on_tensor=tick, modes=list(lay.expert_mode),
                                    backend_of=lambda n: self.devices.get(lay.tensors[n]), load=not self.dry_run,
                                    moe_layers=hp.moe_layers + heads, glu=hp.routing.glu, benchmark=benchmark)

    def _repack_rule(self, backend: Backend) -> Callable[[str], CData | None]:
        """Which tensors on ``backend`` go to a CPU extra buffer type; recorded in ``self.repacked``."""
        rule = repack_rule(self.store, self.options.repack and backend.is_cpu)

        def record(name: str) -> CData | None:
            buft = rule(name)
            if buft is not None:
                self.repacked.add(name)
                self.repack_types.add(buffer_type_name(buft))
            return buft

        return record

    def _load_dense(self, dense: list[str], tick: Callable[[str], None]) -> None:
        """Dense weights into each device's buffer; CPU ones used in place from the mapped file, but for those
        repacked into a CPU extra buffer type (copies, as llama.cpp makes them)."""
        by_dev: dict[str, list[str]] = {}
        for n in dense:
            by_dev.setdefault(self.layout.tensors[n], []).append(n)
        self.weights = {}
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
                self.repack_types.add(buffer_type_name(buft))
            else:
                ctx.allocate(backend, "weights", virtual=self.dry_run)
            if not self.dry_run:
                self.store.load(t, source="token_embd.weight")
            self.weights["output.weight"] = t
            self.weight_ctxs.append((out_dev, ctx))
            tick("output.weight")

    # -- devices --------------------------------------------------------------

    def backend(self, name: str) -> Backend:
        """The backend of a device name of this model (``CPU``: the host backend)."""
        if isinstance(name, str) and name == CPU:
            return self.host
        return self.devices[self.device_name(name, "MoEModel.backend: name")]

    def device_name(self, name: object, what: str) -> str:
        """``name`` if it names one of this model's devices."""
        check_type(name, what, str)
        if name not in self.devices:
            raise ArgumentError(f"{what} {name!r} is not a device of this session; they are "
                                f"{', '.join(self.devices)}")
        return name

    def use_threads(self, n: int) -> None:
        """The CPU backends this model owns (the host's, CPU instances playing devices) run ``n`` threads."""
        if n == self.threads_now:
            return
        owned = list(self.devices.values()) if self._own_devices else []
        for b in [self.host, *owned]:
            if b.is_cpu:
                b.set_threads(n, self.options.poll)
        self.threads_now = n

    def _weight_homes(self) -> dict[int, Backend]:
        """The backend of every weight and routed expert tensor, by the address of its struct."""
        addr: Callable[[Tensor], int] = lambda t: int(ffi.cast("uintptr_t", t.ptr))
        lay, home = self.layout, {}
        for name, t in self.weights.items():
            home[addr(t)] = self.backend(lay.tensors.get(name) or lay.tensors["output.weight(tied)"])
        for i, ew in enumerate(self.experts.weights):
            cache_on = self.experts.layer_backends[i]
            for t in ew.kinds.values() if ew is not None else ():
                # a disk layer's region runs on its cache's device
                home[addr(t)] = cache_on if cache_on is not None else self.backend(lay.tensors[t.name])
        return home

    def _owner_backend(self, entry: DecoderGraph, node: Tensor) -> Backend:
        """A node without a weight runs on its layer's device (attention: its KV's; the output's; else the host)."""
        kind, il = entry.owner(node)
        lay = self.layout
        if kind == "attn":
            return self.backend(lay.kv_device[il])
        if kind == "layer":
            return self.backend(lay.layer_device[il])
        if kind == "output":
            return self.backend(lay.output_device)
        return self.host

    def pins(self, entry: DecoderGraph) -> list[tuple[Tensor, Backend]]:
        """Each node's backend: where its weight lives, else its layer's device (attention: its KV's)."""
        home = self._weight_homes()
        pins = []
        for node in entry.graph.nodes:
            if node.ptr.view_src != ffi.NULL:
                # a view lives where its source does (GGML places it so); pinned elsewhere, GGML would hand
                # that device a tensor in another device's memory without a copy
                continue
            b = None
            for src in node.src:
                p = src.ptr
                b = home.get(int(ffi.cast("uintptr_t", p.view_src if p.view_src != ffi.NULL else p)))
                if b is not None:
                    break
            if b is None:
                b = self._owner_backend(entry, node)
            # an op the chosen backend cannot run is left to the scheduler, which falls back (to the CPU)
            if b.supports(node):
                pins.append((node, b))
        return pins

    # -- reporting ------------------------------------------------------------

    @property
    def counters(self) -> SessionCounters:
        """The expert layers' counters: every session's calls over this model."""
        return SessionCounters(self.experts.counters)

    @property
    def route_trace(self) -> str | None:
        """The routing trace that replaces the router's choice (``moe_route_trace``, benchmarks): when set, the
        output is not the model's own."""
        return self.experts.route_trace

    def device_memory(self, device: str | None = None) -> dict[str, int]:
        """Bytes this model holds on the devices (one device, if named) by purpose: its weights, its experts
        (resident ones and cache slots) and the expert caches' own compute memory; sessions add theirs."""
        names = [self.device_name(device, "MoEModel.device_memory: device")] if device is not None \
            else list(self.devices)
        out = {"weights": 0, "experts": 0, "compute": 0}
        for name in names:
            b = self.devices[name]
            out["weights"] += sum(t.nbytes for dev, ctx in self.weight_ctxs if dev == name for t in ctx.tensors())
            out["experts"] += self.experts.device_bytes(b)
            out["compute"] += self.experts.compute_bytes(b)
        return out

    @functools.cached_property
    def cpu_experts_active(self) -> bool:
        """Whether routed experts run on the CPU: some expert weights are placed there (``cpu_moe``, ``n_cpu_moe``,
        ``-ot ...=CPU``), or a CPU share of cache misses is set for layers that use the cache. How much the CPU
        actually ran is counted apart (``share_applied``, ``cpu_misses``). Reported as ``hybrid_offload_active``."""
        lay = self.layout
        on_cpu = any(dev == CPU for name, dev in lay.tensors.items() if is_expert_tensor(name))
        shared = self.options.moe_cpu_share != 0.0 and "disk" in lay.expert_mode
        return on_cpu or shared

    def layout_report(self) -> dict[str, Any]:
        """Where each tensor class ended up: bytes per device (``CPU``: copies in host RAM, the repacked weights;
        ``mapped``: used in place from the file)."""
        infos = {n: self.store.info(n).nbytes for n in self.layout.tensors if n in self.store}
        if "output.weight(tied)" in self.layout.tensors:
            infos["output.weight(tied)"] = self.store.info("token_embd.weight").nbytes
        host = {n for n in self.repacked if self.layout.tensors.get(n) == CPU} | self.experts.host_copies
        classes = self.layout.classes(infos, host)
        held = sum(infos[n] for n in self.experts.tier_held())
        if held:  # the host tier reads these experts from the file: they are not used through the mapping
            mapped = classes["mapped"]
            mapped["routed_experts"] -= held
            if not mapped["routed_experts"]:
                del mapped["routed_experts"]
            if not mapped:
                del classes["mapped"]
            classes["host tier"] = {"routed_experts": held}
        return {"tensors": classes, "layers": list(self.layout.layer_device), "kv": list(self.layout.kv_device),
                "experts": list(self.layout.expert_mode), "output": self.layout.output_device}

    # -- lifetime -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self, op: str) -> None:
        """Refuse ``op`` on a closed model."""
        if self._closed:
            raise ClosedError(f"{op}: the model is closed")

    def add_session(self, session: Session) -> None:
        """``session`` runs over this model: closing the model closes it first."""
        self.check_open("Session")
        self._sessions.add(session)

    def close(self) -> None:
        """Release everything, its sessions first; safe twice, and on a model whose load failed half way."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for s in list(getattr(self, "_sessions", ())):
            s.close()
        if hasattr(self, "experts"):
            self.experts.close()  # first: its CPU worker may still read the mapped experts
        for _, ctx in getattr(self, "weight_ctxs", ()):
            ctx.close()
        self.store.close()
        if hasattr(self, "host"):
            self.host.close()
        if getattr(self, "_own_devices", False):
            for b in self.devices.values():
                b.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_rows(model: LoadedModel, ubatch_size: int) -> int:
    """Most sequences one decode ubatch of a session over ``model`` takes: ``ubatch_size``, and fewer than GGML's
    tiled threshold when an expert cache computes experts of a tiled type: its graphs (and its CPU worker's) are not
    rowwise, so at the threshold rows of one expert would take another kernel than a lone sequence's one row.
    Likewise fewer than GGML's repacked gemm threshold when dense weights are in an extra buffer type other than
    ``CPU_REPACK`` (AMX, KleidiAI): those products take gemm from that many rows, whose bits differ from a lone row's
    gemv, and no patch of ours steers them. ``CPU_REPACK`` products honour GGML_HINT_ROWWISE (patch 0006: gemv for
    every row); their expert products are gemv per row already.

    On a Vulkan device, at most GGML's mat-vec limit (8 rows; a tiled kernel above, F16 operands: 1e-3 from a
    lone run), and with an expert cache there, as many sequences as keep a call's rows (a sequence's
    ``n_used`` each) within it: its rounds compute their rows together. Within the limit a sequence differs
    from its lone run by about 2e-7 relative on lavapipe, not bit-identical (docs/vulkan.md)."""
    rows = ubatch_size
    vulkan = {name for name in model.devices if name.startswith("Vulkan")}
    if vulkan & set(model.layout.layer_device + model.layout.kv_device + (model.layout.output_device,)):
        rows = min(rows, VULKAN_MAT_VEC_ROWS)
    experts = model.experts
    if any(ex is not None and ex.device.name in vulkan for ex in experts.executors):
        rows = min(rows, VULKAN_MAT_VEC_ROWS)  # a cache's rounds run the call's own graph: the same kernel
    tiled = any(ex is not None and w is not None and any(t.dtype in TILED_TYPES for t in w.kinds.values())
                for ex, w in zip(experts.executors, experts.weights))
    if tiled:
        rows = min(rows, TILED_MIN_ROWS - 1)
    if model.repack_types - {ROWWISE_REPACK_TYPE}:
        rows = min(rows, REPACK_GEMM_MIN_ROWS - 1)
    return rows


def resolve_flash_attn(model: LoadedModel, opts: SessionOptions) -> bool:
    """A session's ``flash_attn`` over ``model`` as a bool; ``auto`` is llama.cpp's rule: on when every backend that
    runs attention (where the KV cache lives) supports the fused op for this model's shapes and types."""
    hp = model.hp
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
            on = all(model.backend(d).supports(probe) for d in set(model.layout.kv_device))
    if not on and opts.cache_type_v == "q8_0":
        raise OptionError("cache_type_v=q8_0 with flash_attn=auto: the backends cannot run flash attention for "
                          "this model, and a quantized V cache needs it")
    return on


class ModelView:
    """What a session shows of its model, read-only (``session.hp``, ``session.tokenizer``, ...): the attributes
    ``MoEModel`` always had, now the loaded model's."""

    model: LoadedModel


    @property
    def hp(self) -> HParams:
        return self.model.hp

    @property
    def store(self) -> GGUFStore:
        return self.model.store

    @property
    def tokenizer(self) -> Tokenizer | SPMTokenizer:
        return self.model.tokenizer

    @property
    def layout(self) -> Layout:
        return self.model.layout

    @property
    def experts(self) -> ExpertLayers:
        return self.model.experts

    @property
    def devices(self) -> dict[str, Backend]:
        return self.model.devices

    @property
    def host(self) -> Backend:
        return self.model.host

    @property
    def device(self) -> Backend:
        return self.model.device

    @property
    def weights(self) -> dict[str, Tensor]:
        return self.model.weights

    @property
    def weight_ctxs(self) -> list[tuple[str, Context]]:
        return self.model.weight_ctxs

    @property
    def repacked(self) -> set[str]:
        return self.model.repacked

    @property
    def repack_types(self) -> set[str]:
        return self.model.repack_types

    @property
    def dry_run(self) -> bool:
        return self.model.dry_run

    @property
    def counters(self) -> SessionCounters:
        return self.model.counters

    @property
    def route_trace(self) -> str | None:
        return self.model.route_trace

    @property
    def cpu_experts_active(self) -> bool:
        return self.model.cpu_experts_active

    def layout_report(self) -> dict[str, Any]:
        return self.model.layout_report()

    def backend(self, name: str) -> Backend:
        """The backend of a device name of this session's model (``CPU``: the host backend)."""
        return self.model.backend(name)


__all__ = ["LoadedModel", "ModelView", "check_context_options", "check_load_arguments", "check_options", "decode_rows",
           "lost_server", "resolve_flash_attn"]
