#!/usr/bin/env python3
"""Where moe_cpu_share=auto beats every fixed share: a mixed prompt + decode workload, replayed.

A chat-like trace alternates a 64-token prompt (prefill) with 32 decode steps, on a 16-layer,
64-expert, top-8 model (synthetic routing, 20% of the experts taking 80% of the traffic, temporal
reuse 0.5). Prefill wants its many-row misses on the device, decode wants its one-row misses split
with the CPU: a fixed share must pick one compromise for both, auto chooses per call. The trace is
replayed through the real LRU cache at 8/16/32 slots with the link cost model of
``ggml_hybrid.moe.traces`` (PCIe-4-like bus, DDR host; see --help for the figures), for shares
0, 0.25, 0.5, 0.75, 1 and auto. This is a model of the time, not a GPU measurement.

    python tools/bench/bench_auto_share.py [--rounds 12]
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import click

from ggml_hybrid.moe.traces import LinkCost, Trace, replay, synthetic_trace

SHARES = [0.0, 0.25, 0.5, 0.75, 1.0, "auto"]


def mixed_trace(rounds: int, seed: int = 0) -> Trace:
    n_layer, n_expert, n_used = 16, 64, 8
    calls = []
    for r in range(rounds):
        prompt = synthetic_trace(n_layer, n_expert, n_used, n_layer, tokens_per_call=64, seed=seed + 2 * r)
        decode = synthetic_trace(n_layer, n_expert, n_used, 32 * n_layer, tokens_per_call=1, seed=seed + 2 * r + 1)
        calls += prompt.calls + decode.calls
    return Trace(n_layer, n_expert, n_used, calls)


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--rounds', type=int, default=12, help='prompt + decode rounds in the trace', show_default=True)
@click.option('--bus-gbps', type=float, default=25.0, show_default=True)
@click.option('--cpu-gbps', type=float, default=30.0, show_default=True)
@click.option('--device-us-per-row', type=float, default=0.2, show_default=True)
@click.option('--cpu-us-per-row', type=float, default=40.0, show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    expert_bytes = 3 * 2048 * 768 * 144 // 256  # one Q4_K expert of a Qwen3-30B-A3B-sized layer
    cost = LinkCost(ns.bus_gbps * 1e9, ns.cpu_gbps * 1e9, ns.device_us_per_row * 1e-6, ns.cpu_us_per_row * 1e-6,
                    expert_bytes)
    trace = mixed_trace(ns.rounds)
    print(f"trace: {len(trace.calls)} layer calls, {trace.tokens:.0f} tokens (64-token prompts + 32 decode steps, "
          f"x{ns.rounds}); bus {ns.bus_gbps} GB/s, CPU {ns.cpu_gbps} GB/s, {ns.cpu_us_per_row} us/row CPU, "
          f"{ns.device_us_per_row} us/row device")
    print(f"{'slots':>5} " + " ".join(f"{str(s):>9}" for s in SHARES) + f" {'auto vs best fixed':>19}")
    for slots in (8, 16, 32):
        us = {s: replay(trace, slots, "lru", share=s, cost=cost).modeled_s_per_token * 1e6 for s in SHARES}
        best_fixed = min(v for s, v in us.items() if s != "auto")
        print(f"{slots:>5} " + " ".join(f"{us[s]:>9.1f}" for s in SHARES) + f" {us['auto'] / best_fixed:>19.3f}")
    print("modeled us per token; ratio < 1: auto beats every fixed share")
    return 0


if __name__ == "__main__":
    main()
