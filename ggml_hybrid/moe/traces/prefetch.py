"""Replay a recorded run's lookahead predictions: loads on the critical path, and bytes moved, beside Belady's.

A trace recorded with ``moe_prefetch`` carries, beside each call's routing, the experts the previous
layer predicted for it (:data:`~.format.FLAG_PREDICTIONS`). :func:`replay_prefetch` runs one
:class:`~ggml_hybrid.moe.slot_cache.SlotCache` per layer, as the executor does, and before each call
with a prediction loads the predicted misses (in the recorded order: most-voted first) with
:meth:`SlotCache.prefetch`, at most ``max_experts`` of them, as the live executor does between the
layer's previous call and this one (nothing else touches a layer's cache in between, so the replay
counts exactly what the live run counted). Then the call is planned as usual:

* ``demand_loads``: the misses of the calls, the loads a call waits for (the critical path);
* ``prefetched``: loads issued ahead by the prediction, ``prefetch_used`` those the call routed to and
  ``prefetch_wasted`` the others (bandwidth spent for nothing);
* ``bytes_moved``: every load, ``(demand_loads + prefetched) * expert_bytes``;
* beside them, the same policy without prefetch (``baseline_loads``) and Belady's optimum without
  prefetch (``belady_loads``, :func:`~.replay.replay`).

No CPU share (``moe_cpu_share=0``): the prefetch replay models the device's loads only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...errors import TraceError
from ..slot_cache import POLICIES, SlotCache
from .format import Trace, _int
from .replay import replay

__all__ = ["PrefetchReplay", "replay_prefetch"]


@dataclass(frozen=True)
class PrefetchReplay:
    """What :func:`replay_prefetch` counted, summed over the layers (the module docstring defines each)."""

    policy: str
    n_slots: int
    max_experts: int
    expert_bytes: int
    calls: int
    predicted_calls: int
    predicted: int
    predicted_right: int
    predicted_of: int
    demand_loads: int
    prefetched: int
    prefetch_used: int
    prefetch_wasted: int
    baseline_loads: int
    belady_loads: int

    @property
    def recall(self) -> float:
        return self.predicted_right / self.predicted_of if self.predicted_of else 0.0

    @property
    def precision(self) -> float:
        return self.predicted_right / self.predicted if self.predicted else 0.0

    @property
    def bytes_moved(self) -> int:
        return (self.demand_loads + self.prefetched) * self.expert_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recall": self.recall, "precision": self.precision, "bytes_moved": self.bytes_moved}


def replay_prefetch(trace: Trace, n_slots: int, policy: str = "lru", max_experts: int | None = None,
                    expert_bytes: int = 1) -> PrefetchReplay:
    """Replay ``trace``'s routing and recorded predictions through ``n_slots``-slot caches (see the module
    docstring); ``max_experts`` bounds each call's prefetch (default: the trace's ``n_used``, the runtime's
    default ``moe_prefetch_bytes``)."""
    if not isinstance(trace, Trace):
        raise TraceError(f"replay_prefetch: trace must be a Trace, got {type(trace).__name__}")
    if trace.predictions is None:
        raise TraceError("replay_prefetch: the trace holds no predictions; record one with moe_prefetch=true and "
                         "trace_path=FILE")
    n_slots = _int(n_slots, "replay_prefetch: n_slots")
    if not 1 <= n_slots <= trace.n_expert:
        raise TraceError(f"replay_prefetch: n_slots={n_slots} must be in 1..n_expert={trace.n_expert}")
    if policy not in POLICIES:
        raise TraceError(f"replay_prefetch: policy {policy!r} must be one of {POLICIES} (the runtime's policies)")
    max_experts = trace.n_used if max_experts is None else _int(max_experts, "replay_prefetch: max_experts")
    expert_bytes = _int(expert_bytes, "replay_prefetch: expert_bytes")
    if max_experts < 0 or expert_bytes < 1:
        raise TraceError(f"replay_prefetch: max_experts={max_experts} must be >= 0 and expert_bytes={expert_bytes} "
                         ">= 1")
    caches = [SlotCache(trace.n_expert, n_slots, policy) for _ in range(trace.n_layer)]
    n = {"predicted_calls": 0, "predicted": 0, "predicted_right": 0, "predicted_of": 0, "prefetched": 0,
         "prefetch_used": 0, "prefetch_wasted": 0}
    for (layer, ids), pred in zip(trace.calls, trace.predictions):
        cache = caches[layer]
        experts, rows = np.unique(ids, return_counts=True)
        actual = set(experts.tolist())
        if pred.size:
            order = pred.tolist()
            keep = frozenset(order)
            loaded = []
            for e in [e for e in order if not cache.holds(e)][:max_experts]:
                placed = cache.prefetch(e, keep)
                if placed is None:
                    break
                cache.commit(placed[0], e)
                loaded.append(e)
            n["predicted_calls"] += 1
            n["predicted"] += len(order)
            n["predicted_right"] += len(actual & keep)
            n["predicted_of"] += len(actual)
            n["prefetched"] += len(loaded)
            n["prefetch_used"] += sum(e in actual for e in loaded)
            n["prefetch_wasted"] += sum(e not in actual for e in loaded)
        cache.plan(experts.tolist(), rows.tolist(), checked=False)
    return PrefetchReplay(
        policy=policy, n_slots=n_slots, max_experts=max_experts, expert_bytes=expert_bytes, calls=trace.n_calls,
        demand_loads=sum(c.counters.misses for c in caches),
        baseline_loads=replay(trace, n_slots, policy).misses, belady_loads=replay(trace, n_slots, "belady").misses,
        **n)
