"""A decode step's inputs written in place (StepFeed) are the inputs the general path builds, byte for byte.

The oracle is ``MoEModel._inputs`` (KVCache.inputs, the recurrent states' rows, M-RoPE positions, output
ids), built anew for the same step; and end to end, logits of a decode with the feeds equal those of the
same decode with every feed taken away.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_hybrid.model.kv_cache import SeqRows
from ggml_hybrid.model.step_feed import StepFeed
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

# (arch, options): plain attention, flash attention (F16 masks), sliding windows, latent attention, recurrent
# states with M-RoPE sections
CASES = {
    "qwen3moe": ("qwen3moe", {}),
    "qwen3moe_fa": ("qwen3moe", {"flash_attn": True}),
    "gpt-oss": ("gpt-oss", {}),
    "deepseek2": ("deepseek2", {}),
    "qwen35moe": ("qwen35moe", {}),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("feed")
    return {arch: write_model(d / f"{arch}.gguf", arch=arch, seed=3) for arch in {a for a, _ in CASES.values()}}


def _opts(extra, **kw):
    return SessionOptions(n_threads=1, n_ctx=512, **extra, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_feed_arrays_equal_the_general_inputs(paths, case, data):
    arch, extra = CASES[case]
    with MoEModel(paths[arch], _opts(extra, n_parallel=3)) as m:
        lens = data.draw(st.lists(st.integers(1, 300), min_size=3, max_size=3), label="prompt lengths")
        for seq, n in enumerate(lens):
            m.eval(list(range(1, n + 1)), seq=seq)
        seqs = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True).map(sorted), label="step")
        tokens = data.draw(st.lists(st.integers(0, m.hp.n_vocab - 1), min_size=len(seqs), max_size=len(seqs)))
        seq_rows = tuple(SeqRows(s, 1, m.kv.n_kv_for(1, s)) for s in seqs)
        entry = m._graph(seq_rows, len(seqs))
        assert entry.feed is not None, f"{case}: a decode step of {seqs} keeps the general path"
        m.sched.prepare(entry.graph)
        if m.rs is not None:
            for s in seqs:
                m.rs.begin(s)
        # then further steps on the same graph: the next position (the masks updated cell by cell), the same
        # one again (a failed step), or a jump (a truncation, a moved sequence)
        moves = data.draw(st.lists(st.sampled_from(["next", "same", "jump"]), max_size=6), label="moves")
        for move in ["first", *moves]:
            for s, rows in zip(seqs, seq_rows):
                if move == "next":
                    m.kv.used[s] = min(m.kv.used[s] + 1, rows.n_kv - 1)
                elif move == "jump":
                    m.kv.used[s] = data.draw(st.integers(1, rows.n_kv - 1), label="position")
            entry.feed.write(tokens)
            parts = [(s, np.array([t], np.int32)) for s, t in zip(seqs, tokens)]
            want = m._inputs(parts, seq_rows, len(seqs), "out_ids" in entry.inputs)
            assert set(entry.feed.arrays) == set(entry.inputs)
            for name in entry.inputs:
                got, exp = entry.feed.arrays[name], want[name]
                assert got.dtype == exp.dtype and got.shape == exp.shape, name
                assert got.tobytes() == exp.tobytes(), f"{case}: input {name} differs after {move}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_decoding_through_the_feeds_is_bit_identical_to_the_general_path(paths, case, monkeypatch):
    arch, extra = CASES[case]
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 300, 9).tolist()

    def run() -> list[bytes]:
        with MoEModel(paths[arch], _opts(extra)) as m:
            rows = [m.eval(prompt)[-1]]
            for _ in range(6):
                rows.append(m.eval([int(np.argmax(rows[-1]))])[-1])
            return [r.tobytes() for r in rows]

    fed = run()
    monkeypatch.setattr(StepFeed, "of", classmethod(lambda cls, *a: None))
    assert run() == fed


def test_prompts_keep_the_general_path(paths):
    arch, extra = CASES["qwen3moe"]
    with MoEModel(paths[arch], _opts(extra)) as m:
        m.eval([1, 2, 3])
        assert m._graph((SeqRows(0, 3, 256),), 1).feed is None  # three tokens: not a decode step
        assert m._graph((SeqRows(0, 1, 256),), 1).feed is not None


def test_step_io_refuses_an_array_of_another_dtype_or_size(paths):
    from ggml_hybrid.errors import ShapeError
    from ggml_hybrid.ggml.step_io import StepIO

    with MoEModel(paths["qwen3moe"], _opts({})) as m:
        g = m._graph((SeqRows(0, 1, 256),), 1)
        t = g.inputs["tokens"]
        with pytest.raises(ShapeError, match="tokens'.*int64"):
            StepIO([(t, np.zeros(1, np.int64))], g.logits)
        with pytest.raises(ShapeError, match="tokens'"):
            StepIO([(t, np.zeros(2, np.int32))], g.logits)
        name, arr = next((k, a) for k, a in g.feed.arrays.items() if a.size > 1)
        strided = np.zeros(2 * arr.size, arr.dtype)[::2].reshape(arr.shape)  # its size, not contiguous
        with pytest.raises(ShapeError, match="C-contiguous"):
            StepIO([(g.inputs[name], strided)], g.logits)
    import ggml_hybrid as gh

    with gh.Context() as ctx:
        w = ctx.new_tensor("q8_0", (4, 32), "w")
        with pytest.raises(ShapeError, match="output 'w' is quantized"):
            StepIO([], w)
        strided = ctx.transpose(ctx.new_tensor("f32", (4, 32), "x"))
        with pytest.raises(ShapeError, match="not contiguous"):
            StepIO([], strided)


def test_step_refuses_a_tensor_without_memory_before_computing(paths):
    """A StepIO with a tensor outside the graph's allocation: a clear error, nothing set, no abort in GGML."""
    import ggml_hybrid as gh
    from ggml_hybrid.errors import BackendError
    from ggml_hybrid.ggml.step_io import StepIO

    with MoEModel(paths["qwen3moe"], _opts({})) as m:
        m.eval([1, 2, 3])
        m.eval([4])
        g = m._graph((SeqRows(0, 1, 256),), 1)
        with gh.Context() as ctx:
            loose = ctx.new_tensor("i32", (1,), "loose")  # in no buffer
            io = StepIO([(loose, np.zeros(1, np.int32))], g.logits)
            with pytest.raises(BackendError, match="step, input: tensor 'loose' has no memory"):
                m.sched.step(g.graph, io)
            io = StepIO([(g.inputs["tokens"], np.zeros(1, np.int32))], loose)
            with pytest.raises(BackendError, match="step, output: tensor 'loose' has no memory"):
                m.sched.step(g.graph, io)
            io = StepIO([(loose, np.zeros(1, np.int32))], g.logits)
        # its context closed since: refused before any pointer of it is read
        from ggml_hybrid.errors import ClosedError

        with pytest.raises(ClosedError, match="StepIO belongs to a closed context"):
            m.sched.step(g.graph, io)
        # the model goes on as if nothing happened
        assert np.isfinite(m.eval([5])).all()


