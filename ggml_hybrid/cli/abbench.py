"""Same-process A/B timing of two session configurations on one model (the ``bench`` command).

Both sessions are loaded, each is warmed up once, then blocks of A, B, B, A runs
alternate so that drift on a shared machine hits both sides alike. A run is a
prompt of random tokens plus ``n_predict`` greedy tokens (EOS ignored); prompt and decode tok/s
are kept per run, by side and by whether the side ran first or second in its pair, with their
standard deviations; a ratio within that spread is reported as such (:func:`spread_warnings`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from ..options import SessionOptions
from ..runtime.generate import complete
from ..runtime.moe_model import MoEModel


@dataclass
class Side:
    label: str
    options: SessionOptions
    prompt_tps: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)   # decode tok/s when this side ran first in its pair
    second: list[float] = field(default_factory=list)  # ... and second


def ab_bench(path, a: SessionOptions, b: SessionOptions, runs: int = 4, n_predict: int = 16,
             n_prompt: int = 512, progress=None, seed: int = 1234) -> dict:
    """``runs`` blocks of A, B, B, A; a run is ``n_prompt`` random tokens (as llama-bench's prompt) and
    ``n_predict`` greedy tokens."""
    check_int(runs, "ab_bench: runs (blocks of A, B, B, A)", 1)
    check_int(n_prompt, "ab_bench: n_prompt", 1)
    sides = {"A": Side("A", a), "B": Side("B", b)}
    # a benchmark's sessions: they may follow a routing trace (moe_route_trace), and the report says so
    with MoEModel(path, a, benchmark=True) as ma, MoEModel(path, b, benchmark=True) as mb:
        models = {"A": ma, "B": mb}
        rng = np.random.default_rng(seed)
        tokens = [int(t) for t in rng.integers(0, ma.hp.n_vocab, size=n_prompt)]
        for m in models.values():
            complete(m, tokens, n_predict, stop_at_eos=False)  # warm-up: graphs built, caches and pages warm
        for i in range(runs):
            for pos, key in enumerate("ABBA"):
                _, st = complete(models[key], tokens, n_predict, stop_at_eos=False)
                s = sides[key]
                s.prompt_tps.append(st.prompt_tps)
                s.decode_tps.append(st.decode_tps)
                (s.first if pos in (0, 2) else s.second).append(st.decode_tps)
            if progress is not None:
                progress(i + 1, runs)
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    by_side: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"model": str(path), "runs": runs, "n_predict": n_predict, "prompt_tokens": len(tokens),
                           "sides": by_side}
    routed = {k: o.moe_route_trace for k, o in (("A", a), ("B", b)) if o.moe_route_trace is not None}
    if routed:
        out["route_trace"] = routed  # the routing came from a trace: the output is not the model's own
    for key, s in sides.items():
        by_side[key] = {"options": s.options.to_items(), "prompt_tps": mean(s.prompt_tps),
                             "decode_tps": mean(s.decode_tps), "decode_tps_median": statistics.median(s.decode_tps),
                             "decode_tps_first": mean(s.first), "decode_tps_second": mean(s.second),
                             "prompt_tps_stddev": stdev(s.prompt_tps), "decode_tps_stddev": stdev(s.decode_tps)}
    A, B = by_side["A"], by_side["B"]
    out["ratio_decode_b_over_a"] = B["decode_tps"] / A["decode_tps"] if A["decode_tps"] else 0.0
    out["ratio_prompt_b_over_a"] = B["prompt_tps"] / A["prompt_tps"] if A["prompt_tps"] else 0.0
    out["warnings"] = spread_warnings(out)
    return out


def stdev(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def spread_warnings(r: dict) -> list[str]:
    """A ratio whose distance from 1 is within the sides' spread (their relative standard deviations
    added in quadrature) cannot tell the two apart: said, with the spread."""
    out = []
    for what in ("decode", "prompt"):
        ratio = r[f"ratio_{what}_b_over_a"]
        rel = []
        for side in r["sides"].values():
            m, s = side[f"{what}_tps"], side[f"{what}_tps_stddev"]
            rel.append(s / m if m else 0.0)
        spread = (rel[0] ** 2 + rel[1] ** 2) ** 0.5
        if abs(ratio - 1) <= spread:
            out.append(f"{what}: the ratio B/A {ratio:.3f} is within the runs' spread (±{100 * spread:.0f}%): "
                       "too noisy to tell the two apart; more -r on an idle machine narrows it")
    return out


def format_table(r: dict) -> str:
    lines = [f"{r['model']}: {r['runs']} blocks of A,B,B,A; prompt {r['prompt_tokens']} tok, "
             f"decode {r['n_predict']} tok",
             f"{'side':<5}{'prompt tok/s':>18}{'decode tok/s':>18}{'first in pair':>15}{'second in pair':>16}  options"]
    for key, s in r["sides"].items():
        pp = f"{s['prompt_tps']:.1f} ± {s['prompt_tps_stddev']:.1f}"
        tg = f"{s['decode_tps']:.1f} ± {s['decode_tps_stddev']:.1f}"
        lines.append(f"{key:<5}{pp:>18}{tg:>18}{s['decode_tps_first']:>15.1f}"
                     f"{s['decode_tps_second']:>16.1f}  {' '.join(s['options']) or '(defaults)'}")
    lines.append(f"ratio B/A: decode {r['ratio_decode_b_over_a']:.3f}, prompt {r['ratio_prompt_b_over_a']:.3f}")
    for key, trace in r.get("route_trace", {}).items():
        lines.append(f"side {key}: routing from the trace {trace} (moe_route_trace): the output is not the model's own")
    return "\n".join(lines)


__all__ = ["ab_bench", "format_table", "spread_warnings"]
