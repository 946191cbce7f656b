#!/usr/bin/env python3
"""ggml-hybrid against llama.cpp on the same synthetic qwen3moe files: prompt and decode tok/s per weight type.

The model (8 layers, embd 1024, 64 experts, top-8, expert ff 512, vocab 8192; ``--arch qwen35moe``: the same
with 6 gated delta-net layers of 4/8 heads of 128 and 2 attention layers, a shared expert, M-RoPE over 32 dims)
is generated once per ``--type`` under build/bench/. llama.cpp runs in a worker process (a Python with
llama-cpp-python==0.3.36, given by --llama-python) that loads the file once; ggml-hybrid runs in this process.
Two configurations per type: ``default`` (every weight where each side puts it on a CPU-only machine:
llama.cpp's CPU, ggml-hybrid's CPU instance playing the device) and ``cpu-moe`` (``--cpu-moe`` on both sides:
the routed experts on the host CPU). Both sides repack the weights GGML's CPU kernels take repacked, each by
default (``--no-repack`` turns it off on both sides, llama.cpp's ``-nr``). After one warm-up each, rounds
alternate A,B,B,A (A = ggml-hybrid, B = llama.cpp); each run is a prompt of --prompt tokens then --n greedy
tokens. Both use the same thread count, no flash attention, F16 KV cache, ubatch 512. Each side times its runs
in wall time and in its own process's CPU time (on a machine shared with other work, CPU time is what each
side's own work cost, less sensitive to either being descheduled). Medians and the ratios ggml-hybrid /
llama.cpp are printed, each A,B,B,A block's ratio (median and range), then one Markdown table of every ratio.
``--sessions K`` loads both sides afresh K times and pools their rounds: a side can run a few percent fast or
slow for its whole life (where its memory landed, what shared the host then), which more rounds in one
session do not average out. ``--model TYPE=PATH`` runs a given file for that type instead of the synthetic one
(e.g. a model quantized by llama.cpp's own quantizer).

    python tools/bench/bench_vs_llama.py --llama-python /opt/llref/bin/python \\
        [--type Q8_0 --type Q4_0 --type Q4_K --type Q6_K] [--threads 1] [--rounds 4] [--sessions 1]
        [--config default] [--arch qwen35moe] [--model Q8_0=held-out-q8_0.gguf]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

from ggml_hybrid.ggml import sched as _sched
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model

SPEC = ModelSpec(arch="qwen3moe", n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff_exp=512,
                 n_expert=64, n_used=8, vocab_size=8192, weight_type="q8_0", seed=42)
# a Qwen3.5-MoE in small: one attention layer in four, delta-net heads of 128, partial interleaved M-RoPE
SPECS = {"qwen3moe": SPEC,
         "qwen35moe": dataclasses.replace(SPEC, arch="qwen35moe", n_rot=32, rope_sections="6,5,5,0", d_state=128,
                                          n_k_heads=4, n_v_heads=8, attn_interval=4, n_ff_shexp=512)}
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_NL")
CONFIGS = ("default", "cpu-moe")


def model_path(wtype: str = "Q8_0", spec: ModelSpec = SPEC) -> str:
    t = wtype.lower().replace("_k", "_K")
    p = Path(__file__).resolve().parents[2] / "build" / "bench" / f"{spec.arch}_l8_e1024_x64_k8_{t}.gguf"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tmp = p.with_suffix(".part")  # renamed when complete: an interrupted write leaves no model behind
        write_model(tmp, dataclasses.replace(spec, weight_type=t))
        tmp.replace(p)
        print(f"generated {p.name} ({p.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return str(p)


class LlamaWorker:
    def __init__(self, python: str, model: str, threads: int, n_ctx: int, cpu_moe: bool, repack: bool):
        worker = Path(__file__).with_name("_llama_worker.py")
        cmd = [python, str(worker), model, str(threads), str(n_ctx)] + (["--cpu-moe"] if cpu_moe else []) \
            + ([] if repack else ["--no-repack"])
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.p.stdout.readline()).get("ready"):
            raise SystemExit("llama.cpp worker failed to start")

    def run(self, tokens, n):
        self.p.stdin.write(json.dumps({"tokens": [int(t) for t in tokens], "n": n}) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        return r["prompt_s"], r["decode_s"], r["tokens"], r["prompt_cpu"], r["decode_cpu"], r["decode_c"]

    def close(self):
        self.p.stdin.close()
        self.p.wait()


class _TimedLib:
    """The scheduler module's view of the native library, timing its graph computes (this side's counterpart of
    the worker's time inside ``llama_decode``; a decode step's native call also sets its inputs and reads the
    logits, as ``llama_decode`` does): what a step spends outside them is ggml-hybrid's own Python."""

    def __init__(self, real) -> None:
        self._real, self.inside = real, 0.0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _timed(self, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.inside += time.perf_counter() - t

    def ggml_backend_sched_graph_compute(self, *args):
        return self._timed(self._real.ggml_backend_sched_graph_compute, *args)

    def hy_sched_step(self, *args):
        return self._timed(self._real.hy_sched_step, *args)


_timed = _TimedLib(_sched.lib)  # installed by _main only: importing this module (bench_threads) changes nothing


def run_ours(model: MoEModel, tokens, n):
    """What the llama.cpp worker does: the prompt in one eval, then n-1 greedy tokens one eval each."""
    model.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    out = [int(np.argmax(model.eval(tokens)[-1]))]
    t1, c1 = time.perf_counter(), time.process_time()
    _timed.inside = 0.0
    for _ in range(n - 1):
        out.append(int(np.argmax(model.eval([out[-1]])[-1])))
    t2, c2 = time.perf_counter(), time.process_time()
    return t1 - t0, t2 - t1, out, c1 - c0, c2 - c1, _timed.inside


def compare(ns: SimpleNamespace, wtype: str, config: str) -> dict:
    given = dict(m.split("=", 1) for m in ns.models)
    path = given.get(wtype) or model_path(wtype, SPECS[ns.arch])
    n_ctx = 512
    tokens = np.random.default_rng(0).integers(0, 8000, ns.prompt).tolist()
    cpu_moe = config == "cpu-moe"
    res: dict[str, list] = {"A": [], "B": []}
    same = True
    # a session: both sides loaded afresh. How fast a side runs for its whole life can depend on where its
    # memory landed and what shares the host then, so several sessions are pooled, each one's ratio printed
    session_ratios = []
    for _ in range(ns.sessions):
        ours = MoEModel(path, SessionOptions(n_threads=ns.threads, n_ctx=n_ctx, cpu_moe=cpu_moe,
                                             repack=not ns.no_repack))
        theirs = LlamaWorker(ns.llama_python, path, ns.threads, n_ctx, cpu_moe, not ns.no_repack)
        sides = {"A": functools.partial(run_ours, ours, tokens, ns.n), "B": functools.partial(theirs.run, tokens, ns.n)}
        one: dict[str, list] = {"A": [], "B": []}
        try:
            warm = {k: f() for k, f in sides.items()}
            same = same and warm["A"][2] == warm["B"][2]
            for _ in range(ns.rounds):
                for k in "ABBA":
                    one[k].append(sides[k]())
        finally:
            theirs.close()
            ours.close()
        session_ratios.append([statistics.median(block_ratios(one, i, ns.n - 1 if i else ns.prompt)) for i in (0, 1)])
        for k in "AB":
            res[k] += one[k]

    def tps(runs, i, n):
        return statistics.median(n / r[i] for r in runs)

    # tok/s from wall time, and from CPU time (this process's, the worker's): on a machine shared with other
    # work the CPU time is what each side's own work cost, less sensitive to being descheduled
    rows = {name: (tps(res[k], 0, ns.prompt), tps(res[k], 1, ns.n - 1), tps(res[k], 3, ns.prompt),
                   tps(res[k], 4, ns.n - 1)) for k, name in (("A", "ggml-hybrid"), ("B", "llama.cpp"))}
    a, b = rows["ggml-hybrid"], rows["llama.cpp"]
    print(f"\n{wtype}, {config}: {Path(path).name}; {ns.threads} thread(s); prompt {ns.prompt} tok, decode "
          f"{ns.n - 1} tok; {ns.sessions} session(s) x {ns.rounds} x ABBA; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<12}{'prompt tok/s':>14}{'decode tok/s':>14}{'prompt, CPU':>14}{'decode, CPU':>14}")
    for name, r in rows.items():
        print(f"{name:<12}{r[0]:>14.1f}{r[1]:>14.2f}{r[2]:>14.1f}{r[3]:>14.2f}")
    ratio = [x / y for x, y in zip(a, b)]
    # a decode step: the compute (GGML's, or llama_decode with llama.cpp's graph set-up) and the Python around it
    step = {k: (statistics.median(r[5] / (ns.n - 1) for r in res[k]) * 1e3,
                statistics.median((r[1] - r[5]) / (ns.n - 1) for r in res[k]) * 1e3) for k in "AB"}
    print(f"{'ratio':<12}{ratio[0]:>14.3f}{ratio[1]:>14.3f}{ratio[2]:>14.3f}{ratio[3]:>14.3f}   "
          "(ggml-hybrid / llama.cpp, medians)")
    print(f"per decode step, ms: ggml-hybrid {step['A'][0]:.3f} in GGML's compute + {step['A'][1]:.3f} around it; "
          f"llama.cpp {step['B'][0]:.3f} in llama_decode + {step['B'][1]:.3f} around it")
    # each A,B,B,A block on its own: the machine's speed drifts over minutes, and within one block both sides
    # meet about the same machine, so the blocks' ratios spread less than the sides' medians do
    paired = [block_ratios(res, i, ns.n - 1 if i else ns.prompt) for i in (0, 1)]
    print(f"{'per block':<12}" + "".join(f"{statistics.median(q):>14.3f}" for q in paired)
          + "   (median of the blocks' ratios; range " + ", ".join(f"{min(q):.3f}-{max(q):.3f}" for q in paired) + ")")
    if ns.sessions > 1:
        print(f"{'per session':<12}" + "".join(f"{statistics.median(q):>14.3f}" for q in zip(*session_ratios))
              + "   (median of the sessions' block medians; each: "
              + ", ".join(f"{p:.3f}/{d:.3f}" for p, d in session_ratios) + ")")
    print(f"same greedy tokens: {same}", flush=True)
    return {"type": wtype, "config": config, "ours": a, "llama": b, "ratio": ratio, "same": same, "step": step,
            "paired": paired, "sessions": session_ratios}


def block_ratios(res: dict[str, list], i: int | str, n: int) -> list[float]:
    """Per A,B,B,A block: ggml-hybrid's tok/s over llama.cpp's (field ``i`` of each run: seconds for n tokens)."""
    out = []
    for j in range(0, len(res["A"]), 2):
        ours = sum(n / r[i] for r in res["A"][j:j + 2]) / 2
        theirs = sum(n / r[i] for r in res["B"][j:j + 2]) / 2
        out.append(ours / theirs)
    return out


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--llama-python", required=True)
@click.option("--arch", type=click.Choice(sorted(SPECS)), default="qwen3moe", show_default=True,
              help="the synthetic model")
@click.option("--type", "types", multiple=True, type=click.Choice(TYPES),
              help="weight type; repeatable [default: Q8_0]")
@click.option("--config", "configs", multiple=True, type=click.Choice(CONFIGS), help="repeatable [default: both]")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=4, help="blocks of A,B,B,A per session",
              show_default=True)
