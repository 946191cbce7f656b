#!/usr/bin/env python3
"""An FFN-stack demo (the whole-model one is `ggml-hybrid demo`).

Generates a small random-weight MoE stack (GGUF, Q4_K experts) in a temporary folder and
runs the same tokens through it four ways: experts resident, disk experts behind a device
cache at moe_cpu_share=0, at 0.5, and at auto. Prints a table (time, tokens/s, cache hits,
loads, CPU misses) and whether every output is bit-identical to the resident run.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

SHAPE = dict(n_layer=4, n_embd=256, n_ff=256, n_expert=16, n_used=4, expert_type="q4_K")
MODES = [("resident", []), ("cache, share 0", ["moe_cpu_share=0"]), ("cache, share 0.5", ["moe_cpu_share=0.5"]),
         ("cache, share auto", ["moe_cpu_share=auto"])]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-t", "--threads", default=1, show_default=True, type=click.IntRange(1), help="CPU threads.")
def main(threads: int) -> None:
    sys.exit(run(threads))


def run(threads: int = 1) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_stack(Path(tmp) / "demo.gguf", seed=0, **SHAPE)
        rng = np.random.default_rng(0)
        # a 16-token prompt, then 24 single-token steps
        batches = [rng.standard_normal((16, SHAPE["n_embd"])).astype(np.float32)] + \
                  [rng.standard_normal((1, SHAPE["n_embd"])).astype(np.float32) for _ in range(24)]
        n_tokens = sum(len(b) for b in batches)
        print(f"MoE stack: {SHAPE['n_layer']} layers, {SHAPE['n_expert']} experts ({SHAPE['expert_type']}), "
              f"top-{SHAPE['n_used']}; {n_tokens} tokens; cache: 6 slots per layer")
        print(f"{'mode':<20} {'ms':>8} {'tok/s':>8} {'hits':>6} {'loads':>6} {'cpu misses':>10} {'share':>6}")
        ref, identical = None, True
        for name, extra in MODES:
            items = [] if name == "resident" else ["disk_experts=1", "expert_cache_slots=6", *extra]
            with MoEStackSession(path, SessionOptions.parse(items + [f"n_threads={threads}"])) as s:
                t0 = time.perf_counter()
                outs = [s.forward(b) for b in batches]
                dt = time.perf_counter() - t0
                c = s.counters.total
            if ref is None:
                ref = outs
            else:
                identical &= all(np.array_equal(a, b) for a, b in zip(outs, ref))
            print(f"{name:<20} {dt * 1e3:>8.1f} {n_tokens / dt:>8.0f} {c.hits:>6} {c.misses:>6} {c.cpu_misses:>10} "
                  f"{c.share_applied:>6.2f}")
        print(f"parity: {'every output bit-identical to the resident run' if identical else 'OUTPUTS DIFFER'}")
        return 0 if identical else 1


if __name__ == "__main__":
    main()
