"""Plan which MoE experts a layer call computes from resident slots and which it loads.

A device holds ``n_slots`` expert slots for one layer. Each layer call names the
DISTINCT experts it needs (optionally with the number of (token, expert) rows of
each). :class:`SlotCache` turns that request into a list of :class:`Round`\\ s and
updates its residency as if the plan were executed. It is pure Python and
deterministic: the plan depends only on the cache state, the *set* of requested
experts and their row counts, never on the order in which they are listed.

Policy
------
State. Every slot is empty or holds one expert. A resident expert carries a
*recency* (the tick of the last call that computed it) and a *use count* (the
number of calls that requested it since it was loaded; the loading call counts,
so a freshly loaded expert has use count 1). Every call to :meth:`SlotCache.plan`
takes a new tick, strictly greater than every earlier one.

Hits and misses. A requested expert that is resident when the call starts is a
*hit*; every other requested expert is a *miss* and is loaded exactly once.
Every requested expert is computed exactly once, either as a hit or as a load.
``hits + misses == distinct`` for every call; ``misses`` equals the number of
loads.

Round 1. All hits are computed in round 1, before anything is loaded, listed in
increasing slot order. The hit slots are protected: round 1 loads at most
``n_slots - hits`` misses, so round 1 uses ``hits + loads <= n_slots`` slots.

Miss order. Misses are loaded in order of decreasing row count (``rows``,
default 1 each), ties by increasing expert id. Round 1 takes the first misses of
that order, each later round the next ones, as many as fit.

Later rounds. The experts computed in earlier rounds of the same call are no
longer pending, so any of them may be evicted; a round after the first loads
``min(remaining misses, n_slots)`` experts. Rounds continue until every miss is
computed, so a call never fails, whatever the number of distinct experts. A
round holds no hits after round 1. A call with no hits does not have an empty
round 1: its round 1 holds loads only. A call with no misses has one round, and
an empty call has none (it still counts in ``calls`` and takes a tick).

Slot choice. Within a round the k-th miss of the round goes to the k-th slot of
this order: first the empty slots, by increasing slot id; then the *evictable*
residents, best victim first. Evictable means resident and not computed in the
current round (in round 1: not a hit of the call, as every requested resident is
a hit; in later rounds: anything but this round's own loads). A requested expert
that is not yet computed is never resident, so it is never evicted. ``evicted``
lists the experts a round displaces, in victim order.

Victim order. An expert's recency is set to the call's tick, and its use count
incremented, at the moment it is computed (so experts computed in an earlier
round of this call rank as most recent, and with their new use count, when a
later round of the same call picks victims).

* ``"lru"``: least recency first; ties by lowest slot id.
* ``"lfu"``: lowest use count first; ties by least recency, then by lowest slot id.
* ``"freq"``: fewest *requests* first (the layer's request history below, which an
  eviction does not forget); ties by the least recent request, then by lowest slot id.
  Frequency over the whole history with recency as the tie-break: on the real routing
  traces it loads 2-14% less than ``"lru"`` at 1/8 to 1/4 of the experts as slots and
  never more (docs/benchmarks.md, "Eviction and the CPU share on real routing"), so it
  is the runtime's default (``expert_eviction``).

Request history. Apart from residency the cache keeps, for every expert of the layer,
the number of calls that requested it since construction or :meth:`reset`
(``requests``) and the tick of the last of them (``last_request``). A call's request
counts whether the expert is computed on the device (:meth:`plan` records the experts
it plans, at the call's tick, before choosing victims) or on the CPU (:meth:`note_cpu`,
called after the call's plan, records them at the same tick). Eviction and
invalidation do not touch it. :meth:`reuse_key` reads it: ``(requests, last_request)``,
lower meaning less likely to be requested again soon; the CPU share takes the misses
of lowest key (:mod:`ggml_hybrid.moe.cpu_share`), the ``"freq"`` policy evicts the
resident of lowest key.

After the call every requested expert that is still resident has the call's
tick as its recency; its use count was incremented once by this call.

Committed loads. By default a planned load counts as done the moment it is planned.
A caller that really copies weights (the executor) plans with ``deferred_loads=True``
and calls :meth:`SlotCache.commit` after each copy returns: a slot whose last
planned load was never committed (the copy failed, or the call was interrupted) is
emptied at the start of the next plan, so the cache never claims an expert that is
not in its slot. An emptied slot is not an eviction; ``invalidated`` counts them.

Prefetch. :meth:`SlotCache.prefetch` places one expert that a lookahead predicted for the
coming call (``moe_prefetch``): into the first empty slot, else into the best victim's slot among
the residents that are neither in ``keep`` (the other predictions) nor an uncommitted load. The
expert ranks as computed at the last call's tick with a use count of 0, and its load stays
uncommitted until :meth:`commit`. It takes no tick and counts in no counter (the executor counts
prefetches).

Counters. :class:`CacheCounters` accumulates, over all calls since construction
or :meth:`SlotCache.reset`: ``calls``, ``distinct`` (requested experts),
``hits``, ``misses`` (== loads), ``evictions``, ``rounds`` and ``invalidated`` (slots
emptied because their load was never committed); the fields are the C struct's.

Cost. One call costs O(len(experts) log len(experts) + rounds * n_slots log n_slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._native.cstruct import Counters, enum_names
from ..checks import check_int
from ..errors import IndexRangeError, SlotCacheError, SlotCacheTypeError

__all__ = ["CacheCounters", "SlotCacheError", "SlotCacheTypeError", "POLICIES", "POLICY_CODES", "Round", "SlotCache"]

#: the eviction orders (the session option ``expert_eviction``), the one table of their names and codes: the C
#: enum ``hy_policy`` (``_native/src/moe_policy.h``), which the slot cache's C port and the host tier both take
POLICIES: tuple[str, ...] = enum_names("enum hy_policy", "HY_POLICY_")
POLICY_CODES: dict[str, int] = {name: code for code, name in enumerate(POLICIES)}




@dataclass(frozen=True)
class Round:
    """One round of a planned call.

    ``hits`` are ``(expert, slot)`` pairs computed from resident slots (round 1 only),
    ``loads`` are ``(expert, slot)`` pairs loaded in this round and then computed,
    ``evicted`` are the experts displaced by those loads, in victim order.
    """

    hits: tuple[tuple[int, int], ...]
    loads: tuple[tuple[int, int], ...]
    evicted: tuple[int, ...]


class CacheCounters(Counters, struct="hy_cache_counters"):
    """Cumulative counters of a :class:`SlotCache`: the fields of the C struct ``hy_cache_counters``
    (``_native/src/moe_policy.h``), which the C port keeps too; the module docstring says what each counts."""


def _as_int(value: object, what: str) -> int:
    return check_int(value, what, error=SlotCacheError, type_error=SlotCacheTypeError)


class SlotCache:
    """Residency of ``n_experts`` experts in ``n_slots`` device slots of one MoE layer.

    See the module docstring for the exact policy.
    """

    def __init__(self, n_experts: int, n_slots: int, policy: str = "lru"):
        n_experts = _as_int(n_experts, "SlotCache: n_experts")
        n_slots = _as_int(n_slots, "SlotCache: n_slots")
        if n_experts < 1:
            raise SlotCacheError(f"SlotCache: n_experts must be >= 1, got {n_experts}")
        if n_slots < 1:
            raise SlotCacheError(f"SlotCache: n_slots must be >= 1, got {n_slots}")
        if n_slots > n_experts:
            raise SlotCacheError(
                f"SlotCache: n_slots={n_slots} exceeds n_experts={n_experts}; "
                "a layer never needs more slots than experts")
        if not isinstance(policy, str) or policy not in POLICIES:
            raise SlotCacheError(f"SlotCache: policy must be one of {POLICIES}, got {policy!r}")
        self.n_experts = n_experts
        self.n_slots = n_slots
        self.policy = policy
        self.reset()

    # -- state -----------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty every slot, forget recency and use counts, zero the counters."""
        self._slots: list[int | None] = [None] * self.n_slots  # slot -> expert
        self._where: dict[int, int] = {}  # expert -> slot
        self._recency: dict[int, int] = {}  # expert -> tick of last computation
        self._uses: dict[int, int] = {}  # expert -> calls that requested it since it was loaded
        self._tick = 0
        self._uncommitted: dict[int, int] = {}  # slot -> the expert its last planned load puts there
        self._requests = [0] * self.n_experts  # expert -> calls that requested it (device or CPU)
        self._last_request = [0] * self.n_experts  # expert -> tick of the last of them
        self.counters = CacheCounters()

    def slot_of(self, expert: int) -> int | None:
        """The slot holding ``expert``, or None when it is not resident."""
        s = self._where.get(self._check_expert(expert, "SlotCache.slot_of"))
        return None if s is None or self._uncommitted.get(s) == expert else s

    def holds(self, expert: int) -> bool:
        """Whether ``expert`` has a slot, its load committed or not (what a prefetch need not load again)."""
        return expert in self._where

    def resident(self) -> dict[int, int]:
        """``{expert: slot}`` for every resident expert, in increasing slot order."""
        return {e: s for s, e in enumerate(self._slots) if e is not None and self._uncommitted.get(s) != e}

    def reuse_key(self, expert: int) -> tuple[int, int]:
        """``(requests, last_request)`` of ``expert`` (module docstring): lower = less likely reused soon."""
        return self._requests[expert], self._last_request[expert]

    def note_cpu(self, experts: Sequence[int]) -> None:
        """The experts the CPU computed in the call just planned: their requests are recorded at its tick."""
        for e in experts:
            self._requests[e] += 1
            self._last_request[e] = self._tick

    def __repr__(self) -> str:
        return (f"SlotCache(n_experts={self.n_experts}, n_slots={self.n_slots}, policy={self.policy!r}, "
                f"resident={len(self._where)})")

    # -- validation ------------------------------------------------------------------------------

    def _check_expert(self, expert: object, where: str) -> int:
        e = _as_int(expert, f"{where}: expert id")
        if not 0 <= e < self.n_experts:
            raise IndexRangeError(f"{where}: expert id {e} is out of range [0, {self.n_experts})")
        return e

    def _check_call(self, experts: Sequence[int], rows: Sequence[int] | None) -> tuple[list[int], list[int]]:
        if isinstance(experts, (str, bytes)) or not hasattr(experts, "__len__") or not hasattr(experts, "__iter__"):
            raise SlotCacheTypeError(
                f"SlotCache.plan: experts must be a sequence of int expert ids, got {type(experts).__name__}")
        ids: list[int] = []
        seen: dict[int, int] = {}
        for i, value in enumerate(experts):
            e = self._check_expert(value, f"SlotCache.plan: experts[{i}]")
            if e in seen:
                raise SlotCacheError(
                    f"SlotCache.plan: expert {e} is listed twice (experts[{seen[e]}] and experts[{i}]); "
                    "a call lists distinct experts")
            seen[e] = i
            ids.append(e)
        if rows is None:
            return ids, [1] * len(ids)
        if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__") or not hasattr(rows, "__iter__"):
            raise SlotCacheTypeError(
                f"SlotCache.plan: rows must be None or a sequence of ints, got {type(rows).__name__}")
        if len(rows) != len(ids):
            raise SlotCacheError(
                f"SlotCache.plan: rows has {len(rows)} entries but experts has {len(ids)}; one row count per expert")
        counts = []
        for i, value in enumerate(rows):
            r = _as_int(value, f"SlotCache.plan: rows[{i}]")
            if r < 1:
                raise SlotCacheError(
                    f"SlotCache.plan: rows[{i}] = {r} for expert {ids[i]}; a requested expert has at least 1 row")
            counts.append(r)
        return ids, counts

    # -- planning --------------------------------------------------------------------------------

    def _expert_in(self, slot: int) -> int:
        e = self._slots[slot]
        assert e is not None, f"slot {slot} is empty"
        return e

    def _victim_key(self, slot: int) -> tuple[int, ...]:
        e = self._expert_in(slot)
        if self.policy == "lru":
            return (self._recency[e], slot)
        if self.policy == "freq":
            return (self._requests[e], self._last_request[e], slot)
        return (self._uses[e], self._recency[e], slot)

    def _use(self, expert: int) -> None:
        self._recency[expert] = self._tick
        self._uses[expert] = self._uses.get(expert, 0) + 1

    def commit(self, slot: int, expert: int) -> None:
        """The copy of ``expert`` into ``slot`` (a load planned with ``deferred_loads=True``) is done.

        Only the last load planned into a slot makes it whole: a call that loads a slot in two rounds
        commits it twice, and only the second commit counts.
        """
        if self._uncommitted.get(slot) == expert:
            del self._uncommitted[slot]

    def prefetch(self, expert: int, keep: set[int] | frozenset[int]) -> tuple[int, int | None] | None:
        """Place ``expert`` (not resident) ahead of the call that was predicted to need it (see the module
        docstring); ``(slot, displaced expert or None)``, or None when every slot is kept."""
        if expert in self._where:
            return None
        free = [s for s, e in enumerate(self._slots) if e is None]
        victim: int | None = None
        if free:
            slot = free[0]
        else:
            cands = [s for s, e in enumerate(self._slots)
                     if e is not None and e not in keep and s not in self._uncommitted]
            if not cands:
                return None
            slot = min(cands, key=self._victim_key)
            victim = self._expert_in(slot)
            del self._where[victim], self._recency[victim], self._uses[victim]
        self._slots[slot] = expert
        self._where[expert] = slot
        self._recency[expert] = self._tick
        self._uses[expert] = 0
        self._uncommitted[slot] = expert
        return slot, victim

    def _drop_uncommitted(self) -> None:
        for s, e in self._uncommitted.items():
            if self._slots[s] == e:
                self._slots[s] = None
                del self._where[e], self._recency[e], self._uses[e]
                self.counters.invalidated += 1
        self._uncommitted.clear()

    def plan(self, experts: Sequence[int], rows: Sequence[int] | None = None, *, checked: bool = True,
             deferred_loads: bool = False) -> list[Round]:
        """Plan one layer call over the distinct ``experts`` (``rows[i]`` rows for ``experts[i]``).

        Returns the rounds of the call and updates residency, recency, use counts and
        counters as if the plan were executed. Raises :class:`IndexRangeError` for an
        expert id outside ``[0, n_experts)`` and :class:`SlotCacheError` (a ValueError)
        for duplicates, mismatched or non-positive row counts and non-int values; the
        cache is left untouched when the call is rejected. ``checked=False`` skips that
        validation for callers whose input is valid by construction (a hot path).
        ``deferred_loads=True``: the loads stay uncommitted until :meth:`commit` (see the module docstring).
        """
        if checked:
            ids, counts = self._check_call(experts, rows)
        else:  # the caller guarantees distinct in-range ints and positive row counts (the executor's bincount)
            ids, counts = list(experts), list(rows) if rows is not None else [1] * len(experts)
        if self._uncommitted:
            self._drop_uncommitted()
        self._tick += 1
        for e in ids:
            self._requests[e] += 1
            self._last_request[e] = self._tick
        c = self.counters
        c.calls += 1
        c.distinct += len(ids)
        if not ids:
            return []

        hit_slots = sorted(self._where[e] for e in ids if e in self._where)
        misses = sorted(((r, e) for e, r in zip(ids, counts) if e not in self._where), key=lambda t: (-t[0], t[1]))
        misses_e = [e for _, e in misses]
        hits = tuple((self._expert_in(s), s) for s in hit_slots)
        for e, _ in hits:
            self._use(e)
        c.hits += len(hits)
        c.misses += len(misses_e)

        rounds: list[Round] = []
        protected = set(hit_slots)  # slots computed in the current round
        capacity = self.n_slots - len(hit_slots)
        pos = 0
        first = True
        while first or pos < len(misses_e):
            batch = misses_e[pos:pos + capacity]
            pos += len(batch)
            free = [s for s, e in enumerate(self._slots) if e is None]
            targets = free[:len(batch)]
            evicted: list[int] = []
            need = len(batch) - len(targets)
            if need:
                cands = sorted((s for s, e in enumerate(self._slots) if e is not None and s not in protected),
                               key=self._victim_key)
                for s in cands[:need]:
                    victim = self._expert_in(s)
                    evicted.append(victim)
                    del self._where[victim], self._recency[victim], self._uses[victim]
                    self._slots[s] = None
                    targets.append(s)
            loads = []
            for e, s in zip(batch, targets):
                self._slots[s] = e
                self._where[e] = s
                self._uses[e] = 0
                self._use(e)
                loads.append((e, s))
            if deferred_loads:
                self._uncommitted.update((s, e) for e, s in loads)
            rounds.append(Round(hits=hits if first else (), loads=tuple(loads), evicted=tuple(evicted)))
            c.evictions += len(evicted)
            protected = set()  # after round 1 everything computed so far may be evicted
            capacity = self.n_slots
            first = False
        c.rounds += len(rounds)
        return rounds
