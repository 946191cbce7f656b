"""Lookahead prefetch (moe_prefetch) and trace-driven routing (moe_route_trace).

Oracles: the resident stack (a prefetch never changes a result, bit for bit), the Python executor (the
C one makes the same predictions, prefetches and decisions), numpy float64 (the prediction is each
token's top k of the next layer's router applied to the layer's input), the routing trace itself
(moe_route_trace routes exactly its rows; its oracle prediction is right every time) and the replay
of the recorded predictions (it counts what the live run counted).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid._native import ffi, lib
from ggml_hybrid.errors import OptionError, TraceError
from ggml_hybrid.moe.slot_cache import SlotCache
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.moe.traces import Trace, TraceWriter, read_trace, replay_prefetch
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

PREFETCH = ("predicted", "predicted_right", "predicted_of", "prefetched", "prefetch_used", "prefetch_wasted",
            "bytes_prefetched")
WORK = ("calls", "routed", "distinct", "hits", "misses", "bytes_loaded", "evictions", "rounds", "cpu_misses",
        "cpu_rows", "invalidated") + PREFETCH


def _session(path, executor, items, benchmark=False) -> MoEStackSession:
    return MoEStackSession(path, SessionOptions.parse([*items, f"moe_executor={executor}", "n_threads=1"]),
                           benchmark=benchmark)


# -- the slot cache's prefetch: C against Python --------------------------------------------------


@st.composite
def prefetch_sequences(draw):
    n_experts = draw(st.integers(1, 16))
    n_slots = draw(st.integers(1, n_experts))
    steps = []
    for _ in range(draw(st.integers(1, 30))):
        experts = draw(st.lists(st.integers(0, n_experts - 1), unique=True, max_size=n_experts))
        pred = draw(st.lists(st.integers(0, n_experts - 1), unique=True, max_size=n_experts))
        steps.append((experts, pred))
    return n_experts, n_slots, draw(st.sampled_from(["lru", "lfu", "freq"])), steps


@settings(max_examples=150, deadline=None)
@given(prefetch_sequences())
def test_the_c_prefetch_places_every_expert_as_the_python_one_and_never_evicts_a_kept_one(case):
    n_experts, n_slots, policy, steps = case
    py = SlotCache(n_experts, n_slots, policy)
    code = {"lru": lib.HY_POLICY_LRU, "lfu": lib.HY_POLICY_LFU, "freq": lib.HY_POLICY_FREQ}[policy]
    c = ffi.gc(lib.hy_cache_new(n_experts, n_slots, code), lib.hy_cache_free)
    evicted = ffi.new("int *")
    for experts, pred in steps:
        keep = ffi.new("uint8_t[]", [int(e in pred) for e in range(n_experts)])
        pending = []
        for e in pred:
            occupied = len(py.resident()) + len(pending)
            want = py.prefetch(e, frozenset(pred))
            got = lib.hy_cache_prefetch(c, e, keep, evicted)
            if want is None:
                assert got == -1
                continue
            slot, victim = want
            assert (got, evicted[0]) == (slot, -1 if victim is None else victim)
            assert victim is None or victim not in pred  # never another prediction
            assert victim is None or occupied == n_slots  # empty slots first
            pending.append((e, slot))
        for e, slot in pending:  # the executor commits them when the predicted call starts
            py.commit(slot, e)
            lib.hy_cache_commit(c, slot, e)
        ex = ffi.new("int32_t[]", experts or [0])
        rows = ffi.new("int32_t[]", [1] * max(1, len(experts)))
        p = lib.hy_cache_plan(c, ex, rows, len(experts), True)
        rounds = py.plan(experts, deferred_loads=True)
        assert [(int(p.load_expert[i]), int(p.load_slot[i])) for i in range(p.n_loads)] == \
            [ld for r in rounds for ld in r.loads]
        for r in rounds:
            for e, s in r.loads:
                py.commit(s, e)
                lib.hy_cache_commit(c, s, e)
        assert {e: int(lib.hy_cache_slot_of(c, e)) for e in range(n_experts)
                if lib.hy_cache_slot_of(c, e) >= 0} == py.resident()


# -- the executors: bit-identical to resident, C = Python ------------------------------------------


@st.composite
def cases(draw):
    t = draw(st.sampled_from(["f32", "q8_0", "q4_K"]))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, 20))
    n_used = draw(st.integers(1, min(5, n_expert)))
    return dict(expert_type=t, n_expert=n_expert, n_used=n_used, n_embd=unit,
                slots=draw(st.integers(1, n_expert)), policy=draw(st.sampled_from(["lru", "lfu", "freq"])),
                share=draw(st.sampled_from(["0", "0", "0.5"])), budget=draw(st.integers(0, 6)),
                tokens=draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, 17]), min_size=2, max_size=8)),
                seed=draw(st.integers(0, 999)))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_prefetch_is_bit_identical_to_resident_and_the_executors_agree(tmp_path, case):
    path = write_moe_stack(tmp_path / f"p{case['seed']}.gguf", n_layer=3, n_embd=case["n_embd"], n_ff=case["n_embd"],
                           n_expert=case["n_expert"], n_used=case["n_used"], expert_type=case["expert_type"],
                           seed=case["seed"])
    rng = np.random.default_rng(case["seed"])
    xs = [rng.standard_normal((n, case["n_embd"])).astype(np.float32) for n in case["tokens"]]
    with MoEStackSession(path, SessionOptions.parse(["n_threads=1"])) as resident:
        want = [resident.forward(x) for x in xs]
    items = ["disk_experts=1", f"expert_cache_slots={case['slots']}", f"expert_eviction={case['policy']}",
             f"moe_cpu_share={case['share']}", "moe_prefetch=1"]
    with _session(path, "python", items) as probe:
        expert_bytes = probe.executors[1].expert_bytes
    # a budget of `budget` experts and a half (whole experts only), or 0: the default, n_used experts
    if case["budget"]:
        items.append(f"moe_prefetch_bytes={case['budget'] * expert_bytes + expert_bytes // 2}")
    with _session(path, "python", items) as py, _session(path, "native", items) as nat:
        for x, w in zip(xs, want):
            np.testing.assert_array_equal(py.forward(x), w)
            np.testing.assert_array_equal(nat.forward(x), w)
            for p_ex, n_ex in zip(py.executors, nat.executors):
                assert n_ex.predicted == p_ex.predicted
        for p_ex, n_ex in zip(py.executors, nat.executors):
            pc, nc = p_ex.counters, n_ex.counters
            assert [getattr(nc, k) for k in WORK] == [getattr(pc, k) for k in WORK]
            assert pc.prefetch_used + pc.prefetch_wasted == pc.prefetched  # every prefetch judged by its call
            assert pc.prefetched <= (case["budget"] or case["n_used"]) * pc.calls
            assert pc.bytes_prefetched == pc.prefetched * expert_bytes
        assert py.executors[0].counters.predicted == 0  # the first layer has no layer before it
        decode = sum(1 for n in case["tokens"] if n <= 16)
        assert py.executors[1].counters.predicted_of > 0 or decode == 0


def test_the_prediction_is_each_tokens_top_k_of_the_next_router_in_float64(tmp_path):
    """Independent of both executors: numpy float64 over the region's input that the Python executor received."""
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ff=64, n_expert=12, n_used=3,
                           expert_type="q8_0", seed=5)
    reader = gguf.GGUFReader(path)  # the gguf package, not our store
    (t,) = [t for t in reader.tensors if t.name == "blk.1.ffn_gate_inp.weight"]
    router = np.asarray(t.data, np.float64).reshape(12, 64)
    seen = []
    with _session(path, "python", ["disk_experts=1", "expert_cache_slots=4", "moe_prefetch=1"]) as py, \
            _session(path, "native", ["disk_experts=1", "expert_cache_slots=4", "moe_prefetch=1"]) as nat:
        first = py.executors[0]
        votes = first._votes

        def spy(call):
            seen.append(call.x.numpy().reshape(call.n_tokens, -1).astype(np.float64))
            return votes(call)

        first._votes = spy
        rng = np.random.default_rng(0)
        for n in (1, 2, 5, 1):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            py.forward(x)
            nat.forward(x)
            scores = seen[-1] @ router.T
            top = np.argsort(-scores, axis=1, kind="stable")[:, :3]
            tally = np.bincount(top.ravel(), minlength=12)
            want = tuple(sorted(np.flatnonzero(tally).tolist(), key=lambda e: (-tally[e], e)))
            assert py.executors[1].predicted == nat.executors[1].predicted == want


