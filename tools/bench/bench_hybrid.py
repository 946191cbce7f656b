#!/usr/bin/env python3
"""Hybrid execution benchmarks (moe_cpu_share).

1. CPU worker weight bandwidth at decode: one token routed to 8 experts of a layer with
   Qwen3-30B-A3B-like expert sizes (Q4_K), bytes of quantized expert weights read per
   second, against this machine's copy bandwidth (numpy) and against GGML's own CPU
   mul_mat_id computing the same experts.
2. Per-layer time for moe_cpu_share in {0, 0.25, 0.5, 0.75, 1, auto} at 8 cache slots, decode
   and a 64-token batch, on the 16-layer synthetic stack of bench_expert_cache.py, with a
   simulated device-load cost (bytes / --bus-gbps) so the trade-off shows on a CPU-only
   machine. Modes alternate per step after a warm-up; every output is checked bit-identical.
   Writes docs/hybrid_share.png when matplotlib is installed (pip install -e '.[bench]').

    python tools/bench/bench_hybrid.py [--steps 8] [--bus-gbps 2] [--threads 1]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid import lib
from ggml_hybrid.model.gguf_store import GGUFStore
from ggml_hybrid.model.synthetic import write_moe_stack
from ggml_hybrid.moe.cpu_worker import CPUWorker
from ggml_hybrid.moe.ffn import ExpertWeights, expert_ffn
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_expert_cache import model_path  # noqa: E402

BIG = dict(n_layer=1, n_embd=2048, n_ff=768, n_expert=32, n_used=8, expert_type="q4_K")


def big_model() -> str:
    p = ROOT / "build" / "bench" / "moe1_e32_2048x768_q4k.gguf"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        write_moe_stack(p, seed=2, **BIG)
    return str(p)


def copy_bandwidth() -> float:
    src = np.ones(64 << 20, np.uint8)
    dst = np.empty_like(src)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return src.nbytes / statistics.median(ts)


def bandwidth(threads: int, reps: int) -> None:
    store = GGUFStore(big_model())
    ctx = gh.Context(n_tensors=8)
    kinds = {k: store.new_tensor(ctx, f"blk.0.ffn_{k}_exps.weight") for k in ("gate", "up", "down")}
    for t in kinds.values():
        store.place(t)
    experts = ExpertWeights(**kinds)
    k, n_embd = BIG["n_used"], BIG["n_embd"]
    per_expert = sum(t.nb[2] for t in kinds.values())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, n_embd)).astype(np.float32)

    worker = CPUWorker(threads)
    backend = gh.cpu(threads)
    gctx = gh.Context(n_tensors=16, graph_size=32)
    xin = gctx.new_tensor("f32", (1, 1, n_embd), "x")
    ids = gctx.new_tensor("i32", (1, k), "ids")
    down = expert_ffn(gctx, experts, xin, ids)
    g = gctx.new_graph(32).expand(down)
    gctx.allocate(backend)
    xin.set(x.reshape(1, 1, n_embd))

    def pick():
        return rng.choice(BIG["n_expert"], k, replace=False).astype(np.int32)

    # warm: fault every page of the mapping in, so both arms read from RAM
    for _ in range(3):
        for e0 in range(0, BIG["n_expert"], k):
            sel = np.arange(e0, e0 + k, dtype=np.int32) % BIG["n_expert"]
            worker.submit(0, experts, np.repeat(x, k, 0), sel).result()
    t_worker, t_mmid = [], []
    for r in range(reps):
        sel = pick()
        for arm in ((0, 1) if r % 2 == 0 else (1, 0)):
            if arm == 0:
                rows, c0, c1 = worker.submit(0, experts, np.repeat(x, k, 0), sel).result()
                t_worker.append((c1 - c0) / 1e9)
            else:
                ids.set(sel.reshape(1, k))
                t0 = time.perf_counter()
                lib.ggml_backend_graph_compute(backend.ptr, g.ptr)
                t_mmid.append(time.perf_counter() - t0)
                ref = down.numpy().reshape(k, n_embd)
        assert np.array_equal(rows, ref), "worker rows differ from mul_mat_id"
    nbytes = k * per_expert
    bw_w, bw_m, bw_c = nbytes / statistics.median(t_worker), nbytes / statistics.median(t_mmid), copy_bandwidth()
    print(f"decode, {k} experts of {per_expert / 2**20:.2f} MiB (Q4_K {BIG['n_embd']}x{BIG['n_ff']}), "
          f"{threads} thread(s), {reps} alternating reps")
    print(f"{'':<34} {'GB/s':>8} {'vs copy':>8}")
    print(f"{'numpy copy bandwidth':<34} {bw_c / 1e9:>8.2f} {1:>8.2f}")
    print(f"{'CPU worker (expert weights read)':<34} {bw_w / 1e9:>8.2f} {bw_w / bw_c:>8.2f}")
    print(f"{'GGML mul_mat_id, same experts':<34} {bw_m / 1e9:>8.2f} {bw_m / bw_c:>8.2f}")
    print(f"worker / mul_mat_id: {bw_w / bw_m:.3f} (rows bit-identical)")
    worker.close()
    gctx.close()
    backend.close()
    ctx.close()
    store.close()


def shares(threads: int, steps: int, warmup: int, bus_gbps: float, plot: bool) -> None:
    path = model_path()
    share_values = ["0", "0.25", "0.5", "0.75", "1", "auto"]
    n_layer = 16
    print(f"\n16-layer stack, 64 experts top-8 Q4_K, 8 slots, simulated bus {bus_gbps} GB/s, {threads} thread(s)")
    print(f"{'tokens':>6} {'share':>6} {'ms/layer':>9} {'vs 0':>6} {'applied':>8} {'cpu misses/call':>15} "
          f"{'loads/call':>10} {'overlap %':>9}")
    results = {}
    for n_tokens in (1, 64):
        sessions = {s: MoEStackSession(path, SessionOptions.parse(
            ["disk_experts=1", "expert_cache_slots=8", f"moe_cpu_share={s}", f"n_threads={threads}"]),
            simulated_bus_bytes_per_s=bus_gbps * 1e9) for s in share_values}
        ref = MoEStackSession(path, SessionOptions.parse([f"n_threads={threads}"]))
        rng = np.random.default_rng(7 + n_tokens)
        times = {s: [] for s in sessions}
        base = {}
        for i in range(warmup + steps):
            x = rng.standard_normal((n_tokens, 256)).astype(np.float32)
            want = ref.forward(x)
            if i == warmup:
                base = {s: ss.counters.total for s, ss in sessions.items()}
            order = list(sessions.items()) if i % 2 == 0 else list(sessions.items())[::-1]
            for s, ss in order:
                t0 = time.perf_counter()
                got = ss.forward(x)
                if i >= warmup:
                    times[s].append(time.perf_counter() - t0)
                assert np.array_equal(got, want), f"share {s} differs from the default path"
        t0ms = statistics.median(times["0"]) * 1e3 / n_layer
        for s, ss in sessions.items():
            tot, b = ss.counters.total, base[s]
            calls = tot.calls - b.calls
            ms = statistics.median(times[s]) * 1e3 / n_layer
            applied = (tot.share_sum - b.share_sum) / max(1, tot.share_calls - b.share_calls)
            overlap = (tot.overlap_ns - b.overlap_ns) / max(1, tot.cpu_ns - b.cpu_ns) * 100
            print(f"{n_tokens:>6} {s:>6} {ms:>9.3f} {ms / t0ms:>6.2f} {applied:>8.2f} "
                  f"{(tot.cpu_misses - b.cpu_misses) / calls:>15.2f} {(tot.misses - b.misses) / calls:>10.2f} "
                  f"{overlap:>9.0f}")
            results[(n_tokens, s)] = ms
        for ss in [*sessions.values(), ref]:
            ss.close()
    print("every output bit-identical to the default path: True")
    if plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot (pip install -e '.[bench]')")
            return
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for ax, n_tokens in zip(axes, (1, 64)):
            ys = [results[(n_tokens, s)] for s in share_values]
            ax.bar(share_values, ys, color=["#888"] * 5 + ["#d62"])
            ax.set_title(f"{n_tokens} token{'s' if n_tokens > 1 else ''}: ms per layer")
            ax.set_xlabel("moe_cpu_share")
        fig.suptitle(f"8 slots, simulated bus {bus_gbps} GB/s, CPU-only machine")
        fig.tight_layout()
        out = ROOT / "docs" / "hybrid_share.png"
        fig.savefig(out, dpi=110)
        print(f"plot: {out.relative_to(ROOT)}")


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--steps', type=int, default=8, show_default=True)
@click.option('--warmup', type=int, default=3, show_default=True)
@click.option('--threads', type=int, default=1, show_default=True)
@click.option('--bus-gbps', type=float, default=2.0, show_default=True)
@click.option('--reps', type=int, default=30, show_default=True)
@click.option('--no-plot', is_flag=True)
@click.option('--only', type=click.Choice(['bandwidth', 'shares']))
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    if ns.only in (None, "bandwidth"):
        bandwidth(ns.threads, ns.reps)
    if ns.only in (None, "shares"):
        shares(ns.threads, ns.steps, ns.warmup, ns.bus_gbps, not ns.no_plot)
    return 0


if __name__ == "__main__":
    main()
