"""Replay routing traces through per-layer expert caches: what-if slots, policies and CPU shares.

:func:`replay` runs one cache of ``n_slots`` slots per layer over a trace. A call requests the
distinct experts of its ``ids``, with ``rows`` = the number of tokens routed to each.
``"freq"``, ``"lru"`` and ``"lfu"`` are :class:`~ggml_hybrid.moe.slot_cache.SlotCache` itself, so the replay
counts exactly what the runtime cache does. ``"belady"`` is the offline optimum (the ceiling)
under the same rules as SlotCache:

* a hit is an expert resident when the call starts; misses are loaded in rounds: round 1 loads at
  most ``n_slots - hits`` misses and never evicts a hit of the call; a later round loads up to
  ``n_slots`` misses and may evict anything but its own loads (experts computed earlier in the call
  included), exactly the SlotCache round structure;
* the victim is the evictable resident whose next use (the next call of the same layer that
  requests it) is farthest in the future; never used again counts as infinitely far. Ties
  (including several never used again) go to the lowest expert id;
* misses are loaded farthest-next-use first (ties by lowest expert id), so the misses used again
  soonest are loaded in the last round and stay resident. This matters only when a call's
  distinct experts exceed ``n_slots``.

With calls whose distinct experts fit in ``n_slots`` (always the case for decode when
``n_used <= n_slots``), this is Belady's rule over "set" requests, which is optimal: no policy
obeying the rules loads fewer experts (the tests check this against an exhaustive search on small
traces), so its hits bound LRU's and LFU's from above. When a call's distinct experts exceed
``n_slots`` it is a heuristic, not a bound: such a call cannot keep all of its experts, and one
of its hits may have to give way to its later loads, which farthest-next-use does not foresee.
For example, with 1 slot and calls {0 (1 row), 1 (2 rows)}, {0, 1}, {1}, LRU and LFU get 2 hits
and this rule 1 (the tests pin this case).

CPU share and modeled time
--------------------------
``share`` (``moe_cpu_share``) sends part of a call's misses to the CPU instead of loading them, by
the runtime's own rule (:mod:`ggml_hybrid.moe.cpu_share`, called here, not restated): a fixed share
takes ``n_cpu_for_share(share, n_miss)`` misses, the ones with the fewest rows, ties by the layer's
request history (the least likely to be reused first: the cache's ``reuse_key``; Belady's replay keeps
the same history beside its residency), then by lower expert id. ``cpu_rule="rows"`` replays the rule
before the history existed (ties straight by lower expert id), to measure what the history buys;
``share="auto"`` asks a :class:`~ggml_hybrid.moe.cpu_share.CostModel` per layer, fixed to the
costs of a :class:`LinkCost`, with the runtime's hysteresis. CPU experts are not loaded into the
cache: the cache only sees the device experts (hits + device misses), so hit rate and bytes moved
reflect the share. A live session whose cost model is fixed the same way
(``CostModel.fixed(cost.coefficients())``) makes exactly the replay's choices, so its counters
equal the replayed ones; a live ``auto`` that learns from timings does not replay exactly.

The modeled time of a layer call with cost ``c`` (:class:`LinkCost`) is the cost model's makespan::

    cpu    = (c.cpu_s_per_job if n_cpu else 0) + n_cpu * c.expert_bytes / c.cpu_bytes_per_s + cpu_rows * c.cpu_s_per_row
    device = device_misses * c.expert_bytes / c.bus_bytes_per_s + device_rows * c.device_s_per_row
    time   = max(cpu, device)

where ``device_rows`` counts the rows of every expert computed on the device (hits and device
misses). The time per token is the sum over calls divided by the number of tokens,
``sum(T) / n_layer`` (every token passes through every layer once).

Auto is greedy: it minimizes each call's time given the cache state. On a fixed sequence of
hits and misses (:func:`modeled_time_per_token` on a :class:`ReplayResult`, which picks the best
``n_cpu`` per call, without hysteresis) it is never slower than any fixed share, but in a coupled
replay a CPU miss is not cached, so a later call may miss again where share 0 would hit: a
coupled auto replay can be slower than a fixed share.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Union, cast

import numpy as np

from ...checks import check_int, check_real
from ...errors import OptionError, TraceError
from ...options import SessionOptions
from ..cpu_share import CostModel, History, MissSplit, makespans, n_cpu_for_share, split_misses
from ..slot_cache import POLICIES as CACHE_POLICIES
from ..slot_cache import SlotCache
from .format import Trace, _int

__all__ = ["CPU_RULES", "POLICIES", "CallRecord", "LayerStats", "LinkCost", "ReplayResult", "modeled_time_per_token",
           "parse_share", "replay"]

#: the runtime's eviction orders (:data:`~ggml_hybrid.moe.slot_cache.POLICIES`) and Belady's (the offline optimum)
POLICIES = (*CACHE_POLICIES, "belady")
#: The CPU share's tie-break among misses of equal rows: the request history (the runtime's) or the expert id.
CPU_RULES = ("reuse", "rows")


@dataclass(frozen=True)
class LinkCost:
    """Costs of the modeled time: bytes per second of the host->device bus and of the CPU reading
    expert weights, seconds per (token, expert) row on the device and on the CPU, bytes per expert."""

    bus_bytes_per_s: float
    cpu_bytes_per_s: float
    device_s_per_row: float
    cpu_s_per_row: float
    expert_bytes: int
    cpu_s_per_job: float = 0.0  # the fixed cost of a call that sends the CPU anything

    def __post_init__(self) -> None:
        for name in ("bus_bytes_per_s", "cpu_bytes_per_s"):
            check_real(getattr(self, name), f"LinkCost: {name}", 0.0, lo_open=True, error=TraceError)
        for name in ("device_s_per_row", "cpu_s_per_row", "cpu_s_per_job"):
            check_real(getattr(self, name), f"LinkCost: {name}", 0.0, error=TraceError)
        check_int(self.expert_bytes, "LinkCost: expert_bytes", 1, error=TraceError)

    def coefficients(self) -> dict[str, float]:
        """The same costs as :class:`~ggml_hybrid.moe.cpu_share.CostModel` coefficients (seconds)."""
        return {"cpu_per_byte": 1.0 / self.cpu_bytes_per_s, "cpu_per_row": float(self.cpu_s_per_row),
                "load_per_byte": 1.0 / self.bus_bytes_per_s, "device_per_row": float(self.device_s_per_row),
                "cpu_per_job": float(self.cpu_s_per_job)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_share(value: object) -> Union[float, str]:
    """``value`` as a moe_cpu_share: a number in [0, 1] (or its text) or ``"auto"`` (the session option's rule)."""
    v = float(value) if isinstance(value, (np.integer, np.floating)) else value
    try:
        return SessionOptions.from_dict({"moe_cpu_share": v}).moe_cpu_share
    except OptionError:
        raise TraceError(f"share {value!r} must be a number in [0, 1] or 'auto'") from None


@dataclass(frozen=True)
class CallRecord:
    """One replayed call: rows of its hits, rows of its misses (ascending: the CPU takes a prefix),
    how many misses went to the CPU, and its modeled time (None without a cost)."""

    layer: int
    tokens: int
    hit_rows: int
    miss_rows: tuple[int, ...]
    n_cpu: int
    time_s: float | None


class _HitRate:
    """``hits / distinct`` for the replay counters (0.0 when nothing was requested)."""

    hits: int
    distinct: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.distinct if self.distinct else 0.0


@dataclass(frozen=True)
class LayerStats(_HitRate):
    """Replay counters of one layer. ``misses`` are loads; ``cpu`` counts misses run on the CPU."""

    layer: int
    calls: int
    distinct: int
    hits: int
    misses: int
    cpu: int
    evictions: int
    rounds: int
    bytes_moved: int
    time_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class ReplayResult(_HitRate):
    """Totals of a replay. ``distinct == hits + misses + cpu`` (requested experts over all calls);
    ``misses`` are loads over the bus, ``bytes_moved = misses * expert_bytes``, ``hit_rate = hits /
    distinct``. ``modeled_s_per_token`` is None when the replay had no cost."""

    policy: str
    n_slots: int
    share: float | str
    expert_bytes: int
    cost: LinkCost | None
    n_layer: int
    token_rows: int
    calls: int
    distinct: int
    hits: int
    misses: int
    cpu: int
    evictions: int
    rounds: int
    bytes_moved: int
    modeled_s_per_token: float | None
    layers: tuple[LayerStats, ...]
    call_log: tuple[CallRecord, ...] = field(repr=False, default=())

    @property
    def tokens(self) -> float:
        return self.token_rows / self.n_layer

    def to_dict(self, layers: bool = True) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("policy", "n_slots", "share", "expert_bytes", "calls", "token_rows",
                                           "distinct", "hits", "misses", "cpu", "evictions", "rounds",
                                           "bytes_moved", "modeled_s_per_token")}
        d["tokens"] = self.tokens
        d["hit_rate"] = self.hit_rate
        d["cost"] = None if self.cost is None else self.cost.to_dict()
        if layers:
            d["layers"] = [s.to_dict() for s in self.layers]
        return d


