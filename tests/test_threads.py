"""Thread counts: the default (one thread per idle core, measured at load), -tb for batches, --poll, and the flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import ggml_hybrid.machine as machine
import ggml_hybrid.runtime.moe_model as moe_model
from ggml_hybrid.cli import main
from ggml_hybrid.errors import ArgumentError, OptionError
from ggml_hybrid.ggml.backend import cpu
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_model(tmp_path_factory.mktemp("threads") / "m.gguf", ModelSpec(arch="qwen3moe", seed=3)))


def _machine(monkeypatch, cores: set[int], others: float, own: float = 0.25, wall: float = 1.0):
    """A machine whose other processes keep ``others`` cores busy while this one uses ``own`` CPU seconds."""
    samples = iter([(10.0, 100.0), (10.0 + others * wall + own, 100.0 + wall * len(cores))])
    clock = iter([5.0, 5.0 + own])
    monkeypatch.setattr(machine, "_last", None)
    monkeypatch.setattr(machine, "_usable", lambda: cores)
    monkeypatch.setattr(machine, "_cpu_times", lambda c: next(samples))
    monkeypatch.setattr(machine.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(machine.time, "sleep", lambda s: None)


@pytest.mark.parametrize("cores, others, want", [
    ({0, 1}, 0.0, 2),    # a quiet machine: every core
    ({0, 1}, 1.0, 1),    # one competing CPU-bound process on two cores
    ({0, 1}, 0.2, 2),    # a little background work: the core still counts
    ({0, 1}, 0.5, 1),    # half a core busy: it does not
    ({0, 1}, 2.0, 1),    # everything busy: still one thread
    ({0, 1, 2, 3, 4, 5, 6, 7}, 3.0, 5),
])
def test_default_threads_are_the_idle_cores(monkeypatch, cores, others, want):
    _machine(monkeypatch, cores, others)
    assert machine.default_threads() == want


def test_own_cpu_time_is_not_another_process(monkeypatch):
    _machine(monkeypatch, {0, 1}, 0.0, own=1.9)  # this process kept both cores busy itself
    assert machine.default_threads() == 2


def test_without_counters_every_usable_core_is_used(monkeypatch):
    monkeypatch.setattr(machine, "_last", None)
    monkeypatch.setattr(machine, "_usable", lambda: {0, 1, 2})
    monkeypatch.setattr(machine, "_cpu_times", lambda c: None)
    assert machine.idle_cores() is None and machine.default_threads() == 3


def test_a_real_sample_is_within_the_usable_cores():
    idle = machine.idle_cores(0.05)
    if idle is None:
        pytest.skip("no /proc/stat")
    assert 0 <= idle <= machine.usable_cores()
    assert 1 <= machine.default_threads() <= machine.usable_cores()


def test_a_session_without_threads_takes_the_default(model, monkeypatch):
    monkeypatch.setattr(moe_model, "default_threads", lambda: 2)
    with MoEModel(model, SessionOptions(n_ctx=64)) as m:
        assert m.n_threads == 2 and m.host.n_threads == 2
        assert all(b.n_threads == 2 for b in m.devices.values())
    with MoEModel(model, SessionOptions(n_ctx=64, n_threads=1)) as m:
        assert m.n_threads == 1 and m.host.n_threads == 1


def test_threads_batch_runs_the_prompt_on_its_own_pool(model):
    tokens = list(range(1, 10))
    with MoEModel(model, SessionOptions(n_ctx=64, n_threads=1)) as m:
        ref = np.concatenate([m.eval(tokens, "all"), m.eval([3], "all"), m.eval([4, 5], "all")])
    with MoEModel(model, SessionOptions(n_ctx=64, n_threads=1, n_threads_batch=2, poll=7)) as m:
        backends = [m.host, *m.devices.values()]
        got = [m.eval(tokens, "all")]
        assert all(b.n_threads == 2 and b.poll == 7 for b in backends)
        got.append(m.eval([3], "all"))
        assert all(b.n_threads == 1 for b in backends)
        got.append(m.eval([4, 5], "all"))
        # one pool per count, reused: switching back and forth starts no threads
        assert all(sorted(b._pools) == [(1, 7), (2, 7)] for b in backends)
    assert np.array_equal(np.concatenate(got), ref)


def test_poll_and_thread_rules():
    b = cpu(1)
    try:
        with pytest.raises(ArgumentError, match="poll"):
            b.set_threads(1, 101)
        b.set_threads(1, 100)
        assert b.poll == 100
    finally:
        b.close()
    with pytest.raises(OptionError, match="poll=101"):
        SessionOptions.parse(["poll=101"])
    with pytest.raises(OptionError, match="n_threads_batch=0"):
        SessionOptions.parse(["n_threads_batch=0"])
    assert SessionOptions.parse(["repack=off"]).repack is False


def test_flags(model):
    r = CliRunner().invoke(main, ["run", model, "--tokens", "1,2,3", "-n", "2", "-t", "1", "-tb", "2", "--poll", "5",
                                  "--no-repack", "--json"])
    assert r.exit_code == 0, r.output
    opts = json.loads(r.output)["options"]
    assert (opts["n_threads"], opts["n_threads_batch"], opts["poll"], opts["repack"]) == (1, 2, 5, False)
    r = CliRunner().invoke(main, ["run", model, "--tokens", "1", "-n", "1", "--poll", "101"])
    assert r.exit_code == 2 and "--poll" in r.output


def test_repack_flags_are_llama_cpps(model):
    def run(*flags):
        return CliRunner().invoke(main, ["run", model, "--tokens", "1", "-n", "1", "-t", "1", "--json", *flags])

    for flags, want in ((["-nr"], False), (["--repack"], True), ([], True), (["-o", "repack=false"], False)):
        r = run(*flags)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["options"]["repack"] is want
    for flags in (["--repack", "--no-repack"], ["-nr", "-o", "repack=true"]):  # one option, two values: refused
        r = run(*flags)
        assert r.exit_code == 2 and "repack" in r.output, r.output
