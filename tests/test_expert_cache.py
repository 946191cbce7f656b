"""SlotCache: hand-computed plans, a stateful check against a reference model, input validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ggml_hybrid.errors import GgmlHybridError, IndexRangeError
from ggml_hybrid.moe.slot_cache import CacheCounters, Round, SlotCache, SlotCacheError


def R(hits=(), loads=(), evicted=()):
    return Round(hits=tuple(hits), loads=tuple(loads), evicted=tuple(evicted))


# -- hand-computed examples ------------------------------------------------------------------------


def test_lru_sequence():
    c = SlotCache(4, 2, "lru")
    assert c.plan([0, 1]) == [R(loads=[(0, 0), (1, 1)])]
    # 1 is a hit and protected; 0 is the only evictable resident
    assert c.plan([2, 1]) == [R(hits=[(1, 1)], loads=[(2, 0)], evicted=[0])]
    # 2 (slot 0) and 1 (slot 1) were both used at tick 2: the tie goes to the lowest slot
    assert c.plan([3]) == [R(loads=[(3, 0)], evicted=[2])]
    # 1 was used at tick 2, 3 at tick 3: 1 is least recent
    assert c.plan([0]) == [R(loads=[(0, 1)], evicted=[1])]
    assert c.resident() == {3: 0, 0: 1}
    assert c.slot_of(3) == 0 and c.slot_of(0) == 1 and c.slot_of(1) is None and c.slot_of(2) is None
    # four distinct experts on two slots: hits first, then the rest in a second round that may
    # evict the experts computed in round 1 (all at the current tick: lowest slot first)
    assert c.plan([0, 1, 2, 3]) == [
        R(hits=[(3, 0), (0, 1)]),
        R(loads=[(1, 0), (2, 1)], evicted=[3, 0]),
    ]
    assert c.resident() == {1: 0, 2: 1}
    assert c.counters == CacheCounters(calls=5, distinct=10, hits=3, misses=7, evictions=5, rounds=6)
    assert c.counters.to_dict() == {"calls": 5, "distinct": 10, "hits": 3, "misses": 7, "evictions": 5, "rounds": 6,
                                    "invalidated": 0}


def test_lfu_sequence_differs_from_lru():
    calls = [[0, 1], [0], [2], [1], [3]]
    lfu, lru = SlotCache(4, 2, "lfu"), SlotCache(4, 2, "lru")
    got_lfu = [lfu.plan(x) for x in calls]
    got_lru = [lru.plan(x) for x in calls]
    assert got_lfu == [
        [R(loads=[(0, 0), (1, 1)])],
        [R(hits=[(0, 0)])],
        # 0: 2 uses, 1: 1 use -> evict 1
        [R(loads=[(2, 1)], evicted=[1])],
        # 0: 2 uses (tick 2), 2: 1 use (tick 3) -> LFU evicts 2 although 0 is less recent
        [R(loads=[(1, 1)], evicted=[2])],
        # 0: 2 uses, 1: 1 use -> evict 1
        [R(loads=[(3, 1)], evicted=[1])],
    ]
    assert got_lru[3] == [R(loads=[(1, 0)], evicted=[0])]
    assert lfu.resident() == {0: 0, 3: 1}
    assert lfu.counters == CacheCounters(calls=5, distinct=6, hits=1, misses=5, evictions=3, rounds=5)


def test_lfu_ties_by_recency_then_slot():
    c = SlotCache(5, 3, "lfu")
    assert c.plan([0, 1, 2]) == [R(loads=[(0, 0), (1, 1), (2, 2)])]  # all: 1 use, tick 1
    assert c.plan([2]) == [R(hits=[(2, 2)])]  # 2: 2 uses
    assert c.plan([3]) == [R(loads=[(3, 0)], evicted=[0])]  # 0 and 1 tie on uses and tick: lowest slot
    assert c.plan([1]) == [R(hits=[(1, 1)])]  # 1: 2 uses at tick 4, 2: 2 uses at tick 2, 3: 1 use
    assert c.plan([4]) == [R(loads=[(4, 0)], evicted=[3])]  # fewest uses wins over recency
    assert c.plan([4]) == [R(hits=[(4, 0)])]  # 4: 2 uses at tick 6: all three tie on uses now
    assert c.plan([0]) == [R(loads=[(0, 2)], evicted=[2])]  # tie on uses: least recent is 2 (tick 2)


def test_hits_are_protected_even_when_lfu_prefers_them():
    c = SlotCache(3, 2, "lfu")
    c.plan([0])
    c.plan([0])
    assert c.plan([0, 1]) == [R(hits=[(0, 0)], loads=[(1, 1)])]  # 0: 3 uses, 1: 1 use
    # 1 is a hit (2 uses after this call) and stays; 0 (3 uses) is the only evictable resident
    assert c.plan([2, 1]) == [R(hits=[(1, 1)], loads=[(2, 0)], evicted=[0])]


def test_rounds_follow_row_order_and_use_updated_state():
    c = SlotCache(4, 1, "lru")
    # decreasing rows, ties by expert id: 1 (5), 2 (5), 3 (2), 0 (1)
    assert c.plan([0, 1, 2, 3], rows=[1, 5, 5, 2]) == [
        R(loads=[(1, 0)]),
        R(loads=[(2, 0)], evicted=[1]),
        R(loads=[(3, 0)], evicted=[2]),
        R(loads=[(0, 0)], evicted=[3]),
    ]
    assert c.counters.rounds == 4 and c.counters.misses == 4 and c.counters.evictions == 3
    # LFU in a later round sees the use counts updated by earlier rounds of the same call
    lfu, lru = SlotCache(3, 2, "lfu"), SlotCache(3, 2, "lru")
    for cc in (lfu, lru):
        cc.plan([0])
        cc.plan([0])
    assert lfu.plan([2, 1, 0]) == [R(hits=[(0, 0)], loads=[(1, 1)]), R(loads=[(2, 1)], evicted=[1])]
    assert lru.plan([2, 1, 0]) == [R(hits=[(0, 0)], loads=[(1, 1)]), R(loads=[(2, 0)], evicted=[0])]


def test_full_hits_leave_no_room_in_round_one():
    c = SlotCache(6, 2)
    c.plan([4, 5])
    assert c.plan([5, 4, 0], rows=[1, 1, 9]) == [R(hits=[(4, 0), (5, 1)]), R(loads=[(0, 0)], evicted=[4])]
    assert c.plan([]) == []
    assert c.counters.calls == 3 and c.counters.rounds == 3 and c.counters.distinct == 5


def test_reset_empties_everything():
    c = SlotCache(4, 2, "lfu")
    c.plan([0, 1, 2])
    c.reset()
    assert c.resident() == {} and c.counters == CacheCounters()
    assert all(c.slot_of(e) is None for e in range(4))
    assert c.plan([3, 2]) == [R(loads=[(2, 0), (3, 1)])]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_plan_ignores_listing_order(data):
    n = data.draw(st.integers(2, 16), label="n_experts")
    k = data.draw(st.integers(1, n), label="n_slots")
    policy = data.draw(st.sampled_from(["lru", "lfu", "freq"]), label="policy")
    a, b = SlotCache(n, k, policy), SlotCache(n, k, policy)
    for _ in range(data.draw(st.integers(1, 6), label="calls")):
        call = data.draw(st.dictionaries(st.integers(0, n - 1), st.integers(1, 4)), label="call")
        items = list(call.items())
        shuffled = data.draw(st.permutations(items), label="order")
        pa = a.plan([e for e, _ in items], [r for _, r in items])
        pb = b.plan([e for e, _ in shuffled], [r for _, r in shuffled])
        assert pa == pb
    assert a.resident() == b.resident() and a.counters == b.counters


# -- stateful check against a reference model --------------------------------------------------------


class CacheMachine(RuleBasedStateMachine):
    """Drives a SlotCache with random calls and checks every round against a slot-by-slot model."""

    @initialize(shape=st.integers(2, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
                policy=st.sampled_from(["lru", "lfu", "freq"]))
    def setup(self, shape, policy):
        self.n, self.k = shape
        self.policy = policy
        self.cache = SlotCache(self.n, self.k, policy)
        self._model_reset()

    def _model_reset(self):
        self.slots = [None] * self.k  # slot -> expert
        self.recency = {}
        self.uses = {}
        self.requests = [0] * self.n  # every call that asked for an expert, device or CPU; evictions keep it
        self.last_request = [0] * self.n
        self.tick = 0
        self.totals = dict(calls=0, distinct=0, hits=0, misses=0, evictions=0, rounds=0, invalidated=0)

    def _key(self, slot):
        e = self.slots[slot]
        if self.policy == "lru":
            return (self.recency[e], slot)
        if self.policy == "freq":
            return (self.requests[e], self.last_request[e], slot)
        return (self.uses[e], self.recency[e], slot)

    def _where(self, e):
        return self.slots.index(e) if e in self.slots else None

    @rule(data=st.data())
    def call(self, data):
        experts = data.draw(st.lists(st.integers(0, self.n - 1), unique=True, max_size=min(self.n, 3 * self.k + 2)),
                            label="experts")
        rows = data.draw(st.none() | st.lists(st.integers(1, 6), min_size=len(experts), max_size=len(experts)),
                         label="rows")
        before = self.cache.counters.to_dict()
        rounds = self.cache.plan(experts, rows)
        self._check(rounds, experts, [1] * len(experts) if rows is None else rows)
        after = self.cache.counters.to_dict()
        d = {key: after[key] - before[key] for key in after}
        assert d["calls"] == 1 and d["distinct"] == len(experts)
        assert d["hits"] + d["misses"] == d["distinct"]
        assert d["misses"] == sum(len(r.loads) for r in rounds)
        assert d["hits"] == sum(len(r.hits) for r in rounds)
        assert d["evictions"] == sum(len(r.evicted) for r in rounds)
        assert d["rounds"] == len(rounds)
        # the CPU computed some other experts of this call: they count in the history at the call's tick
        cpu = data.draw(st.lists(st.integers(0, self.n - 1), unique=True, max_size=4), label="cpu")
        cpu = [e for e in cpu if e not in experts and e not in self.slots]
        self.cache.note_cpu(cpu)
        for e in cpu:
            self.requests[e] += 1
            self.last_request[e] = self.tick
        for e in range(self.n):
            assert self.cache.reuse_key(e) == (self.requests[e], self.last_request[e])

    def _check(self, rounds, experts, rows):
        self.tick += 1
        for e in experts:
            self.requests[e] += 1
            self.last_request[e] = self.tick
        self.totals["calls"] += 1
        self.totals["distinct"] += len(experts)
        requested = set(experts)
        row_of = dict(zip(experts, rows))
        initial_hits = {e for e in requested if e in self.slots}
        miss_order = sorted(requested - initial_hits, key=lambda e: (-row_of[e], e))
        if not experts:
            assert rounds == []
            return
        assert rounds, "a non-empty call has at least one round"
        pending = set(requested)  # requested and not yet computed (at the start of the round)
        computed = []
        loaded = []
        for i, rnd in enumerate(rounds):
            if i == 0:
                # round 1 holds every initial hit, from the slot where the model has it, in slot order
                assert {e for e, _ in rnd.hits} == initial_hits
                assert all(self.slots[s] == e for e, s in rnd.hits)
                assert [s for _, s in rnd.hits] == sorted(s for _, s in rnd.hits)
                for e, _ in rnd.hits:
                    self.recency[e] = self.tick
                    self.uses[e] += 1
            else:
                assert rnd.hits == ()
                assert rnd.loads, "no empty rounds after round 1"
            assert len(rnd.hits) + len(rnd.loads) <= self.k
            # as many loads as fit
            room = self.k - len(rnd.hits) if i == 0 else self.k
            assert len(rnd.loads) == min(room, len(miss_order) - len(loaded))
            # nothing pending (including this round's hits) is evicted
            assert not set(rnd.evicted) & pending, (rnd, pending)
            for e, s in rnd.loads:
                assert e in pending and e not in self.slots and 0 <= s < self.k
            # free slots first, lowest first; then victims in policy order among the evictable residents
            free = [s for s, e in enumerate(self.slots) if e is None]
            n_free = min(len(free), len(rnd.loads))
            protected = {s for _, s in rnd.hits}
            evictable = sorted((s for s, e in enumerate(self.slots) if e is not None and s not in protected),
                               key=self._key)
            victims = evictable[:len(rnd.loads) - n_free]
            assert list(rnd.evicted) == [self.slots[s] for s in victims], (self.policy, rnd, self.slots)
            assert [s for _, s in rnd.loads] == free[:n_free] + victims
            for v in victims:
                e = self.slots[v]
                del self.recency[e], self.uses[e]
                self.slots[v] = None
            for e, s in rnd.loads:
                assert self.slots[s] is None
                self.slots[s] = e
                self.recency[e] = self.tick
                self.uses[e] = 1
            this = [e for e, _ in rnd.hits] + [e for e, _ in rnd.loads]
            computed += this
            loaded += [e for e, _ in rnd.loads]
            pending -= set(this)
            self.totals["hits"] += len(rnd.hits)
            self.totals["misses"] += len(rnd.loads)
            self.totals["evictions"] += len(rnd.evicted)
            self.totals["rounds"] += 1
        # every requested expert computed exactly once; misses loaded in (rows desc, id) order
        assert sorted(computed) == sorted(requested)
        assert loaded == miss_order
        assert not pending

    @rule(data=st.data())
    def bad_call_changes_nothing(self, data):
        state = (self.cache.resident(), self.cache.counters.to_dict())
        e = data.draw(st.integers(0, self.n - 1), label="dup")
        bad = data.draw(st.sampled_from([[e, e], [self.n], [-1], [e, self.n + e]]), label="bad")
        with pytest.raises(GgmlHybridError):
            self.cache.plan(bad)
        assert (self.cache.resident(), self.cache.counters.to_dict()) == state

    @precondition(lambda self: self.tick > 0)
    @rule()
    def reset(self):
        self.cache.reset()
        self._model_reset()

    @invariant()
    def residency_matches_model(self):
        res = self.cache.resident()
        assert len(res) <= self.k
        slots = list(res.values())
        assert len(set(slots)) == len(slots) and all(0 <= s < self.k for s in slots)
        assert all(0 <= e < self.n for e in res)
        assert res == {e: s for s, e in enumerate(self.slots) if e is not None}
        for e in range(self.n):
            assert self.cache.slot_of(e) == self._where(e)

    @invariant()
    def counters_add_up(self):
        c = self.cache.counters
        assert c.hits + c.misses == c.distinct
        assert c.to_dict() == self.totals


CacheMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


# -- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, kwargs, match", [
    ((0, 1), {}, "n_experts must be >= 1"),
    ((4, 0), {}, "n_slots must be >= 1"),
    ((2, 3), {}, "n_slots=3 exceeds n_experts=2"),
    ((4.0, 2), {}, "n_experts must be an int"),
    ((4, True), {}, "n_slots must be an int"),
    ((4, 2), {"policy": "fifo"}, "policy must be one of"),
    ((4, 2), {"policy": None}, "policy must be one of"),
])
def test_bad_construction(args, kwargs, match):
    with pytest.raises(SlotCacheError, match=match) as info:
        SlotCache(*args, **kwargs)
    assert isinstance(info.value, (GgmlHybridError, ValueError))


@pytest.mark.parametrize("experts, rows, exc, match", [
    ([1, 2, 1], None, SlotCacheError, r"expert 1 is listed twice \(experts\[0\] and experts\[2\]\)"),
    ([0, 4], None, IndexRangeError, r"experts\[1\]: expert id 4 is out of range \[0, 4\)"),
    ([-1], None, IndexRangeError, r"expert id -1 is out of range"),
    ([0, 1.0], None, SlotCacheError, r"experts\[1\]: expert id must be an int, got 1.0"),
    ([None], None, SlotCacheError, "must be an int"),
    ([False], None, SlotCacheError, "got the bool False"),
    ("01", None, SlotCacheError, "experts must be a sequence"),
    (5, None, SlotCacheError, "experts must be a sequence"),
    ([0, 1], [1], SlotCacheError, "rows has 1 entries but experts has 2"),
    ([0, 1], [1, 0], SlotCacheError, r"rows\[1\] = 0 for expert 1"),
    ([0, 1], [1, 2.5], SlotCacheError, r"rows\[1\] must be an int"),
    ([0, 1], 3, SlotCacheError, "rows must be None or a sequence"),
])
def test_bad_call(experts, rows, exc, match):
    c = SlotCache(4, 2)
    c.plan([3])
    with pytest.raises(exc, match=match) as info:
        c.plan(experts, rows)
    assert isinstance(info.value, GgmlHybridError)
    assert isinstance(info.value, (IndexError, ValueError))
    # a rejected call leaves the cache untouched, and the next call sees the same state
    assert c.resident() == {3: 0}
    assert c.counters == CacheCounters(calls=1, distinct=1, misses=1, rounds=1)
    assert c.plan([3, 0]) == [R(hits=[(3, 0)], loads=[(0, 1)])]


def test_slot_of_validates():
    c = SlotCache(4, 2)
    with pytest.raises(IndexRangeError, match="expert id 4 is out of range"):
        c.slot_of(4)
    with pytest.raises(SlotCacheError, match="must be an int"):
        c.slot_of("0")


@given(st.integers(1, 16), st.data())
def test_unchecked_plan_equals_checked_plan(n_slots, data):
    """The executor's fast path (checked=False) plans exactly as the validated path does."""
    a, b = SlotCache(32, n_slots, "lru"), SlotCache(32, n_slots, "lru")
    for _ in range(6):
        experts = data.draw(st.lists(st.integers(0, 31), min_size=1, max_size=12, unique=True))
        rows = data.draw(st.lists(st.integers(1, 9), min_size=len(experts), max_size=len(experts)))
        assert a.plan(experts, rows) == b.plan(experts, rows, checked=False)
    assert a.counters == b.counters and a.resident() == b.resident()


