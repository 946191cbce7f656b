#!/usr/bin/env python3
"""The native executor's orchestration per layer call, base against head, by low quantiles (a loaded machine).

``bench_native_executor.py --part ab`` compares the medians of per-round medians; on a machine whose other work
preempts the run, a preemption inside a call's orchestration (a few µs) inflates it, and its rounds' ratios spread
over a factor of ten. This runs the same stack (bench_expert_cache.py's: 16 layers, 64 experts top-8, Q4_K, a CPU
playing the device, 1 thread) at decode with 64 slots (every call a pure hit) and 16 (misses every call), one
process per build and pair, the builds alternated (base first in odd pairs); each process records every decode
step's orchestration, load and compute per layer call and prints their 10th and 50th percentiles. The 10th
percentile is the calls that ran without being preempted: what the code costs. Medians over the pairs, head / base.

    python tools/bench/bench_orchestration.py --base /tmp/base [--pairs 6] [--steps 400]
    python tools/bench/bench_orchestration.py --worker MODEL STEPS        (one process; used by the above)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import click
import numpy as np

FIGURES = ("orch", "load", "compute", "device")


def worker(path: str, steps: int) -> dict:
    import ggml_hybrid as gh

    out: dict = {"where": gh.__file__}
    for slots in (64, 16):
        s = gh.MoEStackSession(path, gh.SessionOptions.parse(["disk_experts=1", f"expert_cache_slots={slots}",
                                                               "n_threads=1"]))
        s.forward(np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32))  # every expert routed
        rng = np.random.default_rng(2)
        rows: dict[str, list[float]] = {k: [] for k in FIGURES}
        for i in range(steps + 10):
            a = s.counters.total
            s.forward(rng.standard_normal((1, 256)).astype(np.float32))
            b = s.counters.total
            if i < 10:  # warm-up
                continue
            n = b.calls - a.calls
            for k, field in (("orch", "orchestration_ns"), ("load", "load_ns"), ("compute", "compute_ns"),
                             ("device", "device_ns")):
                rows[k].append((getattr(b, field) - getattr(a, field)) / n / 1e3)
        out[str(slots)] = {k: {"p10": float(np.percentile(v, 10)), "p50": float(np.percentile(v, 50))}
                           for k, v in rows.items()}
        s.close()
    return out


@click.command(help=__doc__)
@click.option("--base", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--pairs", type=click.IntRange(1), default=6, show_default=True)
@click.option("--steps", type=click.IntRange(10), default=400, show_default=True)
@click.option("--worker", "as_worker", nargs=2, type=(str, int), default=None)
def main(base: Path | None, pairs: int, steps: int, as_worker: tuple[str, int] | None) -> None:
    if as_worker is not None:
        print(json.dumps(worker(*as_worker)))
        return
    if base is None:
        raise click.UsageError("give --base (a built checkout of the earlier commit)")
    from _alternate import alternate_builds
    from bench_expert_cache import model_path

    builds = {"base": base.resolve(), "head": Path(__file__).resolve().parents[2]}
    runs = alternate_builds([sys.executable, __file__, "--worker", model_path(), str(steps)], builds, pairs)
    print(f"{pairs} pairs of processes, {steps} decode steps each; load average {os.getloadavg()[0]:.1f}")
    print(f"{'slots':<6} {'figure µs/call':<16} {'q':<4} {'base':>8} {'head':>8} {'head/base':>10}  per pair")
    for slots in ("64", "16"):
        for fig in FIGURES:
            for q in ("p10", "p50"):
                b = [r[slots][fig][q] for r in runs["base"]]
                h = [r[slots][fig][q] for r in runs["head"]]
                pairs_txt = " ".join(f"{y / x:.2f}" if x else "-" for x, y in zip(b, h))
                ratio = statistics.median(h) / statistics.median(b) if statistics.median(b) else float("nan")
                print(f"{slots:<6} {fig:<16} {q:<4} {statistics.median(b):>8.2f} {statistics.median(h):>8.2f} "
                      f"{ratio:>10.3f}  {pairs_txt}")


if __name__ == "__main__":
    main()
