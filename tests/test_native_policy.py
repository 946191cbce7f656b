"""The C decisions of a layer call (src/moe_policy.c) against their Python specification, call by call.

The native executor decides with the C port; the Python modules (slot_cache, cpu_share) are the
reference. Both are driven with the same random calls and every decision is compared: hits, loads
and their rounds, evictions, counters, residency, the CPU share's count, the cost model's estimates
(bit for bit) and choices.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_hybrid._native import ffi, lib
from ggml_hybrid.moe.cpu_share import COEFFICIENTS, DEFAULT_PRIOR, PRIOR_KEYS, CostModel, n_cpu_for_share, split_misses
from ggml_hybrid.moe.round_cost import device_rounds
from ggml_hybrid.moe.row_graphs import row_bucket
from ggml_hybrid.moe.slot_cache import CacheCounters, SlotCache

POLICIES = {"lru": lib.HY_POLICY_LRU, "lfu": lib.HY_POLICY_LFU, "freq": lib.HY_POLICY_FREQ}


class NativeCache:
    def __init__(self, n_experts, n_slots, policy):
        self.p = ffi.gc(lib.hy_cache_new(n_experts, n_slots, POLICIES[policy]), lib.hy_cache_free)
        assert self.p != ffi.NULL

    def plan(self, experts, rows, deferred):
        e = ffi.new("int32_t[]", list(experts) or [0])
        r = ffi.new("int32_t[]", list(rows) or [0])
        p = lib.hy_cache_plan(self.p, e, r, len(experts), deferred)
        rounds = [[[], [], []] for _ in range(p.n_rounds)]
        if p.n_rounds:
            rounds[0][0] = [(p.hit_expert[i], p.hit_slot[i]) for i in range(p.n_hits)]
        for i in range(p.n_loads):
            rounds[p.load_round[i]][1].append((p.load_expert[i], p.load_slot[i]))
        for i in range(p.n_evicted):
            rounds[p.evicted_round[i]][2].append(p.evicted_expert[i])
        return [tuple(map(tuple, r)) for r in rounds]

    def note_cpu(self, experts):
        lib.hy_cache_note_cpu(self.p, ffi.new("int32_t[]", list(experts) or [0]), len(experts))

    def counters(self):
        return CacheCounters.from_c(self.p.counters).to_dict()

    def resident(self, n_experts):
        out = {}
        for e in range(n_experts):
            s = lib.hy_cache_slot_of(self.p, e)
            if s >= 0:
                out[e] = s
        return dict(sorted(out.items(), key=lambda kv: kv[1]))


@st.composite
def call_sequences(draw):
    n_experts = draw(st.integers(1, 24))
    n_slots = draw(st.integers(1, n_experts))
    calls = []
    for _ in range(draw(st.integers(1, 40))):
        experts = draw(st.lists(st.integers(0, n_experts - 1), unique=True, max_size=n_experts))
        rows = [draw(st.integers(1, 6)) for _ in experts]
        deferred = draw(st.booleans())
        commit = draw(st.lists(st.booleans(), min_size=n_experts, max_size=n_experts))
        # experts of the call the CPU computed (not planned): they count in the request history
        cpu = draw(st.lists(st.sampled_from([e for e in range(n_experts) if e not in experts] or [0]), unique=True))
        cpu = [e for e in cpu if e not in experts]
        calls.append((experts, rows, deferred, commit, cpu))
    return n_experts, n_slots, draw(st.sampled_from(sorted(POLICIES))), calls


@settings(max_examples=200, deadline=None)
@given(call_sequences())
def test_the_c_slot_cache_plans_every_call_as_the_python_one(case):
    n_experts, n_slots, policy, calls = case
    py, c = SlotCache(n_experts, n_slots, policy), NativeCache(n_experts, n_slots, policy)
    for experts, rows, deferred, commit, cpu in calls:
        want = py.plan(experts, rows, deferred_loads=deferred)
        got = c.plan(experts, rows, deferred)
        assert got == [(r.hits, r.loads, r.evicted) for r in want]
        py.note_cpu(cpu)
        c.note_cpu(cpu)
        for rnd in want:  # commit some of the loads, as an executor whose call failed part way would
            for e, s in rnd.loads:
                if commit[e]:
                    py.commit(s, e)
                    lib.hy_cache_commit(c.p, s, e)
        assert c.counters() == py.counters.to_dict()
        assert c.resident(n_experts) == py.resident()


@given(st.integers(1, 1 << 16), st.data())
def test_the_c_share_rule_rounds_a_remembered_share_as_the_python_one(den, data):
    """The cost model remembers best/n (n <= the experts of a layer) and rounds it for other miss counts."""
    num = data.draw(st.integers(0, den))
    n = data.draw(st.integers(0, 1 << 16))
    want = min(int(Fraction(num, den) * n + Fraction(1, 2)), n)
    assert lib.hy_n_cpu_for_share(num, den, n) == want


def test_the_share_rule_has_no_floating_point_error():
    assert lib.hy_n_cpu_for_share(29, 100, 50) == 15 == n_cpu_for_share(0.29, 50)  # float math gives 14
    assert lib.hy_n_cpu_for_share(3, 10, 5) == 2 == n_cpu_for_share(0.3, 5)
    assert lib.hy_n_cpu_for_share(10 ** 17 - 1, 10 ** 17, 65536) == 65536


def test_the_coefficients_are_the_c_enum_and_every_one_has_a_prior():
    assert [getattr(lib, f"HY_COST_{k.upper()}") for k in COEFFICIENTS] == list(range(lib.HY_COST_N))
    assert set(DEFAULT_PRIOR) == set(PRIOR_KEYS) and len(PRIOR_KEYS) == len(COEFFICIENTS)


@st.composite
def cost_histories(draw):
    events = []
    for _ in range(draw(st.integers(0, 60))):
        kind = draw(st.sampled_from(["cpu", "job", "load", "device", "choose"]))
        if kind == "cpu":
            events.append((kind, draw(st.integers(0, 1 << 24)), draw(st.integers(0, 64)),
                           draw(st.floats(0, 1e-2))))
        elif kind in ("job", "load", "device"):
            events.append((kind, draw(st.integers(0, 1 << 24)), draw(st.floats(0, 1e-2))))
        else:
            miss = sorted(draw(st.lists(st.integers(1, 8), max_size=12)))
            events.append((kind, draw(st.integers(0, 40)), miss))
    return draw(st.integers(1, 1 << 24)), draw(st.sampled_from([0.0, 0.05, 0.3])), events


@st.composite
def cost_histories_with_rounds(draw):
    """A history, a device round's prior cost (0: the per-row model alone) and the cache's slots."""
    return (*draw(cost_histories()), draw(st.sampled_from([0.0, 2e-5, 4e-3])), draw(st.integers(1, 8)))


@settings(max_examples=300, deadline=None)
@given(cost_histories_with_rounds())
def test_the_c_cost_model_learns_and_chooses_as_the_python_one(case):
    B, hysteresis, events, round_s, n_slots = case
    py = CostModel(hysteresis=hysteresis, round_s=round_s)
    c = ffi.new("hy_cost_model *")
    lib.hy_cost_init(c, 0.25, hysteresis, [DEFAULT_PRIOR[k] for k in PRIOR_KEYS])
    c.round_s = round_s
    out = ffi.new("double[5]")
    for ev in events:
        kind = ev[0]
        if kind == "cpu":
            py.observe_cpu(ev[1], ev[2], ev[3])
            lib.hy_cost_observe_cpu(c, float(ev[1]), float(ev[2]), ev[3])
        elif kind == "job":
            py.observe_cpu_job(ev[2])
            lib.hy_cost_observe_job(c, ev[2])
        elif kind == "load":
            py.observe_load(ev[1], ev[2])
            lib.hy_cost_observe_load(c, float(ev[1]), ev[2])
        elif kind == "device":
            py.observe_device(ev[1], ev[2])
            lib.hy_cost_observe_device(c, float(ev[1]), ev[2])
        else:
            hit_rows, miss = ev[1], ev[2]
            # a call: one hit expert with hit_rows rows (when any), the misses 100.. with their rows
            experts = ([0] if hit_rows else []) + [100 + i for i in range(len(miss))]
            rows = ([hit_rows] if hit_rows else []) + miss
            split = py.choose(experts, rows, {0}, B, None, n_slots)
            k = lib.hy_cost_choose_rounds(c, B, hit_rows, int(hit_rows > 0), n_slots, ffi.new("int32_t[]", miss or [0]),
                                          len(miss))
            assert k == len(split.cpu_misses)
        lib.hy_cost_estimate(c, B, out)
        est = py.estimate(B)
        assert [out[i] for i in range(5)] == [est[k] for k in COEFFICIENTS]  # bit for bit
        assert lib.hy_cost_round(c, B) == py.round_cost(B)
    assert (c.has_share, Fraction(c.share_num, c.share_den) if c.has_share else None) == \
        (py.share is not None, py._share)


def test_a_fixed_c_cost_model_is_the_python_fixed_one():
    coef = {"cpu_per_byte": 1e-10, "cpu_per_row": 2e-6, "load_per_byte": 5e-11, "device_per_row": 1e-8,
            "cpu_per_job": 3e-5}
    py = CostModel.fixed(coef, 0.05)
    c = ffi.new("hy_cost_model *")
    lib.hy_cost_init_fixed(c, 0.05, [coef[k] for k in COEFFICIENTS])
    rng = np.random.default_rng(0)
    for _ in range(200):
        miss = sorted(rng.integers(1, 6, size=int(rng.integers(0, 9))).tolist())
        experts = [0] + [10 + i for i in range(len(miss))]
        split = py.choose(experts, [3] + miss, {0}, 1 << 20)
        assert lib.hy_cost_choose(c, 1 << 20, 3, ffi.new("int32_t[]", miss or [0]), len(miss)) == \
            len(split.cpu_misses)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_c_cache_refuses_impossible_shapes(policy):
    assert lib.hy_cache_new(4, 5, POLICIES[policy]) == ffi.NULL
    assert lib.hy_cache_new(0, 1, POLICIES[policy]) == ffi.NULL
    assert lib.hy_cache_new(4, 0, POLICIES[policy]) == ffi.NULL
    assert lib.hy_cache_new(4, 2, 7) == ffi.NULL

@st.composite
def split_calls(draw):
    n_experts = draw(st.integers(1, 24))
    n_slots = draw(st.integers(1, n_experts))
    warm = draw(st.lists(st.integers(0, n_experts - 1), unique=True, max_size=n_slots))
    calls = []
    for _ in range(draw(st.integers(1, 12))):
        experts = sorted(draw(st.lists(st.integers(0, n_experts - 1), unique=True, max_size=n_experts)))
        calls.append((experts, [draw(st.integers(1, 9)) for _ in experts]))
    share = draw(st.sampled_from([0.0, 0.25, 0.3, 0.5, 0.75, 1.0, "auto"]))
    return n_experts, n_slots, warm, calls, share, draw(st.sampled_from([0.0, 0.05])), draw(st.sampled_from(
        sorted(POLICIES))), draw(st.sampled_from([0.0, 3e-4]))


@settings(max_examples=200, deadline=None)
@given(split_calls())
def test_the_c_split_of_misses_is_the_python_one(case):
    """hy_split_misses (what the native executor's cpu_split calls) against split_misses and CostModel.choose:
    the misses in the CPU's order and the ones it takes, over calls that move the cache's residency."""
    n_experts, n_slots, warm, calls, share, hysteresis, policy, round_s = case
    py_cache, c_cache = SlotCache(n_experts, n_slots, policy), NativeCache(n_experts, n_slots, policy)
    py_cache.plan(warm)
    c_cache.plan(warm, [1] * len(warm), False)
    B = 1 << 20
    py_model = CostModel(hysteresis=hysteresis, round_s=round_s)  # round_s: rounds priced in the cache's slots
    c_model = ffi.new("hy_cost_model *")
    lib.hy_cost_init(c_model, py_model.alpha, hysteresis, [DEFAULT_PRIOR[k] for k in PRIOR_KEYS])
    c_model.round_s = round_s
    auto = share == "auto"
    table = ffi.NULL if auto else ffi.new("int32_t[]", [n_cpu_for_share(share, n) for n in range(n_experts + 1)])
    miss_e, miss_r, n_miss = ffi.new("int32_t[]", n_experts), ffi.new("int32_t[]", n_experts), ffi.new("int *")
    for i, (experts, rows) in enumerate(calls):
        resident, history = py_cache.resident(), py_cache.reuse_key
        want = (py_model.choose(experts, rows, resident, B, history, n_slots) if auto
                else split_misses(experts, rows, resident, share, history))
        n_cpu = lib.hy_split_misses(c_cache.p, ffi.new("int32_t[]", experts or [0]), ffi.new("int32_t[]", rows or [0]),
                                    len(experts), table, c_model if auto else ffi.NULL, B, miss_e, miss_r, n_miss)
        row_of = dict(zip(experts, rows))
        misses = [(int(miss_r[j]), int(miss_e[j])) for j in range(n_miss[0])]
        # fewest rows first, then the least likely to be reused (fewest requests, then least recent), then lower id
        assert misses == sorted(((row_of[e], e) for e in want.device_misses + want.cpu_misses),
                                key=lambda m: (m[0], *history(m[1]), m[1]))
        assert tuple(sorted(e for _, e in misses[:n_cpu])) == want.cpu_misses
        # the models learn between calls, the same on both sides; the residency moves on
        py_model.observe_load(B, 1e-4 * (i + 1))
        py_model.observe_cpu(B, sum(rows), 3e-5 * (i + 1))
        lib.hy_cost_observe_load(c_model, float(B), 1e-4 * (i + 1))
        lib.hy_cost_observe_cpu(c_model, float(B), float(sum(rows)), 3e-5 * (i + 1))
        py_model.observe_device(len(rows), 2e-4 * (i + 1))
        lib.hy_cost_observe_device(c_model, float(len(rows)), 2e-4 * (i + 1))
        device = sorted(want.device_hits + want.device_misses)
        py_cache.plan(device, [row_of[e] for e in device])
        c_cache.plan(device, [row_of[e] for e in device], False)
        py_cache.note_cpu(want.cpu_misses)
        c_cache.note_cpu(want.cpu_misses)
        assert c_cache.resident(n_experts) == py_cache.resident()


def test_the_row_bucket_is_exact_up_to_32_rows_then_a_power_of_two():
    for n in range(0, 33):
        assert row_bucket(n) == n
    for n, want in ((33, 64), (64, 64), (65, 128), (100, 128), (128, 128), (129, 256), (1000, 1024), (4096, 4096)):
        assert row_bucket(n) == want


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 12), st.integers(0, 40), st.integers(1, 12))
def test_the_rounds_priced_are_the_rounds_the_cache_plans(n_hits, n_loads, n_slots):
    """hy_cost_rounds and device_rounds against the rounds SlotCache.plan makes (hits resident, then the loads)."""
    n_hits = min(n_hits, n_slots)
    cache = SlotCache(max(n_hits + n_loads, n_slots), n_slots)
    cache.plan(list(range(n_hits)))
    plan = cache.plan(list(range(n_hits + n_loads)), checked=False)
    assert lib.hy_cost_rounds(n_hits, n_loads, n_slots) == device_rounds(n_hits, n_loads, n_slots) == len(plan)
