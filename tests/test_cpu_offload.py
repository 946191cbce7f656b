"""CPU offload: a share of cache misses on the persistent CPU worker, bit-identical to the default path."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ggml_hybrid as gh
from ggml_hybrid.moe.cpu_worker import CPUWorker
from ggml_hybrid.moe.ffn import ExpertWeights
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.synthetic import write_moe_stack


def _x(n_tokens, n_embd, seed):
    return np.random.default_rng(seed).standard_normal((n_tokens, n_embd)).astype(np.float32)


def _session(path, items):
    return MoEStackSession(path, SessionOptions.parse(list(items)))


@st.composite
def cases(draw):
    t = draw(st.sampled_from(["f32", "q8_0", "q4_K", "q6_K"]))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, 32))
    return dict(expert_type=t, n_expert=n_expert, n_used=draw(st.integers(1, min(6, n_expert))), n_embd=unit,
                n_ff=unit, n_tokens=draw(st.integers(1, 24)), slots=draw(st.integers(1, n_expert)),
                share=draw(st.sampled_from(["0", "0.25", "0.5", "0.75", "1", "auto"])),
                threads=draw(st.sampled_from([1, 2])), seed=draw(st.integers(0, 999)))


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_cpu_offload_output_is_bit_identical(tmp_path, case):
    path = write_moe_stack(tmp_path / f"h{case['seed']}.gguf", n_layer=2, n_embd=case["n_embd"], n_ff=case["n_ff"],
                           n_expert=case["n_expert"], n_used=case["n_used"], expert_type=case["expert_type"],
                           seed=case["seed"])
    xs = [_x(case["n_tokens"], case["n_embd"], case["seed"] + i) for i in range(3)]
    with _session(path, [f"n_threads={case['threads']}"]) as s:
        refs = [s.forward(x) for x in xs]
    with _session(path, ["disk_experts=1", f"expert_cache_slots={case['slots']}", f"moe_cpu_share={case['share']}",
                         f"n_threads={case['threads']}"]) as s:
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        total = s.counters.total
    assert total.hits + total.misses + total.cpu_misses == total.distinct
    if case["share"] == "0":
        assert total.cpu_misses == 0
    if case["share"] == "1":
        assert total.misses == 0  # every miss went to the CPU, nothing was loaded


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_moe_stack(tmp_path_factory.mktemp("hyb") / "m.gguf", n_layer=3, n_embd=256, n_ff=256,
                           n_expert=16, n_used=4, expert_type="q4_K", seed=3)


def test_counters_show_cpu_work_only_with_a_share(model):
    x = _x(6, 256, 0)
    with _session(model, ["disk_experts=1", "expert_cache_slots=4"]) as s:
        s.forward(x)
        zero = s.counters.total
    with _session(model, ["disk_experts=1", "expert_cache_slots=4", "moe_cpu_share=0.5"]) as s:
        s.forward(x)
        half = s.counters.total
    assert zero.cpu_misses == zero.cpu_rows == 0 and zero.share_applied == 0.0
    assert half.cpu_misses > 0 and half.cpu_rows >= half.cpu_misses and half.cpu_ns > 0
    assert 0.3 <= half.share_applied <= 0.7
    assert half.misses < zero.misses  # CPU misses are not loaded into the cache


def test_steady_decode_allocates_nothing_in_the_worker(model):
    with _session(model, ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=1"]) as s:
        for i in range(6):
            s.forward(_x(1, 256, i))  # warm-up: every row bucket of every layer
        warm = s.worker.allocations
        assert warm > 0
        for i in range(20):
            s.forward(_x(1, 256, 100 + i))
        assert s.worker.allocations == warm


def _fail_next_job(worker, exc):
    """A test double: the worker's next job raises ``exc``, later jobs run as usual."""
    real = worker._compute

    def compute(*args):
        worker._compute = real
        raise exc

    worker._compute = compute


@pytest.mark.parametrize("executor", ["native", "python"])
def test_worker_fault_surfaces_and_session_stays_usable(model, executor):
    x = _x(3, 256, 5)
    with _session(model, []) as ref_s:
        ref = ref_s.forward(x)
    with _session(model, ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=1",
                          f"moe_executor={executor}"]) as s:
        if executor == "native":
            s.worker.fail_next_job()
            expected = (gh.errors.ComputeError, "injected CPU worker failure")
        else:
            _fail_next_job(s.worker, RuntimeError("injected worker fault"))
            expected = (RuntimeError, "injected worker fault")
        with pytest.raises(expected[0], match=expected[1]):
            s.forward(x)
        np.testing.assert_array_equal(s.forward(x), ref)  # the next call is correct
    assert s.worker.closed if executor == "native" else not s.worker.running


def test_share_needs_disk_experts(model):
    with pytest.raises(OptionError, match="needs disk_experts"):
        _session(model, ["moe_cpu_share=0.5"])


