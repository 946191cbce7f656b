"""Prompt reuse (runtime/prompt_cache.py): a prompt sharing a prefix with what a slot holds evaluates only the rest,
and every logit the sampler sees is bit for bit the one of a cold run of the whole prompt (the oracle: a fresh
one-slot model evaluating it from empty), in every family, recurrent ones included."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FAMILY_SPECS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_hybrid.errors import ArgumentError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.engine import Engine, Request
from ggml_hybrid.runtime.moe_model import Checkpoint, MoEModel
from ggml_hybrid.runtime.prompt_cache import common_prefix
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import ARCHS, write_model

RECURRENT = ("qwen3next", "qwen35moe")
N_CTX = 128
SPECS = FAMILY_SPECS


def _write(tmp_path, arch: str) -> str:
    return write_model(tmp_path / "m.gguf", arch=arch, weight_type="q8_0", seed=4, **SPECS[arch])


class Recording(Sampler):
    """A greedy sampler that keeps a copy of every row of logits it is given."""

    def __init__(self) -> None:
        super().__init__(temperature=0.0)
        self.rows: list[np.ndarray] = []

    def __call__(self, logits: np.ndarray) -> int:
        self.rows.append(np.array(logits, copy=True))
        return super().__call__(logits)


def _run(e: Engine, prompt: list[int], max_tokens: int = 3, **kw) -> tuple[Request, Recording]:
    s = Recording()
    r = e.submit(Request(list(prompt), s, max_tokens, ignore_eos=True, **kw))
    assert r.done.wait(120)
    assert r.finish_reason == "length", r.error
    return r, s


def _cold(path: str, opts: SessionOptions, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The oracle: a fresh one-slot model evaluates the whole prompt, then each generated token."""
    with MoEModel(path, opts.merged(n_parallel=1)) as m:
        rows = [m.eval(prompt)[-1]]
        for t in tokens[:-1]:
            rows.append(m.eval([t])[-1])
    return rows


def _prompts(n_vocab: int, shared: int, tails: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = [int(t) for t in rng.integers(0, n_vocab, shared)]
    return [base + [int(t) for t in rng.integers(0, n_vocab, k)] for k in tails]


CASES = [pytest.param(a, {}, id=a) for a in ARCHS] + [
    pytest.param("qwen3moe", {"batch_size": 12}, id="qwen3moe-batch12"),  # cuts at 8, 12, 20, 24, 32, ...
    pytest.param("qwen3moe", {"flash_attn": True, "cache_type_k": "q8_0", "cache_type_v": "q8_0"},
                 id="qwen3moe-flash-q8cache"),
]


@pytest.mark.parametrize("arch,extra", CASES)
def test_a_shared_prefix_evaluates_only_the_rest_bit_for_bit(tmp_path, arch, extra):
    path = _write(tmp_path, arch)
    opts = SessionOptions(n_threads=1, n_ctx=N_CTX, n_parallel=2, ubatch_size=8, **extra)
    with MoEModel(path, opts) as m:
        p1, p2 = _prompts(m.hp.n_vocab, 30, (5, 7))
        e = Engine(m)
        try:
            r1, _ = _run(e, p1)
            r2, s2 = _run(e, p2, 4)
            r3, s3 = _run(e, p2, 2)  # the same prompt again: everything but its last ubatch's tokens
            stats = e.stats
            held = e.slots()
        finally:
            e.close()
        # the cuts a cold run of p2 makes below the 30 shared tokens (and of p2 itself below its 37)
        cuts = [c for c in m.ubatch_ends(len(p2)) if c <= 30]
        cuts_p2 = [c for c in m.ubatch_ends(len(p2)) if c < len(p2)]
    assert r1.n_reused == 0
    assert r2.n_reused == cuts[-1] > 0 and r3.n_reused == cuts_p2[-1]
    assert stats.prompt_tokens_reused == r2.n_reused + r3.n_reused
    assert stats.prompt_tokens_evaluated == len(p1) + 2 * len(p2) - r2.n_reused - r3.n_reused
    assert sum(1 for h in held if h["prompt_tokens"]) == 1  # p2 went to p1's slot, and again
    for r, s in ((r2, s2), (r3, s3)):
        cold = _cold(path, opts, p2, r.tokens)
        assert len(s.rows) == len(cold)
        for got, want in zip(s.rows, cold):
            assert np.array_equal(got, want)  # bit for bit, every step


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_recurrent_model_reuses_only_up_to_a_checkpoint(tmp_path, arch):
    """With one checkpoint per slot (the last fixed cut, 32), a prompt sharing 30 tokens finds none at or before
    them and is evaluated whole (a KV family would keep 24); one sharing 34 keeps 32; both bit for bit."""
    path = _write(tmp_path, arch)
    opts = SessionOptions(n_threads=1, n_ctx=N_CTX, n_parallel=1, ubatch_size=8)
    with MoEModel(path, opts) as m:
        p1, p2 = _prompts(m.hp.n_vocab, 30, (7, 6), seed=1)
        p3 = p1[:34] + [(p1[34] + 1) % m.hp.n_vocab, 5]
        e = Engine(m, max_checkpoints=1)
        try:
            _run(e, p1)
            assert e.slots()[0]["checkpoints"] == [32]
            r2, s2 = _run(e, p2)
            _run(e, p1)
            r3, s3 = _run(e, p3)
        finally:
            e.close()
    assert r2.n_reused == 0 and r3.n_reused == 32
    for p, r, s in ((p2, r2, s2), (p3, r3, s3)):
        for got, want in zip(s.rows, _cold(path, opts, p, r.tokens), strict=True):
            assert np.array_equal(got, want)


def test_a_request_takes_the_slot_holding_its_prefix_and_cache_prompt_false_takes_none(tmp_path):
    path = _write(tmp_path, "qwen3moe")
    opts = SessionOptions(n_threads=1, n_ctx=N_CTX, n_parallel=3, ubatch_size=8)
    with MoEModel(path, opts) as m:
        a, b = _prompts(m.hp.n_vocab, 0, (20, 20), seed=2)
        e = Engine(m)
        try:
            ra, _ = _run(e, a)
            rb = e.submit(Request(b, Sampler(temperature=0.0), 2, ignore_eos=True))  # a free slot that is empty
            assert rb.done.wait(60) and rb.seq != ra.seq
            r, s = _run(e, b[:17] + [1, 2, 3])
            assert r.seq == rb.seq and r.n_reused == 16
            off, s_off = _run(e, b[:17] + [1, 2, 3], cache_prompt=False)
            assert off.n_reused == 0 and off.seq not in (ra.seq, rb.seq)  # the empty slot, not a held one
            assert [x["prompt_tokens"] for x in e.slots()].count(0) == 1  # cache_prompt=False left nothing held
        finally:
            e.close()
    assert r.tokens == off.tokens
    for x, y in zip(s.rows, s_off.rows, strict=True):
        assert np.array_equal(x, y)


def test_checkpoint_and_restore_refuse_what_does_not_fit(tmp_path):
    path = _write(tmp_path, "qwen3next")
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=N_CTX, n_parallel=2)) as m:
        m.eval([1, 2, 3], seq=0)
        cp = m.checkpoint(0)
        assert cp.position == 3 and cp.nbytes == m.rs.bytes_per_sequence
        with pytest.raises(ArgumentError, match="past the 0 positions"):
            m.restore(cp, seq=1)
        with pytest.raises(ArgumentError, match="not of this model"):
            m.restore(Checkpoint(2, None), seq=0)
        with pytest.raises(ArgumentError, match="rows"):
            m.rs.load(0, cp.states[:-1])
        m.eval([4, 5], seq=0)
        m.restore(cp, seq=0)
        assert m.position(0) == 3
        again = m.eval([4, 5], seq=0)
        m.reset()
        assert np.array_equal(again, m.eval([1, 2, 3, 4, 5]))


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([5], [6], 0)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


