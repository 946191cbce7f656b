#!/usr/bin/env python3
"""Cost of the region patch when no region is registered.

The same 48-layer MoE-shaped graph runs through the scheduler of a build with the
patch series and of one without it (same pin, same options), in one process,
alternating A/B blocks after a warm-up. Each iteration is what an inference loop
does per step: forget the previous allocation, split + allocate, set the input,
compute. Prints per-arm medians and the ratio patched/unpatched, and checks that
both arms give bit-identical outputs.

    python tools/bench/bench_region_overhead.py [--rounds 20] [--block 25] [--threads 1]
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import click
import numpy as np
from _native_variants import load_patched, load_upstream
from moe_graph import DEFAULTS, RawMoE


class Arm:
    def __init__(self, name, ffi, lib, threads, shape):
        self.name, self.ffi, self.lib = name, ffi, lib
        self.backend = lib.hy_cpu_init()
        lib.hy_cpu_set_n_threads(self.backend, threads)
        self.model = RawMoE(ffi, lib, self.backend, **shape)
        self.graph, self.x, self.out = self.model.build()
        backends = ffi.new("ggml_backend_t[]", [self.backend])
        self.sched = lib.ggml_backend_sched_new(backends, ffi.NULL, 1, self.model.graph_size, False, False)
        self.keep = ffi.new("ggml_backend_buffer_t[]", [self.model.wbuf])
        base = int(ffi.cast("uintptr_t", lib.ggml_get_mem_buffer(self.model.ctx)))
        self.pools = ffi.new("uintptr_t[]", [base, base + lib.ggml_get_mem_size(self.model.ctx)])
        rng = np.random.default_rng(1)
        self.xv = rng.standard_normal((shape["n_tokens"], shape["n_embd"])).astype(np.float32)
        self.times: dict[str, list[float]] = {"step": [], "alloc": []}

    def step(self, phase: str) -> int:
        lib, ffi = self.lib, self.ffi
        t0 = time.perf_counter_ns()
        lib.ggml_backend_sched_reset(self.sched)
        lib.hy_graph_unalloc(self.graph, self.keep, 1, self.pools, 1)
        assert lib.ggml_backend_sched_alloc_graph(self.sched, self.graph)
        if phase == "step":
            lib.ggml_backend_tensor_set(self.x, ffi.from_buffer(self.xv), 0, self.xv.nbytes)
            assert lib.ggml_backend_sched_graph_compute(self.sched, self.graph) == 0
        return time.perf_counter_ns() - t0

    def output(self) -> np.ndarray:
        out = np.empty(self.lib.ggml_nelements(self.out), np.float32)
        self.lib.ggml_backend_tensor_get(self.out, self.ffi.from_buffer(out), 0, out.nbytes)
        return out


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--rounds', type=int, default=20, show_default=True)
@click.option('--block', type=int, default=25, help='iterations per arm per round', show_default=True)
@click.option('--warmup', type=int, default=30, show_default=True)
@click.option('--threads', type=int, default=1, show_default=True)
@click.option('--tokens', type=int, default=DEFAULTS['n_tokens'], show_default=True)
@click.option('--patched-first', is_flag=True, help='load the patched module before the unpatched one')
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    shape = dict(DEFAULTS, n_tokens=ns.tokens)
    # which module is loaded (and so mapped and warmed) first can bias a few percent either way
    if ns.patched_first:
        patched = Arm("patched", *load_patched(), ns.threads, shape)
        arms = [Arm("unpatched", *load_upstream(), ns.threads, shape), patched]
    else:
        arms = [Arm("unpatched", *load_upstream(), ns.threads, shape),
                Arm("patched", *load_patched(), ns.threads, shape)]
    for arm in arms:
        for _ in range(ns.warmup):
            arm.step("step")
    identical = np.array_equal(arms[0].output(), arms[1].output())
    n_nodes = arms[1].lib.ggml_graph_n_nodes(arms[1].graph)
    print(f"graph: {shape['n_layer']} MoE layers, {n_nodes} nodes, {shape['n_tokens']} token(s), "
          f"{ns.threads} thread(s); {ns.rounds} rounds x {ns.block} iterations per arm, alternating")
    print(f"{'phase':<34} {'unpatched us':>13} {'patched us':>11} {'ratio':>7} {'round ratios q1..q3':>21}")
    for phase, label in (("step", "split+alloc+set input+compute"), ("alloc", "split+alloc only")):
        round_ratios = []
        for r in range(ns.rounds):
            order = arms if r % 2 == 0 else arms[::-1]  # A B, then B A, ...
            med = {}
            for arm in order:
                ts = [arm.step(phase) for _ in range(ns.block)]
                arm.times[phase] += ts
                med[arm.name] = statistics.median(ts)
            round_ratios.append(med["patched"] / med["unpatched"])
        up, pa = (statistics.median(a.times[phase]) / 1e3 for a in arms)
        q = statistics.quantiles(round_ratios, n=4)
        print(f"{label:<34} {up:>13.1f} {pa:>11.1f} {pa / up:>7.4f} {q[0]:>10.4f}..{q[2]:.4f}")
    print(f"outputs bit-identical: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    main()
