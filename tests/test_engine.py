"""The continuous-batching engine: texts equal to one request at a time, stops, cancellation, limits."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ggml_hybrid.errors import ArgumentError, ClosedError, ContextFullError
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.engine import Engine, Request, StepRate, StopText
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.synthetic import write_model

PROMPTS = ["The cache runs the hits first", "a", "Once upon a time in a land far away there lived a", "misses",
           "then the", "CPU share of", "experts, in rounds", "slots"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("eng") / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)


def _model(path, n_parallel, **kw):
    return MoEModel(path, SessionOptions(n_threads=1, n_ctx=128, n_parallel=n_parallel, ubatch_size=4, **kw))


def _run(m: MoEModel, prompts, temp=0.0, max_tokens=12, **kw):
    e = Engine(m)
    try:
        reqs = [e.submit(Request(m.tokenizer.encode(p), Sampler(temperature=temp, seed=i), max_tokens, **kw))
                for i, p in enumerate(prompts)]
        for r in reqs:
            assert r.done.wait(60)
        return [(r.text, r.tokens, r.finish_reason) for r in reqs], e.stats
    finally:
        e.close()


def test_concurrent_requests_give_the_texts_of_one_at_a_time(path):
    """Greedy and seeded: 8 requests over 3 slots (queueing, joining, leaving) equal one-slot runs, which equal
    generate() on a fresh model."""
    with _model(path, 1) as m:
        one, _ = _run(m, PROMPTS)
        seeded_one, _ = _run(m, PROMPTS, temp=0.9)
        ref = [complete(m, m.tokenizer.encode(p), 12, Sampler(temperature=0.0)) for p in PROMPTS[:3]]
    with _model(path, 3) as m:
        many, stats = _run(m, PROMPTS)
        seeded_many, _ = _run(m, PROMPTS, temp=0.9)
    assert many == one and seeded_many == seeded_one
    assert [t for t, _, _ in one[:3]] == [text for text, _ in ref]
    assert stats.decode_steps < sum(len(toks) for _, toks, _ in many)  # steps were shared
    assert sum(stats.requests.values()) == 8 and set(stats.requests) <= {"length", "stop"}
    assert stats.busy_slots == 0 and stats.queued == 0


def test_stop_strings_end_the_text_before_them(path):
    with _model(path, 2) as m:
        (full, _, _), = _run(m, [PROMPTS[0]], max_tokens=24)[0]
        cut = full[len(full) // 3: len(full) // 3 + 2]
        assert cut and cut in full
        (text, _, reason), = _run(m, [PROMPTS[0]], max_tokens=24, stop=[cut, "never-there"])[0]
    assert text == full[:full.index(cut)] and reason == "stop"


@given(pieces=st.lists(st.text("ab", max_size=3), max_size=8), stops=st.lists(st.text("ab", min_size=1, max_size=3),
                                                                                 max_size=3))
def test_stop_text_releases_exactly_the_text_before_the_first_stop(pieces, stops):
    s = StopText(stops)
    out, hit = [], False
    for p in pieces:
        text, hit = s.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(s.flush())
    # the oracle: the first prefix of pieces that contains a stop string is cut at the earliest stop in it
    for k in range(1, len(pieces) + 1):
        acc = "".join(pieces[:k])
        found = [acc.find(x) for x in stops if x in acc]
        if found:
            assert hit and "".join(out) == acc[:min(found)]
            return
    assert not hit and "".join(out) == "".join(pieces)


def test_cancel_frees_the_slot_before_the_next_step(path):
    with _model(path, 1) as m:
        e = Engine(m)
        started = threading.Event()
        long = Request(m.tokenizer.encode(PROMPTS[0]), Sampler(), max_tokens=100, ignore_eos=True,
                       listener=started.set)
        waiting = Request(m.tokenizer.encode(PROMPTS[1]), Sampler(), max_tokens=3, ignore_eos=True)
        e.submit(long)
        e.submit(waiting)
        assert started.wait(30)
        long.cancel()
        assert long.done.wait(30) and waiting.done.wait(30)
        assert long.finish_reason == "cancelled" and long.completion_tokens < 100
        assert waiting.finish_reason == "length" and waiting.completion_tokens == 3
        queued = Request([1, 2], Sampler(), max_tokens=3)
        queued.cancel()
        e.submit(queued)
        assert queued.done.wait(30) and queued.finish_reason == "cancelled" and not queued.tokens
        e.close()
        assert e.stats.requests == {"cancelled": 2, "length": 1}


def test_limits_and_refusals(path):
    with _model(path, 2) as m:
        e = Engine(m)
        with pytest.raises(ContextFullError):
            e.submit(Request(list(range(1, 129)), Sampler()))
        with pytest.raises(ArgumentError):
            e.submit(Request([384], Sampler()))
        with pytest.raises(ArgumentError):
            Request([], Sampler())
        with pytest.raises(ArgumentError):
            Request([1], Sampler(), max_tokens=0)
        # a full context ends the generation with "length"
        r = e.submit(Request(list(range(1, 120)), Sampler(), max_tokens=None, ignore_eos=True))
        assert r.done.wait(60) and r.finish_reason == "length" and len(r.prompt) + r.completion_tokens == 129
        e.close()
        with pytest.raises(ClosedError):
            e.submit(Request([1], Sampler()))


def test_close_cancels_what_runs_and_what_waits(path):
    with _model(path, 1) as m:
        e = Engine(m)
        reqs = [e.submit(Request([1, 2, 3], Sampler(), max_tokens=None, ignore_eos=True)) for _ in range(3)]
        e.close(timeout=30)
        assert all(r.done.is_set() and r.finish_reason in ("cancelled", "length") for r in reqs)
        assert any(r.finish_reason == "cancelled" for r in reqs)


def test_a_failing_step_fails_its_requests_only(path, monkeypatch):
    with _model(path, 2) as m:
        e = Engine(m)
        calls = {"n": 0}
        real = m.decode

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure")
            return real(batch)

        monkeypatch.setattr(m, "decode", flaky)
        a = e.submit(Request([1, 2], Sampler(), max_tokens=5, ignore_eos=True))
        assert a.done.wait(30) and a.finish_reason == "error" and "injected" in (a.error or "")
        b = e.submit(Request([3, 4], Sampler(), max_tokens=5, ignore_eos=True))
        assert b.done.wait(30) and b.finish_reason == "length" and b.completion_tokens == 5
        e.close()


def test_finished_requests_leave_the_others_packed_in_the_lowest_slots(path):
    """Requests of different lengths finish at different steps; the engine moves the highest busy slots down
    (so decode steps meet few graphs), and every text is still the one-slot run's."""
    lengths = [3, 12, 5, 9]
    with _model(path, 1) as m:
        e = Engine(m)
        try:
            one = []
            for i, p in enumerate(PROMPTS[:4]):
                r = e.submit(Request(m.tokenizer.encode(p), Sampler(), lengths[i], ignore_eos=True))
                assert r.done.wait(60)
                one.append(r.tokens)
        finally:
            e.close()
    with _model(path, 4) as m:
        e = Engine(m)
        try:
            # without prompt reuse a finished request's slot is emptied at once (with it, a slot that holds a
            # prompt is kept for a later one and nothing moves into it: test_prompt_cache.py)
            reqs = [e.submit(Request(m.tokenizer.encode(p), Sampler(), lengths[i], ignore_eos=True,
                                     cache_prompt=False)) for i, p in enumerate(PROMPTS[:4])]
            for r in reqs:
                assert r.done.wait(60)
            stats = e.stats
        finally:
            e.close()
        assert [r.tokens for r in reqs] == one
        assert stats.moves >= 1
        assert all(m.position(s) == 0 for s in range(4))


