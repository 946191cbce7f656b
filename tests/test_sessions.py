"""A loaded model and its sessions (runtime/loaded_model.py, runtime/session.py): llama.cpp's model and context.

Oracles: a fresh ``MoEModel`` running the same tokens alone (its logits, bit for bit); the native objects alive
(``gh.live_objects``: a second session adds its KV cache and scheduler, no weight buffer); the options' own fields.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import ClosedError, OptionError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.loaded_model import LoadedModel
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.session import CONTEXT_OPTIONS, Session
from ggml_hybrid.synthetic import write_model

MODES = {
    "resident": {},
    "disk": {"disk_experts": True, "expert_cache_slots": 3},
    "disk_share": {"disk_experts": True, "expert_cache_slots": 3, "moe_cpu_share": 0.5},
    "disk_python": {"disk_experts": True, "expert_cache_slots": 3, "moe_executor": "python"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    return {"qwen3moe": write_model(d / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=11),
            "qwen3next": write_model(d / "q3n.gguf", arch="qwen3next", n_layer=4, n_rot=8, attn_interval=2, seed=12)}


def alone(path, opts: SessionOptions, prompt: list[int], steps: list[int]) -> list[bytes]:
    """The oracle: a fresh model holding this sequence alone, the prompt's last logits then each step's."""
    with MoEModel(path, opts) as m:
        rows = [m.eval(prompt)[-1]] + [m.eval([t])[-1] for t in steps]
    return [r.tobytes() for r in rows]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_sessions_over_one_model_each_run_as_if_alone(models, arch, mode):
    """Two sessions over one loaded model, their calls interleaved (sharing the expert cache, its worker and the
    backends): each sequence's logits are bit-identical to a fresh model running it alone."""
    if arch == "qwen3next" and mode == "disk_python":
        pytest.skip("one executor is enough for the recurrent family")
    path = models[arch]
    opts = SessionOptions(n_threads=1, n_ctx=128, **MODES[mode])
    rng = np.random.default_rng(3)
    a = (rng.integers(0, 384, 9).tolist(), rng.integers(0, 384, 4).tolist())
    b = (rng.integers(0, 384, 5).tolist(), rng.integers(0, 384, 4).tolist())
    with MoEModel(path, opts) as m, Session(m.model) as s:
        got_a, got_b = [m.eval(a[0])[-1].tobytes()], [s.eval(b[0])[-1].tobytes()]
        for ta, tb in zip(a[1], b[1]):
            got_b.append(s.eval([tb])[-1].tobytes())
            got_a.append(m.eval([ta])[-1].tobytes())
        assert m.position() == len(a[0]) + len(a[1]) and s.position() == len(b[0]) + len(b[1])
    assert got_a == alone(path, opts, *a)
    assert got_b == alone(path, opts, *b)


def test_a_second_session_shares_the_weights_and_allocates_only_its_own_state(models):
    opts = SessionOptions(n_threads=1, n_ctx=64, disk_experts=True, expert_cache_slots=3)
    with MoEModel(models["qwen3moe"], opts) as m:
        before = gh.live_objects()
        with Session(m.model) as s:
            during = gh.live_objects()
            assert s.weights is m.weights and s.experts is m.experts and s.tokenizer is m.tokenizer
            assert s.kv is not m.kv and s.sched is not m.sched
            # its own KV cache (one buffer: one device) and scheduler; not one weight or slot buffer more
            assert during["buffer"] - before["buffer"] == 1 and during["scheduler"] - before["scheduler"] == 1
            assert during["native_executor"] == before["native_executor"]
            mine, theirs = s.device_memory(), m.device_memory()
            assert mine == theirs  # the same options: the same KV, the same compute
            assert m.model.device_memory()["weights"] == theirs["weights"]
        after = gh.live_objects()
        assert after["buffer"] == before["buffer"] and after["scheduler"] == before["scheduler"]


def test_a_session_chooses_its_context_options(models):
    path = models["qwen3moe"]
    opts = SessionOptions(n_threads=1, n_ctx=128, disk_experts=True, expert_cache_slots=3)
    prompt, steps = [5, 6, 7, 8, 9], [10, 11]
    with MoEModel(path, opts) as m:
        small = opts.merged(n_ctx=32, n_parallel=2, ubatch_size=2)
        with Session(m.model, small) as s:
            assert (s.n_ctx, s.n_parallel, s.options.ubatch_size) == (32, 2, 2) and m.n_ctx == 128
            rows = [s.eval(prompt, seq=1)[-1]] + [s.eval([t], seq=1)[-1] for t in steps]
        assert [r.tobytes() for r in rows] == alone(path, small, prompt, steps)


@pytest.mark.parametrize("field, value", [("expert_cache_slots", 2), ("disk_experts", False), ("repack", False),
                                           ("moe_cpu_share", 0.5), ("n_gpu_layers", 0)])
def test_a_session_cannot_change_what_shapes_the_load(models, field, value):
    assert field not in CONTEXT_OPTIONS
    opts = SessionOptions(n_threads=1, n_ctx=64, disk_experts=True, expert_cache_slots=3)
    with LoadedModel(models["qwen3moe"], opts) as model:
        other = dataclasses.replace(opts, **{field: value})
        with pytest.raises(OptionError, match=rf"{field}=.*its model's {field}="):
            Session(model, other)


def test_a_sessions_context_options_are_checked(models):
    opts = SessionOptions(n_threads=1, n_ctx=64)
    with LoadedModel(models["qwen3moe"], opts) as model:
        with pytest.raises(OptionError, match="ubatch_size=64: must not exceed batch_size=8"):
            Session(model, opts.merged(batch_size=8, ubatch_size=64))
        with pytest.raises(OptionError, match="options must be SessionOptions"):
            Session(model, {"n_ctx": 64})  # type: ignore[arg-type]


def test_closing_the_model_closes_its_sessions_and_a_session_leaves_the_model(models):
    opts = SessionOptions(n_threads=1, n_ctx=64)
    before = gh.live_objects()
    model = LoadedModel(models["qwen3moe"], opts)
    a, b = Session(model), Session(model)
    ref = a.eval([1, 2, 3])
    b.close()
    assert np.array_equal(Session(model).eval([1, 2, 3]), ref)  # the model and other sessions go on
    with pytest.raises(ClosedError, match="eval: the model is closed"):
        b.eval([1])
    model.close()
    with pytest.raises(ClosedError, match="eval: the model is closed"):
        a.eval([4])
    with pytest.raises(ClosedError, match="Session: the model is closed"):
        Session(model)
    model.close()  # safe twice
    assert gh.live_objects() == before


def test_a_loaded_model_takes_a_number_of_slots(models):
    opts = SessionOptions(n_threads=1, n_ctx=64, disk_experts=True, expert_cache_slots="auto")
    with pytest.raises(OptionError, match="expert_cache_slots=auto"):
        LoadedModel(models["qwen3moe"], opts)


def test_moe_model_is_the_session_that_owns_its_model(models):
    with MoEModel(models["qwen3moe"], SessionOptions(n_threads=1, n_ctx=64)) as m:
        assert isinstance(m, Session) and isinstance(m.model, LoadedModel)
        model = m.model
    assert model.closed
