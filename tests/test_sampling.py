"""The sampler chain against a numpy float64 oracle written from llama.cpp's definitions (llama-sampler.cpp).

The oracle is deliberately plain: a Counter over the last n accepted tokens, a sort by (-logit, id),
loops for top-p and min-p. ``Sampler.candidates`` must give the same candidate set and
probabilities; ``Sampler.__call__`` draws only from them, with their frequencies.
"""

from __future__ import annotations

import math
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_hybrid.errors import ArgumentError
from ggml_hybrid.runtime.sampling import Sampler


def oracle(logits, history, temp, top_k, top_p, min_p, rp, last_n, presence, frequency) -> dict[int, float]:
    z = [float(x) for x in logits]
    if last_n and (rp != 1.0 or presence != 0.0 or frequency != 0.0):
        for tok, count in Counter(history[-last_n:]).items():
            z[tok] = z[tok] * rp if z[tok] <= 0 else z[tok] / rp
            z[tok] -= count * frequency + presence
    if temp == 0:
        best = max(range(len(z)), key=lambda i: (z[i], -i))
        return {best: 1.0}
    cand = sorted(range(len(z)), key=lambda i: (-z[i], i))
    if top_k:
        cand = cand[:top_k]
    if top_p < 1:
        m = z[cand[0]]
        w = [math.exp(z[i] - m) for i in cand]
        total, cum, keep = sum(w), 0.0, []
        for i, wi in zip(cand, w):
            keep.append(i)
            cum += wi / total
            if cum >= top_p:
                break
        cand = keep
    if min_p > 0:
        m = z[cand[0]]
        cand = [i for i in cand if z[i] >= m + math.log(min_p)] or cand[:1]
    m = max(z[i] / temp for i in cand)
    w = [math.exp(z[i] / temp - m) for i in cand]
    return {i: wi / sum(w) for i, wi in zip(cand, w)}


def candidates(s: Sampler, logits) -> dict[int, float]:
    ids, p = s.candidates(logits)
    return dict(zip(ids.tolist(), p.tolist()))


settings_ = st.fixed_dictionaries({
    "temp": st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.5]),
    "top_k": st.sampled_from([0, 1, 3, 40]),
    "top_p": st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    "rp": st.sampled_from([1.0, 1.1, 1.5, 0.8]),
    "last_n": st.sampled_from([0, 1, 4, 64]),
    "presence": st.sampled_from([0.0, 0.5, -0.25]),
    "frequency": st.sampled_from([0.0, 0.3]),
})


@settings(max_examples=300, deadline=None)
@given(cfg=settings_, seed=st.integers(0, 2**32 - 1), n_vocab=st.integers(1, 60), n_hist=st.integers(0, 30))
def test_candidates_equal_the_oracle(cfg, seed, n_vocab, n_hist):
    rng = np.random.default_rng(seed)
    # few distinct values: ties, and cut points that fall between equal logits, are common
    logits = rng.choice([-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0, 4.0], n_vocab) + rng.normal(0, 1e-3, n_vocab) \
        * rng.integers(0, 2)
    history = rng.integers(0, n_vocab, n_hist).tolist()
    s = Sampler(temperature=cfg["temp"], top_k=cfg["top_k"], top_p=cfg["top_p"], min_p=cfg["min_p"],
                repeat_penalty=cfg["rp"], repeat_last_n=cfg["last_n"], presence_penalty=cfg["presence"],
                frequency_penalty=cfg["frequency"])
    for t in history:
        s.accept(t)
    got = candidates(s, logits)
    want = oracle(logits, history, **cfg)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12)


def test_penalties_follow_llama_cpp_arithmetic():
    logits = np.array([2.0, -1.0, 0.5, 3.0])
    s = Sampler(repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5, repeat_last_n=3)
    for t in (0, 0, 1, 3):  # the window keeps the last 3: 0, 1, 3
        s.accept(t)
    z = s.penalized(logits)
    # positive logits are divided, non-positive multiplied, then count * frequency + presence subtracted
    assert z.tolist() == [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25]
    s.reset()
    assert s.penalized(logits).tolist() == logits.tolist()


def test_greedy_is_the_argmax_of_the_penalized_logits():
    logits = np.array([1.0, 5.0, 4.9])
    s = Sampler(repeat_penalty=1.5)
    assert s(logits) == 1
    s.accept(1)
    assert s(logits) == 2  # 5.0 / 1.5 < 4.9
    assert Sampler()(logits) == 1  # no penalty: plain argmax, whatever the filters


