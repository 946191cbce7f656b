"""Log-probabilities of sampled tokens: the model's distribution, from the very logits the sampler saw.

``logprob(t) = logit(t) - log(sum(exp(logits)))`` in float64 (the largest logit taken out first, so no
exp overflows), as OpenAI reports them: the model's own distribution, before temperature or any
truncation the sampler applies (llama.cpp's ``n_probs`` without ``post_sampling_probs``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


class TokenLogprob(NamedTuple):
    """A sampled token, its log-probability, and the ``k`` likeliest tokens with theirs (likeliest first)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The log-probabilities of one row of logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x)
    if not np.isfinite(m):  # all -inf (nothing possible) or a NaN/inf logit: no distribution to speak of
        return np.full_like(x, np.nan)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits`` and the ``k`` likeliest tokens (likeliest first, equal ones
    by id)."""
    lp = log_softmax(logits)
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, lp.size)
        part = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        order = part[np.lexsort((part, -lp[part]))]
        top = [(int(i), float(lp[i])) for i in order]
    return TokenLogprob(int(token), float(lp[token]), top)


__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "log_softmax", "token_logprob"]
