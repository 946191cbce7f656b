#!/usr/bin/env python3
"""The expert cache on a real bus: GGML's RPC backend over loopback TCP (no simulated sleep).

Starts ``ggml-hybrid rpc-server --threads 1`` on a free loopback port and puts the device of the
16-layer synthetic stack of bench_expert_cache.py (64 experts, top-8, Q4_K) on it:

1. Per-layer time and tokens/s for moe_cpu_share in {0, 0.25, 0.5, 0.75, 1, auto} at 8 cache
   slots, at 1 and 64 tokens: every expert load is a ``tensor_set`` over TCP into the server's
   slots, every device compute a graph sent to it. All shares are open together and run in
   alternating order (forward, then reversed) after a warm-up; medians; every output is checked
   bit-identical to the resident run on the local CPU.
2. Upload bandwidth of ``ggml_backend_tensor_set`` into an RPC buffer (weights usage, as the cache
   slots are; above 10 MiB GGML first sends a hash of the data, which the server cannot match without
   its cache: one more round trip and an FNV hash of the bytes), against the same copy into a local
   CPU buffer.

    python tools/bench/bench_rpc.py [--steps 8] [--warmup 3] [--reps 9] [--executor native|python]
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import click
import numpy as np
from _alternate import alternate
from bench_expert_cache import SHAPE, model_path

import ggml_hybrid as gh
from ggml_hybrid import lib
from ggml_hybrid._native import ffi
from ggml_hybrid.ggml import rpc
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions

SHARES = ["0", "0.25", "0.5", "0.75", "1", "auto"]
CLI = [sys.executable, "-c", "from ggml_hybrid.cli import main; main()"]


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("rpc-server did not start")


def shares(endpoint: str, steps: int, warmup: int, executor: str) -> None:
    path = model_path()
    n_layer = SHAPE["n_layer"]
    dev = rpc.server_devices(endpoint)[0]
    print(f"{n_layer}-layer stack, {SHAPE['n_expert']} experts top-{SHAPE['n_used']} {SHAPE['expert_type']}, "
          f"8 slots, device RPC0 = rpc-server on {endpoint} (1 thread), worker 1 thread, {executor} executor")
    print(f"{'tokens':>6} {'share':>6} {'ms/layer':>9} {'tok/s':>8} {'vs best':>7} {'applied':>8} "
          f"{'loads/call':>10} {'load ms/call':>12} {'MB/s loaded':>11}")
    for n_tokens in (1, 64):
        backends = {s: rpc.open_device(dev) for s in SHARES}
        # repack off on every side: the RPC server's slots hold plain weights, and parity needs the same kernels
        items = ["disk_experts=1", "expert_cache_slots=8", "n_threads=1", "repack=false", f"moe_executor={executor}"]
        sessions = {s: MoEStackSession(path, SessionOptions.parse([*items, f"moe_cpu_share={s}"]), device=backends[s])
                    for s in SHARES}
        ref = MoEStackSession(path, SessionOptions.parse(["n_threads=1", "repack=false"]))
        med, base = alternate(sessions, ref, n_tokens, SHAPE["n_embd"], steps, warmup, seed=11 + n_tokens)
        best = min(v for s, v in med.items() if s != "auto")
        for s, ss in sessions.items():
            tot, b = ss.counters.total, base[s]
            calls = tot.calls - b.calls
            applied = (tot.share_sum - b.share_sum) / max(1, tot.share_calls - b.share_calls)
            load_s = (tot.load_ns - b.load_ns) / 1e9
            mbps = (tot.bytes_loaded - b.bytes_loaded) / load_s / 1e6 if load_s else 0.0
            print(f"{n_tokens:>6} {s:>6} {med[s] * 1e3 / n_layer:>9.3f} {n_tokens / med[s]:>8.1f} "
                  f"{med[s] / best:>7.2f} {applied:>8.2f} {(tot.misses - b.misses) / calls:>10.2f} "
                  f"{load_s * 1e3 / calls:>12.3f} {mbps:>11.1f}")
        print(f"{n_tokens:>6} auto / best fixed share: {med['auto'] / best:.3f}")
        for ss in [*sessions.values(), ref]:
            ss.close()
        for be in backends.values():
            be.close()
    print("every output bit-identical to the resident run on the local CPU: True")


def upload(endpoint: str, reps: int) -> None:
    dev = rpc.server_devices(endpoint)[0]
    remote = rpc.open_device(dev)
    local = gh.cpu(1)
    print(f"\ntensor_set bandwidth, weights buffers, {reps} alternating reps, median")
    print(f"{'MiB':>6} {'RPC GB/s':>9} {'local GB/s':>10} {'RPC / local':>11}")
    for mib in (0.25, 1, 4, 9.5, 16, 64):
        n = int(mib * 2**20)
        data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        src = ffi.from_buffer(data)
        ts: dict[str, list[float]] = {"rpc": [], "local": []}
        tensors = {}
        ctxs = []
        for name, b in (("rpc", remote), ("local", local)):
            ctx = gh.Context(n_tensors=1)
            tensors[name] = ctx.new_tensor("i8", (n,), "t")
            ctx.allocate(b, "weights")
            ctxs.append(ctx)
        for r in range(reps + 1):
            for name in (("rpc", "local") if r % 2 == 0 else ("local", "rpc")):
                t0 = time.perf_counter()
                lib.ggml_backend_tensor_set(tensors[name].ptr, src, 0, n)
                if name == "rpc":
                    remote.synchronize()
                if r:  # the first is a warm-up
                    ts[name].append(time.perf_counter() - t0)
        back = tensors["rpc"].numpy().view(np.uint8)
        assert np.array_equal(back, data), "the server holds other bytes than were sent"
        bw = {k: n / statistics.median(v) / 1e9 for k, v in ts.items()}
        print(f"{mib:>6} {bw['rpc']:>9.3f} {bw['local']:>10.3f} {bw['rpc'] / bw['local']:>11.3f}")
        for ctx in ctxs:
            ctx.close()
    remote.close()
    local.close()


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--steps', type=int, default=8, show_default=True)
@click.option('--warmup', type=int, default=3, show_default=True)
@click.option('--reps', type=int, default=9, show_default=True)
@click.option('--only', type=click.Choice(['shares', 'upload']))
@click.option('--executor', type=click.Choice(['native', 'python']), default='native', show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    proc, endpoint = start_server()
    try:
        if ns.only in (None, "shares"):
            shares(endpoint, ns.steps, ns.warmup, ns.executor)
        if ns.only in (None, "upload"):
            upload(endpoint, ns.reps)
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    main()
