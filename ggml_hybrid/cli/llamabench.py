"""``ggml-hybrid bench`` without ``--a``/``--b``: llama.cpp's ``llama-bench`` tests on one session.

As ``llama-bench`` (``tools/llama-bench/llama-bench.cpp``): a prompt test ``ppN`` evaluates N random tokens in
one batch from an empty cache, a generation test ``tgN`` evaluates N random tokens one at a time from an empty
cache; each test is warmed up once (the prompt whole, one generated token), then repeated ``-r`` times; the
rate is the mean of the repetitions' tokens per second, with their sample standard deviation.

With speculative decoding (``--spec-type draft-mtp``, or ``--draft-accept P,...``: drafts replayed, benchmark-only)
a generation test ``tgN`` is greedy: one random token, then the N - 1 tokens the model generates after it (random
tokens could never be drafted), timed plain and then with speculation, each row with its counters; the replayed
drafts are the plain run's own tokens, each kept right with probability P.

The figures are noisy on a shared machine; :func:`noise_warnings` says so when the spread of a test is large
or when fewer cores were idle than the session runs threads.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..machine import usable_cores
from ..runtime.generate import complete
from ..runtime.moe_model import MoEModel
from ..runtime.sampling import Sampler
from ..runtime.speculative import ReplayDrafts, Speculator
from ..units import format_bytes

#: a test whose standard deviation is above this fraction of its mean is reported as noisy
NOISY_SPREAD = 0.05
CSV_FIELDS = ("model_filename", "model_type", "model_size", "model_n_params", "backends", "n_threads",
              "n_prompt", "n_gen", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts")


@dataclass
class BenchResult:
    n_prompt: int
    n_gen: int
    samples_ns: list[int] = field(default_factory=list)
    mode: str = ""  # "": llama-bench's test; "greedy", "draft-mtp", "replay P": a greedy generation test
    spec: dict[str, Any] | None = None  # speculative decoding's counters over the repetitions

    @property
    def name(self) -> str:
        base = f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"
        return f"{base} {self.mode}" if self.mode else base

    @property
    def samples_ts(self) -> list[float]:
        n = self.n_prompt + self.n_gen
        return [n * 1e9 / ns for ns in self.samples_ns]

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        ts = self.samples_ts
        return statistics.stdev(ts) if len(ts) > 1 else 0.0


def _timed_prompt(m: MoEModel, ids: np.ndarray) -> int:
    m.reset()
    t0 = time.perf_counter_ns()
    m.eval(ids, "last")
    return time.perf_counter_ns() - t0


def _timed_gen(m: MoEModel, ids: np.ndarray) -> int:
    m.reset()
    t0 = time.perf_counter_ns()
    for t in ids:
        m.eval([int(t)], "last")
    return time.perf_counter_ns() - t0


def _timed_greedy(m: MoEModel, start: int, n: int, speculator: Speculator | None) -> tuple[int, list[int]]:
    """One random token, then ``n - 1`` greedy ones (``n`` evaluated positions, as a tgN test), timed."""
    m.reset()
    t0 = time.perf_counter_ns()
    _, st = complete(m, [start], n - 1, Sampler(), stop_at_eos=False, speculator=speculator)
    return time.perf_counter_ns() - t0, st.tokens


def run_tests(m: MoEModel, n_prompt: list[int], n_gen: list[int], repetitions: int,
              seed: int = 1234, accepts: list[float] | None = None) -> list[BenchResult]:
    """Every ``ppN`` then every ``tgN`` test (N > 0), each warmed up once and then run ``repetitions`` times.

    With speculative decoding (the model's ``spec_type``), each ``tgN`` is greedy, plain then speculative (replay:
    one row per acceptance of ``accepts``)."""
    rng = np.random.default_rng(seed)
    vocab = m.hp.n_vocab
    results = []
    spec = m.options.spec_type != "none"
    for n, gen in [(p, False) for p in n_prompt if p > 0] + [(g, True) for g in n_gen if g > 0]:
        ids = rng.integers(0, vocab, size=n, dtype=np.int64).astype(np.int32)
        r = BenchResult(0 if gen else n, n if gen else 0)
        if gen and spec:
            results += _spec_tests(m, int(ids[0]), n, repetitions, accepts or [])
            continue
        if gen:
            _timed_gen(m, ids[:1])  # llama-bench's warm-up: one generated token
            r.samples_ns = [_timed_gen(m, ids) for _ in range(repetitions)]
        else:
            _timed_prompt(m, ids)
            r.samples_ns = [_timed_prompt(m, ids) for _ in range(repetitions)]
        results.append(r)
    m.reset()
    return results


def _replay(m: MoEModel, known: list[int], accept: float) -> Speculator:
    return Speculator(m, ReplayDrafts(known, accept=accept))


def _spec_tests(m: MoEModel, start: int, n: int, repetitions: int, accepts: list[float]) -> list[BenchResult]:
    """A greedy tgN plain, then with speculation: the head's drafts, or replayed ones at each acceptance."""
    plain = BenchResult(0, n, mode="greedy")
    _timed_greedy(m, start, 2, None)
    plain.samples_ns = []
    tokens: list[int] = []
    for _ in range(repetitions):
        ns, tokens = _timed_greedy(m, start, n, None)
        plain.samples_ns.append(ns)
    out = [plain]
    if m.options.spec_type == "draft-mtp":
        sides: list[tuple[str, Callable[[], Speculator]]] = [("draft-mtp", lambda: Speculator(m))]
    else:
        known = [start] + tokens
        sides = [(f"replay {a:g}", functools.partial(_replay, m, known, a)) for a in accepts]
    for mode, make in sides:
        r = BenchResult(0, n, mode=mode)
        sp = make()
        _timed_greedy(m, start, 2, sp)
        before = sp.counters.copy()
        for _ in range(repetitions):
            ns, got = _timed_greedy(m, start, n, sp)
            if got != tokens:
                raise AssertionError(f"{mode}: speculation changed the greedy tokens (a bug: they never change)")
            r.samples_ns.append(ns)
        r.spec = {"type": m.options.spec_type, **sp.counters.since(before).to_json(),
                  "benchmark_only": sp.benchmark_only}
        out.append(r)
    return out


