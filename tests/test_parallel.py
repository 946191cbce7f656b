"""Concurrent sequences in one model: each sequence's logits are bit-identical to running it alone.

The oracle is the model itself with one sequence: ``eval(prompt)`` then ``eval([token])`` per step, on a
fresh model. The batched side holds ``n_parallel`` sequences, feeds the prompts in the pieces a lone eval
cuts (``ubatch_ends``), interleaved with decode steps of every sequence that has finished its prompt, in
an arrival order drawn by hypothesis. Bit-identity is compared on the float32 bytes.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid.errors import ArgumentError, ContextFullError, IndexRangeError, ShapeError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

K_SPEC = dict(n_embd=256, n_ff_exp=256, head_dim=64, n_ff_shexp=256)  # block sizes of the K-quants
MODES = {
    "resident": {},
    "cpu_moe": {"cpu_moe": True},
    "disk": {"disk_experts": True, "expert_cache_slots": 3},
    "disk_share": {"disk_experts": True, "expert_cache_slots": 3, "moe_cpu_share": 0.5},
    "disk_share_python": {"disk_experts": True, "expert_cache_slots": 3, "moe_cpu_share": 0.5,
                          "moe_executor": "python"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    out = {}
    for wt in ("f32", "f16", "q8_0"):
        out[("qwen3moe", wt)] = write_model(d / f"q3_{wt}.gguf", arch="qwen3moe", weight_type=wt, seed=7)
    out[("qwen3moe", "q4_K")] = write_model(d / "q3_q4k.gguf", arch="qwen3moe", weight_type="q4_K", seed=7, **K_SPEC)
    out[("qwen2moe", "q6_K")] = write_model(d / "q2_q6k.gguf", arch="qwen2moe", weight_type="q6_K", seed=7, **K_SPEC)
    for arch in ("gpt-oss", "deepseek2", "glm4moe", "llama"):
        out[(arch, "f32")] = write_model(d / f"{arch}.gguf", arch=arch, seed=7)
    return out


def alone(path, opts: SessionOptions, prompt: list[int], steps: list[int]) -> list[bytes]:
    """Logits of the prompt's last token, then of each step's token, from a model holding this sequence alone."""
    with MoEModel(path, opts) as m:
        rows = [m.eval(prompt)[-1]]
        rows += [m.eval([t])[-1] for t in steps]
    return [r.tobytes() for r in rows]


def batched(path, opts: SessionOptions, seqs: list[tuple[list[int], list[int]]], arrivals: list[int]
            ) -> list[list[bytes]]:
    """Every sequence in one model: sequence i joins at step arrivals[i]; each step is one prompt piece of
    the oldest waiting prompt or a decode step of every sequence past its prompt, alternating."""
    n = len(seqs)
    out: list[list[bytes]] = [[] for _ in seqs]
    with MoEModel(path, opts.merged(n_parallel=n)) as m:
        done = [0] * n        # prompt tokens evaluated
        fed = [0] * n         # decode tokens evaluated
        step, last_prompt = 0, False
        while any(fed[i] < len(seqs[i][1]) for i in range(n)):
            joined = [i for i in range(n) if arrivals[i] <= step]
            prompting = [i for i in joined if done[i] < len(seqs[i][0])]
            decoding = [i for i in joined if done[i] == len(seqs[i][0]) and fed[i] < len(seqs[i][1])]
            if prompting and (not decoding or not last_prompt):
                i = prompting[0]
                prompt = seqs[i][0]
                end = next(e for e in m.ubatch_ends(len(prompt)) if e > done[i])
                logits = m.eval(prompt[done[i]:end], seq=i)
                done[i] = end
                if end == len(prompt):
                    out[i].append(logits[-1].tobytes())
                last_prompt = True
            elif decoding:
                rows = m.decode([(i, seqs[i][1][fed[i]]) for i in decoding])
                for i, row in zip(decoding, rows):
                    out[i].append(row.tobytes())
                    fed[i] += 1
                last_prompt = False
            step += 1
    return out


CASES = [("qwen3moe", "f32"), ("qwen3moe", "f16"), ("qwen3moe", "q8_0"), ("qwen3moe", "q4_K"), ("qwen2moe", "q6_K")]


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), mode=st.sampled_from(sorted(MODES)), n=st.integers(2, 4),
       ubatch=st.sampled_from([3, 512]), flash=st.booleans(), data=st.data())
def test_each_sequence_is_bit_identical_to_running_it_alone(models, case, mode, n, ubatch, flash, data):
    path = models[case]
    opts = SessionOptions(n_threads=1, n_ctx=256, ubatch_size=ubatch, flash_attn=flash, **MODES[mode])
    vocab = 384
    seqs = [(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20), label=f"prompt{i}"),
             data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6), label=f"steps{i}"))
            for i in range(n)]
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n), label="arrivals")
    got = batched(path, opts, seqs, arrivals)
    for i, (prompt, steps) in enumerate(seqs):
        assert got[i] == alone(path, opts, prompt, steps), f"sequence {i} differs from its lone run"


@pytest.mark.parametrize("arch, extra", [
    ("gpt-oss", {}), ("gpt-oss", {"flash_attn": True}),            # sliding-window layers, attention sinks
    ("deepseek2", {}), ("deepseek2", {"flash_attn": True}),        # latent attention: a K-only cache
    ("glm4moe", {"disk_experts": True, "expert_cache_slots": 2}),  # dense leading layer, shared expert
    ("llama", {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": True}),  # Hadamard-rotated cache
])
def test_every_family_is_bit_identical_batched(models, arch, extra):
    path = models[(arch, "f32")]
    opts = SessionOptions(n_threads=1, n_ctx=256, ubatch_size=4, **extra)
    rng = np.random.default_rng(1)
    seqs = [(rng.integers(0, 384, n).tolist(), rng.integers(0, 384, 5).tolist()) for n in (7, 2, 11)]
    got = batched(path, opts, seqs, [0, 1, 3])
    for i, (prompt, steps) in enumerate(seqs):
        assert got[i] == alone(path, opts, prompt, steps)


def test_a_decode_step_past_256_cells_uses_each_sequences_own_cells(models):
    """Sequences at different KV lengths (one past a 256-cell pad) in one step: each sees its own n_kv."""
    path = models[("qwen3moe", "f32")]
    opts = SessionOptions(n_threads=1, n_ctx=400)
    rng = np.random.default_rng(2)
    seqs = [(rng.integers(0, 384, 260).tolist(), rng.integers(0, 384, 3).tolist()),
            (rng.integers(0, 384, 3).tolist(), rng.integers(0, 384, 3).tolist())]
    got = batched(path, opts, seqs, [0, 0])
    for i, (prompt, steps) in enumerate(seqs):
        assert got[i] == alone(path, opts, prompt, steps)


def test_without_rowwise_products_f32_rows_differ(models, monkeypatch):
    """The reason for GGML_HINT_ROWWISE: GGML's CPU picks llamafile's sgemm for 2+ rows of F32 weights,
    which rounds differently from the one-row path; so does a batched step without the hint."""
    from ggml_hybrid.ggml.graph import Graph

    path = models[("qwen3moe", "f32")]
    opts = SessionOptions(n_threads=1, n_ctx=256)
    seqs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9])]
    monkeypatch.setattr(Graph, "set_rowwise", lambda self: 0)
    got = batched(path, opts, seqs, [0, 0])
    ref = [alone(path, opts, p, s) for p, s in seqs]
    assert got[0][0] == ref[0][0] and got[1][0] == ref[1][0]  # the prompts: one sequence per ubatch
    assert got != ref  # the decode steps of two sequences: other kernels, other bits
    rel = [float(np.abs(a - b).max() / np.abs(b).max()) for gs, rs in zip(got, ref) for x, y in zip(gs, rs)
           for a, b in [(np.frombuffer(x, np.float32), np.frombuffer(y, np.float32))]]
    assert 0 < max(rel) <= 1e-4  # rounding, not a wrong result


@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0", "q4_0", "q6_K", "q4_K"])
def test_rowwise_products_equal_one_row_products(run, wt):
    """mul_mat and mul_mat_id with GGML_HINT_ROWWISE: each row is bit-identical to its one-row product."""
    from helpers import Raw, quantized

    rng = np.random.default_rng(3)
    k, m, e, n = 256, 48, 4, 12
    w = rng.standard_normal((e, m, k)).astype(np.float32)
    if wt == "f32":
        spec: object = w
    elif wt == "f16":
        spec = w.astype(np.float16)
    else:
        q, _ = quantized(w.reshape(e * m, k), wt)
        spec = Raw(q.dtype, (e, m, k), q.data)
    x = rng.standard_normal((n, k)).astype(np.float32)
    ids = rng.integers(0, e, (n, 2)).astype(np.int32)

    def mm(c, t, hint):
        out = c.mul_mat(c.view(t["w"], (m, k), None, 0), t["x"])
        if hint:
            gh.lib.ggml_mul_mat_set_hint(out.ptr, gh.lib.GGML_HINT_ROWWISE)
        return out

    def mmid(c, t, hint):
        out = c.mul_mat_id(t["w"], c.reshape(t["x"], (t["x"].ne[1], 1, k)), t["ids"])
        if hint:
            gh.lib.ggml_mul_mat_set_hint(out.ptr, gh.lib.GGML_HINT_ROWWISE)
        return out

    for build, names in ((mm, ("x",)), (mmid, ("x", "ids"))):
        data = {"x": x, "ids": ids}
        many = run(functools.partial(build, hint=True), consts={"w": spec},
                   inputs={k: data[k] for k in names}).reshape(n, -1)
        for i in range(n):
            one = run(functools.partial(build, hint=False), consts={"w": spec},
                      inputs={k: data[k][i:i + 1] for k in names})
            assert many[i].tobytes() == one.reshape(-1).tobytes(), (build.__name__, wt, i)


def test_batched_decode_counts_every_call_and_replays_to_the_live_counters(models, tmp_path):
    """With disk experts, a decode step of S sequences is one executor call per layer with S rows; the trace of
    those calls replays (through the same slot policy and CPU-share rule) to the live counters, layer by layer."""
    from ggml_hybrid.moe.traces import read_trace, replay

    path = models[("qwen3moe", "q8_0")]
    trace = tmp_path / "t.trace"
    for executor in ("native", "python"):
        opts = SessionOptions(n_threads=1, n_ctx=256, n_parallel=3, disk_experts=True, expert_cache_slots=3,
                              moe_cpu_share=0.5, moe_executor=executor, trace_path=str(trace))
        with MoEModel(path, opts) as m:
            for seq, prompt in enumerate(([1, 2, 3], [4, 5], [6, 7, 8, 9])):
                m.eval(prompt, seq=seq)
            before = [c.calls for c in m.counters.layers]
            for step in range(4):
                m.decode([(seq, 10 + step + seq) for seq in range(3)])
            live = m.counters.layers
        assert [c.calls - b for c, b in zip(live, before)] == [4] * len(live)
        for c in live:
            assert c.hits + c.misses + c.cpu_misses == c.distinct
        t = read_trace(trace)
        assert [ids.shape for _, ids in t.calls][-2 * 4:] == [(3, 2)] * 8  # 4 steps x 2 layers, 3 rows each
        result = replay(t, 3, SessionOptions().expert_eviction, share=0.5)
        got = [(s.distinct, s.hits, s.misses, s.cpu, s.evictions, s.rounds) for s in result.layers]
        assert got == [(c.distinct, c.hits, c.misses, c.cpu_misses, c.evictions, c.rounds) for c in live]


def test_decode_is_all_or_nothing_and_checks_its_batch(models):
    path = models[("qwen3moe", "f32")]
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256, n_parallel=3)) as m:
        m.eval(list(range(1, 256)), seq=0)
        m.eval([1, 2], seq=1)
        m.decode([(0, 5)])  # the last cell of sequence 0
        with pytest.raises(ContextFullError):
            m.decode([(1, 5), (0, 6)])
        assert (m.position(0), m.position(1)) == (256, 2)  # nothing moved
        for bad, err in [([], ShapeError), ([(0, 1, 2)], ShapeError), ([("0", 1)], ShapeError),
                         ([(True, 1)], ShapeError), ([(1, 1), (1, 2)], ArgumentError), ([(3, 1)], ArgumentError),
                         ([(2, 384)], IndexRangeError), ([(2, -1)], IndexRangeError)]:
            with pytest.raises(err):
                m.decode(bad)
        assert (m.position(1), m.position(2)) == (2, 0)
        with pytest.raises(ArgumentError):
            m.eval([1], seq=3)
        with pytest.raises(ArgumentError):
            m.reset(-1)


def test_reset_and_truncate_touch_one_sequence(models):
    path = models[("qwen3moe", "f32")]
    opts = SessionOptions(n_threads=1, n_ctx=256)
    ref = alone(path, opts, [9, 8, 7], [6])
    with MoEModel(path, opts.merged(n_parallel=2)) as m:
        m.eval([1, 2, 3, 4], seq=0)
        m.eval([5, 6], seq=1)
        m.reset(1)
        assert (m.position(0), m.position(1)) == (4, 0)
        m.truncate(1, seq=0)
        assert m.position(0) == 1
        # a reset slot starts over exactly as a fresh model does
        got = [m.eval([9, 8, 7], seq=1)[-1].tobytes(), m.decode([(1, 6)])[0].tobytes()]
        assert got == ref


def test_one_sequence_model_is_unchanged(models):
    """n_parallel=1 builds exactly the graphs it always did: same logits as before for prompt and decode."""
    path = models[("qwen3moe", "q8_0")]
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256)) as m:
        a = m.eval([1, 2, 3, 4, 5], "all")
        b = m.decode([(0, 6)])
        m.reset()
        m.eval([1, 2, 3, 4, 5], "all")
        c = m.eval([6])
        assert m.kv.n_seq == 1 and [t.name for t in m.kv.k[0]] == ["cache_k_l0", "cache_k_l1"]
    assert b.tobytes() == c.tobytes() and a.shape == (5, 384)


def test_many_sequences_over_k_quant_disk_experts(tmp_path):
    """12 sequences, 4 experts: rows of one expert in a step would reach GGML's tiled threshold (8) in the expert
    cache's own graphs, which are not rowwise; decode steps of such a model take at most 7 sequences."""
    path = write_model(tmp_path / "k.gguf", arch="qwen3moe", weight_type="q4_K", n_expert=4, n_used=2, seed=3, **K_SPEC)
    opts = SessionOptions(n_threads=1, n_ctx=256, disk_experts=True, expert_cache_slots=2, moe_cpu_share=0.5,
                          repack=False)
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 300, 3).tolist(), rng.integers(0, 300, 3).tolist()) for _ in range(12)]
    with MoEModel(path, opts.merged(n_parallel=12)) as m:
        assert m.decode_rows == 7
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=256, n_parallel=12, repack=False)) as m:
        assert m.decode_rows == 512  # resident experts are rowwise in the decoder's own graph
    got = batched(path, opts, seqs, [0] * 12)
    for i, (prompt, steps) in enumerate(seqs):
        assert got[i] == alone(path, opts, prompt, steps)


