"""Next-token choice from logits: greedy, or seeded temperature / top-k / top-p sampling.

The order is llama.cpp's common sampler chain (without its penalties, min-p and
the other optional stages): top-k, then top-p on the softmax of the raw logits,
then temperature applied to the survivors, then a draw. A ``Sampler`` owns its
``numpy.random.Generator``, so the same seed gives the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 40           # 0: no limit
    top_p: float = 1.0        # 1: no limit
    seed: int | None = None
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0")
        self._rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.greedy:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if self.top_k:
            order = order[:self.top_k]
        z = logits[order]
        if self.top_p < 1:
            p1 = np.exp(z - z.max())
            p1 /= p1.sum()
            keep = int(np.searchsorted(np.cumsum(p1), self.top_p) + 1)  # smallest prefix reaching top_p
            order, z = order[:keep], z[:keep]
        z = z / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        return int(order[self._rng.choice(len(order), p=p)])


__all__ = ["Sampler"]
