"""``host_tier_bytes=auto``: the host tier sized beside what the session itself holds in the same memory.

Rule. A dry run of the session (:class:`~ggml_hybrid.runtime.moe_model.MoEModel` with ``dry_run_devices``: every
buffer allocated as a load would, on stand-ins, no tensor read) gives the bytes it holds in host memory besides the
tier (:func:`session_host_bytes`): the host's KV cache, recurrent states and compute buffer, the weights copied into
host RAM (repacked) or used in place from the mapped file (the routed experts the tier reads excepted), and
everything on a CPU playing a device (``DEV0``, ...: its weights, slots, KV cache and compute buffers are host
memory). Then

    budget = available - held - AUTO_SLACK      (moe/host_tier.py: auto_budget)

where ``available`` is the memory available before the model loads (``MemAvailable``, or what the process's memory
cgroup still allows). Less than one layer's experts is refused with these figures. ``plan`` uses the same bytes
(``host.held``) for its advice, so its ``--host-tier`` size and ``auto`` agree. Not counted: a GPU's pinned staging
buffers and the CPU worker's own graphs (small; the slack), GPU and RPC device memory (not host memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..moe.host_tier import AUTO_SLACK
from ..placement.layout import CPU
from ..units import format_bytes

if TYPE_CHECKING:
    from .session import Session

__all__ = ["TierChoice", "host_memory_devices", "session_host_bytes"]


def host_memory_devices(names: list[str]) -> list[str]:
    """The devices among ``names`` whose memory is host memory: CPU instances playing devices (``DEV0``, ...)."""
    return [d for d in names if d.startswith("DEV")]


def session_host_bytes(s: Session) -> dict[str, int]:
    """What session ``s`` (a dry run, or a loaded one) holds in host memory besides the host tier, by part."""
    model = s.model
    tensors = model.layout_report()["tensors"]
    out = {"weights": sum(tensors.get(CPU, {}).values()) + sum(tensors.get("mapped", {}).values()),
           "experts": 0, "kv_cache": s.kv.nbytes(model.host) + (s.rs.nbytes(model.host) if s.rs is not None else 0),
           "compute": s.sched.buffer_size(model.host)}
    for d in host_memory_devices(list(model.devices)):
        mem = s.device_memory(d)
        out["weights"] += mem["weights"]
        out["experts"] += mem["experts"]
        out["kv_cache"] += mem["kv_cache"] + mem["recurrent"]
        out["compute"] += mem["compute"]
    return out


@dataclass(frozen=True)
class TierChoice:
    """The budget ``auto`` chose, and what decided it (bytes)."""

    budget: int
    available: int
    parts: dict[str, int]  # the session's host bytes besides the tier (session_host_bytes)
    slack: int = AUTO_SLACK

    @property
    def held(self) -> int:
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "held": self.held}

    def describe(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        return (f"{format_bytes(self.available)} available less this session's {format_bytes(self.held)} ({parts}) "
                f"less a slack of {format_bytes(self.slack)}")
