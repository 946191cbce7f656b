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
from ggml_hybrid.moe.layer_cache import SyntheticClock
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


def _case(draw, max_expert: int, max_used: int, shares: list[str], max_tokens: int, max_calls: int) -> dict:
    """A stack and its calls: the experts' type, count, use per token, the cache's slots and policy, the CPU share,
    the token count of each call."""
    t = draw(st.sampled_from(["f32", "q8_0", "q4_K"]))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, max_expert))
    return dict(expert_type=t, n_expert=n_expert, n_used=draw(st.integers(1, min(max_used, n_expert))), n_embd=unit,
                slots=draw(st.integers(1, n_expert)), policy=draw(st.sampled_from(["freq", "lru", "lfu"])),
                share=draw(st.sampled_from(shares)),
                tokens=draw(st.lists(st.integers(1, max_tokens), min_size=2, max_size=max_calls)),
                seed=draw(st.integers(0, 999)))


@st.composite
def cases(draw):
    return _case(draw, 24, 6, ["0", "0.25", "0.5", "0.75", "1", "auto"], 20, 7)


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
        for x in xs:
            np.testing.assert_array_equal(nat.forward(x), py.forward(x))
            for layer, (p_ex, n_ex) in enumerate(zip(py.executors, nat.executors)):
                assert n_ex.last_decision() == p_ex.last_decision(), f"layer {layer}, {len(x)} tokens"
        for p_ex, n_ex in zip(py.executors, nat.executors):
            assert [getattr(n_ex.counters, k) for k in WORK] == [getattr(p_ex.counters, k) for k in WORK]
            assert n_ex.counters.share_sum == pytest.approx(p_ex.counters.share_sum, rel=1e-12)
            if case["share"] == "auto":  # the learnt coefficients agree to the bit
                want = p_ex.cost.estimate(p_ex.expert_bytes)
                assert _native_estimate(n_ex) == [want[k] for k in COEFFICIENTS]


# the tier's counts that do not depend on timing (without read-ahead every read of a call is waited for by its end)
TIER_WORK = ("hits", "misses", "bytes_read", "evictions", "faults", "bytes_held")


def _repacked(path) -> bool:
    from ggml_hybrid.ggml.repack import repack_buffer_type
    from ggml_hybrid.gguf.store import GGUFStore

    store = GGUFStore(path)
    try:
        info = store.info("blk.0.ffn_down_exps.weight")
        return repack_buffer_type(info.dtype, info.shape, "mul_mat_id") is not None
    finally:
        store.close()


