#!/usr/bin/env python3
"""A model split over two RPC workers on emulated hosts (tools/netlab.py), at each link shape: ggml-hybrid's leader
against the pinned llama.cpp's own RPC client on the same namespaces, model and split; and the expert cache on a
remote device over the slow link with moe_cpu_share auto against 0 and 1. Root (network namespaces).

Part 1, per link shape (1, 10 and 25 Gbit/s rate limits, and 1 Gbit/s with 0.5 ms each way): two workers running
ggml-hybrid's rpc-server (1 thread each), every layer offloaded, split 1:1 (``-ts 1,1``); the leader (1 thread) in
its own namespace evaluates a prompt of ``--prompt`` tokens in one call, then ``--decode`` greedy tokens one call
each. Ours: ``MoEModel``; llama.cpp: llama-cpp-python 0.3.36 (``--llama-python``, built with GGML_RPC=on), devices
added as llama.cpp's ``--rpc`` adds them. Each side is a fresh process per round (weights uploaded, then
``--reps`` timed repetitions); rounds alternate (ours, llama.cpp, llama.cpp, ours, ...). Medians; both sides must
pick the same greedy tokens.

Part 2, the slow link (1 Gbit/s, 0.5 ms each way; each shape of part 1 with ``--every-shape``), one worker: the
routed experts from the leader's file through an expert cache of ``--slots`` slots on the worker's device
(``split_mode=none``), moe_cpu_share 0, 1 and auto, and the layers resident on the worker (no cache): prompt and
decode tok/s, alternating rounds, medians.

Part 3, the rounds of a prompt through the cache on a remote CPU: :func:`part3`. ``--part`` picks parts (default:
all three).

    python tools/bench/bench_hosts.py --llama-python /opt/llref/bin/python [--rounds 2] [--reps 3] [--every-shape]
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import click

HERE = Path(__file__).resolve().parent
TOOLS = HERE.parent
SHAPES = [("1gbit", 0.0), ("10gbit", 0.0), ("25gbit", 0.0), ("1gbit", 0.5)]
SHARES = {"resident": [], "cache, share 0": ["moe_cpu_share=0"], "cache, share 1": ["moe_cpu_share=1"],
          "cache, share auto": ["moe_cpu_share=auto"]}


def _netlab() -> ModuleType:
    """tools/netlab.py by its file (this script runs from tools/bench/), without touching sys.path."""
    if "netlab" not in sys.modules:
        spec = importlib.util.spec_from_file_location("netlab", TOOLS / "netlab.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["netlab"] = mod  # registered before it runs: its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["netlab"]


# -- the sides (each a process in the leader's namespace; prints one JSON line) -----------------------------------


def side_ours(ns: SimpleNamespace) -> dict:
    import numpy as np

    from ggml_hybrid.options import SessionOptions
    from ggml_hybrid.runtime.moe_model import MoEModel

    # the llama.cpp side's settings (_llama_rpc_worker.py): a 512-cell context and batch, flash attention off
    opts = SessionOptions.parse(["n_threads=1", "n_ctx=512", "batch_size=512", "ubatch_size=512", "flash_attn=false",
                                 f"rpc={ns.rpc}", *ns.opt])
    with MoEModel(ns.model, opts) as m:
        prompt = list(range(10, 10 + ns.prompt))
        out: dict = {"prompt_s": [], "decode_s": [], "tokens": [], "prompt_counters": [], "cpu": []}
        for _ in range(ns.reps):
            m.reset()
            before = _counters(m)
            c0 = leader_cpu()
            t0 = time.perf_counter()
            logits = m.eval(prompt, "last")
            out["prompt_s"].append(time.perf_counter() - t0)
            c1 = leader_cpu()
            after = _counters(m)
            delta = {k: after[k] - before[k] for k in after}
            delta["share"] = delta["share_sum"] / delta["share_calls"] if delta["share_calls"] else 0.0
            out["prompt_counters"].append(delta)
            toks = [int(np.argmax(logits[-1]))]
            t0 = time.perf_counter()
            for _ in range(ns.decode - 1):
                toks.append(int(np.argmax(m.eval([toks[-1]], "last")[-1])))
            out["decode_s"].append(time.perf_counter() - t0)
            out["cpu"].append({"prompt": cpu_delta(c0, c1), "decode": cpu_delta(c1, leader_cpu())})
            out["tokens"] = toks
        return out


def leader_cpu() -> tuple[float, int, int, int]:
    """This process's CPU time (every thread's, those ended included), its voluntary and involuntary context
    switches, and its threads alive: what the leader takes from workers on the same machine."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), ru.ru_nvcsw, ru.ru_nivcsw, len(os.listdir("/proc/self/task"))


