#!/usr/bin/env python3
"""Cost of the index checks of vendor patch 0013 in the CPU kernels that index by tensor data.

Upstream's GET_ROWS, SET_ROWS and ADD_ID kernels test each index with a GGML_ASSERT (an abort when out of
range); MUL_MAT_ID tests it only in debug builds. Patch 0013 replaces each test by a branch that records the
index and skips its row. This runs one-op graphs of the four ops, with in-range indices, on a build with the
patch series and on one without it (same pin, same options; ``python -m ggml_hybrid_build --upstream``), both loaded in
one process on one thread, in alternating blocks (unpatched then patched, then the other way round) after a
warm-up; prints each arm's median time per compute and the ratio patched/unpatched, and checks that both arms
give the same bytes.

    python tools/bench/bench_index_check.py [--rounds 20] [--block 20] [--warmup 20] [--threads 1]
"""

from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import click
import numpy as np
from _native_variants import load_patched, load_upstream

# (rows selected from, row length, indices): each graph is one node over in-range indices
SHAPES = dict(get_rows=(4096, 64, 4096), set_rows=(4096, 64, 2048), add_id=(32, 64, 4096),
              mul_mat_id=(32, 16, 512))


def _new(ffi, lib, ctx, dtype, *ne):
    return lib.ggml_new_tensor(ctx, dtype, len(ne), ffi.new("int64_t[]", list(ne)))


class OpGraph:
    """One op over data in a CPU buffer of its own, on one module (patched or not)."""

    def __init__(self, ffi, lib, backend, op: str, seed: int = 0) -> None:
        self.ffi, self.lib, self.backend = ffi, lib, backend
        rng = np.random.default_rng(seed)
        n_rows, n, n_idx = SHAPES[op]
        f32, i32 = lib.GGML_TYPE_F32, lib.GGML_TYPE_I32
        params = ffi.new("struct ggml_init_params *", {"mem_size": 16 * lib.ggml_tensor_overhead() +
                                                       lib.ggml_graph_overhead_custom(16, False),
                                                       "mem_buffer": ffi.NULL, "no_alloc": True})
        self.ctx = ctx = lib.ggml_init(params[0])
        data: list[tuple[object, np.ndarray]] = []
        if op == "get_rows":
            a, idx = _new(ffi, lib, ctx, f32, n, n_rows), _new(ffi, lib, ctx, i32, n_idx)
            self.out = lib.ggml_get_rows(ctx, a, idx)
            data += [(a, rng.standard_normal((n_rows, n)).astype(np.float32)),
                     (idx, rng.integers(0, n_rows, n_idx, dtype=np.int32))]
        elif op == "set_rows":
            dst, src = _new(ffi, lib, ctx, f32, n, n_rows), _new(ffi, lib, ctx, f32, n, n_idx)
            idx = _new(ffi, lib, ctx, i32, n_idx)
            self.out = lib.ggml_set_rows(ctx, dst, src, idx)
            data += [(dst, np.zeros((n_rows, n), np.float32)),
                     (src, rng.standard_normal((n_idx, n)).astype(np.float32)),
                     (idx, rng.permutation(n_rows)[:n_idx].astype(np.int32))]
        elif op == "add_id":  # n_idx tokens of 8 slots, each adding one of n_rows rows
            a, b = _new(ffi, lib, ctx, f32, n, 8, n_idx // 8), _new(ffi, lib, ctx, f32, n, n_rows)
            ids = _new(ffi, lib, ctx, i32, 8, n_idx // 8)
            self.out = lib.ggml_add_id(ctx, a, b, ids)
            data += [(a, rng.standard_normal((n_idx // 8, 8, n)).astype(np.float32)),
                     (b, rng.standard_normal((n_rows, n)).astype(np.float32)),
                     (ids, rng.integers(0, n_rows, (n_idx // 8, 8), dtype=np.int32))]
        else:  # mul_mat_id: n_rows experts [n, 64], n_idx tokens of 8 used experts
            e, x = _new(ffi, lib, ctx, f32, 64, n, n_rows), _new(ffi, lib, ctx, f32, 64, 1, n_idx)
            ids = _new(ffi, lib, ctx, i32, 8, n_idx)
            self.out = lib.ggml_mul_mat_id(ctx, e, x, ids)
            data += [(e, rng.standard_normal((n_rows, n, 64)).astype(np.float32)),
                     (x, rng.standard_normal((n_idx, 1, 64)).astype(np.float32)),
                     (ids, np.stack([rng.permutation(n_rows)[:8] for _ in range(n_idx)]).astype(np.int32))]
        self.graph = lib.ggml_new_graph_custom(ctx, 16, False)
        lib.ggml_build_forward_expand(self.graph, self.out)
        self.buf = lib.ggml_backend_alloc_ctx_tensors(ctx, backend)
        self.data = data
        self.reset()

    def reset(self) -> None:
        for t, arr in self.data:
            self.lib.ggml_backend_tensor_set(t, self.ffi.from_buffer(arr), 0, arr.nbytes)

    def compute(self) -> int:
        t0 = time.perf_counter_ns()
        status = self.lib.ggml_backend_graph_compute(self.backend, self.graph)
        dt = time.perf_counter_ns() - t0
        assert status == 0, status
        return dt

    def output(self) -> bytes:
        out = np.empty(self.lib.ggml_nbytes(self.out), np.uint8)
        self.lib.ggml_backend_tensor_get(self.out, self.ffi.from_buffer(out), 0, out.nbytes)
        return out.tobytes()


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rounds", type=int, default=20, show_default=True)
@click.option("--block", type=int, default=20, help="computes per arm per round", show_default=True)
@click.option("--warmup", type=int, default=20, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--ops", default=",".join(SHAPES), show_default=True, help="comma-separated subset")
def main(**options) -> None:
    sys.exit(_main(SimpleNamespace(**options)))


def _main(ns: SimpleNamespace) -> int:
    modules = {"unpatched": load_upstream(), "patched": load_patched()}
    backends = {}
    for name, (_ffi, lib) in modules.items():
        backends[name] = lib.hy_cpu_init()
        lib.hy_cpu_set_n_threads(backends[name], ns.threads)
    print(f"{'op':<11} {'shape (rows, row, indices)':<28} {'unpatched us':>13} {'patched us':>11} "
          f"{'ratio':>7} {'q1..q3 of round ratios':>24}")
    for op in ns.ops.split(","):
        arms = {name: OpGraph(*modules[name], backends[name], op) for name in modules}
        for arm in arms.values():
            for _ in range(ns.warmup):
                arm.compute()
        outs = {name: arm.output() for name, arm in arms.items()}
        assert outs["patched"] == outs["unpatched"], f"{op}: the arms' outputs differ"
        times: dict[str, list[int]] = {k: [] for k in arms}
        ratios = []
        for r in range(ns.rounds):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            block: dict[str, list[int]] = {k: [] for k in arms}
            for name in order:
                for _ in range(ns.block):
                    block[name].append(arms[name].compute())
            for k in arms:
                times[k] += block[k]
            ratios.append(statistics.median(block["patched"]) / statistics.median(block["unpatched"]))
        med = {k: statistics.median(v) / 1e3 for k, v in times.items()}
        q = statistics.quantiles(ratios, n=4)
        print(f"{op:<11} {str(SHAPES[op]):<28} {med['unpatched']:>13.1f} {med['patched']:>11.1f} "
              f"{med['patched'] / med['unpatched']:>7.4f} {q[0]:>11.3f}..{q[2]:.3f}")
    return 0


if __name__ == "__main__":
    main()
