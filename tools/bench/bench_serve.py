#!/usr/bin/env python3
"""``ggml-hybrid serve`` under concurrent requests: aggregate and per-request decode tok/s.

Two servers run side by side on one synthetic model, each with ``-np 8 -t THREADS``: ``resident``
(every expert in memory) and ``disk`` (``--disk-experts`` with an expert cache of ``--slots`` slots
per layer). For each concurrency C in --levels, C requests are sent at once (plain
``/v1/completions``, ``ignore_eos``: every request generates exactly --n tokens from its own
random --prompt-token prompt). Aggregate tok/s = C x n / the wall time from the first send to the
last answer; per-request decode tok/s = the server's ``timings.predicted_per_second`` (first token to
last). Rounds alternate the servers and the order of the levels (up, then down); one warm-up round
is dropped; medians over rounds are printed, with the ratio of each level's aggregate to C=1's.

    python tools/bench/bench_serve.py [--model small|large|PATH] [--rounds 4] [--n 32] [--threads 1]
    python tools/bench/bench_serve.py --part steps   # MoEModel.decode of S sequences per step, no server
    python tools/bench/bench_serve.py --part steps --configs resident,plain,disk --llama-python /opt/llref/bin/python

``small``: 4 layers, embd 256, 16 experts top-4, Q8_0 (per-step overhead is a visible part of a
token); ``large``: the llama.cpp benchmark's model (8 layers, embd 1024, 64 experts top-8, Q8_0, 857
MiB), both generated once under build/bench/.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import click
import numpy as np

from ggml_hybrid.synthetic import ModelSpec, write_model

SPECS = {
    "small": ModelSpec(arch="qwen3moe", n_layer=4, n_embd=256, n_head=8, n_head_kv=4, head_dim=32, n_ff_exp=256,
                       n_expert=16, n_used=4, vocab_size=2048, weight_type="q8_0", seed=5),
    "large": ModelSpec(arch="qwen3moe", n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff_exp=512,
                       n_expert=64, n_used=8, vocab_size=8192, weight_type="q8_0", seed=42),
}
NAMES = {"small": "qwen3moe_l4_e256_x16_k4_q8_0.gguf", "large": "qwen3moe_l8_e1024_x64_k8_q8_0.gguf"}


def model_path(which: str) -> tuple[str, int]:
    """The model file and its vocabulary size."""
    if which not in SPECS:
        from ggml_hybrid.gguf.store import GGUFStore

        s = GGUFStore(which)
        try:
            return which, len(s.meta("tokenizer.ggml.tokens"))
        finally:
            s.close()
    p = Path(__file__).resolve().parents[2] / "build" / "bench" / NAMES[which]
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_model(p, SPECS[which])
        print(f"generated {p.name} ({p.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s")
    return str(p), SPECS[which].vocab_size


class Server:
    def __init__(self, model: str, args: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "ggml_hybrid.cli", "serve", model, "--port",
                                      str(self.port), "-a", "m", *args])
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SystemExit("the server did not start")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)

    def complete(self, prompt: list[int], n: int) -> dict:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(self.url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def level(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        """All prompts at once: (aggregate tok/s, median per-request decode tok/s)."""
        out: list[dict | None] = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, self.complete(prompts[i], n)))
                   for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        assert all(r is not None and r["usage"]["completion_tokens"] == n for r in out)
        per = [r["timings"]["predicted_per_second"] for r in out if r is not None]
        return len(prompts) * n / wall, statistics.median(per)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


class LlamaSteps:
    """llama.cpp's decode of S sequences per step (``_llama_steps_worker.py``, under --llama-python)."""

    def __init__(self, python: str, path: str, threads: int, n_seq: int, n_ctx: int, prompt: int) -> None:
        worker = Path(__file__).with_name("_llama_steps_worker.py")
        self.p = subprocess.Popen([python, str(worker), path, str(threads), str(n_seq), str(n_ctx), str(prompt)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.p.stdout.readline()).get("ready"):
            raise SystemExit("llama.cpp worker failed to start")
        self.seed = 0

    def run(self, level: int, n: int) -> float:
        self.seed += 1
        self.p.stdin.write(json.dumps({"level": level, "n": n, "seed": self.seed}) + "\n")
        self.p.stdin.flush()
        return float(json.loads(self.p.stdout.readline())["tok_s"])

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def steps(path: str, vocab: int, levels: list[int], configs: list[str], slots: int, threads: int, rounds: int,
          n: int, llama_python: str | None) -> None:
    """The engine's floor without HTTP: ``MoEModel.decode`` of S sequences per step, in this process.

    Every config's model is open at once; per round, each (config, S) decodes ``n`` steps of S sequences
    (their prompts evaluated first, cells truncated back after), configs and levels alternating as above.
    ``plain`` is ``resident`` with the row-wise products switched off (what bit-identity to a lone run costs:
    its rows are not each sequence's lone bits); with --llama-python, ``llama.cpp`` is the same decode steps
    in llama.cpp (one llama_batch of S sequences per step)."""
    from ggml_hybrid.ggml.graph import Graph
    from ggml_hybrid.options import SessionOptions
    from ggml_hybrid.runtime.moe_model import MoEModel

    extra = {"resident": {}, "plain": {}, "disk": {"disk_experts": True, "expert_cache_slots": slots}}
    rng = np.random.default_rng(1)
    top = max(levels)
    prompts = [rng.integers(0, vocab, 16).tolist() for _ in range(top)]
    rowwise = Graph.set_rowwise
    models: dict[str, MoEModel] = {}
    llama = LlamaSteps(llama_python, path, threads, top, 256, 16) if llama_python else None
    names = configs + (["llama.cpp"] if llama else [])
    out: dict[tuple[str, int], list[float]] = {}
    try:
        for c in configs:
            # graphs take their products' hint when built: build every step graph of ``plain`` now, unmarked
            Graph.set_rowwise = (lambda self: 0) if c == "plain" else rowwise  # type: ignore[method-assign]
            m = models[c] = MoEModel(path, SessionOptions(n_threads=threads, n_ctx=256, n_parallel=top, **extra[c]))
            for s, p in enumerate(prompts):
                m.eval(p, seq=s)
            for lvl in levels:
                m.decode([(s, 1) for s in range(lvl)])
                for s in range(lvl):
                    m.truncate(16, seq=s)
        Graph.set_rowwise = rowwise  # type: ignore[method-assign]
        for rnd in range(rounds + 1):
            for c in (names if rnd % 2 == 0 else names[::-1]):
                for lvl in (levels if rnd % 2 == 0 else levels[::-1]):
                    if c == "llama.cpp":
                        assert llama is not None
                        rate = llama.run(lvl, n)
                    else:
                        m = models[c]
                        batches = [[(s, int(t)) for s, t in enumerate(rng.integers(0, vocab, lvl))]
                                   for _ in range(n)]
                        t0 = time.perf_counter()
                        for batch in batches:
                            m.decode(batch)
                        rate = lvl * n / (time.perf_counter() - t0)
                        for s in range(lvl):
                            m.truncate(16, seq=s)
                    if rnd:
                        out.setdefault((c, lvl), []).append(rate)
    finally:
        Graph.set_rowwise = rowwise  # type: ignore[method-assign]
        for m in models.values():
            m.close()
        if llama is not None:
            llama.close()
    print(f"\nMoEModel.decode, {n} steps per measure, threads {threads}, rounds {rounds}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| config | sequences per step | tok/s | vs 1 |")
    print("| --- | --- | --- | --- |")
    for c in names:
        one = statistics.median(out[(c, levels[0])])
        for lvl in levels:
            v = statistics.median(out[(c, lvl)])
            print(f"| {c} | {lvl} | {v:.1f} | {v / one:.2f} |")


@click.command(help=__doc__)
@click.option("--model", default="small", show_default=True, help="small, large, or a GGUF path.")
@click.option("--rounds", default=4, show_default=True, type=click.IntRange(1))
@click.option("--n", default=32, show_default=True, type=click.IntRange(2), help="Tokens per request.")
@click.option("--prompt", "prompt_len", default=16, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1))
@click.option("--slots", default=8, show_default=True, type=click.IntRange(1), help="Expert cache slots (disk).")
@click.option("--levels", default="1,2,4,8", show_default=True, help="Concurrent requests, comma-separated.")
@click.option("--configs", default="resident,disk", show_default=True)
@click.option("--part", type=click.Choice(["server", "steps"]), default="server", show_default=True,
              help="steps: MoEModel.decode in this process (no HTTP, no engine), the floor the server works on.")