def test_draws_follow_the_candidate_probabilities():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    n = 20000
    draws = np.bincount([s(logits) for _ in range(n)], minlength=4) / n
    np.testing.assert_allclose(draws, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35, seed=7)  # keeps p >= 0.35 * 0.5
    assert {s(logits) for _ in range(500)} == {0, 1}


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).standard_normal(100)
    a = [Sampler(temperature=1.0, seed=3)(logits) for _ in range(3)]
    s1, s2 = Sampler(temperature=1.0, seed=3), Sampler(temperature=1.0, seed=3)
    assert [s1(logits) for _ in range(50)] == [s2(logits) for _ in range(50)]
    assert len(set(a)) == 1


def test_defaults_are_llama_cpp_s_but_greedy():
    s = Sampler()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.repeat_last_n, s.presence_penalty,
            s.frequency_penalty) == (0.0, 40, 0.95, 0.05, 1.0, 64, 0.0, 0.0)


@pytest.mark.parametrize("kw", [dict(min_p=-0.1), dict(min_p=1.5), dict(repeat_penalty=0.0),
                                dict(repeat_penalty=float("inf")), dict(repeat_last_n=-1),
                                dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf"))])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ArgumentError):
        Sampler(**kw)


# -- issue 28, item 7/15/16: values the rules accept never make the sampler draw from NaN --------------------

def _oracle_greedy_with_penalties(logits, seen, presence, frequency, repeat):
    """The penalized argmax (every tied token) in plain Python floats, overflow taken as the clipped finite range."""
    big = sys.float_info.max
    z = [float(x) for x in logits]
    for t, c in Counter(seen).items():
        v = z[t]
        v = v * repeat if v <= 0 else v / repeat
        v = max(-big, min(big, v))
        pen = max(-big, min(big, max(-big, min(big, c * frequency)) + presence))
        z[t] = max(-big, min(big, v - pen))
    return {i for i in range(len(z)) if z[i] == max(z)}


@pytest.mark.parametrize("presence, frequency", [(-1e308, 0.0), (1e308, 0.0), (0.0, -1e308), (0.0, 1e308),
                                                 (-1e308, -1e308), (1e308, -1e308)])
@pytest.mark.parametrize("temp", [0.0, 1e-320, 0.8])
def test_extreme_penalties_and_temperatures_choose_without_nan(presence, frequency, temp):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(64) * 4
    seen = [3, 3, 7, 11, 3, 40]
    s = Sampler(temperature=temp, presence_penalty=presence, frequency_penalty=frequency, seed=1)
    for t in seen:
        s.accept(t)
    z = s.penalized(logits)
    assert not np.isnan(z).any() and np.isfinite(z).all()
    ids, p = s.candidates(logits)
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-12 and (p >= 0).all()
    tok = s(logits)
    if temp < 1e-300:  # a vanishing temperature draws the penalized argmax
        assert tok in _oracle_greedy_with_penalties(logits, seen, presence, frequency, 1.0)
    bonus = presence < 0 or frequency < 0
    if bonus and not (presence > 0 or frequency > 0):
        assert tok in seen  # a huge bonus: only seen tokens can win


def test_a_subnormal_temperature_is_the_argmax():
    logits = np.random.default_rng(3).standard_normal(200)
    for temp in (1e-320, 5e-324, 1e-300):
        assert Sampler(temperature=temp, seed=0, top_k=0, top_p=1.0, min_p=0.0)(logits) == int(np.argmax(logits))


def test_huge_repeat_penalty_quotients_stay_finite():
    s = Sampler(temperature=0.7, repeat_penalty=1e-300, seed=4)
    logits = np.array([1e10, 5.0, -3.0, 2.0])
    for t in (0, 1):
        s.accept(t)
    ids, p = s.candidates(logits)
    assert np.isfinite(p).all() and ids[0] == 0


@pytest.mark.parametrize("logits", [[0.0, np.inf], [np.nan, 1.0], [-np.inf, -np.inf]])
def test_non_finite_logits_are_one_typed_error(logits):
    with pytest.raises(ArgumentError, match="logits must hold at least one finite value"):
        Sampler(temperature=0.8, seed=1)(logits)


def test_masked_tokens_stay_masked_under_extreme_penalties():
    s = Sampler(temperature=0.9, presence_penalty=-1e308, frequency_penalty=-1e308, seed=5)
    logits = np.array([-np.inf, 0.5, -np.inf, 0.1])
    for t in (0, 2, 0):
        s.accept(t)
    ids, p = s.candidates(logits)
    assert np.isfinite(p).all()
    assert all(p[list(ids).index(t)] == 0 for t in (0, 2) if t in ids)
    assert s(logits) in (1, 3)
