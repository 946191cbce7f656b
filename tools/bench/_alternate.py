"""The A/B loop the stack benchmarks share: every session runs the same fresh input per step, in alternating
order (forward, then reversed), after a warm-up; every output is checked bit-identical to the reference."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ggml_hybrid.moe.stack_session import MoEStackSession


def alternate(sessions: dict[str, MoEStackSession], ref: MoEStackSession | None, n_tokens: int, n_embd: int,
              steps: int, warmup: int, seed: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per forward for each session, and each session's counter totals at the end of the warm-up
    (subtract them for the measured steps). Without ``ref`` the first session's output is the reference."""
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    base: dict[str, Any] = {}
    for i in range(warmup + steps):
        x = rng.standard_normal((n_tokens, n_embd)).astype(np.float32)
        want = ref.forward(x) if ref is not None else None
        if i == warmup:
            base = {k: s.counters.total for k, s in sessions.items()}
        order = list(sessions.items()) if i % 2 == 0 else list(sessions.items())[::-1]
        for k, s in order:
            t0 = time.perf_counter()
            got = s.forward(x)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
            if want is None:
                want = got
            assert np.array_equal(got, want), f"{k} differs from the reference run"
    return {k: statistics.median(v) for k, v in times.items()}, base
