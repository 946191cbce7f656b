#!/usr/bin/env python3
"""Cost of vendor patch 0014's graph status on an RPC decode step: two builds A/B, alternated.

Each arm is an interpreter with its own build of ggml-hybrid (``--a`` and ``--b``: e.g. a checkout of main and
this one). A block runs ``_rpc_step_worker.py`` under one arm: it starts that build's ``rpc-server`` (one
thread, loopback), puts a small decode-like graph on the RPC device (GET_ROWS of one token, a 256 x 256 matrix
product, ADD_ID) and times ``--n`` computes, each with its output read back, after ``--warmup``. Blocks alternate
(A B, then B A); prints each block's median, each arm's median of block medians and the ratio B/A. With patch
0014 (B) every graph is followed by a status request whose reply is read before the output's: no round trip of its
own, one 9-byte request and a 264-byte reply.

    python tools/bench/bench_rpc_status.py --a /work/main/.venv/bin/python --b .venv/bin/python \\
        [--blocks 6] [--n 300] [--warmup 50]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import click

WORKER = Path(__file__).resolve().parent / "_rpc_step_worker.py"


def run_block(python: str, n: int, warmup: int) -> float:
    # the worker runs from /tmp so that each interpreter imports its own installed ggml_hybrid
    out = subprocess.run([python, str(WORKER), str(n), str(warmup)], capture_output=True, text=True, check=True,
                         cwd="/tmp")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median_s"])


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--a", "a", required=True, help="the interpreter of arm A (without the patch)")
@click.option("--b", "b", required=True, help="the interpreter of arm B (with it)")
@click.option("--blocks", type=int, default=6, show_default=True, help="blocks per arm")
@click.option("--n", type=int, default=300, show_default=True, help="timed computes per block")
@click.option("--warmup", type=int, default=50, show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    meds: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(ns.blocks):
        order = [("A", ns.a), ("B", ns.b)] if i % 2 == 0 else [("B", ns.b), ("A", ns.a)]
        for name, python in order:
            m = run_block(python, ns.n, ns.warmup)
            meds[name].append(m)
            print(f"block {i} {name}: {m * 1e6:.1f} us per compute", flush=True)
    a, b = statistics.median(meds["A"]), statistics.median(meds["B"])
    print(f"A {a * 1e6:.1f} us, B {b * 1e6:.1f} us, B/A {b / a:.4f}")
    return 0


if __name__ == "__main__":
    main()
