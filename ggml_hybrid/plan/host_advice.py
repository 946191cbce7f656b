"""The plan's advice on host memory: the host tier for a file larger than the memory (how large, never below
what works), and the devices that --vram alone names."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..ggml.backend import gpu_device_names
from ..machine import available_memory
from ..model.hparams import HParams
from ..moe.host_tier import AUTO_MARGIN_MIN, frame_bytes
from ..options import SessionOptions
from ..runtime.moe_model import MoEModel
from ..units import MiB, format_bytes

if TYPE_CHECKING:
    from .planner import Plan

def tier_budget(p: Plan, memory: int) -> int | None:
    """The host tier a run in ``memory`` bytes can hold beside the plan's host buffers (less auto's margin), whole
    MiB, at most every routed expert; None when it is less than the least tier that works (one layer's experts)."""
    resident = p.host.resident_total - p.host.host_tier
    least = -(-p.experts.host_tier_min // MiB) * MiB  # sizes are printed in whole MiB
    every = least * sum(1 for x in p.layout.experts if x != "dense")  # all it can hold
    budget = min(max(0, memory - resident - max(AUTO_MARGIN_MIN, memory // 10)) // MiB * MiB, every)
    return budget if budget >= max(MiB, least) else None


def tier_least(m: MoEModel) -> int:
    """The least host tier a run accepts: one layer's experts (matrices and biases) in the tier's equal frames
    (``check_tier_budget``)."""
    e = m.experts
    names = [n for n in e.names if n is not None]
    per = [[e.store.info(x).nbytes // e.store.info(x).shape[0] for x in n.values()] for n in names]
    return frame_bytes(per) * max(e.store.info(n["down"]).shape[0] for n in names)


def memory_warnings(p: Plan, opts: SessionOptions, hp: HParams) -> list[str]:
    """A model larger than the memory (the page cache cannot hold its experts: the host tier reads them
    explicitly), and a given tier that run refuses."""
    w = []
    h = p.host
    memory = h.ram if h.ram is not None else available_memory()
    file_bytes = os.path.getsize(p.model)
    least = format_bytes(p.experts.host_tier_min)
    if memory is not None and file_bytes > memory and not opts.host_tier_bytes:
        where = f"--ram {format_bytes(memory)}" if h.ram is not None else f"the {format_bytes(memory)} available now"
        budget = tier_budget(p, memory)
        if budget is None:
            w.append(f"the model ({format_bytes(file_bytes)}) does not fit in {where}, and neither does the least host "
                     f"tier (one layer's experts, {least}) beside the host buffers: give the run more memory")
        else:
            w.append(f"the model ({format_bytes(file_bytes)}) does not fit in {where}: run its experts from disk "
                     f"through a host tier, e.g. --expert-cache-slots {max(hp.n_used, 1)} --host-tier "
                     f"{budget // MiB}M (host_tier_bytes=auto takes what is available less a margin); see "
                     "docs/moe.md, \"The host expert tier\"")
    if opts.host_tier_bytes and opts.disk_experts and h.host_tier < p.experts.host_tier_min:
        w.append(f"host_tier_bytes={opts.host_tier_bytes}: run refuses a host tier of {format_bytes(h.host_tier)}, "
                 f"less than one layer's experts ({least}); give --host-tier "
                 f"{-(-p.experts.host_tier_min // MiB)}M or more")
    return w


def search_tier(path: str, ram: int | None, q: Plan) -> list[str]:
    """A file larger than the host memory: the host tier the slots read their misses through (what is left, as
    ``host_tier_bytes=NM``); none when the file fits or the tier would be less than what works."""
    memory = ram if ram is not None else available_memory()
    if memory is None or os.path.getsize(path) <= memory:
        return []
    budget = tier_budget(q, memory)
    return [] if budget is None else [f"host_tier_bytes={budget // MiB}M"]


def planned_devices(p: Plan) -> set[str]:
    """The devices of ``p`` that --vram alone named (CUDA0, CUDA1, ...: no such GPU here, no -dev, no RPC)."""
    if any(x.split("=", 1)[0] in ("rpc", "devices") for x in p.options):
        return set()
    gpus = set(gpu_device_names())
    return {d for d, v in p.devices.items() if v.vram is not None and d not in gpus}


__all__ = ["memory_warnings", "planned_devices", "search_tier", "tier_budget", "tier_least"]