class _Belady:
    """Offline-optimal residency of one layer (see the module docstring for the rule)."""

    def __init__(self, n_slots: int, requests: list[list[int]]) -> None:
        self.n_slots = n_slots
        self.resident: set[int] = set()
        self.uses: dict[int, deque[int]] = {}
        for i, req in enumerate(requests):
            for e in req:
                self.uses.setdefault(e, deque()).append(i)
        self.hits = self.misses = self.evictions = self.rounds = self.distinct = 0

    def _next(self, e: int) -> float:
        q = self.uses.get(e)
        return q[0] if q else math.inf

    def _evict(self, n: int, candidates: Iterable[int]) -> None:
        order = sorted(candidates, key=lambda e: (-self._next(e), e))
        for e in order[:n]:
            self.resident.discard(e)
        self.evictions += min(n, len(order))

    def plan(self, i: int, requested: Iterable[int], device: list[int]) -> None:
        """Call ``i`` of the layer: ``requested`` = every expert it routes to (advances next uses),
        ``device`` = the experts computed on the device (go through the cache)."""
        for e in requested:
            q = self.uses[e]
            assert q[0] == i
            q.popleft()
        self.distinct += len(device)
        if not device:
            return
        hits = {e for e in device if e in self.resident}
        misses = sorted((e for e in device if e not in self.resident), key=lambda e: (-self._next(e), e))
        self.hits += len(hits)
        self.misses += len(misses)
        cap = self.n_slots - len(hits)
        pos, first = 0, True
        while first or pos < len(misses):
            batch = misses[pos:pos + cap]
            pos += len(batch)
            need = len(self.resident) + len(batch) - self.n_slots
            if need > 0:
                self._evict(need, self.resident - hits if first else self.resident)
            self.resident.update(batch)
            self.rounds += 1
            cap, first = self.n_slots, False