def describe(m: MoEModel) -> dict[str, Any]:
    """The columns llama-bench prints about the model and the session."""
    infos = m.store.tensors()
    return {"model_filename": m.store.path, "model_type": m.hp.arch,
            "model_size": sum(t.nbytes for t in infos),
            "model_n_params": sum(math.prod(t.shape) for t in infos),
            "backends": ",".join(m.devices), "n_threads": m.n_threads}


def rows(model: dict[str, Any], results: list[BenchResult], test_time: str) -> list[dict[str, Any]]:
    out = []
    for r in results:
        ns = r.samples_ns
        out.append({**model, "n_prompt": r.n_prompt, "n_gen": r.n_gen, "test_time": test_time,
                    "avg_ns": int(statistics.fmean(ns)), "stddev_ns": int(statistics.stdev(ns)) if len(ns) > 1 else 0,
                    "avg_ts": r.avg_ts, "stddev_ts": r.stddev_ts, "samples_ns": list(ns), "samples_ts": r.samples_ts,
                    **({"mode": r.mode} if r.mode else {}), **({"speculative": r.spec} if r.spec else {})})
    return out


def _params(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(n)


def format_rows(rs: list[dict[str, Any]], fmt: str) -> str:
    """``md`` (llama-bench's table), ``csv``, ``json`` (one array) or ``jsonl`` (one object a line)."""
    if fmt == "json":
        return json.dumps(rs, indent=1)
    if fmt == "jsonl":
        return "\n".join(json.dumps(r) for r in rs)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        w.writerows(rs)
        return buf.getvalue().rstrip("\n")
    head = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    body = [[f"{os.path.basename(r['model_filename'])} ({r['model_type']})", format_bytes(r["model_size"]),
             _params(r["model_n_params"]), r["backends"], str(r["n_threads"]),
             (f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}") + _mode(r),
             f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"] for r in rs]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    right = {1, 2, 4, 5, 6}
    line = lambda cells: "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                            for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def _mode(r: dict[str, Any]) -> str:
    sp = r.get("speculative")
    if not r.get("mode"):
        return ""
    if sp is None:
        return f" {r['mode']}"
    mark = ", BENCHMARK ONLY" if sp["benchmark_only"] else ""
    return f" {r['mode']} (accepted {100 * sp['acceptance_rate']:.0f}%{mark})"


def noise_warnings(results: list[BenchResult], n_threads: int, idle: float | None) -> list[str]:
    """Why these figures should not be trusted to a few percent, if they should not."""
    out = []
    if idle is not None and idle < n_threads - 0.25:
        out.append(f"the machine is busy: {idle:.1f} of {usable_cores()} cores were idle when the tests started and "
                   f"they run {n_threads} thread{'s' if n_threads != 1 else ''}; other processes' load changes these "
                   "figures")
    for r in results:
        if r.avg_ts and len(r.samples_ns) > 1 and r.stddev_ts / r.avg_ts > NOISY_SPREAD:
            out.append(f"{r.name} varies by {100 * r.stddev_ts / r.avg_ts:.0f}% (standard deviation / mean over "
                       f"{len(r.samples_ns)} repetitions): a difference smaller than that is noise; more -r on an "
                       "idle machine narrows it")
    return out


__all__ = ["CSV_FIELDS", "NOISY_SPREAD", "BenchResult", "describe", "format_rows", "noise_warnings",
           "rows", "run_tests"]
