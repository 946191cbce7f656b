"""Prompt reuse: a prompt that begins as a slot's last prompt evaluates only the rest, bit for bit a cold run.

A finished request leaves its cells in its slot (:class:`Held` says what they hold). The next request
that shares a prefix with them keeps the cells of that prefix and evaluates only the rest. Its logits
must be the logits of evaluating its whole prompt in an empty slot, bit for bit, and a cell's values
depend on the ubatch that computed it (a kernel may take another path for another number of rows). So a
prefix is kept only up to a *fixed cut*: a position where every prompt longer than it cuts an ubatch
(:meth:`Session.ubatch_ends`: multiples of ``ubatch_size`` within each ``batch_size``). Below a fixed cut,
the slot's cells were computed by the very ubatches (same tokens, same positions, same cells seen) that
a cold run of the new prompt computes, and from it the new prompt goes on with its cold run's cuts. The
tokens a request generated are never kept: they were computed one per step, a prompt computes them in
ubatches. Cells past the kept prefix are masked (``-inf``: they add exact zeros) until overwritten.

A recurrent model's state has no earlier positions to go back to: its slots keep *checkpoints*, copies
of the states at the last few fixed cuts a prompt passed (:meth:`Session.checkpoint`), and reuse only
reaches back to one of them; with none that fits, the prompt is evaluated whole.

Among the free slots a request takes the one that lets it reuse the most (then the longest common prefix,
then an empty slot, then the one used longest ago), so slots keep distinct prompts for as long as they can.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from .session import Checkpoint, Session

MAX_CHECKPOINTS = 3  # recurrent models: state copies kept per slot (the last fixed cuts its prompt passed)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


@dataclass
class Held:
    """What one slot's cells hold: ``tokens``, a prompt whose first ``n_valid`` cells are its cold run's."""

    tokens: list[int]
    n_valid: int = 0  # a fixed cut: the cells below it are what a cold run of ``tokens`` computes
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)  # recurrent: states at fixed cuts
    used_at: float = field(default_factory=time.monotonic)


class PromptCache:
    """The prompts ``model``'s slots hold, and the rule of what a new prompt may reuse of them.

    Called from the engine's thread only (it alone touches the model)."""

    def __init__(self, model: Session, max_checkpoints: int = MAX_CHECKPOINTS) -> None:
        self.model = model
        self.max_checkpoints = check_int(max_checkpoints, "PromptCache: max_checkpoints", 1)
        self.held: list[Held | None] = [None] * model.n_parallel

    def fixed_cut(self, n: int) -> bool:
        """Whether every prompt longer than ``n`` tokens ends an ubatch at ``n``."""
        return n > 0 and n in self.model.ubatch_ends(n + 1)

    def last_fixed_cut(self, n: int) -> int:
        """The largest fixed cut at most ``n`` (0: none)."""
        if n <= 0:
            return 0
        return max((e for e in self.model.ubatch_ends(n + 1) if e <= n), default=0)

    def reusable(self, seq: int, prompt: list[int]) -> int:
        """How many of ``prompt``'s positions slot ``seq`` can keep (0: evaluate it whole). At least one token
        is always evaluated: its logits are the answer's first."""
        h = self.held[seq]
        if h is None:
            return 0
        limit = min(common_prefix(h.tokens, prompt), len(prompt) - 1, h.n_valid)
        if self.model.recurrent:
            return max((p for p in h.checkpoints if p <= limit), default=0)
        return self.last_fixed_cut(limit)

    def choose(self, free: list[int], prompt: list[int], reuse: bool) -> tuple[int, int]:
        """The free slot for ``prompt`` and the positions it reuses there (``reuse`` False: none)."""
        def rank(seq: int) -> tuple[int, int, int, float]:
            h = self.held[seq]
            n = self.reusable(seq, prompt) if reuse else 0
            shared = common_prefix(h.tokens, prompt) if reuse and h is not None else 0
            return (n, shared, h is None, -h.used_at if h is not None else 0.0)

        best = max(free, key=rank)
        return best, (self.reusable(best, prompt) if reuse else 0)

    def prepare(self, seq: int, prompt: list[int], n: int) -> None:
        """Slot ``seq`` is to evaluate ``prompt`` from position ``n`` (what :meth:`reusable` allowed; 0: from empty,
        zeroed cells as a fresh slot has)."""
        h = self.held[seq]
        if n == 0:
            self.held[seq] = None
            self.model.reset(seq)
            self.held[seq] = Held(list(prompt))
            return
        assert h is not None
        cp = h.checkpoints[n] if self.model.recurrent else Checkpoint(n, None)
        self.model.restore(cp, seq)
        self.held[seq] = Held(list(prompt), n, {p: c for p, c in h.checkpoints.items() if p <= n})

    def evaluated(self, seq: int, end: int) -> None:
        """A prompt step of slot ``seq`` ended at position ``end``: a fixed cut is a point of reuse from now on."""
        h = self.held[seq]
        if h is None or not self.fixed_cut(end):
            return
        h.n_valid = end
        if self.model.recurrent and end in self._last_cuts(len(h.tokens)):  # (earlier ones would be dropped anyway)
            h.checkpoints[end] = self.model.checkpoint(seq)
            for p in sorted(h.checkpoints)[:-self.max_checkpoints]:
                del h.checkpoints[p]

    def _last_cuts(self, n: int) -> list[int]:
        """The last ``max_checkpoints`` fixed cuts of a prompt of ``n`` tokens."""
        return [c for c in self.model.ubatch_ends(n + 1) if c <= n][-self.max_checkpoints:]

    def finished(self, seq: int, keep: bool) -> None:
        """The request in slot ``seq`` ended: its cells stay for the next prompt (``keep``), or are cleared."""
        h = self.held[seq]
        if keep and h is not None and h.n_valid > 0:
            h.used_at = time.monotonic()
            return
        self.held[seq] = None
        self.model.reset(seq)

    def moved(self, src: int, dst: int) -> None:
        """The sequence of slot ``src`` moved to slot ``dst`` (:meth:`Session.move`)."""
        self.held[dst], self.held[src] = self.held[src], None

    def report(self, seq: int) -> dict[str, Any]:
        """What slot ``seq`` holds: the prompt's tokens, how many of them a next prompt may reuse."""
        h = self.held[seq]
        if h is None:
            return {"prompt_tokens": 0, "reusable_tokens": 0, "checkpoints": []}
        points = sorted(list(h.checkpoints))  # one C call: safe against the engine thread adding one meanwhile
        return {"prompt_tokens": len(h.tokens), "reusable_tokens": max(points, default=0) if self.model.recurrent
                else h.n_valid, "checkpoints": points}


__all__ = ["Held", "MAX_CHECKPOINTS", "PromptCache", "common_prefix"]
