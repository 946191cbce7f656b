#!/usr/bin/env python3
"""How far the expert cache's modes on a Vulkan device are from every expert resident on it (issue 30's figures).

The generated model of tests/test_gpu.py (4 layers, 16 experts top-4, 2 cache slots per layer so that every step
loads) at F32 and Q8_0 weights. Each mode generates 64 greedy tokens after an 8-token prompt, one eval each; against
the all-resident run on the same device: the greedy tokens that agree (position by position, and the first
position that differs), and max|Δlogits| / max|logits| over the evals before the first differing token (after it
the runs see different contexts). Modes: the cache at CPU shares 0, 0.5 and auto; and the whole model resident on
the CPU (the kernels' difference alone).

    GGML_VK_VISIBLE_DEVICES=0 python tools/vulkan_numerics.py [--device Vulkan0] [--n 64]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click
import numpy as np
from parity import greedy_run, relative_diff

from ggml_hybrid.ggml.backend import cpu_instance
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

PROMPT = [5, 17, 42, 101, 7, 250, 33, 64]
MODES = {"cache share 0": ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0"],
         "cache share 0.5": ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0.5"],
         "cache share auto": ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=auto"]}


def _run(path: str, items: list[str], n: int, on_cpu: bool = False) -> tuple[list[int], np.ndarray]:
    dev = cpu_instance(0, 2) if on_cpu else None
    try:
        with MoEModel(path, SessionOptions.parse(items), device=dev) as m:
            return greedy_run(m, PROMPT, n)
    finally:
        if dev is not None:
            dev.close()


@click.command(help=__doc__)
@click.option("--device", default="Vulkan0", show_default=True)
@click.option("--n", "n_predict", default=64, show_default=True, type=click.IntRange(1))
def main(device: str, n_predict: int) -> None:
    print(f"{'weights':<8} {'mode':<18} {'tokens equal':>12} {'first diff':>10} {'max|Δ|/max|logit|':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for wtype in ("f32", "q8_0"):
            path = write_model(Path(tmp) / f"m_{wtype}.gguf", n_layer=4, n_expert=16, n_used=4, weight_type=wtype,
                               seed=3)
            ref_tokens, ref_logits = _run(path, [f"devices={device}"], n_predict)
            runs = {k: _run(path, [*v, f"devices={device}"], n_predict) for k, v in MODES.items()}
            runs["resident on the CPU"] = _run(path, [], n_predict, on_cpu=True)
            for k, (tokens, logits) in runs.items():
                same = [a == b for a, b in zip(tokens, ref_tokens)]
                first = same.index(False) if not all(same) else n_predict
                # evals 0..first see the same context: the prompt, then the tokens both runs chose
                rel = relative_diff(logits[:first + 1], ref_logits[:first + 1])
                print(f"{wtype:<8} {k:<18} {sum(same):>9}/{n_predict} {first if first < n_predict else '-':>10} "
                      f"{rel:>18.3g}", flush=True)


if __name__ == "__main__":
    main()
