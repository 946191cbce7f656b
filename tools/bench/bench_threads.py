#!/usr/bin/env python3
"""Decode speed on a quiet machine and beside a competing CPU-bound process: threads = cores against the default.

GGML's CPU threads meet at a spinning barrier after every op; with as many threads as cores and another
busy process, the thread that shares its core is descheduled for whole time slices and the others spin
(ggml_hybrid/machine.py). This benchmark measures decode tok/s of the synthetic qwen3moe file of
bench_vs_llama.py (--type) in two conditions, alternated: ``quiet`` (nothing of ours competes) and
``busy`` (one extra CPU-bound process, ``while True: pass``, runs for the whole condition), for:

- ggml-hybrid with ``n_threads`` = the usable cores (what llama.cpp's default of all cores does),
- ggml-hybrid with the default (none: one thread per idle core, measured when the model loads, which is
  why each condition loads its own models),
- llama.cpp (llama-cpp-python, --llama-python) with threads = the usable cores, when given.

Each run is a --prompt token prompt then --n greedy tokens; --rounds runs per configuration and
condition, medians. The machine's own load (other users) is printed with each condition: it is part
of both, and nothing here can remove it.

    python tools/bench/bench_threads.py [--llama-python /opt/llref/bin/python] [--type Q4_K] [--rounds 3]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
from bench_vs_llama import TYPES, LlamaWorker, model_path, run_ours

from ggml_hybrid.machine import default_threads, idle_cores, usable_cores
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel


def competitor() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(1.0)  # running before anything is measured or loaded
    return p


def condition(ns: SimpleNamespace, path: str, busy: bool) -> dict[str, float]:
    cores = usable_cores()
    comp = competitor() if busy else None
    try:
        load = os.getloadavg()[0]
        idle = idle_cores(0.5)
        sides = {
            f"ggml-hybrid, {cores} threads": MoEModel(path, SessionOptions(n_threads=cores, n_ctx=256)),
            "ggml-hybrid, default threads": MoEModel(path, SessionOptions(n_ctx=256)),
        }
        auto = sides["ggml-hybrid, default threads"].n_threads
        workers = {}
        if ns.llama_python:
            workers[f"llama.cpp, {cores} threads"] = LlamaWorker(ns.llama_python, path, cores, 256, False, True)
        tokens = np.random.default_rng(0).integers(0, 8000, ns.prompt).tolist()
        runs: dict[str, list[float]] = {k: [] for k in [*sides, *workers]}

        def one(name):
            if name in sides:
                return run_ours(sides[name], tokens, ns.n)
            return workers[name].run(tokens, ns.n)

        names = list(runs)
        for name in names:
            one(name)  # warm
        for r in range(ns.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                decode_s = one(name)[1]
                runs[name].append((ns.n - 1) / decode_s)
        for m in sides.values():
            m.close()
        for w in workers.values():
            w.close()
    finally:
        if comp is not None:
            comp.kill()
            comp.wait()
    label = "busy" if busy else "quiet"
    print(f"{label}: load average {load:.1f}, idle cores measured {idle if idle is None else round(idle, 2)}, "
          f"default threads chose {auto}", flush=True)
    return {k: statistics.median(v) for k, v in runs.items()}


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--llama-python", help="a Python with llama-cpp-python==0.3.36, to measure llama.cpp too")
@click.option("--type", default="Q4_K", type=click.Choice(TYPES), show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--prompt", type=click.IntRange(1), default=16, show_default=True)
@click.option("--n", type=click.IntRange(2), default=17, help="generated tokens (the first comes from the prompt)",
              show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    path = model_path(ns.type)
    print(f"{Path(path).name}, {usable_cores()} usable cores; default threads now: {default_threads()}")
    quiet = condition(ns, path, busy=False)
    busy = condition(ns, path, busy=True)
    print("\n| configuration | decode tok/s, quiet | decode tok/s, one competing process | busy / quiet |")
    print("| --- | --- | --- | --- |")
    for name in quiet:
        print(f"| {name} | {quiet[name]:.2f} | {busy[name]:.2f} | {busy[name] / quiet[name]:.3f} |")
    cores = usable_cores()
    d, c = quiet["ggml-hybrid, default threads"], quiet[f"ggml-hybrid, {cores} threads"]
    print(f"\ndefault / {cores} threads, quiet: {d / c:.3f}")
    return 0


if __name__ == "__main__":
    main()