def cpu_delta(a: tuple[float, int, int, int], b: tuple[float, int, int, int]) -> dict[str, float]:
    return {"cpu_s": b[0] - a[0], "voluntary": b[1] - a[1], "involuntary": b[2] - a[2], "threads": b[3]}


COUNTED = ("calls", "rounds", "misses", "load_ns", "compute_ns", "share_calls")


def _counters(m: object) -> dict[str, float]:
    """The expert cache's counters over every layer (zeros without a cache), and share_sum."""
    experts = getattr(m, "experts", None)
    if experts is None or not getattr(experts, "executors", None):
        return dict.fromkeys((*COUNTED, "share_sum"), 0)
    total = m.counters.total  # type: ignore[attr-defined]
    return {k: float(getattr(total, k)) for k in (*COUNTED, "share_sum")}


# -- the driver ------------------------------------------------------------------------------------------------------


def _run(lab, exe: str, side: str, ns: SimpleNamespace, rpc: str, opts: list[str]) -> dict:
    common = ["--rpc", rpc, "--prompt", str(ns.prompt), "--decode", str(ns.decode), "--reps", str(ns.reps)]
    if side == "llama":
        cmd = [exe, str(HERE / "_llama_rpc_worker.py"), ns.model, *common]
    else:
        cmd = [exe, str(Path(__file__)), "--side", side, "--model", ns.model, *common,
               *[a for o in opts for a in ("--opt", o)]]
    r = subprocess.run(lab.leader.cmd(*cmd), capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"{side} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def _rates(results: list[dict], ns: SimpleNamespace) -> tuple[float, float]:
    prompt = statistics.median(t for r in results for t in r["prompt_s"])
    decode = statistics.median(t for r in results for t in r["decode_s"])
    return ns.prompt / prompt, (ns.decode - 1) / decode


def part1(ns: SimpleNamespace) -> None:
    netlab = _netlab()

    print(f"part 1: split 1:1 over two workers; prompt {ns.prompt} tokens, decode {ns.decode}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for rate, delay in SHAPES:
        with netlab.Lab(2) as lab:
            for link in lab.links:
                link.shape(rate)
            for i in (1, 2):
                lab.start_worker(i, delay_ms=delay)
            m = lab.measure(1, megabytes=16, pings=20)
            runs: dict[str, list[dict]] = {"ours": [], "llama.cpp": []}
            for k in range(ns.rounds):
                order = [("ours", sys.executable), ("llama.cpp", ns.llama_python)]
                for side, exe in (order if k % 2 == 0 else order[::-1]):
                    runs[side].append(_run(lab, exe, "ours" if side == "ours" else "llama", ns, lab.rpc(),
                                           ["tensor_split=1,1"] if side == "ours" else []))
            same = runs["ours"][0]["tokens"] == runs["llama.cpp"][0]["tokens"]
            (op, od), (lp, ld) = _rates(runs["ours"], ns), _rates(runs["llama.cpp"], ns)
            print(f"{rate}{f' +{delay} ms' if delay else ''} (measured {m['gbit_s']:.2f} Gbit/s, rtt "
                  f"{m['rtt_ms']:.2f} ms): prompt ours {op:.1f} tok/s, llama.cpp {lp:.1f} ({op / lp:.2f}x); decode "
                  f"ours {od:.1f} tok/s, llama.cpp {ld:.1f} ({od / ld:.2f}x); same tokens: {same}; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)


def part2(ns: SimpleNamespace) -> None:
    for rate, delay in SHAPES if ns.every_shape else [("1gbit", 0.5)]:
        _part2_over(ns, rate, delay)


def _part2_over(ns: SimpleNamespace, rate: str, delay: float) -> None:
    netlab = _netlab()

    print(f"part 2: one worker over {rate}{f' + {delay} ms' if delay else ''}; {ns.slots} cache slots; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    with netlab.Lab(1) as lab:
        lab.links[0].shape(rate)
        lab.start_worker(1, delay_ms=delay)
        runs: dict[str, list[dict]] = {k: [] for k in SHARES}
        cache = ["split_mode=none", "disk_experts=true", f"expert_cache_slots={ns.slots}"]
        for k in range(ns.rounds):
            names = list(SHARES) if k % 2 == 0 else list(SHARES)[::-1]
            for name in names:
                opts = ["split_mode=none"] if name == "resident" else cache + SHARES[name]
                runs[name].append(_run(lab, sys.executable, "ours", ns, lab.rpc(), opts))
        tokens = {tuple(r[0]["tokens"]) for r in runs.values()}
        rates = {name: _rates(rs, ns) for name, rs in runs.items()}
        for name, (p, d) in rates.items():
            share = statistics.median(c["share"] for r in runs[name] for c in r["prompt_counters"])
            print(f"{name}: prompt {p:.1f} tok/s, decode {d:.1f} tok/s (the prompt's share of misses on the CPU "
                  f"{share:.2f})", flush=True)
        fixed = [rates["cache, share 0"], rates["cache, share 1"]]
        auto = rates["cache, share auto"]
        print(f"auto / the better fixed share: prompt {auto[0] / max(p for p, _ in fixed):.2f}, decode "
              f"{auto[1] / max(d for _, d in fixed):.2f}", flush=True)
        print(f"same tokens in every mode: {len(tokens) == 1}; load {os.getloadavg()[0]:.1f}", flush=True)


def part3(ns: SimpleNamespace) -> None:
    """Rounds over RPC (item 7 of issue 44): a prompt through the expert cache on a remote CPU, with every expert
    fitting its slots (one round a layer once warm) and with ``--slots`` (several rounds a layer), against the layers
    resident on the worker; an unshaped link, so loads cost little. Our rpc-server says it computes on a CPU (vendor
    patch 0016): its rounds compute compacted rows, each row once. The pin's own server (``--pin-rpc-server``, on a
    second worker, where built) does not say: its rounds run the call's whole graph, every row once per round."""
    netlab = _netlab()

    n_expert = ns.n_expert
    cache = ["split_mode=none", "disk_experts=true", "moe_cpu_share=0"]
    modes = {"resident": ["split_mode=none"],
             f"cache, {n_expert} slots (all fit)": [*cache, f"expert_cache_slots={n_expert}"],
             f"cache, {ns.slots} slots (compacted rounds)": [*cache, f"expert_cache_slots={ns.slots}"]}
    pin = Path(ns.pin_rpc_server) if ns.pin_rpc_server else None
    if pin is not None and pin.exists():  # a server that does not say it computes on a CPU: whole-graph rounds
        modes[f"cache, {ns.slots} slots, the pin's server (the call's graph per round)"] = modes[
            f"cache, {ns.slots} slots (compacted rounds)"]
    else:
        print(f"(no pin rpc-server at {pin}: `python -m ggml_hybrid_build --pin-rpc-server` for the whole-graph "
              "rounds to compare)", flush=True)
    print(f"part 3: one worker, unshaped link; prompt {ns.prompt} tokens, timed reps after the first; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    with netlab.Lab(2) as lab:
        lab.start_worker(1)
        ours = lab.servers[0].endpoint
        upstream = lab.start_worker(2, upstream=pin).endpoint if pin is not None and pin.exists() else ours
        runs: dict[str, list[dict]] = {k: [] for k in modes}
        for k in range(ns.rounds):
            for name in (list(modes) if k % 2 == 0 else list(modes)[::-1]):
                runs[name].append(_run(lab, sys.executable, "ours", ns, upstream if "pin" in name else ours,
                                       modes[name]))
        warm = 1 if ns.reps > 1 else 0  # the first prompt of each process warms up (when there is another)
        for name, rs in runs.items():
            timed = [t for r in rs for t in r["prompt_s"][warm:]]
            c = [x for r in rs for x in r["prompt_counters"][warm:]]
            med = {key: statistics.median(x[key] for x in c) for key in COUNTED}
            layers = med["calls"] or 1
            print(f"{name}: prompt {ns.prompt / statistics.median(timed):.1f} tok/s (median of {len(timed)}); per "
                  f"prompt: {med['rounds'] / layers:.2f} rounds a layer, {med['misses']:.0f} loads, load "
                  f"{med['load_ns'] / 1e6:.1f} ms, expert compute {med['compute_ns'] / 1e6:.1f} ms", flush=True)
        print(f"same tokens in every mode: {len({tuple(r[0]['tokens']) for r in runs.values()}) == 1}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)


@click.command(help=__doc__)
@click.option("--side", type=click.Choice(["ours"]), default=None, hidden=True)
@click.option("--rpc", default="", hidden=True)
@click.option("--opt", multiple=True, hidden=True)
@click.option("--model", default=None, help="the model (default: a generated qwen3moe, q8_0)")
@click.option("--llama-python", default=None, help="a Python with llama-cpp-python 0.3.36 (GGML_RPC=on)")
@click.option("--prompt", type=int, default=64, show_default=True)
@click.option("--decode", type=int, default=17, show_default=True)
@click.option("--reps", type=int, default=3, show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True)
@click.option("--slots", type=int, default=4, show_default=True)
@click.option("--every-shape", is_flag=True, help="part 2 over each link shape of part 1 (default: the slow one)")
@click.option("--n-expert", type=int, default=16, show_default=True, help="the generated model's experts")
@click.option("--pin-rpc-server", default=str(TOOLS.parent / "build" / "pin-rpc-server" / "ggml-rpc-server"),
              show_default=True, help="part 3: the pin's own rpc-server (its rounds run the call's whole graph)")
@click.option("--part", type=click.Choice(["1", "2", "3", "both", "all"]), default="all", show_default=True,
              help="all: parts 1, 2 and 3; both: parts 1 and 2; 3: the rounds of a prompt through the cache on a "
                   "remote CPU")
def main(**kw: object) -> None:
    ns = SimpleNamespace(**kw)
    ns.opt = list(ns.opt)
    if ns.side is not None:
        print(json.dumps(side_ours(ns)))
        return
    if ns.model is None:
        from ggml_hybrid.synthetic import write_model

        ns.model = str(write_model(f"/tmp/bench_hosts-{ns.n_expert}.gguf", n_layer=8, n_embd=512,
                                   n_expert=ns.n_expert, n_used=2, weight_type="q8_0", seed=5))
    print(f"model {ns.model} ({Path(ns.model).stat().st_size / 2**20:.1f} MiB)", flush=True)
    if ns.part in ("1", "both", "all"):
        if ns.llama_python is None:
            raise click.UsageError("part 1 needs --llama-python")
        part1(ns)
    if ns.part in ("2", "both", "all"):
        part2(ns)
    if ns.part in ("3", "all"):
        part3(ns)


if __name__ == "__main__":
    main()
