"""What the two executors of a disk layer share: one configuration, one interface, their counters and steps.

A disk layer's routed experts run through an expert cache, by the native executor (:mod:`.native_executor`, C
code the scheduler calls) or the Python one (:mod:`.executor`, the readable reference). Both take one
:class:`LayerCacheConfig` (the session's choices for the layer: the fields of the C struct ``hy_moe_config``
that do not come from the file), satisfy one :class:`LayerExecutor` interface, count in :class:`LayerCounters`
(the C struct ``hy_moe_counters``) and run, call by call, the steps :data:`STEPS` lists for their mode: the one
list, ``_native/src/moe_call.c: STEPS``, read here through cffi.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import numpy as np

from .._native import CData, ffi, lib
from .._native.cstruct import Counters, enum_names
from ..checks import check_real
from ..errors import CpuShareError
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.repack import repack_buffer_type
from ..ggml.tensor import Tensor
from ..options import EvictionPolicy
from .cpu_share import COEFFICIENTS
from .cpu_worker import CPUWorker, NativeWorker
from .ffn import ExpertWeights
from .host_tier import HostTier

if TYPE_CHECKING:
    from .traces.format import TraceWriter

#: the executor's modes (``enum hy_exec_mode``): the slots fed from the mapping, the slots fed from the host tier,
#: a CPU playing the device computing straight from the tier's frames
MODES: tuple[str, ...] = enum_names("enum hy_exec_mode", "HY_MODE_")
ExecMode = Literal["slots", "tier", "direct"]


def _steps(mode: int) -> tuple[str, ...]:
    names = [ffi.string(lib.hy_moe_exec_step_name(i)).decode() for i in range(lib.HY_STEP_N)]
    p = ffi.new("const uint8_t **")
    n = lib.hy_moe_exec_steps(mode, p)
    return tuple(names[p[0][i]] for i in range(n))


#: the steps of a call in each mode, in order (``moe_call.c: STEPS``): each a function of the C executor and a
#: method of the Python one (with a leading underscore) of the same name
STEPS: Mapping[str, tuple[str, ...]] = {m: _steps(i) for i, m in enumerate(MODES)}


class LayerCounters(Counters, struct="hy_moe_counters"):
    """A layer's counters, summed over its calls, kept by both executors: the fields of the C struct
    ``hy_moe_counters`` (``_native/src/moe_exec.h`` lists and documents them), in its order."""

    @property
    def share_applied(self) -> float:
        """Mean share of misses the CPU took, over calls with misses."""
        return float(self.share_sum / self.share_calls) if self.share_calls else 0.0

    @property
    def orchestration_ns(self) -> int:
        """Executor time that is neither loading nor computing: the Python side."""
        return int(self.device_ns - self.load_ns - self.compute_ns)

    @property
    def recall(self) -> float:
        """Of the experts the predicted calls routed to, the share the lookahead predicted (moe_prefetch)."""
        return float(self.predicted_right / self.predicted_of) if self.predicted_of else 0.0

    @property
    def precision(self) -> float:
        """Of the experts the lookahead predicted, the share the call routed to."""
        return float(self.predicted_right / self.predicted) if self.predicted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "share_applied": self.share_applied, "orchestration_ns": self.orchestration_ns,
                "recall": self.recall, "precision": self.precision}


@dataclass(frozen=True, eq=False)
class LayerCacheConfig:
    """One disk layer's expert cache as the session configures it, for either executor: the fields of the C
    struct ``hy_moe_config`` that do not come from the file (its experts' shapes and bytes do).

    ``route`` (``moe_route_trace``, benchmarks): ``[n, n_used]`` expert ids that replace the router's choice, one
    row per token, cycling (the weights stay the router's). ``clear=False`` (planning only: nothing will run) only
    reserves the slot memory. ``repack``: slots on a CPU device in GGML's CPU extra buffer types where the experts'
    type allows (:func:`allocate_slots`). ``tier_direct`` (with ``tier``): a CPU playing the device computes every
    expert from the tier's frames; the slots then only give the experts' shapes (address space, never committed).
    """

    layer: int                         # the MoE layer's number: it keys trace records and the worker's graphs
    n_slots: int
    n_used: int
    policy: EvictionPolicy = "freq"
    glu: str = "swiglu"
    share: float | Literal["auto"] = 0.0  # the CPU's share of the misses (with a worker)
    worker: CPUWorker | NativeWorker | None = None
    host_experts: ExpertWeights | None = None  # the experts on the mapped file, for the CPU's share
    trace: TraceWriter | None = None   # shared by the session's layers
    route: np.ndarray | None = None
    tier: HostTier | None = None       # loads read the host tier instead of the mapping
    tier_direct: bool = False
    repack: bool = True
    clear: bool = True

    @property
    def mode(self) -> ExecMode:
        """Which of :data:`STEPS` the layer's calls run."""
        if self.tier is None:
            return "slots"
        return "direct" if self.tier_direct else "tier"

    @property
    def cpu_share(self) -> bool:
        """Whether a share of the misses goes to the worker."""
        return self.worker is not None and self.share != 0.0


@runtime_checkable
class LayerExecutor(Protocol):
    """What a session asks of a disk layer's executor, native or Python (``tests/test_native_executor.py`` holds
    both to it): its counters, its decisions, the lookahead, its memory; the call itself is the region's (a Python
    callable, or a C function and its data)."""

    native: ClassVar[bool]
    config: LayerCacheConfig
    device: Backend
    n_expert: int
    n_embd: int
    expert_bytes: int
    slot_tensors: dict[str, Tensor]

    @property
    def counters(self) -> LayerCounters: ...

    @property
    def predicted(self) -> tuple[int, ...]: ...

    @property
    def slot_bytes(self) -> int: ...

    @property
    def compute_bytes(self) -> int: ...

    @property
    def tier_direct(self) -> bool: ...

    @property
    def mode(self) -> str: ...

    def last_decision(self) -> dict[str, Any]: ...

    def set_prefetch(self, next_layer: Any, router: np.ndarray | None, router_bias: np.ndarray | None = None,
                     select_bias: np.ndarray | None = None, max_experts: int = 0, max_tokens: int = 0,
                     max_read_ahead: int = 0) -> None: ...

    def reserve(self, n_tokens: int) -> None: ...

    def close(self) -> None: ...


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


def slot_tensors(store_infos: Mapping[str, Any], n_slots: int) -> tuple[Context, dict[str, Tensor]]:
    """A layer's slot tensors: each expert tensor's shape with ``n_slots`` experts plus the zeroed pad slot."""
    ctx = Context(n_tensors=len(store_infos))
    return ctx, {k: ctx.new_tensor(info.dtype, (n_slots + 1,) + tuple(info.shape[1:]), f"slots.{k}")
                 for k, info in store_infos.items()}


def allocate_slots(ctx: Context, slots: dict[str, Tensor], device: Backend, repack: bool, virtual: bool,
                   clear: bool) -> list[Buffer]:
    """Memory for a layer's slot tensors on ``device``, zeroed when ``clear`` (the pad slot's zeros absorb
    padding rows). On a CPU device with ``repack`` (the session's option), a kind whose experts GGML's CPU
    extra buffer types take goes there, as its resident experts would: a slot then computes with the same
    kernels, and a load repacks one expert (vendor patch 0004)."""
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


def tier_views(tier: HostTier, layer: int, like: dict[str, Tensor]) -> tuple[Context, ExpertWeights]:
    """The host tier's arena as layer ``layer``'s expert tensors (``host_tier.h: hy_tier_view``): one expert per
    frame, so that a frame index is an expert index (the CPU computes straight from the tier). ``like``: the
    layer's slot tensors by kind, in the tier's kind order."""
    ctx = Context(n_tensors=len(like))
    views = {}
    for k, (kind, t) in enumerate(like.items()):
        p = lib.hy_tier_view(tier.ptr, ctx.ptr, layer, k, t.ptr)
        if p == ffi.NULL:
            ctx.close()
            tier.raise_error()
        views[kind] = Tensor(p, ctx)
    return ctx, ExpertWeights(**views)


__all__ = ["LayerCacheConfig", "LayerCounters", "LayerExecutor", "MODES", "STEPS", "SyntheticClock", "allocate_slots",
           "slot_tensors", "tier_views"]
