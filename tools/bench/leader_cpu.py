#!/usr/bin/env python3
"""The leader's CPU per decode step and per prompt call over RPC: ggml-hybrid's (``MoEModel``) against the pinned
llama.cpp's own client (llama-cpp-python 0.3.36), on bench_hosts.py's part 1 workload (its generated qwen3moe split
1:1 over two of ggml-hybrid's rpc-servers, 1 thread each, the leader 1 thread, n_ctx 512, batch 512, no flash
attention), the servers on loopback with no link emulation (no root needed).

On one machine the leader and its workers share the CPUs: every millisecond the leader (or a thread of it) spends
is taken from a worker, so the leader's CPU time is part of a step's time. Each side is a fresh process per round
(rounds alternate: ours, llama.cpp, llama.cpp, ours, ...) that prints, per repetition, its process CPU time (every
thread's: ``time.process_time``) and context switches (``getrusage``) over the prompt call and over the decode
steps. A voluntary context switch (``*_switches``) is where the threads of a leader hand work to each other (the
RPC client's dispatcher thread per server) or wait for a server, the main cost of a step's CPU; an involuntary one
(``*_preempted``) is the load taking the CPU away. Reported: medians per decode step and per prompt call, of the
repetitions after the first (warm), and the first repetition's decode separately (it holds the first decode step).

``--ours LABEL=DIR`` (repeatable) runs our side with the package of checkout DIR (built) instead of this one:
a before/after comparison in one run, alternated with the rest.

    python tools/bench/leader_cpu.py --llama-python /opt/llref/bin/python [--ours before=/tmp/main] [--rounds 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from types import SimpleNamespace

import click
from rpc_counts import _free_port, _server, leader_command, stop_servers


def _side(ns: SimpleNamespace, label: str, rpc: str) -> dict:
    env = dict(os.environ)
    cmd = leader_command(ns, "llama.cpp" if label == "llama.cpp" else "ours", rpc, ns.reps, ns.decode)
    if label != "llama.cpp":
        root = ns.roots[label]
        if root is not None:  # another checkout's package first on the path (no bytecode written into it)
            env["PYTHONPATH"] = str(root)
            env["PYTHONDONTWRITEBYTECODE"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{label} failed: {r.stderr[-3000:]}")
    return dict(json.loads(r.stdout.splitlines()[-1]))


def _summary(runs: list[dict], ns: SimpleNamespace) -> dict[str, float]:
    steps = ns.decode - 1
    warm = [c for r in runs for c in r["cpu"][1:]]
    first = [r["cpu"][0] for r in runs]

    def med(rows: list[dict], phase: str, key: str, per: int = 1) -> float:
        return statistics.median(c[phase][key] / per for c in rows)

    return {"step_cpu_ms": 1e3 * med(warm, "decode", "cpu_s", steps),
            "step_switches": med(warm, "decode", "voluntary", steps),
            "step_preempted": med(warm, "decode", "involuntary", steps),
            "prompt_cpu_ms": 1e3 * med(warm, "prompt", "cpu_s"),
            "prompt_switches": med(warm, "prompt", "voluntary"),
            "prompt_preempted": med(warm, "prompt", "involuntary"),
            "first_decode_cpu_ms": 1e3 * med(first, "decode", "cpu_s"),
            "first_prompt_cpu_ms": 1e3 * med(first, "prompt", "cpu_s"),
            "threads": max(c["decode"]["threads"] for r in runs for c in r["cpu"]),
            "step_ms": 1e3 * statistics.median(t for r in runs for t in r["decode_s"][1:]) / steps}


@click.command(help=__doc__)
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python 0.3.36 (GGML_RPC=on)")
@click.option("--model", default=None, help="the model (default: bench_hosts.py's generated qwen3moe)")
@click.option("--ours", "others", multiple=True, help="LABEL=DIR: also our side from checkout DIR")
@click.option("--prompt", type=int, default=64, show_default=True)
@click.option("--decode", type=int, default=65, show_default=True, help="tokens per repetition (steps + 1)")
@click.option("--reps", type=int, default=4, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True)
def main(**kw: object) -> None:
    ns = SimpleNamespace(**kw)
    if ns.model is None:
        from ggml_hybrid.synthetic import write_model

        ns.model = str(write_model("/tmp/bench_hosts-16.gguf", n_layer=8, n_embd=512, n_expert=16, n_used=2,
                                   weight_type="q8_0", seed=5))
    ns.roots = {"ours": None}
    for item in ns.others:
        label, _, root = item.partition("=")
        if not root or label in ("ours", "llama.cpp"):
            raise click.UsageError(f"--ours {item!r}: give LABEL=DIR, LABEL other than ours and llama.cpp")
        ns.roots[label] = Path(root).resolve()
    ports = [_free_port(), _free_port()]
    servers = [_server(p) for p in ports]
    try:
        rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
        labels = [*ns.roots, "llama.cpp"]
        runs: dict[str, list[dict]] = {k: [] for k in labels}
        load = [os.getloadavg()[0]]
        for k in range(ns.rounds):
            for label in labels if k % 2 == 0 else labels[::-1]:
                runs[label].append(_side(ns, label, rpc))
        load.append(os.getloadavg()[0])
        tokens = {label: tuple(rs[0]["tokens"]) for label, rs in runs.items()}
        print(f"model {ns.model}; prompt {ns.prompt} tokens; {ns.decode - 1} decode steps x {ns.reps} reps x "
              f"{ns.rounds} rounds; load {load[0]:.1f} -> {load[1]:.1f}; same tokens: {len(set(tokens.values())) == 1}")
        rows = {label: _summary(rs, ns) for label, rs in runs.items()}
        keys = list(next(iter(rows.values())))
        print(f"| {'':20} | " + " | ".join(f"{label:>10}" for label in rows) + " |")
        for key in keys:
            print(f"| {key:20} | " + " | ".join(f"{rows[label][key]:10.3f}" for label in rows) + " |")
    finally:
        stop_servers(servers)


if __name__ == "__main__":
    main()