def _check_replay_args(trace: object, n_slots: object, policy: object, share: object, cost: object,
                       expert_bytes: object) -> tuple[int, str, float | str, int]:
    if not isinstance(trace, Trace):
        raise TraceError(f"replay: trace must be a Trace, got {type(trace).__name__}")
    n_slots = _int(n_slots, "replay: n_slots")
    if not 1 <= n_slots <= trace.n_expert:
        raise TraceError(f"replay: n_slots={n_slots} must be in 1..n_expert={trace.n_expert}")
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise TraceError(f"replay: policy {policy!r} must be one of {POLICIES}")
    share = parse_share(share)
    if cost is not None and not isinstance(cost, LinkCost):
        raise TraceError(f"replay: cost must be a LinkCost or None, got {type(cost).__name__}")
    if share == "auto" and cost is None:
        raise TraceError("replay: share='auto' needs a cost (LinkCost) to choose the CPU misses")
    if expert_bytes is None:
        expert_bytes = cost.expert_bytes if cost is not None else 1
    else:
        expert_bytes = _int(expert_bytes, "replay: expert_bytes")
        if expert_bytes < 1:
            raise TraceError(f"replay: expert_bytes={expert_bytes} must be >= 1")
        if cost is not None and expert_bytes != cost.expert_bytes:
            raise TraceError(f"replay: expert_bytes={expert_bytes} differs from cost.expert_bytes="
                             f"{cost.expert_bytes}; give one of them")
    return n_slots, policy.lower(), share, expert_bytes


