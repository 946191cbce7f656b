#!/usr/bin/env python3
"""Lookahead prefetch (moe_prefetch): how well it predicts, and whether it pays on a real bus.

1. ``recall``: generated models of three families (random weights: qwen3moe, llama with routed experts as
   Mixtral, deepseek2 with sigmoid gating and a selection bias), disk experts with a quarter of the
   experts as slots, LRU: a prompt then greedy decode tokens with ``moe_prefetch=true`` and a trace of the
   routing with its predictions. Per family: recall and precision of the next-layer prediction over the
   decode steps, and from the recorded trace (``replay_prefetch``, which counts what the live run counted):
   loads on the critical path (demand misses) with prefetch, the loads without prefetch, Belady's optimum
   without prefetch, and every expert moved. A random-weight model's routing says little about a trained
   one's: these figures check the mechanism, not the recall a real model gets.
2. ``rpc``: the 8-layer synthetic stack (60 experts, top-4, Q4_K, 15 slots = a quarter) on GGML's RPC
   backend over loopback TCP (``ggml-hybrid rpc-server --threads 1``), its routing replaced by a shared
   Qwen1.5-MoE trace (``moe_route_trace``, ../shared/traces): decode steps of one token, A/B alternated in
   one run (after a warm-up; medians; outputs checked bit-identical between the sides) for prefetch off,
   prefetch with the trace as the prediction (an oracle: the most a prediction can give on this bus) and,
   on the stack's own routing, prefetch by the router against no prefetch.
3. ``queue``: why (on that bus): the time of a small graph on the RPC device alone, of an asynchronous
   upload of one prefetch's bytes alone, and of the upload followed at once by the graph, alternated,
   medians. If the last is the sum of the first two, the server takes uploads and graphs in one queue and a
   load sent ahead cannot overlap the compute that follows it.

    python tools/bench/bench_prefetch.py [--only recall|rpc|queue] [--tokens 48] [--steps 64] [--warmup 8] [--rounds 1]
        [--reps 41] [--rows 8]
        [--trace ../shared/traces/qwen1.5-moe-a2.7b_4bit_mlx_ml_moe_1.ghtrace]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np
from _alternate import alternate
from bench_rpc import start_server

from ggml_hybrid.ggml import rpc
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.moe.traces import read_trace, replay_prefetch
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model, write_moe_stack

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "qwen1.5-moe-a2.7b_4bit_mlx_ml_moe_1.ghtrace"
FAMILIES = {
    "qwen3moe": ModelSpec(arch="qwen3moe", n_layer=8, n_embd=256, n_ff_exp=128, n_expert=32, n_used=4,
                          weight_type="q8_0", seed=1),
    "llama (Mixtral)": ModelSpec(arch="llama", n_layer=8, n_embd=256, n_ff_exp=128, n_expert=8, n_used=2,
                                 weight_type="q8_0", seed=2),
    "deepseek2": ModelSpec(arch="deepseek2", n_layer=8, n_embd=256, n_ff_exp=128, n_expert=32, n_used=4,
                           n_dense_lead=1, gating="sigmoid", weight_type="q8_0", seed=3),
}
STACK = dict(n_layer=8, n_embd=512, n_ff=512, n_expert=60, n_used=4, expert_type="q4_K")


def recall(tokens: int) -> None:
    print(f"{'family':<16} {'experts':>7} {'slots':>5} {'recall':>6} {'precision':>9} {'demand loads':>12} "
          f"{'no prefetch':>11} {'Belady':>6} {'prefetched':>10} {'used':>5} {'moved':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in FAMILIES.items():
            path = write_model(Path(tmp) / "m.gguf", spec)
            slots = max(spec.n_expert // 4, spec.n_used)
            trace = Path(tmp) / "t.ghtrace"
            opts = SessionOptions.parse(["disk_experts=1", f"expert_cache_slots={slots}", "moe_prefetch=1",
                                         f"trace_path={trace}", "n_threads=1"])
            with MoEModel(path, opts) as m:
                complete(m, m.tokenizer.encode("The quick brown fox jumps over the lazy dog."), tokens,
                         stop_at_eos=False)
                live = m.counters.total
            r = replay_prefetch(read_trace(trace), slots, SessionOptions().expert_eviction, spec.n_used)
            assert (r.demand_loads, r.prefetched) == (live.misses, live.prefetched), "replay and live disagree"
            print(f"{name:<16} {spec.n_expert:>7} {slots:>5} {live.recall:>6.3f} {live.precision:>9.3f} "
                  f"{r.demand_loads:>12} {r.baseline_loads:>11} {r.belady_loads:>6} {r.prefetched:>10} "
                  f"{r.prefetch_used:>5} {r.demand_loads + r.prefetched:>6}")


def _print(label: str, med: float, c, b, steps: int, base_tps: float) -> None:
    d = lambda k: (getattr(c, k) - getattr(b, k)) / steps
    print(f"{label:<28} {1 / med:>7.1f} {1 / med / base_tps:>6.3f} {d('misses'):>9.2f} {d('prefetched'):>10.2f} "
          f"{d('prefetch_used'):>5.2f} {d('load_ns') / 1e6:>8.3f} {d('staging_wait_ns') / 1e6:>8.3f} "
          f"{d('prefetch_ns') / 1e6:>8.3f} {d('device_ns') / 1e6:>9.3f}")


def rpc_ab(trace: Path, steps: int, warmup: int, rounds: int) -> None:
    if not trace.exists():
        print(f"rpc: {trace} is absent (the shared traces are not part of the project): skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = write_moe_stack(Path(tmp) / "stack.gguf", seed=7, **STACK)
        proc, endpoint = start_server()
        try:
            dev = rpc.server_devices(endpoint)[0]
            items = ["disk_experts=1", "expert_cache_slots=15", "n_threads=1", "repack=false"]
            pairs = {
                "trace routing": (["moe_route_trace=" + str(trace)], "prefetch oracle"),
                "the stack's own routing": ([], "prefetch by the router"),
            }
            print(f"{STACK['n_layer']}-layer stack, {STACK['n_expert']} experts top-{STACK['n_used']} "
                  f"{STACK['expert_type']}, 15 slots, device RPC0 = rpc-server on {endpoint} (1 thread); decode "
                  f"steps of 1 token, {warmup} warm-up + {steps} measured, alternated; per token:")
            print(f"{'side':<28} {'tok/s':>7} {'ratio':>6} {'demand':>9} {'prefetched':>10} {'used':>5} "
                  f"{'load ms':>8} {'wait ms':>8} {'pf ms':>8} {'exec ms':>9}")
            for routing, (extra, on) in [p for _ in range(rounds) for p in pairs.items()]:
                backends = {k: rpc.open_device(dev) for k in ("off", "on")}
                sessions = {
                    "off": MoEStackSession(path, SessionOptions.parse([*items, *extra]), device=backends["off"],
                                           benchmark=True),
                    "on": MoEStackSession(path, SessionOptions.parse([*items, *extra, "moe_prefetch=1"]),
                                          device=backends["on"], benchmark=True),
                }
                med, base = alternate(sessions, None, 1, STACK["n_embd"], steps, warmup, seed=5)
                print(f"-- {routing}")
                for k, label in (("off", "no prefetch"), ("on", on)):
                    _print(label, med[k], sessions[k].counters.total, base[k], steps * STACK["n_layer"] // 8,
                           1 / med["off"])
                for s in sessions.values():
                    s.close()
                for be in backends.values():
                    be.close()
            print("outputs bit-identical between the sides of each pair: True")
        finally:
            proc.terminate()
            proc.wait()


def queue(reps: int, rows: int) -> None:
    import statistics
    import time

    import ggml_hybrid as gh
    from ggml_hybrid import lib
    from ggml_hybrid._native import ffi

    proc, endpoint = start_server()
    try:
        be = rpc.open_device(rpc.server_devices(endpoint)[0])
        n = STACK["n_embd"]
        expert = 3 * n * n * 144 // 256  # one Q4_K expert of the stack
        nbytes = STACK["n_used"] * expert  # one prefetch at the default bound
        ctx = gh.Context(n_tensors=16, graph_size=16)
        slot = ctx.new_tensor("i8", (nbytes,), "slot")
        w = ctx.new_tensor("f32", (n, n), "w")
        x = ctx.new_tensor("f32", (rows, n), "x")
        y = ctx.mul_mat(w, x)
        for _ in range(7):  # a layer's dense part: a few small products in a row
            y = ctx.mul_mat(w, y)
        graph = ctx.new_graph(16).expand(y)
        ctx.allocate(be, "weights")
        w.set(np.full((n, n), 1e-3, np.float32))
        x.set(np.ones((rows, n), np.float32))
        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        src = ffi.from_buffer(data)
        probe = ffi.new("uint8_t[4]")

        def compute() -> None:
            lib.ggml_backend_graph_compute(be.ptr, graph.ptr)

        def upload() -> None:
            lib.ggml_backend_tensor_set_async(be.ptr, slot.ptr, src, 0, nbytes)

        cases = {"graph alone": [compute], "upload alone": [upload], "upload, then the graph": [upload, compute]}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(reps + 3):
            for k in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                t0 = time.perf_counter()
                for f in cases[k]:
                    f()
                # the RPC client queues uploads and graphs (synchronize only drains its sending): a read waits until
                # the server has done everything before it
                lib.ggml_backend_tensor_get(slot.ptr, probe, 0, 4)
                if r >= 3:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"RPC loopback, {nbytes} bytes uploaded ({STACK['n_used']} Q4_K experts of {n}x{n}) and a graph of "
              f"8 products {n}x{n} by {rows} rows; {reps} alternated reps, medians:")
        for k, v in med.items():
            print(f"  {k:<24} {v:8.3f} ms")
        print(f"  sum of the first two     {med['graph alone'] + med['upload alone']:8.3f} ms")
        ctx.close()
        be.close()
    finally:
        proc.terminate()
        proc.wait()


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--only", type=click.Choice(["recall", "rpc", "queue"]))
@click.option("--reps", type=int, default=41, show_default=True, help="alternated reps (queue)")
@click.option("--rows", type=int, default=8, show_default=True, help="rows of the graph's products (queue)")
@click.option("--tokens", type=int, default=48, show_default=True, help="decode tokens per family (recall)")
@click.option("--steps", type=int, default=64, show_default=True)
@click.option("--warmup", type=int, default=8, show_default=True)
@click.option("--rounds", type=int, default=1, show_default=True, help="the RPC A/B pairs, run this many times")
@click.option("--trace", type=click.Path(path_type=Path), default=TRACE, show_default=True)
def main(**options) -> None:
    ns = SimpleNamespace(**options)
    np.seterr(all="ignore")
    if ns.only in (None, "recall"):
        recall(ns.tokens)
    if ns.only in (None, "rpc"):
        rpc_ab(ns.trace, ns.steps, ns.warmup, ns.rounds)
    if ns.only in (None, "queue"):
        queue(ns.reps, ns.rows)
    sys.exit(0)


if __name__ == "__main__":
    main()
