"""The native expert-cache executor: one layer's region run by C code (``_native/src/moe_call.c`` and its neighbours).

Python builds it (slot tensors, the layer's mapped experts, the options), registers its C function with
the scheduler as the region's executor, and afterwards only reads its counters, its trace records and,
when a call failed, its error. A layer call runs no Python at all. Its decisions (hits, loads,
evictions, rounds, the CPU set) and outputs are the Python executor's (:mod:`.executor`), which stays
the reference: ``tests/test_native_executor.py`` compares them call by call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .._native import CData, ffi, lib
from .._native.cstruct import enum_names
from .._native.managed import Managed
from ..errors import (
    AllocationError,
    BackendError,
    ComputeError,
    GgmlHybridError,
    ModelFileError,
    OptionError,
    ShapeError,
)
from ..ggml import rpc
from ..ggml.backend import Backend
from ..ggml.ops import GLU_KINDS, GLU_OPS
from ..gguf.store import GGUFStore
from .cpu_share import COEFFICIENTS, PRIOR_KEYS, CostModel, n_cpu_for_share
from .cpu_worker import NativeWorker
from .ffn import ExpertWeights
from .layer_cache import MODES, LayerCacheConfig, LayerCounters, SyntheticClock, allocate_slots, slot_tensors
from .slot_cache import POLICY_CODES

_ERRORS: dict[int, type[GgmlHybridError]] = {
    lib.HY_ERR_FILE: ModelFileError, lib.HY_ERR_COMPUTE: ComputeError, lib.HY_ERR_ALLOC: AllocationError,
    lib.HY_ERR_WORKER: ComputeError, lib.HY_ERR_INJECTED: ComputeError, lib.HY_ERR_INPUT: ShapeError,
}

#: how loads reach the slots (``enum hy_load_mode``): ``copy`` (``tensor_set``), ``staged`` (double-buffered pinned
#: host memory, asynchronous uploads), ``queued`` (asynchronous uploads straight from the mapping: the backend copies
#: the data when it queues it, as GGML's RPC client does)
LOAD_MODES = enum_names("enum hy_load_mode", "HY_LOAD_")


class Scratch(Managed):
    """The compute buffer shared by the native executors of one session on one device."""

    _kind = "native_scratch"

    def __init__(self, device: Backend) -> None:
        super().__init__(lib.hy_scratch_new(lib.ggml_backend_get_default_buffer_type(device.ptr)),
                         lib.hy_scratch_free)
        self.device = device  # the buffer type belongs to the backend

    @property
    def size(self) -> int:
        return int(self.ptr.size)


class _Exec(Managed):
    _kind = "native_executor"

    def __init__(self, cfg: CData) -> None:
        ptr = lib.hy_moe_exec_new(cfg)
        if ptr == ffi.NULL:
            raise AllocationError("could not create the native expert executor")
        super().__init__(ptr, lib.hy_moe_exec_free)


class NativeExpertExecutor:
    """The native executor of one layer (:class:`~.layer_cache.LayerExecutor`, as the Python reference)."""

    native: ClassVar[bool] = True

    @staticmethod
    def supports(names: dict[str, str], glu: str) -> bool:
        """Whether the C code builds this layer's FFN (``moe_graphs.c: hy_experts_buildable``): a GLU of one input
        over gate_up and down, or gate, up and down with any of their biases and gpt-oss's clamped SwiGLU too."""
        if "gate_up" in names:
            return glu in GLU_OPS and not {"gate_b", "up_b"} & set(names)
        return glu in GLU_OPS or glu == "swiglu_oai"

    def __init__(self, store: GGUFStore, names: dict[str, str], device: Backend, config: LayerCacheConfig, *,
                 scratch: Scratch | None = None, staging: bool | None = None, trace_seq: CData | None = None) -> None:
        """``scratch``: the compute buffer shared with the other layers' executors on this device (default: its
        own); ``staging``: load through pinned staging or queued uploads where the device allows (default: where
        the slots are not host memory); ``trace_seq``: the session's call counter, which orders the trace records
        of its layers."""
        cfg = self.config = config
        if cfg.worker is not None and not isinstance(cfg.worker, NativeWorker):
            raise OptionError("NativeExpertExecutor: its CPU worker is a NativeWorker (the Python one is Python's)")
        self.store, self.names, self.device = store, names, device
        self.layer, self.n_slots, self.n_used = cfg.layer, cfg.n_slots, cfg.n_used
        infos = {k: store.info(n) for k, n in names.items()}
        self.n_expert = infos["down"].shape[0]
        self.n_embd = infos["down"].shape[1]
        self.ctx, self.slot_tensors = slot_tensors(infos, cfg.n_slots)
        direct = self.tier_direct
        self.buffers = allocate_slots(self.ctx, self.slot_tensors, device, cfg.repack and not direct,
                                      virtual=not cfg.clear or direct, clear=cfg.clear and not direct)
        self.slots = ExpertWeights(**self.slot_tensors)
        # bytes of one expert (slot) of each kind: a matrix's nb[2], a bias's nb[1] (gpt-oss)
        self.kind_bytes = {k: t.nb[t.ndim - 1] for k, t in self.slot_tensors.items()}
        self.expert_bytes = sum(self.kind_bytes.values())
        self._raw = {k: np.asarray(store.raw(n)) for k, n in names.items()}  # kept: C reads the mapping
        self.scratch = scratch if scratch is not None else Scratch(device)
        self._own_scratch = scratch is None
        if staging is None:  # where the slots are not host memory: pinned staging, or queued uploads (C decides)
            # the device's default buffer type says it: repacked CPU slots are not "host" buffers, yet CPU memory
            slots_host = lib.ggml_backend_buft_is_host(lib.ggml_backend_get_default_buffer_type(device.ptr))
            staging = not slots_host and lib.ggml_backend_get_device(device.ptr) != ffi.NULL
        self.staging = bool(staging)
        self._keep: list[Any] = []
        self.route = None if cfg.route is None else np.ascontiguousarray(cfg.route, np.int32)
        self.tier = cfg.tier  # loads read the host tier instead of the mapping (kept alive: C points at it)
        self.tier_layer = cfg.tier.add_layer(cfg.layer, names) if cfg.tier is not None else -1
        c = self._config(trace_seq)
        self._exec = _Exec(c)
        self._cfg = c  # C points into what it holds

    @property
    def tier_direct(self) -> bool:
        return self.config.mode == "direct"

    @property
    def mode(self) -> str:
        """Which step order its calls run (``enum hy_exec_mode``), as the C executor took it from the config."""
        return MODES[lib.hy_moe_exec_mode(self._exec.ptr)]

    @property
    def worker(self) -> NativeWorker | None:
        return self.config.worker if self.config.cpu_share else None  # type: ignore[return-value]

    def _config(self, trace_seq: CData | None) -> CData:
        """The C struct ``hy_moe_config`` of this layer: the session's choices (:class:`LayerCacheConfig`), the
        experts' tensors, bytes and place in the mapping, the file's identity."""
        cfg, lc = ffi.new("hy_moe_config *"), self.config
        cfg.layer, cfg.n_expert, cfg.n_used, cfg.n_embd = lc.layer, self.n_expert, lc.n_used, self.n_embd
        cfg.n_slots = lc.n_slots
        cfg.policy = POLICY_CODES[lc.policy]
        cfg.glu = GLU_KINDS[lc.glu]
        for k, t in self.slot_tensors.items():
            setattr(cfg.slots, k, t.ptr)
        if lc.host_experts is not None:
            for k, t in lc.host_experts.kinds.items():
                setattr(cfg.host, k, t.ptr)
        cfg.n_kinds = len(self.names)
        for i, k in enumerate(self.names):
            cfg.slot_tensor[i] = self.slot_tensors[k].ptr
            cfg.src[i] = ffi.cast("const uint8_t *", self._raw[k].ctypes.data)
            cfg.nbytes[i] = self.kind_bytes[k]
        cfg.device = self.device.ptr
        cfg.remote_cpu = int(rpc.computes_on_cpu(self.device))  # rounds compacted, as on a local CPU
        cfg.scratch = self.scratch.ptr
        worker = self.worker
        cfg.worker = worker.ptr if worker is not None else ffi.NULL
        cost = CostModel.for_link(rpc.link_of(self.device.endpoint))  # over RPC: the link's rate and round trips
        if worker is None:
            cfg.share_mode = lib.HY_SHARE_NONE
        elif lc.share == "auto":
            cfg.share_mode = lib.HY_SHARE_AUTO
        else:
            cfg.share_mode = lib.HY_SHARE_FIXED
            # the exact decimal rule, evaluated here once for every miss count a call can have
            table = ffi.new("int32_t[]", [n_cpu_for_share(float(lc.share), n) for n in range(self.n_expert + 1)])
            self._keep.append(table)
            cfg.n_cpu_table = table
        cfg.alpha, cfg.hysteresis, cfg.round_s = cost.alpha, cost.hysteresis, cost.round_s
        for i, k in enumerate(PRIOR_KEYS):
            cfg.prior[i] = cost.prior[k]
        cfg.fd = -1 if self.store.fd is None else self.store.fd  # the open file, not whatever the path names now
        for i, v in enumerate(self.store.identity):
            cfg.file_id[i] = v
        cfg.map_guard = self.store.map_guard + 1
        cfg.staging = int(self.staging)
        cfg.trace = int(lc.trace is not None)
        cfg.trace_seq = trace_seq if trace_seq is not None else ffi.NULL
        if self.route is not None:
            cfg.route = ffi.cast("const int32_t *", self.route.ctypes.data)
            cfg.n_route = len(self.route)
        cfg.tier = self.tier.ptr if self.tier is not None else ffi.NULL
        cfg.tier_layer = self.tier_layer
        cfg.tier_direct = int(self.tier_direct)
        return cfg

    # -- the region -----------------------------------------------------------------------------

    @property
    def c_function(self) -> Callable[..., int]:
        return lib.hy_moe_exec_run

    @property
    def c_user_data(self) -> CData:
        return self._exec.ptr

    def error(self) -> GgmlHybridError | None:
        """The typed error of the last call when it failed (the scheduler only knows it failed)."""
        msg = ffi.new("const char **")
        code = lib.hy_moe_exec_error(self._exec.ptr, msg)
        if code == lib.HY_OK:
            return None
        return _ERRORS.get(code, BackendError)(ffi.string(msg[0]).decode())

    # -- what it did ---------------------------------------------------------------------------------

    @property
    def counters(self) -> LayerCounters:
        if self._exec.closed:  # what the session did stays readable after close()
            return self._final
        return LayerCounters.from_c(lib.hy_moe_exec_counters(self._exec.ptr))

    def last_decision(self) -> dict[str, Any]:
        """The last call's plan, as the Python executor's SlotCache would give it: ``rounds`` of
        (hits, loads, evicted) (none straight from the tier's frames), and ``cpu``, the experts the CPU computed
        (tests compare them)."""
        rounds = [] if self.tier_direct else plan_rounds(lib.hy_moe_exec_cache(self._exec.ptr).plan)
        return {"rounds": rounds, "cpu": self._last_cpu()}

    def _last_cpu(self) -> tuple[int, ...]:
        cpu = ffi.new("const int32_t **")
        n = lib.hy_moe_exec_last_cpu(self._exec.ptr, cpu)
        return tuple(int(cpu[0][i]) for i in range(n))

    def drain_trace(self) -> list[tuple[int, int, np.ndarray, np.ndarray | None]]:
        """``(sequence, layer, ids, prediction or None)`` of every call recorded since the last drain."""
        n = ffi.new("int64_t *")
        p = lib.hy_moe_exec_trace(self._exec.ptr, n)
        if n[0] == 0:
            return []
        data = np.frombuffer(ffi.buffer(p, 4 * n[0]), np.uint32).copy()
        lib.hy_moe_exec_trace_take(self._exec.ptr)
        out, pos, k = [], 0, self.n_used
        while pos < len(data):
            seq = int(data[pos]) | int(data[pos + 1]) << 32
            layer, T = int(data[pos + 2]), int(data[pos + 3])
            ids = data[pos + 4:pos + 4 + T * k].astype(np.int32).reshape(T, k)
            pos += 4 + T * k
            n_pred = int(data[pos])
            out.append((seq, layer, ids, data[pos + 1:pos + 1 + n_pred].astype(np.int32) if n_pred else None))
            pos += 1 + n_pred
        return out

    def set_prefetch(self, next_layer: NativeExpertExecutor | None, router: np.ndarray | None,
                     router_bias: np.ndarray | None = None, select_bias: np.ndarray | None = None,
                     max_experts: int = 0, max_tokens: int = 0, max_read_ahead: int = 0) -> None:
        """Lookahead prefetch into ``next_layer`` (:meth:`.executor.ExpertCacheExecutor.set_prefetch`; C reads
        the arrays, kept here, during every call). With a host tier, up to ``max_read_ahead`` predicted misses are
        read ahead into it (``moe_exec.h: hy_moe_exec_set_prefetch``)."""
        arrays = [None if a is None else np.ascontiguousarray(a, np.float32) for a in (router, router_bias,
                                                                                     select_bias)]
        self._prefetch_arrays = arrays
        ptrs = [ffi.NULL if a is None else ffi.cast("const float *", a.ctypes.data) for a in arrays]
        lib.hy_moe_exec_set_prefetch(self._exec.ptr, ffi.NULL if next_layer is None else next_layer._exec.ptr,
                                     ptrs[0], ptrs[1], ptrs[2], max_experts, max_tokens,
                                     max_read_ahead)

    @property
    def predicted(self) -> tuple[int, ...]:
        """The last prediction the previous layer made for this layer, in id order."""
        p = ffi.new("const int32_t **")
        n = lib.hy_moe_exec_predicted(self._exec.ptr, p)
        return tuple(int(p[0][i]) for i in range(n))

    def reserve(self, n_tokens: int) -> None:
        """Grow the shared scratch now to what a call of ``n_tokens`` tokens can need (its largest graphs)."""
        if lib.hy_moe_exec_reserve(self._exec.ptr, n_tokens) != lib.HY_OK:
            raise self.error() or AllocationError(f"layer {self.layer}: cannot reserve the expert graphs")

    @property
    def load_mode(self) -> str:
        """How loads reach the slots: ``copy`` (``tensor_set``), ``staged`` (double-buffered pinned host memory,
        asynchronous uploads), ``queued`` (asynchronous uploads straight from the mapping: the backend copies
        the data when it queues it, as GGML's RPC client does)."""
        return LOAD_MODES[lib.hy_moe_exec_load_mode(self._exec.ptr)]

    def use_plain_loads(self) -> None:
        """Load by plain ``tensor_set`` from now on (benchmarks compare it with staged or queued loads)."""
        lib.hy_moe_exec_plain_loads(self._exec.ptr)

    @property
    def graph_builds(self) -> int:
        return int(lib.hy_moe_exec_graph_builds(self._exec.ptr))

    @property
    def compute_bytes(self) -> int:
        return self.scratch.size if self._own_scratch else 0

    @property
    def slot_bytes(self) -> int:
        return 0 if self.tier_direct else sum(t.nbytes for t in self.slot_tensors.values())

    def use_cost_model(self, cost: CostModel) -> None:
        """Replace the layer's cost model (``auto``) by one with ``cost``'s fixed coefficients or priors."""
        c = lib.hy_moe_exec_cost_model(self._exec.ptr)
        if cost._fixed is not None:
            lib.hy_cost_init_fixed(c, cost.hysteresis, [cost._fixed[k] for k in COEFFICIENTS])
        else:
            lib.hy_cost_init(c, cost.alpha, cost.hysteresis, [cost.prior[k] for k in PRIOR_KEYS])
        c.round_s = cost.round_s

    def use_clock(self, clock: SyntheticClock) -> None:
        """Observe durations computed from the work (repeatable ``auto`` decisions)."""
        lib.hy_moe_exec_set_clock(self._exec.ptr, [clock.coefficients[k] for k in COEFFICIENTS])

    def inject_load_failure(self, after: int) -> None:
        """Fail the load that comes after the next ``after`` loads (tests)."""
        lib.hy_moe_exec_inject_load_failure(self._exec.ptr, after)

    def close(self) -> None:
        if self._exec.closed:
            return
        self._final = self.counters
        self._exec.close()
        if self._own_scratch:
            self.scratch.close()
        self.ctx.close()


# a round of a C plan as plain tuples: slot_cache.Round's fields (hits, loads, evicted), compared with it in the tests
RoundFields = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], tuple[int, ...]]


def plan_rounds(p: CData) -> list[RoundFields]:
    """A C plan (``hy_plan``) as ``[(hits, loads, evicted), ...]`` by round, the SlotCache's Round fields."""
    rounds: list[list[list[Any]]] = [[[], [], []] for _ in range(p.n_rounds)]
    if p.n_rounds:
        rounds[0][0] = [(int(p.hit_expert[i]), int(p.hit_slot[i])) for i in range(p.n_hits)]
    for i in range(p.n_loads):
        rounds[p.load_round[i]][1].append((int(p.load_expert[i]), int(p.load_slot[i])))
    for i in range(p.n_evicted):
        rounds[p.evicted_round[i]][2].append(int(p.evicted_expert[i]))
    return [(tuple(h), tuple(ld), tuple(ev)) for h, ld, ev in rounds]