class _History:
    """The request history of one layer for Belady's replay: SlotCache's rule (its ``reuse_key``), kept beside
    a residency that SlotCache does not hold."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = {}
        self.last: dict[int, int] = {}

    def record(self, experts: Iterable[int], tick: int) -> None:
        for e in experts:
            self.requests[e] = self.requests.get(e, 0) + 1
            self.last[e] = tick

    def reuse_key(self, e: int) -> tuple[int, int]:
        return self.requests.get(e, 0), self.last.get(e, 0)


def _call_split(model: CostModel | None, share: float | str, experts: list[int], rows: list[int],
                resident: Iterable[int], expert_bytes: int, history: History | None) -> MissSplit:
    """Where one call's experts run: the runtime's rule, fixed share or the layer's cost model."""
    if model is not None:
        return model.choose(experts, rows, resident, expert_bytes, history)
    return split_misses(experts, rows, resident, cast(float, share), history)  # not "auto": that comes with a model


def replay(trace: Trace, n_slots: int, policy: str = "lru", share: float | str = 0.0, cost: LinkCost | None = None,
           expert_bytes: int | None = None, hysteresis: float = 0.05, cpu_rule: str = "reuse") -> ReplayResult:
    """Replay ``trace`` through one ``n_slots``-slot cache per layer under ``policy`` ("freq", "lru", "lfu",
    "belady").

    ``share`` (a number in [0, 1] or "auto") sends that share of each call's misses to the CPU, by the
    runtime's rule; those are not loaded. ``"auto"`` fixes a cost model per layer to ``cost`` with
    ``hysteresis`` (the runtime's default). ``expert_bytes`` (default ``cost.expert_bytes``, else 1)
    prices a load. With a ``cost`` the result carries the modeled time per token. ``cpu_rule`` ("reuse",
    the runtime's, or "rows", the rule before it) breaks ties among the CPU's candidates. See the module
    docstring.
    """
    n_slots, policy, share, expert_bytes = _check_replay_args(trace, n_slots, policy, share, cost, expert_bytes)
    if cpu_rule not in CPU_RULES:
        raise TraceError(f"replay: cpu_rule {cpu_rule!r} must be one of {CPU_RULES}")
    L = trace.n_layer
    coeffs = cost.coefficients() if cost is not None else None
    models: list[CostModel | None] = [None] * L
    if share == "auto":
        assert coeffs is not None  # _check_replay_args: auto needs a cost
        models = [CostModel.fixed(coeffs, hysteresis) for _ in range(L)]
    uniq_calls = []
    for layer, ids in trace.calls:
        experts, rows = np.unique(ids, return_counts=True)
        uniq_calls.append((layer, int(ids.shape[0]), experts.tolist(), rows.tolist()))

    belady: list[_Belady] = []  # one cache per layer, of the policy's kind
    slot_caches: list[SlotCache] = []
    if policy == "belady":
        per_layer: list[list[list[int]]] = [[] for _ in range(L)]
        for layer, _, experts, _ in uniq_calls:
            per_layer[layer].append(experts)
        belady = [_Belady(n_slots, per_layer[layer]) for layer in range(L)]
        histories = [_History() for _ in range(L)]
        local = [0] * L
    else:
        slot_caches = [SlotCache(trace.n_expert, n_slots, policy) for _ in range(L)]

    log = []
    cpu_count = [0] * L
    for layer, n_tok, experts, rows in uniq_calls:
        if policy == "belady":
            resident: Iterable[int] = belady[layer].resident
            history: History = histories[layer].reuse_key
        else:
            resident, history = slot_caches[layer].resident(), slot_caches[layer].reuse_key
        sp = _call_split(models[layer], share, experts, rows, resident, expert_bytes,
                         history if cpu_rule == "reuse" else None)
        row_of = dict(zip(experts, rows))
        device = sorted(sp.device_hits + sp.device_misses)
        if policy == "belady":
            belady[layer].plan(local[layer], experts, device)
            local[layer] += 1
            histories[layer].record(experts, local[layer])
        else:
            slot_caches[layer].plan(device, [row_of[e] for e in device], checked=False)
            slot_caches[layer].note_cpu(sp.cpu_misses)
        hit_rows = sum(row_of[e] for e in sp.device_hits)
        # the misses in the order the CPU takes them (fewest rows first, ties by lower id)
        miss_rows = tuple(r for r, _ in sorted((row_of[e], e) for e in sp.device_misses + sp.cpu_misses))
        n_cpu = len(sp.cpu_misses)
        t = None if coeffs is None else makespans(coeffs, expert_bytes, hit_rows, miss_rows)[n_cpu]
        cpu_count[layer] += n_cpu
        log.append(CallRecord(layer, n_tok, hit_rows, miss_rows, n_cpu, t))

    calls_per_layer = [0] * L
    time_per_layer = [0.0] * L
    for rec in log:
        calls_per_layer[rec.layer] += 1
        if rec.time_s is not None:
            time_per_layer[rec.layer] += rec.time_s
    layers = []
    for layer in range(L):
        if policy == "belady":
            b = belady[layer]
            d, h, m, ev, rd = b.distinct, b.hits, b.misses, b.evictions, b.rounds
        else:
            c = slot_caches[layer].counters
            d, h, m, ev, rd = c.distinct, c.hits, c.misses, c.evictions, c.rounds
        layers.append((LayerStats(layer, calls_per_layer[layer], d + cpu_count[layer], h, m, cpu_count[layer], ev,
                                  rd, m * expert_bytes, time_per_layer[layer] if cost is not None else None), rd))
    stats = tuple(st for st, _ in layers)
    modeled = _per_token(log, L) if cost is not None else None
    misses = sum(st.misses for st in stats)
    return ReplayResult(
        policy=policy, n_slots=n_slots, share=share, expert_bytes=expert_bytes, cost=cost, n_layer=L,
        token_rows=trace.token_rows, calls=len(log), distinct=sum(st.distinct for st in stats),
        hits=sum(st.hits for st in stats), misses=misses, cpu=sum(st.cpu for st in stats),
        evictions=sum(st.evictions for st in stats), rounds=sum(rd for _, rd in layers),
        bytes_moved=misses * expert_bytes, modeled_s_per_token=modeled, layers=stats, call_log=tuple(log))


