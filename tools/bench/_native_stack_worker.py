#!/usr/bin/env python3
"""One checkout's native executor, for ``bench_native_executor.py --part ab``: one round, printed as JSON.

    PYTHONPATH=CHECKOUT python _native_stack_worker.py MODEL N_LAYER N_EMBD STEPS WARMUP

It imports only ``ggml_hybrid``'s public names (``gh.MoEStackSession``, ``gh.SessionOptions``), which every
commit compared has. Sessions of the stack MODEL: resident experts, the native executor with 64 and with 16
slots, 1 thread, each first given 256 tokens (every expert routed: a 64-slot cache is then full); then
WARMUP + STEPS decode steps, a fresh input each, the sessions in alternating order, every output checked equal
to the resident one. Prints the median µs per layer of each session and the native ones' orchestration µs per
layer call over the STEPS, and ``where``, the package's folder (the caller checks which checkout answered).
"""

import json

import click
import numpy as np
from _alternate import alternate

import ggml_hybrid as gh


@click.command(help=__doc__)
@click.argument("path")
@click.argument("n_layer", type=int)
@click.argument("n_embd", type=int)
@click.argument("steps", type=int)
@click.argument("warmup", type=int)
def main(path: str, n_layer: int, n_embd: int, steps: int, warmup: int) -> None:
    modes = {"resident": [], **{f"native {n} slots": ["disk_experts=1", f"expert_cache_slots={n}",
                                                       "moe_executor=native"] for n in (64, 16)}}
    sessions = {k: gh.MoEStackSession(path, gh.SessionOptions.parse([*v, "n_threads=1"])) for k, v in modes.items()}
    warm = np.random.default_rng(1).standard_normal((256, n_embd)).astype(np.float32)
    for s in sessions.values():
        s.forward(warm)
    # the stack benchmarks' own A/B loop: alternating order, every output equal to the resident one
    medians, base = alternate(sessions, None, 1, n_embd, steps, warmup, seed=0)
    orch = {}
    for k, s in sessions.items():
        tot, b = s.counters.total, base[k]
        if k != "resident":
            orch[k] = (tot.orchestration_ns - b.orchestration_ns) / (tot.calls - b.calls) / 1e3
        s.close()
    print(json.dumps({"where": gh.__file__, "us_layer": {k: v * 1e6 / n_layer for k, v in medians.items()},
                      "orch_us": orch}))


if __name__ == "__main__":
    main()
