#!/usr/bin/env python3
"""Regions through the patched scheduler, on a small MoE layer stack (the model demo is `ggml-hybrid demo`).

Builds a small MoE layer stack (router -> top-k -> gate/up/down mul_mat_id), registers
each layer's routed experts as a region, and runs it three ways through the patched
scheduler: no regions (the default path), regions whose executor runs the layer's own
nodes, and regions whose executor declines. Prints the timings and whether the
outputs are bit-identical to the default path.
"""

from __future__ import annotations

import sys
import time

import click
import numpy as np

import ggml_hybrid as gh

N_LAYER, N_EMBD, N_FF, N_EXPERT, N_USED, N_TOKENS = 8, 128, 64, 16, 4, 4


def build(cpu):
    rng = np.random.default_rng(0)
    wctx = gh.Context(n_tensors=5 * N_LAYER)
    layers = [{k: wctx.new_tensor("q8_0" if k in ("gate", "up", "down") else "f32", shape, f"blk.{i}.{k}")
               for k, shape in (("router", (N_EXPERT, N_EMBD)), ("gate", (N_EXPERT, N_FF, N_EMBD)),
                                ("up", (N_EXPERT, N_FF, N_EMBD)), ("down", (N_EXPERT, N_EMBD, N_FF)))}
              for i in range(N_LAYER)]
    wctx.allocate(cpu, "weights")
    for layer in layers:
        for t in layer.values():
            data = (rng.standard_normal(t.shape) * 0.2).astype(np.float32)
            t.set(gh.quantize(data, t.dtype) if t.dtype.is_quantized else data)

    c = gh.Context(n_tensors=40 * N_LAYER, graph_size=40 * N_LAYER)
    g = c.new_graph(40 * N_LAYER)
    x = c.new_tensor("f32", (N_TOKENS, N_EMBD), "x").set_input()
    cur, regions = x, []
    for i, layer in enumerate(layers):
        h = c.rms_norm(cur, 1e-6)
        probs = c.soft_max(c.mul_mat(layer["router"], h))
        ids = c.top_k(probs, N_USED)
        w = c.get_rows(c.reshape(probs, (N_TOKENS, N_EXPERT, 1)), ids)
        h3 = c.reshape(h, (N_TOKENS, 1, N_EMBD))
        g.expand(h3).expand(w)  # region inputs first, so the region is contiguous
        act = c.swiglu(c.mul_mat_id(layer["gate"], h3, ids), c.mul_mat_id(layer["up"], h3, ids))
        y = c.mul(c.mul_mat_id(layer["down"], act, ids), w)
        y.name = f"blk.{i}.experts_out"
        regions.append(([h3, ids, w], [y]))
        moe = c.sum_rows(c.cont(c.permute(y, (0, 2, 1))))  # sum over the used experts
        cur = c.add(c.reshape(moe, (N_TOKENS, N_EMBD)), cur)
    cur.set_output()
    g.expand(cur)
    return wctx, c, g, x, cur, regions


def run(cpu, graph, x, out, xv, regions=None, executor=None, reps=20):
    with gh.Scheduler([cpu], graph_size=2048) as s:
        for inputs, outputs in regions or []:
            s.add_region(inputs, outputs, executor)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            s.alloc(graph)
            x.set(xv)
            s.compute(graph)
            times.append(time.perf_counter() - t0)
        return out.numpy(), float(np.median(times))


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-t", "--threads", default=2, show_default=True, type=click.IntRange(1), help="CPU threads.")
def main(threads: int) -> None:
    sys.exit(run_example(threads))


def run_example(threads: int) -> int:
    cpu = gh.cpu(threads)
    wctx, ctx, g, x, out, regions = build(cpu)
    xv = np.random.default_rng(1).standard_normal((N_TOKENS, N_EMBD)).astype(np.float32)
    ref, t_ref = run(cpu, g, x, out, xv)
    own, t_own = run(cpu, g, x, out, xv, regions, lambda call: call.compute_own_nodes())
    dec, t_dec = run(cpu, g, x, out, xv, regions, lambda call: gh.DECLINE)
    print(f"MoE stack: {N_LAYER} layers, {N_EXPERT} experts (Q8_0), top-{N_USED}, {N_TOKENS} tokens, "
          f"GGML {gh.GGML_VERSION}")
    print(f"{'mode':<34} {'median ms':>10} {'identical to default':>22}")
    print(f"{'default path (no regions)':<34} {t_ref * 1e3:>10.2f} {'-':>22}")
    for name, got, t in (("regions, executor runs own nodes", own, t_own), ("regions, executor declines", dec, t_dec)):
        print(f"{name:<34} {t * 1e3:>10.2f} {str(bool(np.array_equal(got, ref))):>22}")
    return 0 if np.array_equal(own, ref) and np.array_equal(dec, ref) else 1


if __name__ == "__main__":
    main()