@pytest.fixture(scope="module", params=[("qwen3moe", 6, 4), ("qwen3moe", 2048, 8), ("qwen35moe", 10, 4)],
                ids=["qwen3moe-b6-ub4", "qwen3moe-ub8", "qwen35moe-b10-ub4"])
def served(request, tmp_path_factory):
    """An engine of 2 slots that keeps what earlier examples left in them, a one-slot oracle model, and the prompts
    the engine has seen."""
    arch, batch, ubatch = request.param
    path = _write(tmp_path_factory.mktemp("prop"), arch)
    opts = SessionOptions(n_threads=1, n_ctx=64, n_parallel=2, batch_size=batch, ubatch_size=ubatch)
    with MoEModel(path, opts) as m, MoEModel(path, opts.merged(n_parallel=1)) as oracle:
        e = Engine(m, max_checkpoints=2)
        try:
            yield e, oracle, []
            assert e.stats.prompt_tokens_reused > 0  # the examples did reuse (the property is not vacuous)
        finally:
            e.close()


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_sequence_of_prompts_sharing_prefixes_gives_cold_logits(served, data):
    """Prompts drawn as edits of earlier ones (shared prefixes of every length, any ubatch cut): each request's
    logits, every step, equal a cold run's; what it reused is a cut of its cold run below the shared prefix."""
    e, oracle, seen = served  # seen: every prompt the engine was given (its slots may hold earlier examples')
    n_vocab = oracle.hp.n_vocab
    tokens = st.integers(0, n_vocab - 1)
    history: list[list[int]] = []
    for _ in range(data.draw(st.integers(2, 4))):
        if history and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(history))
            keep = data.draw(st.integers(0, len(base)))
            prompt = base[:keep] + data.draw(st.lists(tokens, min_size=1, max_size=12))
        else:
            prompt = data.draw(st.lists(tokens, min_size=9, max_size=40))
        prompt = prompt[:50]
        r, s = _run(e, prompt, data.draw(st.integers(1, 3)))
        assert r.n_reused == 0 or r.n_reused in oracle.ubatch_ends(len(prompt))
        assert r.n_reused < len(prompt)
        assert r.n_reused <= max((common_prefix(h, prompt) for h in seen), default=0)
        oracle.reset()
        rows = [oracle.eval(prompt)[-1]]
        for t in r.tokens[:-1]:
            rows.append(oracle.eval([t])[-1])
        for got, want in zip(s.rows, rows, strict=True):
            assert np.array_equal(got, want)
        history.append(prompt)
        seen.append(prompt)
