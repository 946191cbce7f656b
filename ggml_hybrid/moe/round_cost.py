"""The fixed cost of a device's rounds, for ``moe_cpu_share=auto`` (:class:`~.cpu_share.CostModel`).

A layer call whose device experts do not fit the expert cache's slots at once runs in *rounds* (the slot cache's
plan: loads, then the round's compute). Over RPC each round waits for its exchanges with the server
(:data:`ROUND_TRIPS_PER_ROUND` round trips, and the server's dispatch), whatever its rows, so a round of one row
costs milliseconds over a slow link. Priced per row alone, that read as a huge per-row cost, which then overpriced
a prompt's rows; and before any round was timed the device looked free but for its loads (docs/benchmarks.md,
section 28, part 2).

A cost model given ``round_s > 0`` (:meth:`~.cpu_share.CostModel.for_link`: the prior of a round's fixed cost,
:func:`round_seconds` of the measured link) fits every round as ``t = R + d*rows`` (the EMAs of 1, rows, rows^2, t
and rows*t; the CPU's fit, with the priors ``round_s`` and ``device_per_row``, the per-row term pulled a thousand
times harder, ``RIDGE_DEVICE_ROW``, so that rounds of one row, which cannot tell the two apart, go to ``R``), and
prices each split with ``R`` times the rounds the cache will plan for its device experts (:func:`device_rounds`).
The native executor's model is the same (``moe_policy.c``: ``hy_cost_round``, ``hy_cost_rounds``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..checks import check_real
from ..errors import CpuShareError

if TYPE_CHECKING:
    from ..ggml.rpc import Link

__all__ = ["ROUND_TRIPS_PER_ROUND", "device_rounds", "round_seconds"]

#: The exchanges of one device round with an RPC server, each waiting for the server's reply: the copy of the
#: call's activations into the round's graph, the graph's compute (its status reply, vendor patch 0014) and the
#: read of its rows (moe_call.c: compute_rows, compute_rows_call).
ROUND_TRIPS_PER_ROUND = 3


def round_seconds(link: Link | None) -> float:
    """The prior of a device round's fixed cost over ``link`` (None: a local device, 0: not modeled):
    :data:`ROUND_TRIPS_PER_ROUND` round trips."""
    if link is None:
        return 0.0
    return ROUND_TRIPS_PER_ROUND * check_real(link.rtt_s, "round_seconds: round trip", 0.0, error=CpuShareError)


def device_rounds(n_hits: int, n_loads: int, n_slots: int) -> int:
    """The rounds the slot cache's plan makes for ``n_hits`` hits and ``n_loads`` misses in ``n_slots`` slots: 0
    without either, else one, and one more per ``n_slots`` loads past the slots the hits leave free in the first
    (``n_slots <= 0``: unknown, one)."""
    if n_hits + n_loads == 0:
        return 0
    if n_slots <= 0:
        return 1
    first = max(n_slots - n_hits, 0)
    return 1 if n_loads <= first else 1 + -(-(n_loads - first) // n_slots)
