"""The plan's advice on host memory: the host tier for a file larger than the memory (how large, never below
what works), and the devices that --vram alone names."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..ggml.backend import gpu_device_names
from ..model.hparams import HParams
from ..moe.host_tier import auto_budget, frame_bytes, memory_available
from ..options import OptionError, SessionOptions
from ..runtime.moe_model import MoEModel
from ..units import MiB, format_bytes

if TYPE_CHECKING:
    from .planner import Plan

@functools.cache
def program_bytes() -> int:
    """What the program holds before it loads a model: the anonymous memory of a fresh interpreter that imported
    the command and the runtime (measured once per process, in a child: this process may hold anything)."""
    code = ("import ggml_hybrid.cli.run, ggml_hybrid.runtime.moe_model; "
            "from ggml_hybrid.machine import process_anon_bytes; print(process_anon_bytes())")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        return int(out.stdout.strip() or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def tier_budget(p: Plan, memory: int) -> int | None:
    """The host tier a run in ``memory`` bytes can hold beside what the session of plan ``p`` (one with a tier)
    holds there, as ``auto`` sizes it (``host.held``, less the slack), and the program itself before it loads
    (:func:`program_bytes`; ``auto`` measures the memory available after it), whole MiB, at most every routed
    expert; None when it is less than the least tier that works (one layer's experts)."""
    least = -(-p.experts.host_tier_min // MiB) * MiB  # sizes are printed in whole MiB
    every = least * sum(1 for x in p.layout.experts if x != "dense")  # all it can hold
    budget = min(auto_budget(memory - program_bytes(), p.host.held) // MiB * MiB, every)
    return budget if budget >= max(MiB, least) else None


def tier_least(m: MoEModel) -> int:
    """The least host tier a run accepts: one layer's experts (matrices and biases) in the tier's equal frames
    (``check_tier_budget``)."""
    e = m.experts
    names = [n for n in e.names if n is not None]
    per = [[e.store.info(x).nbytes // e.store.info(x).shape[0] for x in n.values()] for n in names]
    return frame_bytes(per) * max(e.store.info(n["down"]).shape[0] for n in names)


def memory_tight(path: str, opts: SessionOptions, ram: int | None) -> int | None:
    """The memory a file larger than it is planned for (``ram``, or what is available now, as ``auto`` reads it:
    ``MemAvailable`` or the memory cgroup's), when no host tier was given: the experts must then be read through
    one; None otherwise."""
    try:
        memory = ram if ram is not None else memory_available()
    except OptionError:  # the system does not say
        return None
    if opts.host_tier_bytes or os.path.getsize(path) <= memory:
        return None
    return memory


def memory_warnings(p: Plan, opts: SessionOptions, hp: HParams) -> list[str]:
    """A given tier that run refuses."""
    w = []
    tier, least = p.host.host_tier, p.experts.host_tier_min
    if opts.host_tier_bytes and opts.disk_experts and tier < least:
        w.append(f"host_tier_bytes={opts.host_tier_bytes}: run refuses a host tier of {format_bytes(tier)}, less than "
                 f"one layer's experts ({format_bytes(least)}); give --host-tier {-(-least // MiB)}M or more")
    return w


def larger_than_memory(p: Plan, memory: int, advised: bool) -> str:
    """The warning for a file larger than ``memory``: the advice is the plan's ``try:`` line (``advised``), or no
    configuration holds the least tier beside the session's buffers."""
    where = f"--ram {format_bytes(memory)}" if p.host.ram is not None else f"the {format_bytes(memory)} available now"
    size = format_bytes(os.path.getsize(p.model))
    if advised:
        return (f"the model ({size}) does not fit in {where}: its experts are read from disk through a host tier "
                "sized beside the session's own buffers (the try: line); see docs/moe.md, \"The host expert tier\"")
    return (f"the model ({size}) does not fit in {where}, and neither does the least host tier (one layer's experts, "
            f"{format_bytes(p.experts.host_tier_min)}) beside the session's own buffers at the smallest context and "
            "batch: give the run more memory")


def search_tier(q: Plan, memory: int | None) -> list[str]:
    """The host tier for the configuration of plan ``q`` (planned with a tier: its held bytes are those of a session
    with one) in ``memory`` (a file larger than it): ``host_tier_bytes=NM``; none without memory to fit, or when
    the tier would be less than what works."""
    if memory is None:
        return []
    budget = tier_budget(q, memory)
    return [] if budget is None else [f"host_tier_bytes={budget // MiB}M"]


def tier_items(try_plan: Callable[[list[str]], Plan | None], items: list[str], least: int,
               memory: int | None) -> list[str]:
    """The host tier for configuration ``items`` in ``memory`` (a file larger than it; None: none needed), sized
    beside what that configuration's session holds (planned with the least tier, ``least`` bytes: the same
    buffers)."""
    if memory is None:
        return []
    q = try_plan(items + [f"host_tier_bytes={-(-least // MiB)}M"])
    return [] if q is None else search_tier(q, memory)


def search_host(try_plan: Callable[[list[str]], Plan | None], ladder: list[list[str]], n_used: int, least: int,
                memory: int) -> tuple[list[str], Plan] | None:
    """A CPU-only machine and a file larger than ``memory``: the first configuration of ``ladder`` (the largest
    context and batch first) whose session leaves the least host tier beside its own buffers (a CPU playing the
    device holds them in the same memory), the experts read through the tier (slots for a token's experts, none
    used where the CPU computes from the tier's frames) and the tier as large as what is left (``auto``'s rule);
    its items and its plan, or None."""
    experts = [f"expert_cache_slots={max(1, n_used)}", "disk_experts=true"]
    for items in ladder:
        if "no_kv_offload=true" in items:  # the KV cache is in host memory already
            continue
        tier = tier_items(try_plan, items + experts, least, memory)
        q = try_plan(items + experts + tier) if tier else None
        if q is not None:
            return items + experts + tier, q
    return None


def planned_devices(p: Plan) -> set[str]:
    """The devices of ``p`` that --vram alone named (CUDA0, CUDA1, ...: no such GPU here, no -dev, no RPC)."""
    if any(x.split("=", 1)[0] in ("rpc", "devices") for x in p.options):
        return set()
    gpus = set(gpu_device_names())
    return {d for d, v in p.devices.items() if v.vram is not None and d not in gpus}


__all__ = ["larger_than_memory", "memory_tight", "memory_warnings", "planned_devices", "program_bytes", "search_host",
           "search_tier", "tier_budget", "tier_items", "tier_least"]
