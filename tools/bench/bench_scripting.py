#!/usr/bin/env python3
"""Scripting GGML from Python against GGML's own C (issue 43): graph building, and a training step.

1. building a 1,000-node graph (a chain of add, mul, relu and scale on a [32, 64] tensor) through ggml_hybrid's
   checked API, against the same calls in C (tools/bench/scripting_c.c): median seconds per build, per node, ratio;
2. one training epoch of tools/digits.py's network (45 AdamW steps of 32 images, one CPU thread) through
   ggml_hybrid.ggml.opt.Trainer, against the same model and ggml-opt calls in C: median seconds per step, ratio, and
   the losses of both (the same arithmetic: they must agree).

Each measurement alternates C and Python (C, Python, Python, C, ...) after a warm-up and reports medians.

    python tools/bench/bench_scripting.py [--rounds 6] [--builds 20] [--epochs 4]
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid._native import buildinfo

HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path, package: list[str] | None = None) -> ModuleType:
    """A module of this checkout by its file (tools/digits.py; the build package by its ``__init__.py`` and its
    folder, ``package``), without touching sys.path."""
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # registered before it runs: its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


D = _load("digits", HERE.parent / "digits.py")


def compile_c(out_dir: Path) -> Path:
    """scripting_c.c against the pin's headers and the package's GGML libraries."""
    pkg = HERE.parents[1] / "ggml_hybrid_build"
    _load("ggml_hybrid_build", pkg / "__init__.py", [str(pkg)])
    from ggml_hybrid_build import abi  # the checkout's build package, loaded by its folder just above
    include = abi.pin_headers() / "include"
    libdir = buildinfo.NATIVE_DIR / "lib"
    exe = out_dir / "scripting_c"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE / "scripting_c.c"), f"-I{include}", f"-L{libdir}",
                    "-l:libggml-base.so.0", "-l:libggml.so.0", f"-Wl,-rpath,{libdir}", "-lm"], check=True)
    return exe


def build_chain(n_nodes: int) -> gh.Graph:
    """The chain of scripting_c.c's build, through the checked API."""
    c = gh.Context(n_tensors=n_nodes + 16, graph_size=n_nodes + 16)
    x = c.new_tensor("f32", (32, 64), "x")
    w = c.new_tensor("f32", (32, 64), "w")
    cur = x
    for i in range(n_nodes):
        k = i % 4
        cur = c.add(cur, w) if k == 0 else c.mul(cur, w) if k == 1 else c.relu(cur) if k == 2 else c.scale(cur, 0.5)
    g = c.new_graph().expand(cur)
    assert g.n_nodes == n_nodes
    return g


def py_builds(n_nodes: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        g = build_chain(n_nodes)
        out.append(time.perf_counter() - t0)
        g.context.close()
    return out


def c_lines(exe: Path, *args: str) -> list[list[float]]:
    env = dict(os.environ, GGML_LIB_DIR=str(buildinfo.NATIVE_DIR / "lib"))
    res = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True, env=env)
    return [[float(v) for v in line.split()] for line in res.stdout.splitlines() if line.strip()]


def write_digits(path: Path, data, params: dict[str, np.ndarray]) -> None:
    parts = [params[n] for n in ("w1", "b1", "w2", "b2")] + [data.x_train, data.y_train, data.x_test, data.y_test]
    path.write_bytes(b"".join(np.ascontiguousarray(p, np.float32).tobytes() for p in parts))


def py_epochs(data, params: dict[str, np.ndarray], epochs: int) -> list[list[float]]:
    """seconds of each training epoch (no shuffling, as the C run), its losses and accuracies."""
    from ggml_hybrid.ggml.opt import Dataset

    cpu = gh.cpu(1)
    model = D.GgmlModel([cpu], params)
    out = []
    with Dataset(data.x_train, data.y_train) as train, Dataset(data.x_test, data.y_test) as test:
        for _ in range(epochs):
            t0 = time.perf_counter()
            (h,) = model.trainer.fit(train, 1)
            secs = time.perf_counter() - t0
            v = model.trainer.evaluate(test)
            out.append([secs, h.train.loss, h.train.accuracy, v.loss, v.accuracy])
    model.close()
    cpu.close()
    return out


@click.command()
@click.option("--rounds", default=6, show_default=True, help="alternating C/Python rounds")
@click.option("--builds", default=20, show_default=True, help="graph builds per round")
@click.option("--epochs", default=4, show_default=True, help="training epochs per round (the first is warm-up)")
@click.option("--nodes", default=1000, show_default=True)
def main(rounds: int, builds: int, epochs: int, nodes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_c(Path(tmp))
        build_c: list[float] = []
        build_py: list[float] = []
        for r in range(rounds):
            order = ("c", "py") if r % 2 == 0 else ("py", "c")
            for who in order:
                if who == "c":
                    build_c += [v[0] for v in c_lines(exe, "build", str(nodes), str(builds))][1:]
                else:
                    build_py += py_builds(nodes, builds)[1:]
        mc, mp = statistics.median(build_c), statistics.median(build_py)
        print(f"building a {nodes}-node graph: C {mc * 1e3:.3f} ms, Python {mp * 1e3:.3f} ms "
              f"({mp / nodes * 1e6:.2f} us per node), Python/C {mp / mc:.1f}x  (n={len(build_c)}, {len(build_py)})")

        data, params = D.load(0), D.init_params(0)
        path = Path(tmp) / "digits.f32"
        write_digits(path, data, params)
        step_c: list[float] = []
        step_py: list[float] = []
        curves = {}
        steps = D.N_TRAIN // D.BATCH
        for r in range(rounds):
            order = ("c", "py") if r % 2 == 0 else ("py", "c")
            for who in order:
                rows = c_lines(exe, "train", str(path), str(epochs), "1") if who == "c" else \
                    py_epochs(data, params, epochs)
                (step_c if who == "c" else step_py).extend(row[0] / steps for row in rows[1:])
                curves[who] = rows
        for (_, lc, ac, vc, vac), (_, lp, ap, vp, vap) in zip(curves["c"], curves["py"]):
            assert abs(lc - lp) <= 1e-6 * abs(lc) and abs(ac - ap) < 1e-8 and abs(vc - vp) <= 1e-6 * abs(vc) \
                and abs(vac - vap) < 1e-8, \
                (lc, lp, ac, ap, vc, vp)
        sc, sp = statistics.median(step_c), statistics.median(step_py)
        print(f"one training step (digits, batch {D.BATCH}, AdamW, 1 thread): C {sc * 1e6:.1f} us, Python "
              f"{sp * 1e6:.1f} us, Python/C {sp / sc:.3f}  (n={len(step_c)}, {len(step_py)}); losses per epoch "
              f"agree: {[round(r[1], 6) for r in curves['py']]}")


if __name__ == "__main__":
    main()