def _per_token(log: list[CallRecord], n_layer: int) -> float:
    token_rows = sum(rec.tokens for rec in log)
    if not token_rows:
        return 0.0
    return sum(cast(float, rec.time_s) for rec in log) * n_layer / token_rows  # priced calls only


def modeled_time_per_token(source: ReplayResult | Trace, share: float | str | None = None,
                           cost: LinkCost | None = None, *, n_slots: int | None = None,
                           policy: str = "lru") -> float:
    """Modeled seconds per token.

    * ``source`` a :class:`ReplayResult`: the result's hits and misses per call are kept fixed and
      ``share`` (default: the result's own) splits each call's misses, priced with ``cost``
      (default: the result's own). With neither given this is exactly ``result.modeled_s_per_token``
      (the replay's own choices); ``share="auto"`` given takes each call's optimum (no hysteresis),
      which is never above any fixed share.
    * ``source`` a :class:`Trace`: a coupled replay ``replay(trace, n_slots, policy, share, cost)``
      (share default 0), whose cache sees only the device experts; ``n_slots`` and ``cost`` are required.
    """
    if isinstance(source, ReplayResult):
        own = share is None and cost is None
        share = source.share if share is None else parse_share(share)
        cost = source.cost if cost is None else cost
        if not isinstance(cost, LinkCost):
            raise TraceError("modeled_time_per_token: the result has no cost; pass cost=LinkCost(...)")
        c = cost.coefficients()
        log = []
        for r in source.call_log:
            spans = makespans(c, cost.expert_bytes, r.hit_rows, r.miss_rows)
            n = len(r.miss_rows)
            if own:  # the replay's own choices, hysteresis included
                k = r.n_cpu
            elif share == "auto":  # the per-call optimum, without hysteresis
                k = min(range(n + 1), key=lambda j: (spans[j], j))
            else:
                k = n_cpu_for_share(cast(float, share), n)  # a number (checked there)
            log.append(CallRecord(r.layer, r.tokens, r.hit_rows, r.miss_rows, k, spans[k]))
        return _per_token(log, source.n_layer)
    if isinstance(source, Trace):
        if cost is None or n_slots is None:
            raise TraceError("modeled_time_per_token: a Trace needs n_slots=... and cost=LinkCost(...)")
        modeled = replay(source, n_slots, policy, share=0.0 if share is None else share, cost=cost).modeled_s_per_token
        assert modeled is not None  # a replay with a cost models its time
        return modeled
    raise TraceError(f"modeled_time_per_token: source must be a ReplayResult or a Trace, got {type(source).__name__}")