@given(st.lists(st.tuples(st.integers(0, 3 * 10**9), st.integers(1, 10**8), st.integers(1, 8)), max_size=60),
       st.lists(st.integers(0, 4 * 10**9), min_size=1, max_size=8))
def test_step_rate_is_the_rate_of_the_steps_in_its_window(gaps, reads):
    """The running sums give exactly what a fresh sum over the window's steps gives, read at any times."""
    rate = StepRate(window=1.0)
    steps, now, reads = [], 0, sorted(reads)
    for gap, dur, n in gaps:
        now += gap
        while reads and reads[0] <= now:
            t = reads.pop(0)
            kept = [(d, k) for e, d, k in steps if e >= t - 10**9]
            busy = sum(d for d, _ in kept)
            assert rate.rate(t) == (sum(k for _, k in kept) / (busy / 1e9) if busy else 0.0)
            steps = [(e, d, k) for e, d, k in steps if e >= t - 10**9]
        rate.add(now, dur, n)
        steps.append((now, dur, n))


class _FailingSampler(Sampler):
    """A greedy sampler whose choice raises once ``watch`` has finished (a sequence that fails mid-generation in the
    very step where another one ends: ``watch`` sits in a lower slot, so it is handled first in that step)."""

    def __init__(self, watch: Request) -> None:
        super().__init__(temperature=0.0)
        self.watch = watch

    def __call__(self, logits):
        if self.watch.done.is_set():
            raise RuntimeError("this sequence's choice failed")
        return super().__call__(logits)