@click.option("--llama-python", help="steps: a Python with llama-cpp-python==0.3.36, to run llama.cpp's steps too")
def main(model, rounds, n, prompt_len, threads, slots, levels, configs, part, llama_python) -> None:
    path, vocab = model_path(model)
    levels_ = [int(x) for x in levels.split(",")]
    if part == "steps":
        steps(path, vocab, levels_, configs.split(","), slots, threads, rounds, n, llama_python)
        return
    n_ctx = max(256, -(-(prompt_len + n) // 256) * 256)
    base = ["-np", str(max(levels_)), "-t", str(threads), "-c", str(n_ctx)]
    extra = {"resident": [], "disk": ["-o", "disk_experts=true", "--expert-cache-slots", str(slots)]}
    servers = {c: Server(path, base + extra[c]) for c in configs.split(",")}
    rng = np.random.default_rng(0)
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for rnd in range(rounds + 1):  # round 0 warms up (graphs of every batch shape, caches, pages)
            order = levels_ if rnd % 2 == 0 else levels_[::-1]
            for c in (servers if rnd % 2 == 0 else dict(reversed(list(servers.items())))):
                for lvl in order:
                    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(lvl)]
                    r = servers[c].level(prompts, n)
                    if rnd:
                        results.setdefault((c, lvl), []).append(r)
                    print(f"round {rnd} {c:8s} C={lvl}: aggregate {r[0]:.1f} tok/s, per request {r[1]:.1f} tok/s",
                          file=sys.stderr)
    finally:
        for s in servers.values():
            s.close()
    print(f"\nmodel {os.path.basename(path)}, n {n}, prompt {prompt_len}, threads {threads}, rounds {rounds}")
    print("| config | concurrent | aggregate tok/s | per-request decode tok/s | aggregate vs 1 |")
    print("| --- | --- | --- | --- | --- |")
    for c in servers:
        one = statistics.median(a for a, _ in results[(c, levels_[0])])
        for lvl in levels_:
            agg = statistics.median(a for a, _ in results[(c, lvl)])
            per = statistics.median(p for _, p in results[(c, lvl)])
            print(f"| {c} | {lvl} | {agg:.1f} | {per:.1f} | {agg / one:.2f} |")


if __name__ == "__main__":
    main()
