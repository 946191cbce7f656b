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
penalized logits, as in llama.cpp. The defaults are llama.cpp's, but for the temperature: 0 for a
``Sampler()`` (greedy, reproducible), 0.8 there and in the command line (:data:`LLAMA_DEFAULTS`). A
``Sampler`` owns its ``numpy.random.Generator``, so the same seed gives the same tokens (not llama.cpp's:
its generator is another one).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..checks import check_int, check_real
from ..errors import ArgumentError, ArgumentTypeError

_FMAX = float(np.finfo(np.float64).max)

#: llama.cpp's sampling defaults (``common/common.h``), those of ``run``, ``run -cnv`` and ``serve``'s requests
#: alike; a :class:`Sampler` made without arguments is greedy instead (the library's reproducible default)
LLAMA_DEFAULTS: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                          "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0,
                                          "frequency_penalty": 0.0}


def _logits(logits: npt.ArrayLike) -> np.ndarray:
    """``logits`` as a flat float64 array of at least one finite value, none NaN or +inf (-inf masks a token):
    the sampler would draw from garbage."""
    try:
        z = np.array(logits, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise ArgumentTypeError(f"Sampler: logits must be an array of numbers, got {type(logits).__name__}") from None
    if z.size == 0 or not (z < np.inf).all() or not np.isfinite(z).any():
        what = "NaN" if np.isnan(z).any() else "+inf" if (z == np.inf).any() else "only -inf"
        raise ArgumentError(f"Sampler: logits must hold at least one finite value and no NaN or +inf (-inf masks a "
                            f"token), got {z.size} values{' with ' + what if z.size else ''}")
    return z


def _bounded(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.clip(x, -_FMAX, _FMAX)
    return out


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
            with np.errstate(over="ignore", invalid="ignore"):  # extreme (valid) penalties: handled below
                w = np.where(v <= 0, v * self.repeat_penalty, v / self.repeat_penalty)
                out = w - counts * self.frequency_penalty - self.presence_penalty
                if np.isnan(out).any() or (~np.isfinite(out) & np.isfinite(v)).any():
                    # a penalty overflowed: every step clipped to the finite range, so no NaN (inf - inf) can
                    # arise and a token stays chosen by its order; a masked token (-inf) stays masked
                    pen = _bounded(_bounded(counts * self.frequency_penalty) + self.presence_penalty)
                    out = _bounded(_bounded(w) - pen)
                    out[np.isneginf(v)] = -np.inf
            z[ids] = out
        return z

    def candidates(self, logits: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Stages 1-5 without the draw: (token ids, probabilities) the next token is drawn from."""
        z = self.penalized(logits)
        if self.greedy:
            best = int(np.argmax(z))
            return np.array([best]), np.array([1.0])
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # extreme values: handled below
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
            w = v / self.temperature
            p = np.exp(w - w.max())
            total = p.sum()
            if not (np.isfinite(total) and total > 0):
                # a temperature so small (or logits so large) that v / T overflowed: the same softmax taken
                # from the largest logit (v is sorted, v[0] finite), where nothing can overflow
                p = np.exp((v - v[0]) / self.temperature)
                total = p.sum()
            return order, p / total

    def random(self) -> float:
        """A uniform draw in [0, 1) from this sampler's generator (speculative decoding's acceptance test)."""
        return float(self._rng.random())

    def choose(self, ids: np.ndarray, p: np.ndarray) -> int:
        """A draw of one of ``ids`` with probabilities ``p`` from this sampler's generator."""
        return int(ids[self._rng.choice(len(ids), p=p)])

    def __call__(self, logits: npt.ArrayLike) -> int:
        """The next token (not accepted: the caller accepts what it keeps)."""
        ids, p = self.candidates(logits)
        if len(ids) == 1:
            return int(ids[0])
        return int(ids[self._rng.choice(len(ids), p=p)])


__all__ = ["LLAMA_DEFAULTS", "Sampler"]
