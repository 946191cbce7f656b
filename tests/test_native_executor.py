"""The native executor against the Python one, call by call.

The Python executor (``moe/executor.py``) is the reference: on the same routing, the C executor must make
the same decisions (hits, loads, evictions by round, the experts the CPU computes), count the same work and
give bit-identical outputs. ``auto`` learns from timings, so both observe a synthetic clock (durations
computed from the work) and start from the same priors: their cost models then agree to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid.moe.cpu_share import COEFFICIENTS
from ggml_hybrid.moe.executor import SyntheticClock
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

# per byte loaded, per device row, per CPU byte, per CPU row, per job: a CPU that reads fast but computes slowly,
# so the choice depends on the rows of each expert
CLOCK = SyntheticClock(load_per_byte=1e-9, device_per_row=1e-7, cpu_per_byte=5e-10, cpu_per_row=2e-6,
                       cpu_per_job=3e-6)

WORK = ("calls", "routed", "distinct", "hits", "misses", "bytes_loaded", "evictions", "rounds", "cpu_misses",
        "cpu_rows", "share_calls", "invalidated")


def _session(path, executor: str, items) -> MoEStackSession:
    return MoEStackSession(path, SessionOptions.parse([*items, f"moe_executor={executor}"]))


class Recorder:
    """Wraps a Python executor's cache and CPU split to keep each call's decision (the native one reports its own)."""

    def __init__(self, ex) -> None:
        self.rounds: list = []
        self.cpu: tuple[int, ...] = ()
        plan, split = ex.cache.plan, ex._cpu_split

        def recording_plan(*args, **kwargs):
            self.rounds = plan(*args, **kwargs)
            return self.rounds

        def recording_split(*args):
            s = split(*args)
            self.cpu = tuple(sorted(s.cpu_misses)) if s is not None else ()
            return s

        ex.cache.plan, ex._cpu_split = recording_plan, recording_split

    def decision(self) -> dict:
        return {"rounds": [(tuple(r.hits), tuple(r.loads), tuple(r.evicted)) for r in self.rounds],
                "cpu": self.cpu}


@st.composite
def cases(draw):
    t = draw(st.sampled_from(["f32", "q8_0", "q4_K"]))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, 24))
    return dict(expert_type=t, n_expert=n_expert, n_used=draw(st.integers(1, min(6, n_expert))), n_embd=unit,
                slots=draw(st.integers(1, n_expert)), policy=draw(st.sampled_from(["freq", "lru", "lfu"])),
                share=draw(st.sampled_from(["0", "0.25", "0.5", "0.75", "1", "auto"])),
                tokens=draw(st.lists(st.integers(1, 20), min_size=2, max_size=7)), seed=draw(st.integers(0, 999)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
# a second round whose compacted rows, padded to a power of two, outnumber the call's rows (a heap overflow once)
@example(case=dict(expert_type="q8_0", n_expert=10, n_used=6, n_embd=32, slots=9, policy="lfu", share="0.25",
                   tokens=[1, 12, 16, 9, 15], seed=12))
def test_native_decisions_counters_and_outputs_equal_the_python_executor(tmp_path, case):
    path = write_moe_stack(tmp_path / f"n{case['seed']}.gguf", n_layer=2, n_embd=case["n_embd"],
                           n_ff=case["n_embd"], n_expert=case["n_expert"], n_used=case["n_used"],
                           expert_type=case["expert_type"], seed=case["seed"])
    items = ["disk_experts=1", f"expert_cache_slots={case['slots']}", f"expert_eviction={case['policy']}",
             f"moe_cpu_share={case['share']}", "n_threads=1"]
    rng = np.random.default_rng(case["seed"])
    xs = [rng.standard_normal((n, case["n_embd"])).astype(np.float32) for n in case["tokens"]]
    with _session(path, "python", items) as py, _session(path, "native", items) as nat:
        assert all(ex.native for ex in nat.executors) and not any(getattr(ex, "native", False)
                                                                   for ex in py.executors)
        for p_ex, n_ex in zip(py.executors, nat.executors):
            p_ex.clock = CLOCK
            n_ex.use_clock(CLOCK)
        recorders = [Recorder(ex) for ex in py.executors]
        for x in xs:
            np.testing.assert_array_equal(nat.forward(x), py.forward(x))
            for layer, (rec, n_ex) in enumerate(zip(recorders, nat.executors)):
                assert n_ex.last_decision() == rec.decision(), f"layer {layer}, {len(x)} tokens"
        for p_ex, n_ex in zip(py.executors, nat.executors):
            assert [getattr(n_ex.counters, k) for k in WORK] == [getattr(p_ex.counters, k) for k in WORK]
            assert n_ex.counters.share_sum == pytest.approx(p_ex.counters.share_sum, rel=1e-12)
            if case["share"] == "auto":  # the learnt coefficients agree to the bit
                want = p_ex.cost.estimate(p_ex.expert_bytes)
                assert _native_estimate(n_ex) == [want[k] for k in COEFFICIENTS]


def _native_estimate(ex) -> list[float]:
    from ggml_hybrid._native import ffi, lib

    out = ffi.new("double[5]")
    lib.hy_cost_estimate(lib.hy_moe_exec_cost_model(ex._exec.ptr), ex.expert_bytes, out)
    return [float(out[i]) for i in range(len(COEFFICIENTS))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_moe_stack(tmp_path_factory.mktemp("nat") / "m.gguf", n_layer=3, n_embd=256, n_ff=256,
                           n_expert=16, n_used=4, expert_type="q4_K", seed=11)


@pytest.mark.parametrize("share", ["0", "0.5", "1", "auto"])
def test_steady_native_decode_builds_no_graph_and_no_buffer(model, share):
    """A decode step has few shapes: the full graph and the compacted graphs of 1..n_used rows on the device,
    1..n_used rows per layer on the worker. Each is built once and kept, the scratch buffer stops growing:
    once warm, a fixed share builds nothing; ``auto`` may still meet a row count for the first time, but
    never builds past those shapes however long it runs."""
    rng = np.random.default_rng(0)
    n_used, n_layer = 4, 3
    with _session(model, "native", ["disk_experts=1", "expert_cache_slots=3", f"moe_cpu_share={share}",
                                    "n_threads=1"]) as s:
        def step():
            s.forward(rng.standard_normal((1, 256)).astype(np.float32))
            assert all(ex.graph_builds <= 1 + n_used for ex in s.executors)
            assert s.worker is None or s.worker.allocations <= n_layer * n_used

        for _ in range(40):
            step()
        builds = [ex.graph_builds for ex in s.executors]
        scratch = s.executors[0].scratch.size
        worker = s.worker.allocations if s.worker is not None else 0
        for _ in range(60):
            step()
        assert s.executors[0].scratch.size == scratch
        if share != "auto":
            assert [ex.graph_builds for ex in s.executors] == builds
            assert (s.worker.allocations if s.worker is not None else 0) == worker
        assert s.counters.total.misses + s.counters.total.cpu_misses > 0  # the steady state really loads


def test_native_trace_records_equal_the_routing(model, tmp_path):
    """The C executor's trace holds each call's ids in the order the layers ran."""
    from ggml_hybrid.moe.traces import read_trace

    rng = np.random.default_rng(1)
    paths = {e: tmp_path / f"{e}.trace" for e in ("native", "python")}
    for executor, path in paths.items():
        with _session(model, executor, ["disk_experts=1", "expert_cache_slots=4", f"trace_path={path}",
                                        "n_threads=1"]) as s:
            for n in (1, 5, 2):
                s.forward(np.random.default_rng(n).standard_normal((n, 256)).astype(np.float32))
    del rng
    nat, py = read_trace(paths["native"]), read_trace(paths["python"])
    assert [layer for layer, _ in nat.calls] == [layer for layer, _ in py.calls] == [0, 1, 2] * 3
    for (_, a), (_, b) in zip(nat.calls, py.calls):
        np.testing.assert_array_equal(a, b)


def test_a_synthetic_clock_takes_exactly_the_cost_models_coefficients():
    with pytest.raises(gh.errors.CpuShareError, match="cpu_per_job"):
        SyntheticClock(load_per_byte=1e-9, device_per_row=1e-7, cpu_per_byte=5e-10, cpu_per_row=2e-6)
    with pytest.raises(gh.errors.CpuShareError, match="load_per_byte"):
        SyntheticClock(**{**CLOCK.coefficients, "load_per_byte": -1.0})
    assert CLOCK.seconds("cpu", 10, 3) == 5e-10 * 10 + 2e-6 * 3
    assert CLOCK.seconds("load", 7, 0) == 1e-9 * 7 and CLOCK.seconds("job", 0, 0) == 3e-6