@pytest.mark.parametrize("mode", ["resident", "disk_share"])
def test_a_moved_sequence_goes_on_exactly_as_it_would_have(models, mode):
    """move(src, dst) copies the slot's cells: the sequence's next logits are its lone run's, src is empty."""
    path = models[("qwen3moe", "q8_0")]
    opts = SessionOptions(n_threads=1, n_ctx=256, ubatch_size=4, **MODES[mode])
    prompt, steps = [3, 1, 4, 1, 5, 9, 2], [6, 5, 3]
    ref = alone(path, opts, prompt, steps)
    with MoEModel(path, opts.merged(n_parallel=3)) as m:
        m.eval([7, 7, 7], seq=0)
        got = [m.eval(prompt, seq=2)[-1].tobytes(), m.decode([(0, 8), (2, steps[0])])[1].tobytes()]
        m.move(2, 1)
        assert (m.position(1), m.position(2)) == (len(prompt) + 1, 0)
        got += [m.decode([(0, 9), (1, t)])[1].tobytes() for t in steps[1:]]
        with pytest.raises(ArgumentError):
            m.move(0, 1)  # slot 1 is not empty
        with pytest.raises(ArgumentError):
            m.move(0, 3)
    assert got == ref


@pytest.mark.parametrize("repack", [True, False])
def test_repacked_dense_weights_take_whole_decode_steps(models, repack):
    """GGML's repacked CPU products take gemm from 4 rows, whose Q4_K bits differ from a lone row's; patch 0006
    makes them honour the rowwise hint (gemv per row), so a decode step of 8 sequences is one step with repacked
    dense weights as without, and every sequence is its lone run."""
    path = models[("qwen3moe", "q4_K")]
    opts = SessionOptions(n_threads=1, n_ctx=256, repack=repack)
    with MoEModel(path, opts.merged(n_parallel=8)) as m:
        assert bool(m.repacked) == repack
        assert m.repack_types == ({"CPU_REPACK"} if repack else set())
        assert m.decode_rows == opts.ubatch_size
    rng = np.random.default_rng(3)
    seqs = [(rng.integers(0, 384, k).tolist(), rng.integers(0, 384, 3).tolist()) for k in (3, 5, 2, 7, 4, 6, 1, 8)]
    got = batched(path, opts, seqs, [0] * 8)
    for i, (prompt, steps) in enumerate(seqs):
        assert got[i] == alone(path, opts, prompt, steps), f"sequence {i} differs from its lone run"
