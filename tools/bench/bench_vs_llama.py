#!/usr/bin/env python3
"""ggml-hybrid against llama.cpp on the same synthetic file: prompt and decode tok/s, one run.

The model (8 layers, embd 1024, 64 experts, top-8, expert ff 512, Q8_0, vocab 8192; ``--arch qwen35moe``: the
same with 6 gated delta-net layers of 4/8 heads of 128 and 2 attention layers, a shared expert, M-RoPE over 32
dims) is generated once under build/bench/. llama.cpp runs in a worker process (a Python with
llama-cpp-python==0.3.36, given by --llama-python) that loads the file once; ggml-hybrid
runs in this process. After one warm-up each, rounds alternate A,B,B,A (A = ggml-hybrid,
B = llama.cpp); each run is a prompt of --prompt tokens then --n greedy tokens. Both use
the same thread count, no flash attention, F16 KV cache, ubatch 512. Medians and the
ratio ggml-hybrid / llama.cpp are printed.

    python tools/bench/bench_vs_llama.py --llama-python /path/to/python [--threads 1] [--rounds 4]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from ggml_hybrid.model.generate import complete
from ggml_hybrid.model.moe_model import MoEModel
from ggml_hybrid.model.synthetic import ModelSpec, write_model
from ggml_hybrid.options import SessionOptions

SPEC = ModelSpec(arch="qwen3moe", n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff_exp=512,
                 n_expert=64, n_used=8, vocab_size=8192, weight_type="q8_0", seed=42)
# a Qwen3.5-MoE in small: one attention layer in four, delta-net heads of 128, partial interleaved M-RoPE
SPECS = {"qwen3moe": SPEC,
         "qwen35moe": replace(SPEC, arch="qwen35moe", n_rot=32, rope_sections="6,5,5,0", d_state=128, n_k_heads=4,
                              n_v_heads=8, attn_interval=4, n_ff_shexp=512)}


def model_path(spec: ModelSpec = SPEC) -> str:
    p = Path(__file__).resolve().parents[2] / "build" / "bench" / f"{spec.arch}_l8_e1024_x64_k8_q8_0.gguf"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_model(p, spec)
        print(f"generated {p.name} ({p.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s")
    return str(p)


class LlamaWorker:
    def __init__(self, python: str, model: str, threads: int, n_ctx: int):
        worker = Path(__file__).with_name("_llama_worker.py")
        self.p = subprocess.Popen([python, str(worker), model, str(threads), str(n_ctx)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        if not json.loads(self.p.stdout.readline()).get("ready"):
            raise SystemExit("llama.cpp worker failed to start")

    def run(self, tokens, n):
        self.p.stdin.write(json.dumps({"tokens": [int(t) for t in tokens], "n": n}) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        return r["prompt_s"], r["decode_s"], r["tokens"]

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def run_ours(model: MoEModel, tokens, n):
    _, st = complete(model, tokens, n, stop_at_eos=False)
    return st.prompt_seconds, st.decode_seconds, st.tokens


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--llama-python', required=True)
@click.option('--arch', type=click.Choice(sorted(SPECS)), default="qwen3moe", show_default=True,
              help='the synthetic model')
@click.option('--threads', type=int, default=1, show_default=True)
@click.option('--rounds', type=int, default=4, help='blocks of A,B,B,A', show_default=True)
@click.option('--prompt', type=int, default=128, help='prompt tokens', show_default=True)
@click.option('--n', type=int, default=32, help='generated tokens (the first comes from the prompt)', show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    spec = SPECS[ns.arch]
    path = model_path(spec)
    n_ctx = 512
    tokens = np.random.default_rng(0).integers(0, 8000, ns.prompt).tolist()
    ours = MoEModel(path, SessionOptions(n_threads=ns.threads, n_ctx=n_ctx))
    theirs = LlamaWorker(ns.llama_python, path, ns.threads, n_ctx)
    sides = {"A": lambda: run_ours(ours, tokens, ns.n), "B": lambda: theirs.run(tokens, ns.n)}
    res = {"A": [], "B": []}
    try:
        warm = {k: f() for k, f in sides.items()}
        same = warm["A"][2] == warm["B"][2]
        for _ in range(ns.rounds):
            for k in "ABBA":
                res[k].append(sides[k]())
    finally:
        theirs.close()
        ours.close()

    def tps(runs, i, n):
        return statistics.median(n / r[i] for r in runs)

    rows = {}
    for k, name in (("A", "ggml-hybrid"), ("B", "llama.cpp")):
        rows[name] = (tps(res[k], 0, ns.prompt), tps(res[k], 1, ns.n - 1))
    a, b = rows["ggml-hybrid"], rows["llama.cpp"]
    print(f"model {Path(path).name}: {spec.n_layer} layers, embd {spec.n_embd}, {spec.n_expert} experts top-"
          f"{spec.n_used}, {spec.weight_type}; {ns.threads} thread(s); prompt {ns.prompt} tok, decode {ns.n - 1} "
          f"tok; {ns.rounds} x ABBA; {os.cpu_count()} cores")
    print(f"{'':<12}{'prompt tok/s':>14}{'decode tok/s':>14}")
    for name, (p, d) in rows.items():
        print(f"{name:<12}{p:>14.1f}{d:>14.2f}")
    print(f"{'ratio':<12}{a[0] / b[0]:>14.3f}{a[1] / b[1]:>14.3f}   (ggml-hybrid / llama.cpp, medians)")
    print(f"same greedy tokens: {same}")
    return 0


if __name__ == "__main__":
    main()
