#!/usr/bin/env python3
"""The native expert executor against the Python reference (issue 12's figures).

1. ``orchestration``: the 16-layer stack of bench_expert_cache.py (64 experts, top-8, Q4_K, 256 wide,
   so that the experts' own compute is small and the executor's overhead shows) at decode, a CPU
   backend instance playing the device, 1 thread. Sessions: resident experts; the native and the Python
   executor with 64 slots (every expert fits: after the warm-up every call is a pure hit, so the time
   over resident is the price of the cache path itself) and with 16 slots (misses every call). Per layer
   call: wall time, its ratio to resident, the orchestration time (executor time minus loads and GGML
   compute), the hit rate. Alternating order, fresh input per step, every output checked bit-identical.
2. ``loads``: the same stack with its device on a ``ggml-hybrid rpc-server`` (loopback, 1 thread) and 8
   slots, share 0: the native executor's queued uploads (straight from the mapping, the RPC client sends
   while the next expert is read) against plain ``tensor_set`` (same executor, ``use_plain_loads``), at 1
   and 64 tokens: time per layer, load time per call, MB/s.

3. ``ab``: the native executor's orchestration against another build of the package (``--base DIR``: a
   checkout built with ``python -m ggml_hybrid_build``, e.g. ``git worktree add /tmp/base COMMIT``), alternated in one
   run:
   each of ``--rounds`` rounds runs the stack of part 1 (resident, native with 64 and 16 slots) once in a fresh
   process of each build (``_native_stack_worker.py``), in alternating order; medians over the rounds and
   their ratio, head / base (bench_commits.py does the same for a whole model's tok/s).

    python tools/bench/bench_native_executor.py [--part orchestration|loads|all] [--steps 40] [--warmup 10]
    python tools/bench/bench_native_executor.py --part ab --base /tmp/base [--rounds 6]
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import click
import numpy as np
from _alternate import alternate, alternate_builds
from bench_expert_cache import SHAPE, model_path
from bench_rpc import start_server

from ggml_hybrid.ggml import rpc
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions


def _delta(s: MoEStackSession, base) -> dict[str, float]:
    tot = s.counters.total
    calls = tot.calls - base.calls
    distinct = tot.distinct - base.distinct
    return {"calls": calls, "hit": (tot.hits - base.hits) / distinct if distinct else float("nan"),
            "orch_us": (tot.orchestration_ns - base.orchestration_ns) / calls / 1e3 if calls else float("nan"),
            "load_ms": (tot.load_ns - base.load_ns) / calls / 1e6 if calls else float("nan"),
            "bytes": tot.bytes_loaded - base.bytes_loaded, "load_s": (tot.load_ns - base.load_ns) / 1e9,
            "wait_ms": (tot.staging_wait_ns - base.staging_wait_ns) / calls / 1e6 if calls else float("nan")}


def _run(sessions: dict[str, MoEStackSession], ref: MoEStackSession | None, n_tokens: int, steps: int, warmup: int,
         seed: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    med, base = alternate(sessions, ref, n_tokens, SHAPE["n_embd"], steps, warmup, seed)
    return med, {k: _delta(s, base[k]) for k, s in sessions.items() if k != "resident"}


def orchestration(steps: int, warmup: int) -> None:
    path, n_layer = model_path(), SHAPE["n_layer"]
    modes = {"resident": [],
             **{f"{e} {n} slots": ["disk_experts=1", f"expert_cache_slots={n}", f"moe_executor={e}"]
                for n in (64, 16) for e in ("native", "python")}}
    sessions = {k: MoEStackSession(path, SessionOptions.parse([*v, "n_threads=1"])) for k, v in modes.items()}
    warm = np.random.default_rng(0).standard_normal((256, SHAPE["n_embd"])).astype(np.float32)
    for s in sessions.values():
        s.forward(warm)  # 256 tokens route to every expert: the 64-slot caches are full from here on
    med, d = _run(sessions, None, 1, steps, warmup, seed=1)
    print(f"decode, {n_layer} layers, {SHAPE['n_expert']} experts top-{SHAPE['n_used']} {SHAPE['expert_type']}, "
          f"{steps} steps after {warmup}")
    print(f"{'mode':<18} {'us/layer':>9} {'vs resident':>11} {'hit rate':>8} {'orchestration us/call':>22}")
    for k, m in med.items():
        us = m * 1e6 / n_layer
        row = d.get(k)
        hit = "-" if row is None else f"{row['hit']:.2f}"
        orch = "-" if row is None else f"{row['orch_us']:.1f}"
        print(f"{k:<18} {us:>9.1f} {m / med['resident']:>11.3f} {hit:>8} {orch:>22}")
    for e in ("native", "python"):
        print(f"{e}: orchestration 16 slots / 64 slots: "
              f"{d[f'{e} 16 slots']['orch_us'] / d[f'{e} 64 slots']['orch_us']:.2f}")
    print(f"python / native orchestration at 64 slots: "
          f"{d['python 64 slots']['orch_us'] / d['native 64 slots']['orch_us']:.1f}x")
    for s in sessions.values():
        s.close()


def ab(base: str, rounds: int, steps: int, warmup: int) -> None:
    builds = {"base": Path(base).resolve(), "head": Path(__file__).resolve().parents[2]}
    worker = [sys.executable, str(Path(__file__).with_name("_native_stack_worker.py")), model_path(),
              *map(str, (SHAPE["n_layer"], SHAPE["n_embd"], steps, warmup))]
    runs = alternate_builds(worker, builds, rounds)
    print(f"native executor, {rounds} rounds (a fresh process of each build per round, alternating), each {steps} "
          f"decode steps after {warmup}; base = {builds['base']}, head = {builds['head']}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<16} {'figure':<22} {'base':>8} {'head':>8} {'head/base':>10}  per-round ratios")
    for mode in runs["head"][0]["us_layer"]:
        for key, label in (("us_layer", "us/layer"), ("orch_us", "orchestration us/call")):
            if mode not in runs["head"][0][key]:
                continue
            b = [x[key][mode] for x in runs["base"]]
            a = [x[key][mode] for x in runs["head"]]
            ratios = " ".join(f"{y / x:.2f}" for x, y in zip(b, a))
            print(f"{mode:<16} {label:<22} {statistics.median(b):>8.1f} {statistics.median(a):>8.1f} "
                  f"{statistics.median(a) / statistics.median(b):>10.3f}  {ratios}")


def loads(steps: int, warmup: int) -> None:
    path, n_layer = model_path(), SHAPE["n_layer"]
    proc, endpoint = start_server()
    try:
        dev = rpc.server_devices(endpoint)[0]
        print(f"device RPC0 = rpc-server on {endpoint} (1 thread), 8 slots, share 0, native executor")
        print(f"{'tokens':>6} {'loads':<7} {'ms/layer':>9} {'ratio':>6} {'load ms/call':>12} {'wait ms/call':>12} "
              f"{'MB/s':>7}")
        for n_tokens in (1, 64):
            backends = {k: rpc.open_device(dev) for k in ("queued", "copy")}
            # repack off on every side: the RPC server's slots hold plain weights, and parity needs the same kernels
            items = ["disk_experts=1", "expert_cache_slots=8", "n_threads=1", "repack=false"]
            sessions = {k: MoEStackSession(path, SessionOptions.parse(items), device=b) for k, b in backends.items()}
            for ex in sessions["copy"].executors:
                ex.use_plain_loads()
            assert {ex.load_mode for ex in sessions["queued"].executors} == {"queued"}
            ref = MoEStackSession(path, SessionOptions.parse(["n_threads=1", "repack=false"]))
            med, d = _run(sessions, ref, n_tokens, steps, warmup, seed=5 + n_tokens)
            for k in sessions:
                row = d[k]
                print(f"{n_tokens:>6} {k:<7} {med[k] * 1e3 / n_layer:>9.3f} {med[k] / med['copy']:>6.3f} "
                      f"{row['load_ms']:>12.3f} {row['wait_ms']:>12.3f} {row['bytes'] / row['load_s'] / 1e6:>7.1f}")
            for s in [*sessions.values(), ref]:
                s.close()
            for b in backends.values():
                b.close()
        print("every output bit-identical to the resident run on the local CPU: True")
    finally:
        proc.terminate()
        proc.wait(30)


@click.command(help=__doc__)
@click.option("--part", type=click.Choice(["orchestration", "loads", "all", "ab"]), default="all", show_default=True)
@click.option("--steps", type=click.IntRange(1), default=40, show_default=True, help="measured steps per mode")
@click.option("--warmup", type=click.IntRange(0), default=10, show_default=True)
@click.option("--base", type=click.Path(exists=True, file_okay=False), help="ab: the other build's checkout")
@click.option("--rounds", type=click.IntRange(1), default=6, show_default=True, help="ab: processes per build")
def main(part: str, steps: int, warmup: int, base: str | None, rounds: int) -> None:
    if part == "ab":
        if base is None:
            raise click.UsageError("--part ab needs --base DIR, a built checkout to compare with")
        ab(base, rounds, steps, warmup)
        return
    if part in ("orchestration", "all"):
        orchestration(steps, warmup)
    if part in ("loads", "all"):
        loads(steps, warmup)


if __name__ == "__main__":
    main()