def _worker_threads():
    return [t for t in threading.enumerate() if t.name == "ggml-hybrid-cpu-worker"]


class WorkerLifecycle(RuleBasedStateMachine):
    """start on first use, compute, fail, close, close again, use after close."""

    def __init__(self):
        super().__init__()
        self.before = len(_worker_threads())
        self.w = CPUWorker(1)
        self.ctx = gh.Context(n_tensors=8)
        self.experts = ExpertWeights(**{k: self.ctx.new_tensor("f32", (4, 32, 32), k)
                                               for k in ("gate", "up", "down")})
        self.backend = gh.cpu(1)
        self.ctx.allocate(self.backend)
        rng = np.random.default_rng(0)
        for t in (self.experts.gate, self.experts.up, self.experts.down):
            t.set(rng.standard_normal(t.shape).astype(np.float32))
        self.closed = False

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 9))
    def compute(self, n):
        x = np.ones((n, 32), np.float32)
        rows, t0, t1 = self.w.submit(0, self.experts, x, np.arange(n, dtype=np.int32) % 4).result(timeout=30)
        assert rows.shape == (n, 32) and np.isfinite(rows).all() and t1 >= t0
        assert self.w.running

    @precondition(lambda self: not self.closed)
    @rule()
    def fail(self):
        _fail_next_job(self.w, ValueError("boom"))
        with pytest.raises(ValueError, match="boom"):
            self.w.submit(0, self.experts, np.ones((1, 32), np.float32), np.zeros(1, np.int32)).result(timeout=30)

    @rule()
    def close(self):
        self.w.close()
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule()
    def use_after_close(self):
        with pytest.raises(gh.errors.ClosedError):
            self.w.submit(0, self.experts, np.ones((1, 32), np.float32), np.zeros(1, np.int32))

    @invariant()
    def no_thread_after_close(self):
        if self.closed:
            assert not self.w.running and len(_worker_threads()) == self.before

    def teardown(self):
        self.w.close()
        self.ctx.close()
        self.backend.close()


WorkerLifecycle.TestCase.settings = settings(max_examples=15, stateful_step_count=8, deadline=None)
TestWorkerLifecycle = WorkerLifecycle.TestCase


def test_session_records_a_routing_trace(model, tmp_path):
    from ggml_hybrid.moe.traces import read_trace, replay

    path = tmp_path / "run.trace"
    xs = [_x(n, 256, 20 + n) for n in (1, 4, 1)]
    with _session(model, ["disk_experts=1", "expert_cache_slots=4", f"trace_path={path}"]) as s:
        for x in xs:
            s.forward(x)
        live = s.counters.total
    trace = read_trace(path)
    assert (trace.n_layer, trace.n_expert, trace.n_used) == (3, 16, 4)
    assert [layer for layer, _ in trace.calls] == [0, 1, 2] * 3
    assert [ids.shape for _, ids in trace.calls] == [(n, 4) for n in (1, 4, 1) for _ in range(3)]
    # replaying the trace through the same cache policy (the default eviction) reproduces the live counters
    result = replay(trace, 4, SessionOptions().expert_eviction)
    assert (result.hits, result.misses) == (live.hits, live.misses)


@pytest.mark.parametrize("executor", ["native", "python"])
@pytest.mark.parametrize("share", ["0", "0.29", "0.5", "1", "auto"])
def test_replayed_counters_equal_live_counters(model, tmp_path, share, executor):
    """The replay calls the runtime's CPU-share rule, so a trace replays to the live counters, layer by layer.

    ``auto`` learns from timings at run time, which no replay can repeat; here every layer's cost model
    is fixed to the replay's costs (``CostModel.fixed``), so both make the same choices.
    """
    from ggml_hybrid.moe.cpu_share import CostModel
    from ggml_hybrid.moe.traces import LinkCost, read_trace, replay

    path = tmp_path / "run.trace"
    slots = 5
    with _session(model, ["disk_experts=1", f"expert_cache_slots={slots}", f"moe_cpu_share={share}",
                          f"trace_path={path}", "n_threads=1", f"moe_executor={executor}"]) as s:
        bytes_per_expert = s.executors[0].expert_bytes
        # the CPU reads weights at twice the bus speed but computes rows 100x slower: few-row misses go to the CPU
        cost = LinkCost(bus_bytes_per_s=1e9, cpu_bytes_per_s=2e9, device_s_per_row=1e-7, cpu_s_per_row=1e-5,
                        expert_bytes=bytes_per_expert)
        if share == "auto":
            for ex in s.executors:
                if executor == "native":
                    ex.use_cost_model(CostModel.fixed(cost.coefficients()))
                else:
                    ex.cost = CostModel.fixed(cost.coefficients())
        for i, n in enumerate((1, 7, 1, 1, 12, 2, 1, 30, 1)):
            s.forward(_x(n, 256, 300 + i))
        live = s.counters.layers
    result = replay(read_trace(path), slots, SessionOptions().expert_eviction, share=share, cost=cost)
    got = [(st.distinct, st.hits, st.misses, st.cpu, st.evictions, st.rounds) for st in result.layers]
    want = [(c.distinct, c.hits, c.misses, c.cpu_misses, c.evictions, c.rounds) for c in live]
    assert got == want
    total_cpu = sum(c.cpu_misses for c in live)
    total_misses = total_cpu + sum(c.misses for c in live)
    if share == "0":
        assert total_cpu == 0
    elif share == "1":
        assert total_cpu == total_misses
    else:  # a real split: the rounding and the choice of experts are exercised
        assert 0 < total_cpu < total_misses


