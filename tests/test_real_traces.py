"""The expert cache's goals on real routing (issue 31): the default eviction and the reuse-aware CPU share.

The traces are real router decisions of Qwen1.5-MoE-A2.7B and Mixtral-8x7B in ``../shared/traces`` (reference
data outside the project, never copied into it); without that folder (CI) these tests skip, and the rules they
judge are tested on generated routing against plain models in tests/test_traces.py and tests/test_expert_cache.py.
Belady's optimum (tests/test_traces.py checks it against an exhaustive search) is the oracle each policy is
judged against.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ggml_hybrid.moe.traces import read_trace, replay
from ggml_hybrid.options import SessionOptions

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
PATHS = sorted(TRACES.glob("*.ghtrace")) if TRACES.is_dir() else []
pytestmark = pytest.mark.skipif(not PATHS, reason=f"no real routing traces in {TRACES}")


@pytest.fixture(scope="module")
def traces():
    return {p.stem: read_trace(str(p), warn=False) for p in PATHS}


def _slots(tr):
    E = tr.n_expert
    return {"1/8": max(1, round(E / 8)), "1/4": E // 4, "1/2": E // 2}


def test_the_default_eviction_meets_the_goal_on_every_trace(traces):
    """freq loads at most 0.96x LRU's (geometric mean, 1/8..1/4 of the experts, more than n_used) and never more."""
    assert SessionOptions().expert_eviction == "freq"
    goal = []
    for name, tr in traces.items():
        for frac, n in _slots(tr).items():
            freq, lru, belady = (replay(tr, n, p).misses for p in ("freq", "lru", "belady"))
            assert belady <= freq <= lru, (name, n, belady, freq, lru)
            if frac != "1/2" and n > tr.n_used:
                goal.append(freq / lru)
    assert goal and math.exp(sum(map(math.log, goal)) / len(goal)) <= 0.96


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_the_reuse_aware_share_loads_less_on_every_trace(traces, share):
    """At a fixed share the reuse-aware rule loads no more than the rule before, and runs no more misses on
    the CPU, so it loads fewer experts per CPU-run miss (the bench matches the CPU counts exactly)."""
    fewer = 0
    for name, tr in traces.items():
        n = _slots(tr)["1/4"]
        a = replay(tr, n, "freq", share=share)
        b = replay(tr, n, "freq", share=share, cpu_rule="rows")
        assert a.misses + a.cpu < b.misses + b.cpu, (name, a.misses, a.cpu, b.misses, b.cpu)
        assert a.misses <= b.misses, (name, a.misses, b.misses)
        fewer += a.misses < b.misses
    assert fewer >= len(traces) - 1
