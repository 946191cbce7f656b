"""The MoE language model against llama.cpp (recorded fixtures, or live) and against its own default path."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid.model.kv_cache import ContextFullError
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.runtime.generate import GenerationStats, generate
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import ModelSpec, write_model

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "fixtures", "llama_ref", "*.npz")))
from make_reference_fixtures import simd_tag  # noqa: E402

# every fixture is bit-identical to llama.cpp on a CPU with the SIMD features of the one that recorded it (the
# kernels GGML's native build picks depend on them; the repacked Q4_0, Q4_K and IQ4_NL weights too); elsewhere the
# bound is a max relative logit difference of 1e-3, and 2e-2 for the types GGML repacks on some CPUs only: their
# repacked kernels round differently from the plain ones for products of few rows, which random weights amplify
TOLERANCE = {"q4_0": 2e-2, "q4_K": 2e-2, "iq4_nl": 2e-2}


def _load_fixture(path):
    z = np.load(path)
    return {"spec": ModelSpec(**json.loads(str(z["spec"]))), "sha256": str(z["sha256"]), "tokens": z["tokens"],
            "logits": z["logits"], "last": z["last_logits"], "ubatch": int(z["ubatch"]),
            "options": json.loads(str(z["options"])), "tokenized": json.loads(str(z["tokenized"])),
            "simd": str(z["simd"]), "decode_from": int(z["decode_from"]) if "decode_from" in z else 0,
            "decode": z["decode_logits"] if "decode_logits" in z else None}


@pytest.fixture(scope="module", params=FIXTURES, ids=[os.path.basename(f)[:-4] for f in FIXTURES])
def case(request, tmp_path_factory):
    fx = _load_fixture(request.param)
    path = write_model(tmp_path_factory.mktemp("ref") / "model.gguf", fx["spec"])
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    # the fixture describes this exact file: a generator change must come with new fixtures
    assert digest == fx["sha256"], "generator output changed; rerun tools/make_reference_fixtures.py"
    return path, fx


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """Max over positions of max|a - ref| / max|ref| (per position)."""
    return float((np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())


def test_fixtures_present():
    assert len(FIXTURES) >= 41
    archs = {_load_fixture(f)["spec"].arch for f in FIXTURES}
    assert archs == {"qwen3moe", "qwen2moe", "llama", "olmoe", "glm4moe", "deepseek2", "gpt-oss", "qwen3next",
                     "qwen35moe"}


def _assert_parity(got, ref, fx):
    assert got.shape == ref.shape
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()
    wtype = fx["spec"].weight_type
    if fx["simd"] == simd_tag():
        assert np.array_equal(got, ref), f"not bit-identical: max relative difference {rel_err(got, ref):.3g}"
    else:
        assert rel_err(got, ref) <= TOLERANCE.get(wtype, 1e-3)


def test_logits_match_llama_cpp(case):
    path, fx = case
    opts = SessionOptions(n_threads=1, n_ctx=512, ubatch_size=fx["ubatch"], **fx["options"])
    with MoEModel(path, opts) as m:
        _assert_parity(m.eval(fx["tokens"], "all"), fx["logits"], fx)
        # only the last position's logits: the output rows are picked where llama.cpp picks them
        m.reset()
        _assert_parity(m.eval(fx["tokens"], "last"), fx["last"], fx)
        if fx["decode"] is not None:
            # a prompt, then one eval per token (what generation does): llama.cpp's own split, row for row
            m.reset()
            n = fx["decode_from"]
            rows = [m.eval(fx["tokens"][:n], "all")] + [m.eval(fx["tokens"][i:i + 1], "all")
                                                         for i in range(n, len(fx["tokens"]))]
            _assert_parity(np.concatenate(rows), fx["decode"], fx)


def test_tokenizer_ids_match_llama_cpp(case):
    path, fx = case
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=64)) as m:
        for item in fx["tokenized"]:
            assert m.tokenizer.encode(item["text"]) == item["ids"], item["text"]
            if fx["spec"].vocab == "spm":
                # SentencePiece decoding is llama.cpp's llama_detokenize (the prefix space dropped, "▁" a space)
                assert m.tokenizer.decode(item["ids"]) == item["detokenized"], item["text"]
            else:
                # llama.cpp's BOS is the only thing decode does not give back
                ids = item["ids"][1:] if m.tokenizer.add_bos else item["ids"]
                assert m.tokenizer.decode(ids) == item["text"]


def _llama_python():
    exe = os.environ.get("GGML_HYBRID_LLAMA_PYTHON")
    if exe:
        return exe
    try:
        import llama_cpp  # noqa: F401
        return sys.executable
    except ImportError:
        return None


@pytest.mark.reference
def test_fixtures_recomputed_live(tmp_path):
    """Recompute every fixture with llama.cpp itself (needs llama-cpp-python==0.3.36)."""
    exe = _llama_python()
    if exe is None:
        pytest.skip("no llama-cpp-python: set GGML_HYBRID_LLAMA_PYTHON to a Python that has it")
    tool = os.path.join(HERE, "..", "tools", "make_reference_fixtures.py")
    r = subprocess.run([sys.executable, tool, "--llama-python", exe, "--out", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    for path in FIXTURES:
        old, new = _load_fixture(path), _load_fixture(tmp_path / os.path.basename(path))
        assert new["sha256"] == old["sha256"]
        assert (new["tokens"] == old["tokens"]).all()
        assert new["tokenized"] == old["tokenized"]
        for key in ("logits", "last") + (("decode",) if old["decode"] is not None else ()):
            if new["simd"] == old["simd"]:
                assert np.array_equal(new[key], old[key])
            else:
                assert rel_err(new[key], old[key]) <= 1e-3


# -- the default path against itself ---------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    return {arch: write_model(d / f"{arch}.gguf", arch=arch, head_dim=16 if arch == "qwen2moe" else 32, seed=11)
            for arch in ("qwen3moe", "qwen2moe", "llama")}


PROMPT = "The cache runs the hits first, then the misses."


def _all_logits(path, opts: SessionOptions, tokens, chunks=(None,)):
    with MoEModel(path, opts) as m:
        out, start = [], 0
        for n in chunks:
            part = tokens[start:] if n is None else tokens[start:start + n]
            out.append(m.eval(part, "all"))
            start += len(part)
        return np.concatenate(out), m.counters.total


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["qwen3moe", "qwen2moe", "llama"]),
       mode=st.sampled_from(["cpu_moe", "n_cpu_moe", "cache", "hybrid", "auto"]),
       slots=st.integers(1, 8), share=st.sampled_from([0.25, 0.5, 1.0]), threads=st.sampled_from([1, 2]),
       ubatch=st.sampled_from([3, 512]))
def test_every_mode_is_bit_identical_to_resident(small, arch, mode, slots, share, threads, ubatch):
    path = small[arch]
    base = dict(n_threads=threads, n_ctx=256, ubatch_size=ubatch)
    extra = {"cpu_moe": dict(cpu_moe=True), "n_cpu_moe": dict(n_cpu_moe=1),
             "cache": dict(disk_experts=True, expert_cache_slots=slots),
             "hybrid": dict(disk_experts=True, expert_cache_slots=slots, moe_cpu_share=share),
             "auto": dict(disk_experts=True, expert_cache_slots=slots, moe_cpu_share="auto")}[mode]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
    ref, _ = _all_logits(path, SessionOptions(**base), tokens, (5, None))
    got, counters = _all_logits(path, SessionOptions(**base, **extra), tokens, (5, None))
    assert np.array_equal(got, ref)
    if mode in ("cache", "hybrid", "auto"):
        assert counters.misses + counters.cpu_misses > 0
    if mode == "hybrid":
        assert counters.cpu_misses > 0


def test_ubatch_and_token_by_token_agree_with_one_batch(small):
    path = small["qwen3moe"]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
    one, _ = _all_logits(path, SessionOptions(n_threads=1), tokens)
    split, _ = _all_logits(path, SessionOptions(n_threads=1, ubatch_size=4), tokens)
    steps, _ = _all_logits(path, SessionOptions(n_threads=1), tokens, [1] * len(tokens))
    # different batch shapes take different kernels: equal to rounding, same argmax
    for other in (split, steps):
        assert (other.argmax(1) == one.argmax(1)).all()
        assert np.abs(other - one).max() <= 1e-3 * np.abs(one).max()


def test_last_logits_equal_the_last_row_of_all(small):
    path = small["qwen2moe"]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
        every = m.eval(tokens, "all")
        m.reset()
        last = m.eval(tokens, "last")
    assert last.shape == (1, every.shape[1])
    assert np.allclose(last[0], every[-1], rtol=0, atol=1e-4 * np.abs(every[-1]).max())


def test_flash_attention_and_q8_cache_stay_close(small):
    path = small["qwen3moe"]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
    ref, _ = _all_logits(path, SessionOptions(n_threads=1), tokens)
    for opts in (SessionOptions(n_threads=1, flash_attn=True),
                 SessionOptions(n_threads=1, flash_attn=True, cache_type_k="q8_0", cache_type_v="q8_0"),
                 SessionOptions(n_threads=1, cache_type_k="f32", cache_type_v="f32")):
        got, _ = _all_logits(path, opts, tokens)
        assert (got.argmax(1) == ref.argmax(1)).all()
        assert rel_err(got, ref) <= 2e-2


def test_kv_cache_continues_across_calls_and_reset_starts_over(small):
    path = small["llama"]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
        a = m.eval(tokens, "all")
        assert m.n_past == len(tokens)
        m.reset()
        assert m.n_past == 0
        b = m.eval(tokens, "all")
    assert np.array_equal(a, b)


def test_context_overflow_is_refused_before_anything_runs(small):
    with MoEModel(small["qwen3moe"], SessionOptions(n_threads=1, n_ctx=8)) as m:
        m.eval([1, 2, 3, 4, 5])
        with pytest.raises(ContextFullError, match="n_ctx=8"):
            m.eval([1, 2, 3, 4])
        assert m.n_past == 5  # nothing of the refused call was evaluated
        m.eval([1, 2, 3])


@pytest.mark.parametrize("tokens, err", [([], "non-empty"), ([[1, 2]], "1-D"), ([1.5], "integers"),
                                         ([-1], "outside the vocabulary"), ([384], "outside the vocabulary")])
def test_bad_tokens_raise(small, tokens, err):
    with MoEModel(small["qwen3moe"], SessionOptions(n_threads=1)) as m:
        # ShapeError is a ValueError, IndexRangeError (a token outside the vocabulary) an IndexError
        with pytest.raises((ValueError, TypeError, IndexError), match=err):
            m.eval(tokens)


@pytest.mark.parametrize("opts, msg", [
    (dict(ubatch_size=1024, batch_size=512), "ubatch_size=1024"),
    (dict(cache_type_v="q8_0"), "flash_attn"),
    (dict(expert_cache_slots=99, disk_experts=True), "expert_cache_slots=99"),
    (dict(n_cpu_moe=5), "n_cpu_moe=5"),
    (dict(moe_cpu_share=0.5), "disk_experts"),
])
def test_impossible_options_are_refused_before_loading(small, opts, msg):
    with pytest.raises(OptionError, match=msg):
        MoEModel(small["qwen3moe"], SessionOptions(**opts))


def test_seeded_sampling_is_deterministic(small):
    path = small["qwen3moe"]

    def sample(seed):
        with MoEModel(path, SessionOptions(n_threads=1)) as m:
            st = GenerationStats()
            list(generate(m, m.tokenizer.encode(PROMPT), 12, Sampler(temperature=1.0, top_k=50, top_p=0.95,
                                                                    seed=seed), st, stop_at_eos=False))
            return st.tokens

    a, b, c = sample(5), sample(5), sample(6)
    assert a == b and len(a) == 12
    assert a != c


def test_greedy_generation_follows_argmax_and_stops_at_eos(small):
    path = small["qwen3moe"]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        prompt = m.tokenizer.encode(PROMPT)
        st = GenerationStats()
        text = "".join(generate(m, prompt, 6, stats=st, keep_logits=True, stop_at_eos=False))
        seq = prompt + st.tokens[:-1]
        m.reset()
        ref = m.eval(seq, "all")
        eos = m.tokenizer.eos_id
    logits = st.all_logits()
    assert np.array_equal(logits[len(prompt) - 1:].argmax(1), np.asarray(st.tokens))
    assert np.allclose(logits, ref, atol=1e-3 * np.abs(ref).max(), rtol=0)
    assert text == m.tokenizer.decode(st.tokens)
    # force EOS: a sampler that always picks it
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        st2 = GenerationStats()
        out = list(generate(m, prompt, 5, lambda _: eos, st2))
    assert out == [] and st2.stop_reason == "eos" and st2.generated_tokens == 0


def test_sampler_rejects_bad_settings():
    for kw in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(seed=-2),
               dict(temperature=float("nan"))):
        with pytest.raises(ValueError):
            Sampler(**kw)


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(0).standard_normal(100)
    s = Sampler(temperature=2.0, top_k=1, seed=0)
    assert all(s(logits) == int(np.argmax(logits)) for _ in range(20))


def test_top_p_is_cut_before_temperature():
    # llama.cpp's chain: top-p on the raw softmax ({0, 1} reach 0.8 here), temperature afterwards
    logits = np.array([2.0, 1.0, 0.0])
    s = Sampler(temperature=0.5, top_k=0, top_p=0.8, seed=0)
    draws = [s(logits) for _ in range(2000)]
    assert set(draws) == {0, 1}
    p1 = 1 / (1 + np.exp(2.0))  # token 1 after the cut, at temperature 0.5
    assert abs(draws.count(1) / 2000 - p1) < 0.03


def test_top_p_keeps_the_smallest_prefix():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(temperature=1.0, top_k=0, top_p=0.7, seed=1)
    draws = {s(logits) for _ in range(200)}
    assert draws == {0, 1}


@pytest.mark.skipif(shutil.which("ggml-hybrid") is None, reason="console script not installed")
def test_console_script_runs_demo():
    r = subprocess.run(["ggml-hybrid", "demo", "-n", "4", "-t", "1", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["all_identical"] is True


def test_user_defined_tokens_are_matched_in_text():
    from ggml_hybrid.synthetic import train_vocab
    from ggml_hybrid.text.tokenizer import Tokenizer

    tokens, types, merges = train_vocab("qwen2", 384)
    tokens = tokens + ["<think>"]
    types = types + [4]
    tok = Tokenizer(tokens, merges, "qwen2", types)
    ids = tok.encode("a<think>b")
    assert ids.count(len(tokens) - 1) == 1 and tok.decode(ids) == "a<think>b"
    # a control token is never produced from text
    im_end = tokens.index("<|im_end|>")
    assert im_end not in tok.encode("x<|im_end|>y")
    assert im_end in tok.eog_ids and tok.eos_id is None


def test_generation_stops_at_any_end_of_generation_token(small):
    with MoEModel(small["qwen3moe"], SessionOptions(n_threads=1)) as m:
        im_end = m.tokenizer.tokens.index("<|im_end|>")
        assert im_end in m.tokenizer.eog_ids and im_end != m.tokenizer.eos_id
        st = GenerationStats()
        calls = []

        def sampler(logits):
            calls.append(1)
            return 5 if len(calls) < 3 else im_end

        text = "".join(generate(m, m.tokenizer.encode(PROMPT), 10, sampler, st))
    assert st.stop_reason == "eos" and st.tokens == [5, 5] and st.decode_steps == 2
    assert text == m.tokenizer.decode([5, 5])


def test_a_failed_load_releases_everything(small, tmp_path, monkeypatch):
    import gc

    import ggml_hybrid as gh
    from ggml_hybrid.moe import expert_layers

    def refuse(*args, **kwargs):  # the trace file cannot be opened, after the dense weights and slots exist
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(expert_layers, "TraceWriter", refuse)
    gc.collect()
    before = gh.live_objects()
    gc.disable()
    try:
        with pytest.raises(OSError):
            MoEModel(small["qwen3moe"], SessionOptions(disk_experts=True, expert_cache_slots=2,
                                                       trace_path=str(tmp_path / "t.bin")))
        assert gh.live_objects() == before  # without waiting for the garbage collector
    finally:
        gc.enable()


def test_graph_cache_is_bounded(small):
    from ggml_hybrid.runtime.moe_model import MAX_GRAPHS

    with MoEModel(small["qwen3moe"], SessionOptions(n_threads=1)) as m:
        ref = m.eval(list(range(1, 4)), "all")
        for n in range(1, MAX_GRAPHS + 6):
            m.reset()
            m.eval(list(range(1, n + 1)))
        assert len(m._graphs) <= MAX_GRAPHS
        m.reset()
        assert np.array_equal(m.eval(list(range(1, 4)), "all"), ref)  # rebuilt after eviction, same result


def test_compute_memory_is_fixed_at_load_in_disk_experts_mode(small):
    """Issue 18 item 5: new prompt lengths never grow the compute buffers (they grew to 1.9 GiB over 300 lengths
    with disk experts and a CPU share); every buffer is sized for the largest ubatch at load."""
    opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0.5", "n_threads=1",
                                 "ubatch_size=64", "n_ctx=256"])
    with MoEModel(small["qwen3moe"], opts) as m:
        at_load = m.device_memory()["compute"]
        for n in [*range(1, 40), 63, 64, 65, 130, 200]:
            m.reset()
            logits = m.eval(list(range(1, n + 1)))
            m.eval([int(np.argmax(logits[-1]))])
            assert m.device_memory()["compute"] == at_load, n


def test_a_failed_eval_leaves_the_sequence_as_it_was(small):
    """A fault in ubatch 2 of 4 must not leave n_past half advanced: the retry is then exactly a clean run."""
    tokens = list(range(1, 33))
    opts = SessionOptions.parse(["ubatch_size=8", "batch_size=32", "n_threads=1"])
    with MoEModel(small["qwen3moe"], opts) as m:
        clean = m.eval(tokens, "all")
        m.reset()
        m.eval([5, 6, 7])
        real, seen = m._ubatch, []

        def dies_on_the_second(part, n_out):  # a test double: the second ubatch fails, as a Ctrl-C could
            seen.append(len(part))
            if len(seen) == 2:
                raise KeyboardInterrupt
            return real(part, n_out)

        m._ubatch = dies_on_the_second
        with pytest.raises(KeyboardInterrupt):
            m.eval(tokens, "all")
        m._ubatch = real
        assert m.n_past == 3
        m.reset()
        np.testing.assert_array_equal(m.eval(tokens, "all"), clean)


def test_one_model_from_two_threads_takes_turns(small):
    import threading

    with MoEModel(small["qwen3moe"], SessionOptions.parse(["n_threads=1"])) as m:
        errors, outs = [], []

        def work(seed):
            try:
                rng = np.random.default_rng(seed)
                for _ in range(6):
                    outs.append(m.eval(rng.integers(1, 300, size=int(rng.integers(1, 5))).tolist()))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(outs) == 12 and all(np.isfinite(o).all() for o in outs)


def test_an_executor_cannot_evaluate_its_own_model(small):
    # a Python executor: the test double wraps it (the native one never runs Python to call eval from)
    opts = SessionOptions.parse(["disk_experts=1", "expert_cache_slots=4", "n_threads=1", "moe_executor=python"])
    with MoEModel(small["qwen3moe"], opts) as m:
        ex = m.experts.executors[0]
        real, caught = ex.__call__, []

        def reentrant(call):
            try:
                m.eval([1])
            except gh.errors.BackendError as exc:
                caught.append(str(exc))
            return real(call)

        m.experts.executors[0] = reentrant
        m.sched.clear_regions()
        m._active = None  # register the test double as layer 0's executor
        try:
            out = m.eval([1, 2])
        finally:
            m.experts.executors[0] = ex  # the real one, which close() releases
        assert caught and "from inside its own eval" in caught[0] and np.isfinite(out).all()
