"""MoE layers from GGUF in every mode: the device expert cache is bit-identical to resident experts."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid.gguf.store import GGUFStore, ModelFileError
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

TYPES = ["f32", "f16", "q8_0", "q4_K", "q6_K"]


def _x(n_tokens, n_embd, seed):
    return np.random.default_rng(seed).standard_normal((n_tokens, n_embd)).astype(np.float32)


def _run(path, x, items=()):
    with MoEStackSession(path, SessionOptions.parse(list(items))) as s:
        return s.forward(x), s.counters


@st.composite
def layer_cases(draw):
    t = draw(st.sampled_from(TYPES))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, 64))
    return dict(
        expert_type=t, n_expert=n_expert, n_used=draw(st.integers(1, min(8, n_expert))),
        n_embd=unit * draw(st.integers(1, 2)), n_ff=unit * draw(st.integers(1, 2)),
        n_tokens=draw(st.integers(1, 64)), slots=draw(st.integers(1, n_expert)),
        policy=draw(st.sampled_from(["freq", "lru", "lfu"])), fused=draw(st.booleans()), seed=draw(st.integers(0, 999)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=layer_cases())
def test_cache_path_is_bit_identical_to_resident(tmp_path, case):
    path = write_moe_stack(tmp_path / f"m{case['seed']}.gguf", n_layer=2, n_embd=case["n_embd"], n_ff=case["n_ff"],
                           n_expert=case["n_expert"], n_used=case["n_used"], expert_type=case["expert_type"],
                           fused=case["fused"], seed=case["seed"])
    x = _x(case["n_tokens"], case["n_embd"], case["seed"])
    ref, _ = _run(path, x)
    got, counters = _run(path, x, ["disk_experts=1", f"expert_cache_slots={case['slots']}",
                                   f"expert_eviction={case['policy']}"])
    np.testing.assert_array_equal(got, ref)
    total = counters.total
    assert total.calls == 2 and total.routed == 2 * case["n_tokens"] * case["n_used"]
    assert total.hits + total.misses == total.distinct
    # a call never needs more rounds than its distinct experts divided by the slots, rounded up
    for layer in counters.layers:
        assert layer.rounds <= -(-layer.distinct // case["slots"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_moe_stack(tmp_path_factory.mktemp("moe") / "stack.gguf", n_layer=3, n_embd=256, n_ff=256,
                           n_expert=16, n_used=4, expert_type="q4_K", seed=7)


@pytest.mark.parametrize("items", [["cpu_moe=1"], ["n_cpu_moe=2"], ["disk_experts=1", "expert_cache_slots=16"],
                                   ["disk_experts=1", "expert_cache_slots=4", "expert_eviction=lfu"]])
def test_every_mode_gives_the_resident_output(model, items):
    x = _x(7, 256, 1)
    ref, _ = _run(model, x)
    got, counters = _run(model, x, items)
    np.testing.assert_array_equal(got, ref)
    assert (counters.total.calls > 0) == ("disk_experts=1" in items)


def test_counters_follow_the_cache(model):
    x = _x(1, 256, 2)
    with MoEStackSession(model, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=16"])) as s:
        s.forward(x)
        first = s.counters.total.to_dict()
        s.forward(x)  # the same token again: every expert is resident now
        second = s.counters.total.to_dict()
        js = s.counters.to_json()
    assert first["misses"] == first["distinct"] == 3 * 4 and first["hits"] == 0
    assert second["hits"] - first["hits"] == 12 and second["misses"] == first["misses"]
    assert second["bytes_loaded"] == first["bytes_loaded"] > 0
    assert '"layers"' in js and len(s.counters.layers) == 3


def test_sessions_are_isolated(model):
    xs = [_x(n, 256, 10 + n) for n in (1, 3, 1, 5)]
    a_opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2"])
    b_opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=9", "expert_eviction=lfu"])

    def alone(opts):
        with MoEStackSession(model, opts) as s:
            return [s.forward(x) for x in xs], s.counters.to_dict()

    ref_a, ref_b = alone(a_opts), alone(b_opts)
    with MoEStackSession(model, a_opts) as a, MoEStackSession(model, b_opts) as b:
        outs_a, outs_b = [], []
        for x in xs:  # used alternately
            outs_a.append(a.forward(x))
            outs_b.append(b.forward(x))
        for got, ref in ((outs_a, ref_a[0]), (outs_b, ref_b[0])):
            for g, r in zip(got, ref):
                np.testing.assert_array_equal(g, r)
        assert _no_time(a.counters.to_dict()) == _no_time(ref_a[1])
        assert _no_time(b.counters.to_dict()) == _no_time(ref_b[1])

    results = {}

    def worker(name, opts):
        results[name] = alone(opts)

    threads = [threading.Thread(target=worker, args=(n, o)) for n, o in (("a", a_opts), ("b", b_opts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, ref in (("a", ref_a), ("b", ref_b)):
        for g, r in zip(results[name][0], ref[0]):
            np.testing.assert_array_equal(g, r)
        assert _no_time(results[name][1]) == _no_time(ref[1])


def _no_time(d):
    strip = lambda c: {k: v for k, v in c.items() if not k.endswith("_ns")}
    return {"total": strip(d["total"]), "layers": [strip(c) for c in d["layers"]]}


def test_invalid_session_options_fail_before_loading(model):
    for items, match in ((["disk_experts=1"], "needs expert cache"), (["expert_cache_slots=17"], "only 16 experts"),
                         (["n_cpu_moe=4"], "only 3 layers"), (["moe_cpu_share=0.5"], "needs disk_experts")):
        with pytest.raises(OptionError, match=match):
            MoEStackSession(model, SessionOptions.parse(items))


def test_a_refused_session_closes_what_it_opened(model, monkeypatch):
    opened, closed = [], []
    real_init, real_close = GGUFStore.__init__, GGUFStore.close
    monkeypatch.setattr(GGUFStore, "__init__", lambda self, *a, **k: (opened.append(self), real_init(self, *a, **k))[1])
    monkeypatch.setattr(GGUFStore, "close", lambda self: (closed.append(self), real_close(self))[1])
    for items in (["expert_cache_slots=17"], ["n_cpu_moe=4"], ["moe_cpu_share=0.5"]):
        with pytest.raises(OptionError):
            MoEStackSession(model, SessionOptions.parse(items))
    assert len(opened) == 3 and all(s in closed for s in opened)


def test_bad_model_files_are_clear_errors(tmp_path, model):
    with pytest.raises(ModelFileError, match="does not exist"):
        MoEStackSession(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        MoEStackSession(junk)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(Path(model).read_bytes()[:-4096])
    with pytest.raises(ModelFileError):
        MoEStackSession(truncated)


def test_forward_rejects_bad_input(model):
    with MoEStackSession(model) as s:
        with pytest.raises(gh.errors.ShapeError, match="float32"):
            s.forward(np.zeros((2, 128), np.float32))
        with pytest.raises(gh.errors.ShapeError):
            s.forward(np.zeros((2, 256), np.float64))


@pytest.fixture(scope="module")
def small_model_bytes(tmp_path_factory):
    path = write_moe_stack(tmp_path_factory.mktemp("fuzz") / "s.gguf", n_layer=2, n_embd=32, n_ff=32, n_expert=4,
                           n_used=2, expert_type="q8_0", seed=1)
    return Path(path).read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_gguf_is_a_clear_error_or_still_runs(tmp_path, small_model_bytes, data):
    """Mutated headers, counts, offsets and sizes, or a cut file: a ModelFileError/OptionError, never a crash."""
    raw = bytearray(small_model_bytes)
    kind = data.draw(st.sampled_from(["flip", "cut", "int"]))
    if kind == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            pos = data.draw(st.integers(0, min(len(raw), 2048) - 1))  # the header and metadata region
            raw[pos] = data.draw(st.integers(0, 255))
    else:  # overwrite one little-endian 8-byte field with an extreme value
        pos = data.draw(st.integers(0, min(len(raw), 2048) - 8))
        raw[pos:pos + 8] = data.draw(st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**64 - 1])).to_bytes(8, "little")
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(raw))
    try:
        with MoEStackSession(path, SessionOptions.parse(["n_threads=1"])) as s:
            s.forward(_x(2, s.n_embd, 0))
    except (ModelFileError, OptionError):
        pass