def test_a_failed_native_load_never_leaves_a_slot_claiming_an_expert(model):
    """The native executor's loads commit one by one: a call failing after its second load leaves the
    later calls exactly right, and the failure is a typed error naming the layer."""
    xs = [_x(n, 256, 40 + n) for n in (3, 5, 3, 1, 7)]
    with _session(model, []) as ref_s:
        refs = [ref_s.forward(x) for x in xs]
    with _session(model, ["disk_experts=1", "expert_cache_slots=6"]) as s:
        ex = s.executors[1]
        ex.inject_load_failure(2)
        with pytest.raises(gh.errors.ComputeError, match="layer 1: injected expert load failure"):
            s.forward(xs[0])
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        assert ex.counters.invalidated > 0  # the planned-but-uncopied slots were emptied, not trusted


def test_a_failed_load_never_leaves_a_slot_claiming_an_expert(model):
    """A layer call that dies half way through its loads (a failed copy, Ctrl-C) must not make later calls wrong."""
    xs = [_x(n, 256, 40 + n) for n in (3, 5, 3, 1, 7)]
    with _session(model, []) as ref_s:
        refs = [ref_s.forward(x) for x in xs]
    with _session(model, ["disk_experts=1", "expert_cache_slots=6", "moe_executor=python"]) as s:
        ex = s.executors[1]
        real, calls = ex._load, []

        def flaky(expert, slot):  # a test double: the third copy of this call fails
            calls.append(expert)
            if len(calls) == 3:
                raise OSError("injected copy failure")
            return real(expert, slot)

        ex._load = flaky
        with pytest.raises(OSError, match="injected copy failure"):
            s.forward(xs[0])
        ex._load = real
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        assert ex.cache.counters.invalidated > 0  # the planned-but-uncopied slots were emptied, not trusted


def test_a_model_file_changed_under_a_run_is_a_clear_error(tmp_path):
    path = write_moe_stack(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ff=64, n_expert=8, n_used=2,
                           expert_type="q8_0", seed=1)
    with _session(path, ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0.5"]) as s:
        s.forward(_x(2, 64, 0))
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])  # truncated in place: the mapping now ends early
        with pytest.raises(gh.errors.ModelFileError, match="changed on disk"):
            for i in range(8):  # a call with a miss reaches the check before any read of the mapping
                s.forward(_x(4, 64, 100 + i))


_GEN = """
import sys
import numpy as np
import ggml_hybrid as gh
opts = gh.SessionOptions.parse(["disk_experts=1", "expert_cache_slots=4", "moe_cpu_share=0.5", "n_threads=1"])
with gh.MoEModel(sys.argv[1], opts) as m:
    print("ready", flush=True)
    logits = m.eval(list(range(1, 40)))
    while True:
        logits = m.eval([int(np.argmax(logits[-1]))])
        if m.n_past >= m.n_ctx - 1:
            m.reset()
            logits = m.eval([1, 2, 3])
"""


def test_ctrl_c_during_a_cpu_offload_run_always_ends_the_process(tmp_path):
    """Ctrl-C (once or twice) at any moment of a run with a CPU share: the process ends, never hangs.

    It used to hang in about one run in six: the interrupt could land between a job queued for the CPU
    worker and the worker's wake-up, and close() then waited for ever for a worker asleep on a
    non-empty queue.
    """
    import random
    import signal
    import subprocess
    import sys

    from ggml_hybrid.synthetic import ModelSpec, write_model

    path = write_model(tmp_path / "m.gguf", ModelSpec(n_layer=4, n_embd=64, n_expert=16, n_used=4,
                                                      weight_type="q8_0"))
    script = tmp_path / "gen.py"
    script.write_text(_GEN)
    rng = random.Random(7)
    for _ in range(12):
        p = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.6))
            p.send_signal(signal.SIGINT)
            if rng.random() < 0.4:
                time.sleep(rng.uniform(0.0, 0.05))
                p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
                pytest.fail("the process hung after Ctrl-C")
        assert p.returncode != 0 and "KeyboardInterrupt" in err