def test_a_failing_sequence_fails_alone_and_a_finished_one_stays_finished(path):
    """Issue 28 items 7 and 10: in one decode step, slot 0 finishes (length) and slot 1's choice fails; the failure
    ends slot 1 only: slot 0 stays "length" (counted once), slot 2's text is its lone run's."""
    with _model(path, 1) as m:
        (alone,), _ = _run(m, [PROMPTS[2]], max_tokens=10)
    with _model(path, 3) as m:
        e = Engine(m)
        try:
            enc = m.tokenizer.encode
            a = Request(enc(PROMPTS[1]), Sampler(temperature=0.0), 8, ignore_eos=True)
            b = Request(enc(PROMPTS[1]), _FailingSampler(a), None, ignore_eos=True)
            c = Request(enc(PROMPTS[2]), Sampler(temperature=0.0), 10)
            for r in (a, b, c):
                e.submit(r)
            for r in (a, b, c):
                assert r.done.wait(60)
            stats = e.stats
        finally:
            e.close()
    assert (a.finish_reason, len(a.tokens), a.error) == ("length", 8, None)
    assert b.finish_reason == "error" and "choice failed" in (b.error or "") and 0 < len(b.tokens) < 8
    assert (c.text, c.tokens, c.finish_reason) == alone
    want = {"length": 1, "error": 1}
    want[alone[2]] = want.get(alone[2], 0) + 1
    assert stats.requests == want


class _Seen(Sampler):
    """A sampler that keeps a copy of every row of logits it is given."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rows: list[np.ndarray] = []

    def __call__(self, logits):
        self.rows.append(np.array(logits, copy=True))
        return super().__call__(logits)


@pytest.mark.parametrize("k", [0, 1, 7])
def test_logprobs_are_the_log_softmax_of_the_logits_the_sampler_saw(path, k):
    """Sampled at temperature 0.9 with penalties (which change what the sampler draws from, not the model's
    distribution): each token's logprob and the k likeliest are a float64 log-softmax of the row it was drawn
    from (numpy's logaddexp, not the engine's formula)."""
    with _model(path, 2) as m:
        e = Engine(m)
        try:
            s = _Seen(temperature=0.9, seed=3, repeat_penalty=1.3, presence_penalty=0.5)
            r = e.submit(Request(m.tokenizer.encode(PROMPTS[2]), s, 8, ignore_eos=True, logprobs=k))
            plain = e.submit(Request(m.tokenizer.encode(PROMPTS[2]), Sampler(temperature=0.9, seed=3), 8))
            assert r.done.wait(60) and plain.done.wait(60)
        finally:
            e.close()
    assert len(r.token_logprobs) == len(r.tokens) == len(s.rows) == 8 and plain.token_logprobs == []
    for e_, tok, row in zip(r.token_logprobs, r.tokens, s.rows, strict=True):
        x = row.astype(np.float64)
        lp = x - np.logaddexp.reduce(x)
        assert e_.token == tok and e_.logprob == pytest.approx(lp[tok], rel=1e-12, abs=1e-12)
        want = sorted(range(lp.size), key=lambda i: (-lp[i], i))[:k]
        assert [t for t, _ in e_.top] == want
        assert [v for _, v in e_.top] == pytest.approx([lp[i] for i in want], rel=1e-12, abs=1e-12)
    assert r.take_logprobs() == r.token_logprobs and r.take_logprobs() == []


def test_between_steps_runs_on_the_engine_thread_never_inside_a_step(path):
    """A call given to between_steps runs on the engine thread: at once when it is idle, and between two steps
    while a request runs (the steps counted before it equal those its caller saw end, none half done)."""
    with _model(path, 1) as m:
        inside = threading.Event()
        seen: list[tuple[str, int, bool]] = []
        eval_, decode = m.eval, m.decode

        def marked(fn):
            def run(*a, **kw):
                inside.set()
                try:
                    return fn(*a, **kw)
                finally:
                    inside.clear()
            return run

        m.eval, m.decode = marked(eval_), marked(decode)
        e = Engine(m)
        try:
            def record(done: threading.Event) -> None:
                seen.append((threading.current_thread().name, e.stats.decode_steps, inside.is_set()))
                done.set()

            idle = threading.Event()
            e.between_steps(lambda: record(idle))
            assert idle.wait(60)
            r = e.submit(Request(m.tokenizer.encode("a"), Sampler(temperature=0.0), 30))
            calls = []
            while not r.done.is_set() and len(calls) < 5:
                ev = threading.Event()
                e.between_steps(lambda ev=ev: record(ev))
                assert ev.wait(60)
                calls.append(ev)
            assert r.done.wait(60)
        finally:
            e.close()
    with pytest.raises(ClosedError):
        e.between_steps(lambda: None)  # a closed engine runs nothing more: said at once
    assert all(name == "engine-model" and not busy for name, _, busy in seen), seen
    steps = [n for _, n, _ in seen]
    assert steps == sorted(steps) and e.stats.decode_ns > 0 and e.stats.prompt_ns > 0
