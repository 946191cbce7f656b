"""Next-token choice from logits: greedy, or seeded temperature / top-k / top-p sampling.

The order is llama.cpp's common sampler chain (without its penalties, min-p and
the other optional stages): top-k, then top-p on the softmax of the raw logits,
then temperature applied to the survivors, then a draw. A ``Sampler`` owns its
``numpy.random.Generator``, so the same seed gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checks import check_int, check_real


@dataclass
class Sampler:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 40           # 0: no limit
    top_p: float = 1.0        # 1: no limit
    seed: int | None = None
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_real(self.temperature, "Sampler: temperature", 0.0)
        check_int(self.top_k, "Sampler: top_k", 0)
        check_real(self.top_p, "Sampler: top_p", 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            check_int(self.seed, "Sampler: seed", 0)
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