def test_no_budget_predicts_and_counts_but_loads_nothing(tmp_path):
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_ff=32, n_expert=8, n_used=2,
                           expert_type="q8_0", seed=2)
    with _session(path, "native", ["disk_experts=1", "expert_cache_slots=3", "moe_prefetch=1",
                                   "moe_prefetch_bytes=1"]) as s:
        for n in (1, 1, 1):
            s.forward(np.ones((n, 32), np.float32))
        c = s.executors[2].counters
    assert c.predicted > 0 and c.prefetched == 0 and c.bytes_prefetched == 0 and 0 <= c.recall <= 1


def test_prefetch_options_are_refused_where_they_would_do_nothing(tmp_path):
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=2, n_embd=32, n_ff=32, n_expert=8, n_used=2, seed=1)
    with pytest.raises(OptionError, match="moe_prefetch=True.*disk_experts=true"):
        MoEStackSession(path, SessionOptions.parse(["moe_prefetch=1"]))
    with pytest.raises(OptionError, match="moe_prefetch_bytes=100.*moe_prefetch=true"):
        MoEStackSession(path, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2",
                                                    "moe_prefetch_bytes=100"]))
    with pytest.raises(OptionError, match="moe_prefetch_bytes=-1: must be an integer >= 0"):
        SessionOptions.parse(["moe_prefetch_bytes=-1"])