def test_step_sets_every_input_computes_and_returns_a_fresh_copy_of_the_output(paths):
    """Scheduler.step against the same graph computed the general way (set, compute, numpy)."""
    with MoEModel(paths["qwen3moe"], _opts({})) as m:
        m.eval([1, 2, 3])
        m.eval([4])  # the decode graph cached and allocated
        g = m._graph((SeqRows(0, 1, 256),), 1)
        assert g.feed is not None
        g.feed.write([7])
        first = m.sched.step(g.graph, g.feed.io)
        assert first.dtype == np.float32 and first.shape == g.logits.shape
        again = m.sched.step(g.graph, g.feed.io)  # the same inputs: the same logits, in a new array
        assert again is not first and again.tobytes() == first.tobytes()
        for name, t in g.inputs.items():
            t._set_trusted(g.feed.arrays[name])
        m.sched.compute(g.graph)
        assert g.logits.numpy().tobytes() == first.tobytes()
        # a step consumes the inputs as a compute does: a compute without setting them again is refused
        from ggml_hybrid.errors import BackendError

        for name, t in g.inputs.items():
            t._set_trusted(g.feed.arrays[name])
        m.sched.step(g.graph, g.feed.io)
        with pytest.raises(BackendError, match="not set since the last compute"):
            m.sched.compute(g.graph)


def test_logits_reader_reads_what_numpy_reads_and_refuses_what_it_cannot(paths):
    from ggml_hybrid.errors import ShapeError

    with MoEModel(paths["qwen3moe"], _opts({})) as m:
        m.eval([1, 2, 3])
        entry = m._graph((SeqRows(0, 1, 256),), 1)
        m.eval([4])
        got = entry.read_logits()
        assert got.dtype == np.float32 and got.shape == entry.logits.shape
        assert got.tobytes() == entry.logits.numpy().tobytes()
        assert got is not entry.read_logits()  # a fresh copy every call
    import ggml_hybrid as gh

    cpu = gh.cpu(1)
    with gh.Context() as ctx:
        w = ctx.new_tensor("q8_0", (4, 32), "w")
        ctx.allocate(cpu)
        with pytest.raises(ShapeError, match="quantized"):
            w.reader()
    cpu.close()


def test_feed_refuses_a_position_outside_its_graph_and_writes_nothing_past_the_arrays(paths):
    from ggml_hybrid.errors import IndexRangeError

    with MoEModel(paths["qwen3moe"], _opts({})) as m:
        m.eval([1, 2, 3])
        g = m._graph((SeqRows(0, 1, 256),), 1)
        before = {k: a.copy() for k, a in g.feed.arrays.items()}
        for p in (256, 10_000, -1):
            m.kv.used[0] = p
            with pytest.raises(IndexRangeError, match=f"sequence 0 is at position {p}, outside the 256 cells"):
                g.feed.write([5])
            assert all(a.tobytes() == before[k].tobytes() for k, a in g.feed.arrays.items())
        m.kv.used[0] = 3
        g.feed.write([5])
        assert g.feed.arrays["tokens"][0] == 5 and g.feed.arrays["pos"][0] == 3
