#!/usr/bin/env python3
"""Speculative decoding: what a verify step costs, and what speculation gives, in each expert mode (issue 42).

Every side generates the same greedy tokens (a tgN test: one token, then N - 1 greedy ones, checked equal to the
plain run's); a mode's sides run in one worker process (``_spec_worker.py``), in rounds, in order then reversed,
after a warm-up round; medians. Modes (--modes):

- ``resident``: every expert in memory (the CPU plays the device);
- ``rpc``: the expert cache (--slots per layer) on an RPC device: ``ggml-hybrid rpc-server --threads 1`` on
  loopback, every layer and the output there (a real bus: each load a ``tensor_set`` over TCP);
- ``tier``: the expert cache on the CPU fed by the host tier (``host_tier_bytes`` = --tier), the worker in a
  cgroup v1 memory group whose limit (--limit, page cache included) is below the model's size, from a cold page
  cache (``drop_caches``): every miss of the tier is a read from the file (needs root).

Parts (--parts):

- ``verify``: drafts replayed at acceptance 1 with k = 1, 2, 3 drafts per step, so that every verify step evaluates
  k + 1 tokens, against plain decoding's one-token steps: seconds and bytes (copied into cache slots, read by the
  tier, read from the block device) per target step, and their ratio to a one-token step; and, on the same file,
  llama.cpp's batched decode of 2, 3, 4 tokens of one sequence against one token (``_llama_verify_worker.py``
  under --llama-python);
- ``tps``: tok/s with k = 3 replayed drafts right with probability 0.5, 0.7, 0.9 (realised acceptance shown),
  against plain decoding;
- ``zero`` (resident): the model's own head (random weights: acceptance about 0), k = 3, drafting until it stops
  (--p-min 0, no backoff), stopped by ``draft_p_min`` = --p-min, and with the backoff: tok/s against plain; and
  speculation's path without any draft (every step the speculator's, a plain decode step on the head's model, its
  hidden rows kept: what the path itself costs). Besides wall time, each side's CPU time against plain's (the
  worker's ``time.process_time``: on a loaded machine the waits for a core do not count).

The model (default: generated once into ~/.cache/ggml-hybrid/bench/spec-qwen35moe-60x4.gguf, 480 MiB) is a
Qwen3.5-MoE-layout qwen35moe (gated delta-net layers, one attention layer in four) with a next-token-prediction head,
60 Q4_K experts per layer, top-4 (a generated glm4moe routes nearly every token to the same experts: its selection
bias outweighs its random router). A random-weight model's greedy loop
repeats one token and its routing, which flatters every cache; so the verify and tps parts decode a fixed varied
sequence instead (random tokens, seeded; ``_spec_worker.py``'s forced sampler), whose replayed drafts are kept as
the model's own greedy tokens would be (a routing trace cannot stand in: it is consumed by calls, and rejected drafts
would consume rows of it). The zero part decodes the model's own greedy tokens (its head drafts against them).

    sudo python tools/bench/bench_speculative.py [--modes resident,rpc,tier] [--parts verify,tps,zero] [--n 48]
        [--rounds 3] [--slots 8] [--tier 96M] [--limit 320M] [--llama-python /opt/llref/bin/python]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-c", "from ggml_hybrid.cli import main; main()"]
CGROUP = Path("/sys/fs/cgroup/memory/hy_spec")
START = 17  # the first token of every generation


def model_path() -> str:
    from ggml_hybrid.synthetic import write_model

    d = Path.home() / ".cache" / "ggml-hybrid" / "bench"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "spec-qwen35moe-60x4.gguf"
    if not path.exists():
        write_model(path.with_suffix(".part"), arch="qwen35moe", n_layer=8, nextn=1, n_embd=512, n_head=8,
                    n_head_kv=2, head_dim=64, n_rot=32, rope_sections="8,4,4,0", n_ff_exp=1024, n_ff_shexp=512,
                    n_expert=60, n_used=4, vocab_size=2048, weight_type="q8_0", expert_type="q4_k", d_state=64,
                    n_k_heads=4, n_v_heads=8, attn_interval=4, seed=42)
        os.replace(path.with_suffix(".part"), path)
    return str(path)




class Worker:
    def __init__(self, model: str, items: list[str], cgroup_limit: int | None = None) -> None:
        cmd = [sys.executable, str(HERE / "_spec_worker.py"), model, *items]
        if cgroup_limit is not None:  # the process joins the cgroup before it execs: all it maps or reads counts
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            CGROUP.mkdir(exist_ok=True)
            (CGROUP / "memory.force_empty").write_text("0\n")
            (CGROUP / "memory.limit_in_bytes").write_text(f"{cgroup_limit}\n")
            (CGROUP / "memory.max_usage_in_bytes").write_text("0\n")
            cmd = ["sh", "-c", f"echo $$ > {CGROUP}/cgroup.procs && exec " + " ".join(f"'{c}'" for c in cmd)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise SystemExit(f"the worker exited {self.proc.wait()} while loading (killed by the cgroup?)")

    def ask(self, req: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker exited {self.proc.wait()} while running (killed by the cgroup?)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_sides(w: Worker, sides: dict[str, dict], n: int, rounds: int, forced: bool) -> dict[str, dict]:
    """Each side ``rounds`` times after a warm-up round, alternating; per side the median run and its counters.
    ``forced``: a fixed varied sequence is decoded instead of the greedy one."""
    force = [int(t) for t in random.Random(5).choices(range(1000), k=n)] if forced else None
    want = w.ask({"side": "plain", "start": START, "n": n, "force": force})["tokens"]
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(rounds + 1):
        for name, req in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
            rep = w.ask({"start": START, "n": n, "tokens": want, "force": force, **req})
            if rep["tokens"] != want:
                raise SystemExit(f"{name}: the tokens differ from plain decoding's (a bug: they never change)")
            if r:
                runs[name].append(rep)
    out = {}
    for name, reps in runs.items():
        med = statistics.median(r["seconds"] for r in reps)
        last = reps[-1]
        out[name] = {"seconds": med, "min_s": min(r["seconds"] for r in reps), "tok_s": (n - 1) / med,
                     "cpu_s": statistics.median(r["cpu_seconds"] for r in reps),
                     "steps": last["steps"],
                     "per_step_ms": 1e3 * med / max(last["steps"], 1), "loaded": last["loaded"],
                     "tier_read": last["tier_read"], "io_read": last["io_read"], "spec": last["spec"]}
    return out


def mib(b: float) -> str:
    return f"{b / 2 ** 20:.2f}"


@click.command(help=__doc__)
@click.option("--model", "model", type=click.Path(exists=True, dir_okay=False), help="default: generated")
@click.option("--modes", default="resident,rpc,tier", show_default=True)
@click.option("--parts", default="verify,tps,zero", show_default=True)
@click.option("--n", default=48, show_default=True, help="evaluated positions per generation")
@click.option("--n-zero", "n_zero", default=256, show_default=True, help="the same for the zero part (the backoff's "
              "pauses grow to 64 tokens: a short run is mostly its first probes)")
@click.option("--rounds", default=3, show_default=True)
@click.option("--slots", default=8, show_default=True, help="expert cache slots per layer (rpc, tier)")
@click.option("--tier", default="96M", show_default=True, help="host_tier_bytes (tier)")
@click.option("--limit", default="320M", show_default=True, help="the tier mode's cgroup memory limit")
@click.option("--p-min", "p_min", default=0.5, show_default=True, help="draft_p_min of the zero part")
@click.option("--llama-python", default="/opt/llref/bin/python", show_default=True)
def main(model: str | None, modes: str, parts: str, n: int, n_zero: int, rounds: int, slots: int, tier: str,
         limit: str, p_min: float, llama_python: str) -> None:
    from ggml_hybrid.units import parse_size

    path = model or model_path()
    part_list, mode_list = parts.split(","), modes.split(",")
    print(f"model {path} ({mib(os.path.getsize(path))} MiB), N={n}, rounds={rounds}, 1 thread, load average "
          f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    from bench_rpc import start_server as start_rpc_server  # this folder's: rpc-server on a free loopback port

    base = ["n_threads=1", "n_ctx=512"]
    rpc = None
    try:
        for mode in mode_list:
            items = list(base)
            limit_b = None
            if mode == "rpc":
                rpc = rpc or start_rpc_server()
                items += [f"rpc={rpc[1]}", "disk_experts=1", f"expert_cache_slots={slots}", "repack=false"]
            elif mode == "tier":
                items += ["disk_experts=1", f"expert_cache_slots={slots}", f"host_tier_bytes={tier}"]
                limit_b = parse_size(limit)
            spec_parts = [p for p in part_list if p in ("verify", "tps")]
            if spec_parts:
                w = Worker(path, [*items, "spec_type=replay", "draft_max=3"], limit_b)
                try:
                    sides: dict[str, dict] = {"plain": {"side": "plain"}}
                    if "verify" in spec_parts:
                        sides.update({f"verify k+1={k + 1}": {"side": "replay", "k": k, "accept": 1.0}
                                      for k in (1, 2, 3)})
                    if "tps" in spec_parts:
                        sides.update({f"replay {a}": {"side": "replay", "k": 3, "accept": a} for a in (0.5, 0.7, 0.9)})
                    report(mode, run_sides(w, sides, n, rounds, forced=True))
                finally:
                    w.close()
            if "zero" in part_list and mode == "resident":
                w = Worker(path, [*items, "spec_type=draft-mtp", "draft_max=3"])
                try:
                    sides = {"plain": {"side": "plain"},
                             "spec path, no drafts": {"side": "nodraft", "k": 3},
                             "mtp, no stop": {"side": "mtp", "k": 3, "p_min": 0.0, "backoff": False},
                             f"mtp, p_min {p_min}": {"side": "mtp", "k": 3, "p_min": p_min, "backoff": False},
                             "mtp, backoff": {"side": "mtp", "k": 3, "p_min": 0.0, "backoff": True}}
                    report(mode + f" (the head's own drafts, N={n_zero})", run_sides(w, sides, n_zero, rounds,
                                                                                      forced=False))
                finally:
                    w.close()
        if "verify" in part_list and "resident" in mode_list and os.path.exists(llama_python):
            r = subprocess.run([llama_python, str(HERE / "_llama_verify_worker.py"), path, "1", "32", str(2 * rounds)],
                               capture_output=True, text=True, check=True)
            med = json.loads(r.stdout.strip().splitlines()[-1])["median_s"]
            one = med["1"]
            print("\nllama.cpp, batched decode of n tokens of one sequence (every logit) against one token, resident:")
            print("| n | ms | ratio to 1 |\n| ---: | ---: | ---: |")
            for k, v in med.items():
                print(f"| {k} | {1e3 * v:.2f} | {v / one:.2f} |")
    finally:
        if rpc is not None:
            rpc[0].kill()
            rpc[0].wait()


def report(mode: str, res: dict[str, dict]) -> None:
    plain = res["plain"]
    print(f"\n{mode}:")
    print("| side | tok/s | vs plain | vs plain, fastest runs | vs plain, CPU time | target steps | ms/step | "
          "step vs plain step | MiB loaded/step | MiB tier read/step | MiB disk read/step | acceptance | "
          "verify steps | head steps | head rows filled |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in res.items():
        steps = max(r["steps"], 1)
        sp = r["spec"]
        acc = f"{100 * sp['acceptance_rate']:.0f}%" if sp else "-"
        counts = f"{sp['verify_steps']} | {sp['draft_steps']} | {sp['head_rows_filled']}" if sp else "- | - | -"
        print(f"| {name} | {r['tok_s']:.2f} | {r['tok_s'] / plain['tok_s']:.2f} | {plain['min_s'] / r['min_s']:.2f} | "
              f"{plain['cpu_s'] / r['cpu_s']:.2f} | "
              f"{r['steps']} | {r['per_step_ms']:.2f} | {r['per_step_ms'] / plain['per_step_ms']:.2f} | "
              f"{mib(r['loaded'] / steps)} | {mib(r['tier_read'] / steps)} | {mib(r['io_read'] / steps)} | {acc} | "
              f"{counts} |")


if __name__ == "__main__":
    main()
