"""``expert_cache_slots=auto``: the expert cache sized from the devices' free memory.

Rule. For every device that holds expert cache layers, two dry runs of the session (:class:`MoEModel` with
``dry_run_devices``: every buffer allocated as a load would, on stand-ins, no tensor read) give its bytes at 1
and at 2 slots per layer: everything but the slots (the dense weights, the KV cache for ``n_parallel``
sequences, the recurrent states, the compute buffers, the caches' own graphs and pad slots) is
``fixed = total(1) - per_slot`` and each further slot in every cache layer of the device costs
``per_slot = total(2) - total(1)``. The device then holds

    slots_d = floor((free_d - margin_d - fixed_d) / per_slot_d),   margin_d = max(MARGIN_MIN, MARGIN_SHARE * free_d)

and the session takes the smallest over its devices, at most the model's experts per layer (one slot count
for every layer; the per-device figures are reported). Fewer than ``n_expert_used`` slots is refused: every
token would load its experts in several rounds, and the error says what each device has and needs. A last
dry run at the chosen count checks it (one slot less per try when it does not fit, which the linear model
makes rare).

Free memory: what each device reports now (a GPU's driver, an RPC server), or the sizes given to ``plan
--vram``; CPU instances playing devices (no accelerator) share the host's available memory evenly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import OptionError
from ..units import MiB, format_bytes

__all__ = ["MARGIN_MIN", "MARGIN_SHARE", "SlotChoice", "choose_slots", "margin"]

#: the least memory each device keeps free (allocator slack, driver contexts, fragmentation)
MARGIN_MIN = 256 * MiB
#: and the share of its free memory it keeps when that is more
MARGIN_SHARE = 0.05


def margin(free: int) -> int:
    """The bytes a device keeps free under ``auto``."""
    return max(MARGIN_MIN, int(free * MARGIN_SHARE))


@dataclass(frozen=True)
class SlotChoice:
    """The slots ``auto`` chose and, per device with cache layers, what decided it (bytes)."""

    slots: int
    per_device: dict[str, int]  # slots that fit each device (before the cap at n_expert)
    free: dict[str, int]
    margin: dict[str, int]
    fixed: dict[str, int]  # everything but the slots
    per_slot: dict[str, int]  # one more slot in every cache layer of the device

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{d}: {n} fit ({format_bytes(self.free[d])} free - {format_bytes(self.margin[d])} margin - "
                 f"{format_bytes(self.fixed[d])} dense/KV/compute, {format_bytes(self.per_slot[d])} per slot)"
                 for d, n in self.per_device.items()]
        if self.per_device and self.slots < min(self.per_device.values()):  # more fit: capped at the experts
            parts.insert(0, f"the model's {self.slots} experts per layer")
        return f"expert_cache_slots=auto -> {self.slots}" + (f" ({'; '.join(parts)})" if parts else "")


def choose_slots(total_1: dict[str, int], total_2: dict[str, int], free: dict[str, int], n_expert: int,
                 n_used: int) -> SlotChoice:
    """The choice from each device's bytes at 1 and 2 slots per layer and its free bytes (module docstring).

    A device whose bytes do not grow with the slots holds no cache layer and does not limit the choice.
    Raises :class:`OptionError` when fewer than ``n_used`` slots (or none) fit a device.
    """
    per_device, fixed, per_slot, margins = {}, {}, {}, {}
    for d, t1 in total_1.items():
        k = total_2[d] - t1
        if k <= 0:
            continue
        m = margin(free[d])
        fixed[d], per_slot[d], margins[d] = t1 - k, k, m
        per_device[d] = max(0, (free[d] - m - fixed[d]) // k)
    slots = min([n_expert, *per_device.values()])
    choice = SlotChoice(slots, per_device, {d: free[d] for d in per_device}, margins, fixed, per_slot)
    if slots < max(1, n_used):
        short = [d for d, n in per_device.items() if n < max(1, n_used)]
        raise OptionError(
            f"expert_cache_slots=auto: only {slots} expert slot(s) per layer fit, fewer than the {n_used} experts "
            f"the model routes each token to ({choice.describe().split(' (', 1)[1][:-1]}); free memory on "
            f"{', '.join(short)}, or lower n_ctx / n_parallel / ubatch_size, or move layers' experts to the CPU "
            "(n_cpu_moe)")
    return choice
