"""The A/B loops the stack benchmarks share. :func:`alternate`: every session runs the same fresh input per step, in
alternating order (forward, then reversed), after a warm-up; every output is checked bit-identical to the
reference. :func:`alternate_builds`: one worker process per build and round, the builds alternated, each checked to
have imported the package from its own build."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
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


def alternate_builds(cmd: list[str], builds: dict[str, Path], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Run ``cmd`` (a worker that prints one JSON object last, with ``where``: its ``ggml_hybrid.__file__``) once per
    build and round with the build first on ``PYTHONPATH``, in alternating order (forward, then reversed); each
    build's outputs in round order."""
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in builds}
    for r in range(rounds):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(builds[name])}, check=True,
                                 capture_output=True, text=True)
            got = json.loads(out.stdout.splitlines()[-1])
            if builds[name] not in Path(got["where"]).resolve().parents:
                raise SystemExit(f"the worker for {builds[name]} imported ggml_hybrid from {got['where']}")
            runs[name].append(got)
    return runs
