#!/usr/bin/env python3
"""Device expert cache vs resident experts on a 16-layer synthetic MoE stack (64 experts, top-8, Q4_K).

For decode (1 token) and a 64-token batch: time per layer for resident experts and for
disk experts with 8/16/32 cache slots, bytes loaded per token, the hit rate, and the
Python orchestration time per layer call (executor time minus loading and GGML compute).
Sessions are opened together and measured in alternating order after a warm-up; each
forward gets a fresh random input, the same sequence for every mode. Without a GPU a CPU
backend instance plays the device, so "loading" is a host memcpy from the mapped file.

    python tools/bench/bench_expert_cache.py [--steps 12] [--threads 2]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

SHAPE = dict(n_layer=16, n_embd=256, n_ff=256, n_expert=64, n_used=8, expert_type="q4_K")


def model_path() -> str:
    p = Path(__file__).resolve().parents[2] / "build" / "bench" / "moe16_e64_k8_q4k.gguf"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        write_moe_stack(p, seed=1, **SHAPE)
    return str(p)


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--steps', type=int, default=12, help='measured forwards per mode and batch size', show_default=True)
@click.option('--warmup', type=int, default=3, show_default=True)
@click.option('--threads', type=int, default=1, show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    path = model_path()
    modes = {"resident": [], **{f"cache {n} slots": ["disk_experts=1", f"expert_cache_slots={n}"] for n in (8, 16, 32)}}
    print(f"model: {SHAPE}, {ns.threads} threads")
    print(f"{'tokens':>6} {'mode':<16} {'ms/layer':>9} {'ratio':>6} {'hit rate':>8} {'KiB loaded/token':>17} "
          f"{'orchestration us/call':>22}")
    for n_tokens in (1, 64):
        sessions = {name: MoEStackSession(path, SessionOptions.parse(items + [f"n_threads={ns.threads}"]))
                    for name, items in modes.items()}
        rng = np.random.default_rng(n_tokens)
        xs = [rng.standard_normal((n_tokens, SHAPE["n_embd"])).astype(np.float32)
              for _ in range(ns.warmup + ns.steps)]
        times = {name: [] for name in sessions}
        base = {}
        for i, x in enumerate(xs):
            if i == ns.warmup:
                base = {name: s.counters.total for name, s in sessions.items()}
            order = list(sessions.items())
            if i % 2:
                order.reverse()  # alternate A..D, D..A
            outs = []
            for name, s in order:
                t0 = time.perf_counter()
                outs.append(s.forward(x))
                if i >= ns.warmup:
                    times[name].append(time.perf_counter() - t0)
            assert all(np.array_equal(o, outs[0]) for o in outs), "modes disagree"
        ref = statistics.median(times["resident"])
        for name, s in sessions.items():
            med = statistics.median(times[name])
            tot, b = s.counters.total, base[name]
            calls = tot.calls - b.calls
            distinct = tot.distinct - b.distinct
            hit = (tot.hits - b.hits) / distinct if distinct else float("nan")
            kib = (tot.bytes_loaded - b.bytes_loaded) / 1024 / (ns.steps * n_tokens)
            orch = (tot.orchestration_ns - b.orchestration_ns) / calls / 1e3 if calls else float("nan")
            print(f"{n_tokens:>6} {name:<16} {med * 1e3 / SHAPE['n_layer']:>9.3f} {med / ref:>6.2f} "
                  f"{'-' if calls == 0 else f'{hit:.2f}':>8} {kib:>17.1f} {'-' if calls == 0 else f'{orch:.1f}':>22}")
        for s in sessions.values():
            s.close()
    print("outputs of every mode bit-identical at every step: True")
    return 0


if __name__ == "__main__":
    main()
