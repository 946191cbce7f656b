#!/usr/bin/env python3
"""Memory over a long run: RSS and device compute memory across many decode steps with varying prompts.

Disk experts with a CPU share (the mode with the most per-shape state: decoder graphs, the executor's
token-count graphs, row graphs of the device rounds and of the CPU worker). Every ``--every`` decode
steps a new prompt of a random length starts the sequence over. After ``--warmup`` steps the RSS should
stay flat: the report gives its growth from the end of warm-up to the end, and the device compute bytes.

    python tools/bench/soak_rss.py --steps 10000 --warmup 2000
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.synthetic import ModelSpec, write_model

SPEC = ModelSpec(arch="qwen3moe", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=128,
                 n_expert=32, n_used=4, weight_type="q8_0", seed=5)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@click.command(help=__doc__)
@click.option("--steps", default=10000, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=2000, show_default=True, type=click.IntRange(0))
@click.option("--every", default=40, show_default=True, type=click.IntRange(1), help="Decode steps per prompt.")
@click.option("--max-prompt", default=300, show_default=True, type=click.IntRange(1))
@click.option("--share", default="0.5", show_default=True)
@click.option("--slots", default=8, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1))
def main(steps, warmup, every, max_prompt, share, slots, threads):
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "soak.gguf"), SPEC)
        opts = gh.SessionOptions.parse(["disk_experts=1", f"expert_cache_slots={slots}", f"moe_cpu_share={share}",
                                        f"n_threads={threads}", "n_ctx=1024"])
        samples = []
        t0 = time.perf_counter()
        with gh.MoEModel(path, opts) as m:
            step, warm = 0, None
            while step < steps:
                m.reset()
                prompt = rng.integers(1, SPEC.vocab_size - 8, size=int(rng.integers(1, max_prompt + 1)))
                logits = m.eval(prompt.tolist())
                for _ in range(min(every, steps - step)):
                    logits = m.eval([int(np.argmax(logits[-1]))])
                    step += 1
                    if step == warmup:
                        warm = (rss_bytes(), m.device_memory()["compute"])
                    if step % 500 == 0:
                        samples.append((step, rss_bytes(), m.device_memory()["compute"]))
            end = (rss_bytes(), m.device_memory()["compute"])
        seconds = time.perf_counter() - t0
    report = {"steps": steps, "warmup": warmup, "every": every, "max_prompt": max_prompt, "share": share,
              "slots": slots, "seconds": round(seconds, 1),
              "rss_after_warmup_mib": None if warm is None else warm[0] / 2**20, "rss_end_mib": end[0] / 2**20,
              "rss_growth_mib": None if warm is None else (end[0] - warm[0]) / 2**20,
              "compute_after_warmup_mib": None if warm is None else warm[1] / 2**20,
              "compute_end_mib": end[1] / 2**20,
              "samples": [(s, round(r / 2**20, 2), round(c / 2**20, 2)) for s, r, c in samples]}
    click.echo(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