# -- traces: predictions recorded, and replayed ----------------------------------------------------


def test_the_recorded_predictions_replay_to_the_live_counters(tmp_path):
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=4, n_embd=64, n_ff=64, n_expert=16, n_used=4,
                           expert_type="q8_0", seed=3)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, 64)).astype(np.float32) for n in [1, 1, 3, 1, 20, 1, 2, 1, 1] * 2]
    traces = {}
    for executor in ("native", "python"):
        traces[executor] = tmp_path / f"{executor}.ghtrace"
        with _session(path, executor, ["disk_experts=1", "expert_cache_slots=6", "moe_prefetch=1",
                                       f"trace_path={traces[executor]}"]) as s:
            for x in xs:
                s.forward(x)
            live = s.counters.total
        tr = read_trace(traces[executor])
        assert tr.predictions is not None and len(tr.predictions) == tr.n_calls
        r = replay_prefetch(tr, 6, gh.SessionOptions().expert_eviction, 4)  # the session's default eviction
        assert (r.demand_loads, r.prefetched, r.prefetch_used, r.prefetch_wasted, r.predicted,
                r.predicted_right, r.predicted_of) == (live.misses, live.prefetched, live.prefetch_used,
                                                       live.prefetch_wasted, live.predicted, live.predicted_right,
                                                       live.predicted_of)
        assert r.baseline_loads >= r.belady_loads > 0
        assert r.bytes_moved == r.demand_loads + r.prefetched
    nat, py = read_trace(traces["native"]), read_trace(traces["python"])
    assert [layer for layer, _ in nat.calls] == [layer for layer, _ in py.calls]
    for (_, a), (_, b), pa, pb in zip(nat.calls, py.calls, nat.predictions, py.predictions):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(pa, pb)
    # no prediction for the first layer, nor after a call of more than 16 tokens
    assert all(p.size == 0 for (layer, _), p in zip(nat.calls, nat.predictions) if layer == 0)


def test_trace_predictions_round_trip_and_bad_ones_are_refused(tmp_path):
    ids = np.array([[0, 1]], np.int32)
    t = Trace(2, 4, 2, calls=[(0, ids), (1, ids)], predictions=[np.array([], np.int32), np.array([3, 1])])
    t.write(tmp_path / "t")
    back = read_trace(tmp_path / "t")
    assert [p.tolist() for p in back.predictions] == [[], [3, 1]]
    plain = tmp_path / "plain"
    Trace(2, 4, 2, calls=[(0, ids)]).write(plain)
    assert read_trace(plain).predictions is None
    with pytest.raises(TraceError, match="lists an expert twice"):
        Trace(2, 4, 2, calls=[(0, ids)], predictions=[np.array([1, 1])])
    with pytest.raises(TraceError, match="predicted expert id 4 is out of range"):
        Trace(2, 4, 2, calls=[(0, ids)], predictions=[np.array([4])])
    with pytest.raises(TraceError, match="1 predictions for 2 calls"):
        Trace(2, 4, 2, calls=[(0, ids), (1, ids)], predictions=[np.array([1])])
    with TraceWriter(tmp_path / "w", 2, 4, 2) as w, pytest.raises(TraceError, match="without predictions"):
        w.record(0, ids, [1])
    with pytest.raises(TraceError, match="holds no predictions"):
        replay_prefetch(read_trace(plain), 2)
    data = (tmp_path / "t").read_bytes()
    (tmp_path / "cut").write_bytes(data[:-1])  # the last record's prediction cut short
    with pytest.warns(gh.errors.TraceTruncatedWarning):
        cut = read_trace(tmp_path / "cut")
    assert cut.n_calls == 1 and cut.truncated == 1


# -- moe_route_trace --------------------------------------------------------------------------------


