#!/usr/bin/env python3
"""Hybrid execution benchmarks (moe_cpu_share).

1. CPU worker weight bandwidth at decode: one token routed to 8 experts of a layer with
   Qwen3-30B-A3B-like expert sizes (Q4_K), bytes of quantized expert weights read per
   second, against this machine's copy bandwidth (numpy) and against GGML's own CPU
   mul_mat_id computing the same experts and rows: the native worker (moe_worker.c, the
   default) and the Python reference, with the experts used in place from the mapping and
   repacked (as a session holds them with repack=false and repack=true).
2. Per-layer time for moe_cpu_share in {0, 0.25, 0.5, 0.75, 1, auto} at 8 cache slots, decode
   and a 64-token batch, on the 16-layer synthetic stack of bench_expert_cache.py, with a
   simulated device-load cost (bytes / --bus-gbps) so the trade-off shows on a CPU-only
   machine. Modes alternate per step after a warm-up; every output is checked bit-identical.
   Writes docs/hybrid_share.png when matplotlib is installed (pip install -e '.[bench]').

    python tools/bench/bench_cpu_offload.py [--steps 8] [--bus-gbps 2] [--threads 1]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid import ffi, lib
from ggml_hybrid._native import cstr
from ggml_hybrid.ggml.ops import GLU_OPS
from ggml_hybrid.gguf.store import GGUFStore, load_into, repack_rule
from ggml_hybrid.moe.cpu_worker import CPUWorker, NativeWorker
from ggml_hybrid.moe.ffn import ExpertWeights, expert_ffn
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.synthetic import write_moe_stack

ROOT = Path(__file__).resolve().parents[2]
from _alternate import alternate  # noqa: E402
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


class _NativeArm:
    """Jobs handed to the native CPU worker (moe_worker.c) directly, as the native executor hands them."""

    def __init__(self, threads: int, experts: ExpertWeights, n_expert: int, n_embd: int):
        self.worker = NativeWorker(threads)
        self.w = ffi.new("hy_experts *")
        for k, t in experts.kinds.items():
            setattr(self.w, k, t.ptr)
        self.n_expert, self.n_embd = n_expert, n_embd

    def run(self, x_rows: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, float]:
        out = np.empty_like(x_rows)
        job = ffi.new("hy_job *")
        job.w, job.key, job.glu = self.w, self.w, GLU_OPS["swiglu"]
        job.n_expert, job.n_embd, job.n = self.n_expert, self.n_embd, len(ids)
        job.x = ffi.cast("const float *", ffi.from_buffer(x_rows))
        job.ids = ffi.cast("const int32_t *", ffi.from_buffer(ids))
        job.out = ffi.cast("float *", ffi.from_buffer(out))
        lib.hy_worker_submit(self.worker.ptr, job)
        if lib.hy_worker_wait(self.worker.ptr) != lib.HY_OK:
            raise SystemExit("the native worker's job failed")
        return out, (job.t_end - job.t_start) / 1e9

    def close(self) -> None:
        self.worker.close()


def bandwidth(threads: int, reps: int, repack: bool) -> dict[str, float]:
    store = GGUFStore(big_model())
    k, n_embd = BIG["n_used"], BIG["n_embd"]
    names = [f"blk.0.ffn_{kind}_exps.weight" for kind in ("gate", "up", "down")]
    # the experts as a session holds them on the host: used in place from the mapping, or repacked copies
    ctx, tensors = load_into(store, names, None, repack=repack_rule(store, repack))
    experts = ExpertWeights(**{kind: tensors[n] for kind, n in zip(("gate", "up", "down"), names)})
    where = sorted({cstr(lib.ggml_backend_buffer_name(t.ptr.buffer)) for t in experts.kinds.values()})
    per_expert = sum(t.nb[2] for t in experts.kinds.values())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, n_embd)).astype(np.float32)

    py_worker = CPUWorker(threads)
    native = _NativeArm(threads, experts, BIG["n_expert"], n_embd)
    backend = gh.cpu(threads)
    gctx = gh.Context(n_tensors=16, graph_size=32)
    xin = gctx.new_tensor("f32", (1, 1, n_embd), "x")
    ids = gctx.new_tensor("i32", (1, k), "ids")
    down = expert_ffn(gctx, experts, xin, ids)
    g = gctx.new_graph(32).expand(down)
    gctx.allocate(backend)
    xin.set(x.reshape(1, 1, n_embd))

    def mmid(sel):
        ids.set(sel.reshape(1, k))
        t0 = time.perf_counter()
        lib.ggml_backend_graph_compute(backend.ptr, g.ptr)
        t = time.perf_counter() - t0
        return down.numpy().reshape(k, n_embd), t

    def python(sel):
        rows, c0, c1 = py_worker.submit(0, experts, np.repeat(x, k, 0), sel).result()
        return rows, (c1 - c0) / 1e9

    arms = {"native": lambda sel: native.run(np.repeat(x, k, 0), sel), "python": python, "mmid": mmid}
    # warm: fault every page of the mapping in, so every arm reads from RAM
    for _ in range(3):
        for e0 in range(0, BIG["n_expert"], k):
            sel = np.arange(e0, e0 + k, dtype=np.int32) % BIG["n_expert"]
            for f in arms.values():
                f(sel)
    # each arm's own wall time of the computation, and the CPU seconds this process spent on the whole call
    # (hand-offs included): on a machine shared with other work the CPU time is what each arm's work cost,
    # less sensitive to being descheduled
    times: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    order = list(arms)
    for r in range(reps):
        sel = rng.choice(BIG["n_expert"], k, replace=False).astype(np.int32)
        got = {}
        for a in (order if r % 2 == 0 else order[::-1]):
            c0 = time.process_time()
            got[a], t = arms[a](sel)
            cpu[a].append(time.process_time() - c0)
            times[a].append(t)
        assert np.array_equal(got["native"], got["mmid"]) and np.array_equal(got["python"], got["mmid"]), \
            "worker rows differ from mul_mat_id"
    nbytes = k * per_expert
    bw = {a: nbytes / statistics.median(ts) for a, ts in times.items()}
    bw_cpu = {a: nbytes / statistics.median(ts) for a, ts in cpu.items()}
    bw_c = copy_bandwidth()
    print(f"\ndecode, {k} experts of {per_expert / 2**20:.2f} MiB (Q4_K {BIG['n_embd']}x{BIG['n_ff']}) in "
          f"{', '.join(where)}, {threads} thread(s), {reps} alternating reps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':<38} {'GB/s':>8} {'vs copy':>8} {'GB/CPU-s':>9}")
    print(f"{'numpy copy bandwidth':<38} {bw_c / 1e9:>8.2f} {1:>8.2f}")
    for a, label in (("native", "native CPU worker (moe_worker.c)"), ("python", "Python CPU worker (reference)"),
                     ("mmid", "GGML mul_mat_id, same experts")):
        print(f"{label:<38} {bw[a] / 1e9:>8.2f} {bw[a] / bw_c:>8.2f} {bw_cpu[a] / 1e9:>9.2f}")
    print(f"native worker / mul_mat_id: {bw['native'] / bw['mmid']:.3f} wall, {bw_cpu['native'] / bw_cpu['mmid']:.3f} "
          f"CPU; Python worker / mul_mat_id: {bw['python'] / bw['mmid']:.3f} wall, "
          f"{bw_cpu['python'] / bw_cpu['mmid']:.3f} CPU (rows bit-identical)")
    native.close()
    py_worker.close()
    gctx.close()
    backend.close()
    ctx.close()
    store.close()
    return {"wall": bw["native"] / bw["mmid"], "cpu": bw_cpu["native"] / bw_cpu["mmid"],
            "mmid_cpu": bw_cpu["mmid"], "native_cpu": bw_cpu["native"]}


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
        med, base = alternate(sessions, ref, n_tokens, 256, steps, warmup, seed=7 + n_tokens)
        t0ms = med["0"] * 1e3 / n_layer
        for s, ss in sessions.items():
            tot, b = ss.counters.total, base[s]
            calls = tot.calls - b.calls
            ms = med[s] * 1e3 / n_layer
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
        plain, repacked = bandwidth(ns.threads, ns.reps, False), bandwidth(ns.threads, ns.reps, True)
        print(f"\nrepacked / mapped experts, per CPU second: mul_mat_id "
              f"{repacked['mmid_cpu'] / plain['mmid_cpu']:.3f}, native worker "
              f"{repacked['native_cpu'] / plain['native_cpu']:.3f}")
    if ns.only in (None, "shares"):
        shares(ns.threads, ns.steps, ns.warmup, ns.bus_gbps, not ns.no_plot)
    return 0


if __name__ == "__main__":
    main()
