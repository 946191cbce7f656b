#!/usr/bin/env python3
"""Python-side cost of the graph API: the baseline later work must not regress.

1. building a 48-layer MoE-shaped graph through ggml_hybrid's Python API (context,
   checked ops, graph expand): median wall time per build, and per node;
2. one Scheduler.compute() call on a tiny graph (1 node), where Python and the
   scheduler, not the kernel, dominate; and the same through raw cffi calls, so the
   wrapper's own share is visible.

    python tools/bench/bench_graph.py [--runs 50]
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import click
import numpy as np
from moe_graph import DEFAULTS

import ggml_hybrid as gh
from ggml_hybrid import ffi, lib


def build_moe(weights, n_layer, n_embd, n_expert, n_used, n_tokens, **_):
    """The MoE-shaped graph of moe_graph.RawMoE, written with the checked Python API."""
    T, E, k = n_tokens, n_expert, n_used
    c = gh.Context(n_tensors=64 * n_layer + 64, graph_size=64 * n_layer + 64)
    g = c.new_graph(64 * n_layer + 64)
    x = c.new_tensor("f32", (T, n_embd), "x").set_input()
    cur = x
    for layer in weights:
        h = c.mul(c.rms_norm(cur, 1e-6), layer["norm"])
        probs = c.soft_max(c.mul_mat(layer["router"], h))
        ids = c.top_k(probs, k)
        w = c.get_rows(c.reshape(probs, (T, E, 1)), ids)
        g.expand(w)
        h3 = c.reshape(h, (T, 1, n_embd))
        act = c.swiglu(c.mul_mat_id(layer["gate"], h3, ids), c.mul_mat_id(layer["up"], h3, ids))
        y = c.mul(c.mul_mat_id(layer["down"], act, ids), w)
        row = y.nb[2]
        moe = c.view(y, (T, n_embd), (row,), 0)
        for j in range(1, k):
            moe = c.add(moe, c.view(y, (T, n_embd), (row,), j * y.nb[1]))
        cur = c.add(moe, cur)
    cur.set_output()
    g.expand(cur)
    return c, g


def make_weights(backend, n_layer, n_embd, n_ff, n_expert, **_):
    wctx = gh.Context(n_tensors=6 * n_layer)
    layers = [dict(norm=wctx.new_tensor("f32", (n_embd,)), router=wctx.new_tensor("f32", (n_expert, n_embd)),
                   gate=wctx.new_tensor("f32", (n_expert, n_ff, n_embd)),
                   up=wctx.new_tensor("f32", (n_expert, n_ff, n_embd)),
                   down=wctx.new_tensor("f32", (n_expert, n_embd, n_ff))) for _ in range(n_layer)]
    wctx.allocate(backend, "weights")
    return wctx, layers


def timed(fn, runs):
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option('--runs', type=int, default=50, show_default=True)
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    cpu = gh.cpu(1)
    wctx, layers = make_weights(cpu, **DEFAULTS)

    built = []

    def build_once():
        c, g = build_moe(layers, **DEFAULTS)
        built.append(g.n_nodes)
        c.close()

    build_once()
    build_us = timed(build_once, ns.runs)
    n_nodes = built[-1]

    c = gh.Context(n_tensors=8, graph_size=8)
    a = c.new_tensor("f32", (4,), "a").set_input()
    out = c.scale(a, 2.0)
    g = c.new_graph(8).expand(out)
    s = gh.Scheduler([cpu], graph_size=16)
    av = np.ones(4, np.float32)
    s.alloc(g)

    def api_compute():
        a.set(av)
        s.compute(g)

    sp, gp, ap_ = s.ptr, g.ptr, a.ptr

    def raw_compute():
        lib.ggml_backend_tensor_set(ap_, ffi.from_buffer(av), 0, av.nbytes)
        lib.ggml_backend_sched_graph_compute(sp, gp)

    for f in (api_compute, raw_compute):
        timed(f, 100)
    api_us, raw_us = timed(api_compute, ns.runs * 20), timed(raw_compute, ns.runs * 20)
    assert np.array_equal(out.numpy(), 2 * av)
    print(f"{'measure':<52} {'median':>12}")
    print(f"{'build 48-layer MoE graph (' + str(n_nodes) + ' nodes), Python API':<52} {build_us / 1e3:>9.2f} ms")
    print(f"{'  per node':<52} {build_us / n_nodes:>9.2f} us")
    print(f"{'set input + Scheduler.compute, 1-node graph':<52} {api_us:>9.2f} us")
    print(f"{'  same through raw cffi calls':<52} {raw_us:>9.2f} us")
    print(f"{'  wrapper share':<52} {api_us - raw_us:>9.2f} us")
    return 0


if __name__ == "__main__":
    main()