def test_deferred_loads_count_only_once_committed():
    """A load that was planned but never copied (a failed or interrupted call) is never a hit later."""
    c = SlotCache(8, 3)
    r = c.plan([0, 1, 2], deferred_loads=True)
    assert [e for e, _ in r[0].loads] == [0, 1, 2]
    c.commit(r[0].loads[0][1], 0)  # only expert 0's copy finished
    assert c.resident() == {0: r[0].loads[0][1]}  # queries already ignore the uncommitted slots
    assert c.slot_of(1) is None and c.slot_of(0) == r[0].loads[0][1]
    r2 = c.plan([0, 1, 2])
    assert r2[0].hits == ((0, r[0].loads[0][1]),)
    assert sorted(e for e, _ in r2[0].loads) == [1, 2]  # loaded again, not mistaken for hits
    assert c.counters.invalidated == 2 and c.counters.evictions == 0


def test_a_slot_loaded_twice_in_one_call_is_whole_only_after_its_last_load():
    c = SlotCache(8, 1)
    rounds = c.plan([3, 4], [2, 1], deferred_loads=True)  # one slot, two rounds: 3 (more rows) then 4
    assert [rnd.loads for rnd in rounds] == [((3, 0),), ((4, 0),)]
    c.commit(0, 3)  # the first round's copy; the call died before the second
    assert c.resident() == {} and c.plan([4])[0].loads == ((4, 0),)
    c2 = SlotCache(8, 1)
    c2.plan([3, 4], [2, 1], deferred_loads=True)
    c2.commit(0, 3)
    c2.commit(0, 4)
    assert c2.resident() == {4: 0} and c2.plan([4])[0].hits == ((4, 0),)


def test_freq_evicts_the_fewest_requests_and_remembers_across_evictions():
    """'freq' counts every request of the layer, resident or not; LRU and LFU forget an evicted expert."""
    freq, lru = SlotCache(3, 2, "freq"), SlotCache(3, 2, "lru")
    for c in (freq, lru):
        c.plan([0])
        c.plan([0])
        c.plan([1])
    # 0: 2 requests, last at tick 2; 1: 1 request, last at tick 3
    assert freq.plan([2])[0].evicted == (1,)
    assert lru.plan([2])[0].evicted == (0,)
    # 0 was requested twice: after 2 is requested twice too and 1 once more (now 2 requests, but later)...
    freq.plan([2])
    freq.note_cpu([1])  # the CPU computed 1 at tick 5: its history counts it although it is not resident
    assert freq.reuse_key(1) == (2, 5) and freq.reuse_key(0) == (2, 2) and freq.reuse_key(2) == (2, 5)
    # ...so a new expert evicts the least recent of the equally requested residents: 0 (tick 2) before 2 (tick 5)
    assert freq.plan([1])[0].evicted == (0,)
    assert freq.reuse_key(1) == (3, 6)
