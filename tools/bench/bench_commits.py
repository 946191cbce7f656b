#!/usr/bin/env python3
"""Prompt and decode tok/s of two checkouts of ggml-hybrid on the same model, A/B alternated in one run.

A refactoring must not cost speed; this measures it. ``--base`` is a checkout of the earlier commit whose native
module is built (``git worktree add /tmp/base REV && cd /tmp/base && python -m ggml_hybrid_build``; GGML comes from the
build cache when the pin and patches are the same), ``--head`` the one to compare (default: this checkout).
Each side runs in its own worker process (``_ours_worker.py`` with ``PYTHONPATH`` set to its checkout) that loads
the model once: bench_vs_llama's synthetic qwen3moe (8 layers, embd 1024, 64 experts, top-8) of ``--type``.
After a warm-up each, rounds alternate A,B,B,A (A = base, B = head); a run is a prompt of ``--prompt`` tokens,
then ``--n`` greedy tokens one eval each. Prints the medians, head / base ratios (of the medians and of each
A,B,B,A block) and whether both sides chose the same greedy tokens (they must: the logits are bit-identical).

    python tools/bench/bench_commits.py --base /tmp/base [--type Q8_0] [--threads 1] [--rounds 6] [--model M.gguf]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
from bench_vs_llama import SPEC, TYPES, block_ratios, model_path

ROOT = Path(__file__).resolve().parents[2]


class Side:
    """One checkout's worker process."""

    def __init__(self, checkout: Path, model: str, threads: int, n_ctx: int):
        env = dict(os.environ, PYTHONPATH=str(checkout))
        worker = Path(__file__).with_name("_ours_worker.py")
        self.proc = subprocess.Popen([sys.executable, str(worker), model, str(threads), str(n_ctx)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline() or "{}")
        where = Path(hello.get("where", "")).resolve()
        if not hello.get("ready") or checkout.resolve() not in where.parents:
            self.close()
            raise SystemExit(f"the worker for {checkout} imported ggml_hybrid from {where}, not from the checkout")

    def run(self, tokens: list[int], n: int) -> dict:
        self.proc.stdin.write(json.dumps({"tokens": tokens, "n": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@click.command(help=__doc__)
@click.option("--base", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--head", type=click.Path(exists=True, file_okay=False, path_type=Path), default=ROOT,
              show_default=True)
@click.option("--type", "wtype", type=click.Choice(TYPES), default="Q8_0", show_default=True)
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--rounds", type=int, default=6, show_default=True, help="A,B,B,A blocks")
@click.option("--prompt", type=int, default=64, show_default=True)
@click.option("--n", type=int, default=33, show_default=True, help="greedy tokens (n-1 decode steps)")
@click.option("--model", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a model file instead of the synthetic one of --type (e.g. one quantized by llama.cpp)")
def main(base: Path, head: Path, wtype: str, threads: int, rounds: int, prompt: int, n: int,
         model: str | None) -> None:
    path = model or model_path(wtype, SPEC)
    tokens = np.random.default_rng(0).integers(0, 8000, prompt).tolist()
    sides = {"A": Side(base, path, threads, 512), "B": Side(head, path, threads, 512)}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        warm = {k: s.run(tokens, n) for k, s in sides.items()}
        same = warm["A"]["tokens"] == warm["B"]["tokens"]
        for _ in range(rounds):
            for k in "ABBA":
                r = sides[k].run(tokens, n)
                same = same and r["tokens"] == warm["A"]["tokens"]
                runs[k].append(r)
    finally:
        for s in sides.values():
            s.close()

    def tps(k: str, key: str, count: int) -> float:
        return statistics.median(count / r[key] for r in runs[k])

    print(f"{Path(path).name}; {threads} thread(s); prompt {prompt} tok, decode {n - 1} tok; {rounds} x ABBA; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<8}{'prompt tok/s':>14}{'decode tok/s':>14}{'prompt, CPU':>14}{'decode, CPU':>14}")
    cols = (("prompt_s", prompt), ("decode_s", n - 1), ("prompt_cpu", prompt), ("decode_cpu", n - 1))
    for k, name in (("A", "base"), ("B", "head")):
        print(f"{name:<8}" + "".join(f"{tps(k, key, c):>14.2f}" for key, c in cols))
    print(f"{'ratio':<8}" + "".join(f"{tps('B', key, c) / tps('A', key, c):>14.3f}" for key, c in cols)
          + "   (head / base, medians)")
    # per A,B,B,A block, head over base (bench_vs_llama's rule, its first side the numerator)
    blocks = [block_ratios({"A": runs["B"], "B": runs["A"]}, key, c) for key, c in cols[:2]]
    print(f"{'blocks':<8}" + "".join(f"{statistics.median(b):>14.3f}" for b in blocks) + "   (median of the blocks' "
          "ratios; range " + ", ".join(f"{min(b):.3f}-{max(b):.3f}" for b in blocks) + ")")
    print(f"same greedy tokens: {same}")
    if not same:
        raise SystemExit("the two checkouts chose different tokens")


if __name__ == "__main__":
    main()
