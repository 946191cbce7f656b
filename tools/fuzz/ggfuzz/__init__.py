"""The ggml-hybrid fuzz suite: GGUF mutations, CLI and option values, signals, API faults.

``tools/fuzz/run.py`` is its command line; ``tests/test_fuzz.py`` runs every kind at CI size.
Each ``run_*`` function draws ``cases`` cases from ``seed`` (case i depends on (seed, i) only),
runs them ``jobs`` at a time, keeps the reproducers of failures under ``out/failures`` and
returns the :class:`~ggfuzz.report.Summary` (also written to ``out/summary-KIND.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from typing import Any

from .report import Summary

DEFAULT_TIMEOUT = 60.0


def prepare_parent() -> None:
    """Settings the forked cases inherit: no BLAS threads, no gdb on abort."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _drive(kind: str, cases: int, seed: int, out: str, jobs: int, argv: list[str] | None,
           one: Callable[[int, str], dict[str, Any]], keep: Callable[[str, str], None] | None,
           indices: Iterable[int] | None = None, worker_timeout: float = 600.0) -> Summary:
    from .pool import fork_map

    prepare_parent()
    os.makedirs(out, exist_ok=True)
    work = os.path.join(out, "work", kind)
    os.makedirs(work, exist_ok=True)
    summary = Summary(kind, seed, cases, out, argv or sys.argv)
    todo = list(indices) if indices is not None else list(range(cases))

    def fn(i: int) -> dict[str, Any]:
        return one(i, os.path.join(work, f"{i:06d}"))

    for i, rec in fork_map(fn, todo, jobs, work, worker_timeout):
        rec.setdefault("index", i)
        summary.add(rec)
        folder = os.path.join(work, f"{i:06d}")
        if rec.get("class") not in (None, "fine") or "harness_error" in rec:
            dest = os.path.join(out, "failures", f"{kind}-{i:06d}")
            os.makedirs(dest, exist_ok=True)
            if keep is not None and os.path.isdir(folder):
                keep(folder, dest)
            with open(os.path.join(dest, "case.json"), "w") as f:
                json.dump(rec, f, indent=1)
        shutil.rmtree(folder, ignore_errors=True)
    summary.write()
    return summary


def run_gguf(cases: int, seed: int, out: str, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT, how: str = "fork",
             argv: list[str] | None = None, indices: Iterable[int] | None = None) -> Summary:
    from . import gguf_cases
    from .models import SIGNAL_SPEC, ensure_models

    models = ensure_models(os.path.join(out, "models"))
    maps = {name: gguf_cases.map_file(p) for name, p in models.items() if name not in SIGNAL_SPEC}
    return _drive("gguf", cases, seed, out, jobs, argv,
                  lambda i, folder: gguf_cases.run_case(seed, i, maps, folder, timeout, how),
                  gguf_cases.keep_reproducer, indices, worker_timeout=8 * timeout)


def run_cli(cases: int, seed: int, out: str, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT, how: str = "fork",
            argv: list[str] | None = None, indices: Iterable[int] | None = None) -> Summary:
    from . import cli_cases
    from .models import ensure_models

    model = ensure_models(os.path.join(out, "models"))["qwen3moe-q8_0"]
    return _drive("cli", cases, seed, out, jobs, argv,
                  lambda i, folder: cli_cases.run_case(seed, i, model, folder, timeout, how),
                  cli_cases.keep_reproducer, indices, worker_timeout=3 * timeout)


def run_signals(cases: int, seed: int, out: str, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
                argv: list[str] | None = None, indices: Iterable[int] | None = None, grace: float = 20.0,
                modes: list[str] | None = None) -> Summary:
    """Ctrl-C during runs; ``grace``: seconds a process may take to end after SIGINT before it is a hang.
    Cases always run as real processes (``ggml-hybrid`` started fresh), so the jobs share the machine:
    keep ``jobs`` small, timing matters here."""
    from . import signal_cases
    from .models import SIGNAL_SPEC, ensure_models

    model = ensure_models(os.path.join(out, "models"))[next(iter(SIGNAL_SPEC))]
    refs = signal_cases.references(model, os.path.join(out, "work", "signal-refs"), timeout,
                                   modes or list(signal_cases.MODES))
    return _drive("signals", cases, seed, out, jobs, argv,
                  lambda i, folder: signal_cases.run_case(seed, i, model, refs, folder, grace),
                  None, indices, worker_timeout=timeout + grace + 30)


def run_api(cases: int, seed: int, out: str, jobs: int = 1, timeout: float = DEFAULT_TIMEOUT,
            argv: list[str] | None = None, indices: Iterable[int] | None = None) -> Summary:
    from . import api_cases
    from .models import ensure_models

    models = ensure_models(os.path.join(out, "models"))
    return _drive("api", cases, seed, out, jobs, argv,
                  lambda i, folder: api_cases.run_case(seed, i, models["qwen3moe-q8_0"], models["stack-q8_0"],
                                                       folder, timeout),
                  None, indices, worker_timeout=timeout + 30)


__all__ = ["DEFAULT_TIMEOUT", "Summary", "prepare_parent", "run_api", "run_cli", "run_gguf", "run_signals"]