@click.option("--sessions", type=click.IntRange(1), default=1, show_default=True,
              help="times both sides are loaded afresh, their rounds pooled")
@click.option("--prompt", type=click.IntRange(1), default=128, help="prompt tokens", show_default=True)
@click.option("--n", type=click.IntRange(2), default=32, help="generated tokens (the first comes from the prompt)",
              show_default=True)
@click.option("--no-repack", is_flag=True, help="both sides without repacked weights (llama.cpp's -nr)")
@click.option("--model", "models", multiple=True, metavar="TYPE=PATH",
              help="a model file of one --type instead of the synthetic one (e.g. one quantized by llama.cpp)")
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    _sched.lib = _timed  # type: ignore[assignment]
    results = [compare(ns, t, c) for t in ns.types or ["Q8_0"] for c in ns.configs or CONFIGS]
    print(f"\n{os.cpu_count()} cores, {ns.threads} thread(s), {ns.sessions} x {ns.rounds} x ABBA; ratios ggml-hybrid / "
          "llama.cpp of the median tok/s, from wall time (CPU time)")
    print("| type | configuration | prompt tok/s (ours, llama.cpp) | decode tok/s (ours, llama.cpp) | prompt ratio "
          "| decode ratio | per block: prompt, decode (range) | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        q = r["ratio"]
        blocks = ", ".join(f"{statistics.median(b):.3f} ({min(b):.3f}-{max(b):.3f})" for b in r["paired"])
        print(f"| {r['type']} | {r['config']} | {r['ours'][0]:.1f}, {r['llama'][0]:.1f} | {r['ours'][1]:.2f}, "
              f"{r['llama'][1]:.2f} | {q[0]:.3f} ({q[2]:.3f}) | {q[1]:.3f} ({q[3]:.3f}) | {blocks} | {r['same']} |")
    return 0


if __name__ == "__main__":
    main()