_TRUNCATED = """
import os
import sys
import numpy as np
import ggml_hybrid as gh
from ggml_hybrid._native import ffi
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions

path, executor, share = sys.argv[1:]
opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=1", f"moe_cpu_share={share}", "n_threads=1",
                             f"moe_executor={executor}"])
rng = np.random.default_rng(0)
with MoEStackSession(path, opts) as s:
    s.forward(rng.standard_normal((4, 64)).astype(np.float32))
    # the truncation lands just after each call's check of the file (size, time, inode) and before its reads
    for ex in s.executors:
        if executor == "native":  # the executor's copy of its config is the first member of its struct
            ffi.cast("hy_moe_config *", ex._exec.ptr).fd = -1  # no check: the guard alone must catch it
        else:
            ex.store.check_unchanged = lambda: None
    os.truncate(path, os.path.getsize(path) // 4)
    try:
        for i in range(8):
            s.forward(rng.standard_normal((8, 64)).astype(np.float32))
    except gh.errors.ModelFileError as exc:
        print(exc)
        sys.exit(3)
print("no error")
"""


@pytest.mark.parametrize("executor", ["native", "python"])
@pytest.mark.parametrize("share", ["1", "0"])
def test_a_model_file_truncated_during_the_reads_is_a_clear_error_not_sigbus(tmp_path, executor, share):
    """Issue 28 item 2: the file check comes before the reads, so a truncation landing after it used to kill
    the process with SIGBUS when the CPU worker (share 1) or a load (share 0) read a page that was gone.
    The mapping's guard turns the read into zeros and the call into a ModelFileError."""
    import subprocess
    import sys

    path = write_moe_stack(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_ff=64, n_expert=16, n_used=4,
                           expert_type="q8_0", seed=1)
    script = tmp_path / "truncated.py"
    script.write_text(_TRUNCATED)
    p = subprocess.run([sys.executable, str(script), str(path), executor, share], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3, (p.returncode, p.stdout, p.stderr)
    assert "truncated" in p.stdout and (executor == "native" or str(path) in p.stdout), p.stdout


def test_the_mapping_guard_reads_zeros_past_the_end_and_counts_the_fault(tmp_path):
    """The guard itself, on a store: bytes past the new end read as zeros (not SIGBUS), and the store says so."""
    import subprocess
    import sys

    path = write_moe_stack(tmp_path / "m.gguf", n_layer=1, n_embd=64, n_ff=64, n_expert=4, n_used=2,
                           expert_type="f32", seed=1)
    code = ("import os, sys, numpy as np\n"
            "from ggml_hybrid.gguf.store import GGUFStore\n"
            "from ggml_hybrid.errors import ModelFileError\n"
            "s = GGUFStore(sys.argv[1])\n"
            "info = max(s.tensors(), key=lambda t: t.offset)\n"
            "raw = s.raw(info.name)\n"
            "before = np.array(raw)\n"
            "assert before.any()\n"
            "s.check_reads()\n"
            "os.truncate(sys.argv[1], 4096)\n"
            "after = np.array(raw)\n"
            "assert not after.any()\n"
            "try:\n"
            "    s.check_reads()\n"
            "except ModelFileError as exc:\n"
            "    print(exc)\n"
            "    sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "truncated while it was in use" in p.stdout, (p.returncode, p.stdout, p.stderr)


_RESIDENT_TRUNCATED = """
import os
import sys
import ggml_hybrid as gh
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.options import SessionOptions

path = sys.argv[1]
with MoEModel(path, SessionOptions.parse(["n_threads=1", "repack=false", "n_gpu_layers=0"])) as m:
    m.eval([1, 2, 3])
    os.truncate(path, min(t.offset for t in m.store.tensors()))  # every tensor's bytes gone
    try:
        m.eval([4, 5, 6])
    except gh.errors.ModelFileError as exc:
        print(exc)
        sys.exit(3)
print("no error")
"""


def test_a_resident_model_file_truncated_under_a_run_is_a_clear_error_not_sigbus(tmp_path):
    """Weights used in place from the mapping (resident mode, CPU, not repacked): GGML's own reads of a page past
    the new end used to kill the process with SIGBUS; now the eval raises and its logits are never returned."""
    import subprocess
    import sys

    from ggml_hybrid.synthetic import ModelSpec, write_model

    path = write_model(tmp_path / "m.gguf", ModelSpec(n_layer=2, n_embd=64, n_expert=8, n_used=2, weight_type="f32"))
    script = tmp_path / "resident.py"
    script.write_text(_RESIDENT_TRUNCATED)
    p = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stdout, p.stderr)
    assert "truncated while it was in use" in p.stdout, p.stdout
