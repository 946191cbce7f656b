"""Next-token choice from logits: llama.cpp's common sampler chain, greedy or seeded.

The stages and their order are llama.cpp's default chain (``common/sampling.cpp``, without the
stages this package does not implement: DRY, top-n-sigma, typical, XTC, mirostat):

1. penalties over the last ``repeat_last_n`` accepted tokens (prompt and generated): a token seen
   ``c`` times has its logit divided by ``repeat_penalty`` (multiplied when it is <= 0), then
   ``c * frequency_penalty + presence_penalty`` subtracted;
2. top-k (0 = off);
3. top-p on the softmax of the surviving logits: the smallest prefix reaching ``top_p``;
4. min-p: the tokens whose probability is at least ``min_p`` times the largest one's;
5. temperature, then a draw from the softmax (``temperature == 0``: the largest logit).

With ``temperature == 0`` stages 2-4 cannot change the winner, so greedy is the argmax of the
penalized logits, as in llama.cpp. The defaults are llama.cpp's, but for the temperature: 0 here
(greedy, reproducible), 0.8 there. A ``Sampler`` owns its ``numpy.random.Generator``, so the same
seed gives the same tokens (not llama.cpp's: its generator is another one).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..checks import check_int, check_real
from ..errors import ArgumentError, ArgumentTypeError


def _logits(logits: npt.ArrayLike) -> np.ndarray:
    """``logits`` as a flat float64 array of at least one value, none NaN (the sampler would draw from garbage)."""
    try:
        z = np.array(logits, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"Sampler: logits must be an array of numbers, got {type(logits).__name__}") from None
    if z.size == 0 or np.isnan(z).any():
        raise ArgumentError(f"Sampler: logits must hold at least one value and no NaN, got {z.size} values"
                            f"{' with NaN' if z.size else ''}")
    return z


@dataclass
class Sampler:
    temperature: float = 0.0      # 0: greedy (argmax of the penalized logits)
    top_k: int = 40               # 0: no limit
    top_p: float = 0.95           # 1: no limit
    min_p: float = 0.05           # 0: no limit
    repeat_penalty: float = 1.0   # 1: off
    repeat_last_n: int = 64       # 0: penalties off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    _rng: np.random.Generator = field(init=False, repr=False)
    _window: deque[int] = field(init=False, repr=False)
    _counts: Counter[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_real(self.temperature, "Sampler: temperature", 0.0)
        check_int(self.top_k, "Sampler: top_k", 0)
        check_real(self.top_p, "Sampler: top_p", 0.0, 1.0, lo_open=True)
        check_real(self.min_p, "Sampler: min_p", 0.0, 1.0)
        check_real(self.repeat_penalty, "Sampler: repeat_penalty", 0.0, lo_open=True)
        check_int(self.repeat_last_n, "Sampler: repeat_last_n", 0)
        check_real(self.presence_penalty, "Sampler: presence_penalty")
        check_real(self.frequency_penalty, "Sampler: frequency_penalty")
        if self.seed is not None:
            check_int(self.seed, "Sampler: seed", 0)
        self._rng = np.random.default_rng(self.seed)
        self._window = deque()
        self._counts = Counter()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                           or self.presence_penalty != 0.0)

    # -- history (the penalties' input) ----------------------------------------

    def accept(self, token: int) -> None:
        """Record a token of the sequence (prompt or generated) for the penalties."""
        if self.repeat_last_n == 0:
            return
        self._window.append(int(token))
        self._counts[int(token)] += 1
        if len(self._window) > self.repeat_last_n:
            old = self._window.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]

    def reset(self) -> None:
        """Forget the accepted tokens (a new sequence); the random state goes on."""
        self._window.clear()
        self._counts.clear()

    # -- the chain ---------------------------------------------------------------

    def penalized(self, logits: npt.ArrayLike) -> np.ndarray:
        """Stage 1: the logits (float64) with the penalties of the accepted tokens applied."""
        z = _logits(logits)
        if not self.penalizes or not self._counts:
            return z
        ids = np.fromiter((t for t in self._counts if 0 <= t < z.size), dtype=np.int64)
        if ids.size:
            counts = np.array([self._counts[int(t)] for t in ids], dtype=np.float64)
            v = z[ids]
            v = np.where(v <= 0, v * self.repeat_penalty, v / self.repeat_penalty)
            z[ids] = v - counts * self.frequency_penalty - self.presence_penalty
        return z

    def candidates(self, logits: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Stages 1-5 without the draw: (token ids, probabilities) the next token is drawn from."""
        z = self.penalized(logits)
        if self.greedy:
            best = int(np.argmax(z))
            return np.array([best]), np.array([1.0])
        order = np.argsort(-z, kind="stable")
        if self.top_k:
            order = order[:self.top_k]
        v = z[order]
        if self.top_p < 1:
            p = np.exp(v - v[0])
            cum = np.cumsum(p / p.sum())
            keep = int(np.searchsorted(cum, self.top_p)) + 1  # the first prefix whose mass reaches top_p
            order, v = order[:keep], v[:keep]
        if self.min_p > 0:
            keep = int(np.count_nonzero(v >= v[0] + math.log(self.min_p)))  # v is sorted: a prefix
            order, v = order[:max(keep, 1)], v[:max(keep, 1)]
        v = v / self.temperature
        p = np.exp(v - v.max())
        return order, p / p.sum()

    def __call__(self, logits: npt.ArrayLike) -> int:
        """The next token (not accepted: the caller accepts what it keeps)."""
        ids, p = self.candidates(logits)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[self._rng.choice(len(ids), p=p)])


__all__ = ["Sampler"]