def _route_trace(path, n_layer, n_expert, n_used, tokens, seed=0):
    rng = np.random.default_rng(seed)
    calls = []
    for t in tokens:
        for layer in range(n_layer):
            calls.append((layer, np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(t)])))
    Trace(n_layer, n_expert, n_used, calls=calls).write(path)
    return read_trace(path)


@pytest.mark.parametrize("executor", ["native", "python"])
def test_a_route_trace_replaces_the_routing_row_by_row_and_its_oracle_is_always_right(tmp_path, executor):
    model = write_moe_stack(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_ff=32, n_expert=10, n_used=3, seed=4)
    trace = _route_trace(tmp_path / "route.ghtrace", 2, 10, 3, [4, 1, 1])  # 2 trace layers for 3: layer 2 reads 0
    rows = {layer: np.concatenate([ids for lay, ids in trace.calls if lay == layer]) for layer in (0, 1)}
    out = tmp_path / "out.ghtrace"
    items = ["disk_experts=1", "expert_cache_slots=4", f"moe_route_trace={tmp_path / 'route.ghtrace'}",
             "moe_prefetch=1", f"trace_path={out}"]
    with pytest.raises(OptionError, match="benchmark-only"):
        _session(model, executor, items)
    with _session(model, executor, items, benchmark=True) as s:
        for n in (2, 1, 1, 1, 3):  # 8 tokens: the 6 rows of a trace layer, then again from its first
            s.forward(np.ones((n, 32), np.float32))
        counters = [ex.counters for ex in s.executors]
    got = read_trace(out)
    for layer in range(3):
        ids = np.concatenate([i for lay, i in got.calls if lay == layer])
        np.testing.assert_array_equal(ids, np.concatenate([rows[layer % 2]] * 2)[:8])
    for c in counters[1:]:  # the oracle predicts the trace's own next rows: never wrong, never missed
        assert c.predicted_of > 0 and c.recall == 1.0 and c.precision == 1.0


def test_a_route_trace_must_fit_the_model(tmp_path):
    model = write_moe_stack(tmp_path / "m.gguf", n_layer=2, n_embd=32, n_ff=32, n_expert=10, n_used=3, seed=4)
    _route_trace(tmp_path / "r.ghtrace", 2, 8, 2, [1])
    with pytest.raises(OptionError, match="routes 2 of 8 experts per token, the model 3 of 10"):
        _session(model, "native", ["disk_experts=1", "expert_cache_slots=4",
                                    f"moe_route_trace={tmp_path / 'r.ghtrace'}"], benchmark=True)
    with pytest.raises(OptionError, match="moe_route_trace=.*disk_experts=true"):
        _session(model, "native", [f"moe_route_trace={tmp_path / 'r.ghtrace'}"], benchmark=True)


def test_a_model_takes_a_route_trace_only_in_a_benchmark_which_says_so(tmp_path):
    from ggml_hybrid.cli.abbench import ab_bench, format_table
    from ggml_hybrid.runtime.moe_model import MoEModel
    from ggml_hybrid.synthetic import ModelSpec, write_model

    model = write_model(tmp_path / "m.gguf", ModelSpec(n_layer=2, n_expert=8, n_used=2, seed=1))
    _route_trace(tmp_path / "r.ghtrace", 2, 8, 2, [3, 1])
    items = ["disk_experts=1", "expert_cache_slots=2", "n_threads=1"]
    routed = SessionOptions.parse([*items, f"moe_route_trace={tmp_path / 'r.ghtrace'}", "moe_prefetch=1"])
    with pytest.raises(OptionError, match="benchmark-only"):
        MoEModel(model, routed)
    r = ab_bench(model, SessionOptions.parse(items), routed, runs=1, n_predict=2)
    assert r["route_trace"] == {"B": str(tmp_path / "r.ghtrace")}
    assert "side B: routing from the trace" in format_table(r) and "not the model's own" in format_table(r)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_input_predicts_the_same_in_both_executors_and_changes_nothing(tmp_path, bad):
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_ff=32, n_expert=8, n_used=2, seed=6)
    x = np.ones((2, 32), np.float32)
    x[1, 3] = bad
    items = ["disk_experts=1", "expert_cache_slots=3", "moe_prefetch=1"]
    with MoEStackSession(path, SessionOptions.parse(["n_threads=1"])) as resident, \
            _session(path, "python", items) as py, _session(path, "native", items) as nat:
        for _ in range(3):
            want = resident.forward(x)
            np.testing.assert_array_equal(py.forward(x), want)
            np.testing.assert_array_equal(nat.forward(x), want)
            assert [e.predicted for e in nat.executors] == [e.predicted for e in py.executors]