def _layer_need(path) -> int:
    from ggml_hybrid.gguf.store import GGUFStore
    from ggml_hybrid.moe.host_tier import entry_bytes

    store = GGUFStore(path)
    try:
        infos = [store.info(f"blk.0.ffn_{k}_exps.weight") for k in ("gate", "up", "down")]
        return entry_bytes([i.nbytes // i.shape[0] for i in infos]) * infos[0].shape[0]
    finally:
        store.close()


@st.composite
def tier_cases(draw):
    return {**_case(draw, 16, 4, ["0", "0", "0.5", "1", "auto"], 12, 6), "repack": draw(st.booleans()),
            "budget_layers": draw(st.sampled_from([1.0, 1.5, 3.0])), "prefetch": draw(st.booleans())}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tier_cases())
def test_with_the_host_tier_the_native_executor_is_the_python_one_and_resident(tmp_path, case):
    """The host tier's steps against their Python reference (moe_executor=python runs the same steps, read from
    moe_call.c: STEPS, over the same tier) and both against the resident graph, the oracle: every mode (a CPU
    playing the device straight from the tier's frames; slots fed from the tier, with the CPU worker's rows from
    the frames), every output bit for bit. Without the lookahead (whose slot loads take only what the tier holds by
    then: timing) the decisions, the layer's counters and the tier's are the same call by call."""
    path = write_moe_stack(tmp_path / f"t{case['seed']}.gguf", n_layer=3, n_embd=case["n_embd"],
                           n_ff=case["n_embd"], n_expert=case["n_expert"], n_used=case["n_used"],
                           expert_type=case["expert_type"], seed=case["seed"])
    # the worker computes plain rows from the tier's frames: resident's where its experts are not repacked
    repack = case["repack"] and not (case["share"] != "0" and _repacked(path))
    rng = np.random.default_rng(case["seed"])
    xs = [rng.standard_normal((n, case["n_embd"])).astype(np.float32) for n in case["tokens"]]
    with MoEStackSession(path, SessionOptions(repack=repack, n_threads=1)) as s:
        refs = [s.forward(x) for x in xs]
    items = ["disk_experts=1", f"expert_cache_slots={case['slots']}", f"expert_eviction={case['policy']}",
             f"moe_cpu_share={case['share']}", "n_threads=1", f"repack={int(repack)}",
             f"host_tier_bytes={int(_layer_need(path) * case['budget_layers'])}"]
    if case["prefetch"]:
        items.append("moe_prefetch=1")
    with _session(path, "python", items) as py, _session(path, "native", items) as nat:
        modes = {ex.mode for ex in py.executors + nat.executors}
        assert modes == {"direct" if case["share"] == "0" and not (repack and _repacked(path)) else "tier"}
        assert [ex.native for ex in py.executors + nat.executors] == [False] * 3 + [True] * 3
        for p_ex, n_ex in zip(py.executors, nat.executors):
            p_ex.clock = CLOCK
            n_ex.use_clock(CLOCK)
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(py.forward(x), ref)
            np.testing.assert_array_equal(nat.forward(x), ref)
            if not case["prefetch"]:
                for layer, (p_ex, n_ex) in enumerate(zip(py.executors, nat.executors)):
                    assert n_ex.last_decision() == p_ex.last_decision(), f"layer {layer}, {len(x)} tokens"
        if case["prefetch"]:
            return
        for p_ex, n_ex in zip(py.executors, nat.executors):
            assert [getattr(n_ex.counters, k) for k in WORK] == [getattr(p_ex.counters, k) for k in WORK]
        p_tier, n_tier = py.layers.tier.counters, nat.layers.tier.counters
        assert [getattr(n_tier, k) for k in TIER_WORK] == [getattr(p_tier, k) for k in TIER_WORK]


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


def test_the_steps_are_one_list_named_alike_in_c_python_and_the_docs():
    """The steps of a call and their order, per mode, are written once (moe_call.c: STEPS, read through cffi); each
    is a method of the Python executor and a function of the C one of the same name, in the file docs/moe.md's
    table names, and that table describes every step of the list and no other."""
    import re
    from pathlib import Path

    from ggml_hybrid.moe.executor import ExpertCacheExecutor
    from ggml_hybrid.moe.layer_cache import MODES, STEPS

    root = Path(__file__).resolve().parents[1]
    assert set(STEPS) == set(MODES) == {"slots", "tier", "direct"}
    steps = {s for order in STEPS.values() for s in order}
    assert {"read_ids", "plan", "run_rounds", "weighted_sum", "fetch_direct", "count_call"} <= steps
    for order in STEPS.values():  # every mode starts with the routing and ends with the counters
        assert order[:3] == ("read_ids", "count_rows", "settle_prefetch") and order[-1] == "count_call"
    table = dict(re.findall(r"^\| `(\w+)` \| [^\n]* \| `(moe_\w+\.c)` \|$", (root / "docs/moe.md").read_text(), re.M))
    assert set(table) == steps
    src = root / "ggml_hybrid/_native/src"
    for step, file in table.items():
        assert callable(getattr(ExpertCacheExecutor, "_" + step, None)), step
        assert re.search(rf"^(static )?int {step}\(hy_moe_exec \* ex, hy_call \* call\) \{{",
                         (src / file).read_text(), re.M), (step, file)


@pytest.mark.parametrize("executor", ["native", "python"])
def test_both_executors_are_one_interface(model, executor):
    """Both executors take one LayerCacheConfig and satisfy one interface (LayerExecutor), which the session uses and
    nothing else: its counters, decisions, lookahead and memory."""
    from ggml_hybrid.moe.layer_cache import LayerCacheConfig, LayerCounters, LayerExecutor

    with _session(model, executor, ["disk_experts=1", "expert_cache_slots=3", "n_threads=1"]) as s:
        s.forward(np.ones((2, 256), np.float32))
        for ex in s.executors:
            assert isinstance(ex, LayerExecutor) and isinstance(ex.config, LayerCacheConfig)
            assert ex.native == (executor == "native") and ex.mode == ex.config.mode == "slots"
            assert isinstance(ex.counters, LayerCounters) and ex.counters.calls == 1
            assert set(ex.last_decision()) == {"rounds", "cpu"} and ex.slot_bytes > 0 and ex.compute_bytes >= 0
