"""The fuzz suite's command line.

    python tools/fuzz/run.py gguf --cases 2000 --jobs 2      # mutated model files through inspect/run/plan
    python tools/fuzz/run.py cli --cases 2000                # flags, option values, config files
    python tools/fuzz/run.py signals --cases 100             # Ctrl-C at random times during runs
    python tools/fuzz/run.py api --cases 500                 # bad arguments to the Python API
    python tools/fuzz/run.py server --cases 2000             # hostile requests against one real server
    python tools/fuzz/run.py rpc --cases 500                 # hostile messages to an rpc-server
    python tools/fuzz/run.py all --cases 50                  # every kind, for a quick look

Each prints one line of counts per class and writes OUT/summary-KIND.json; failing cases keep
their reproducer (the mutated file, the command line, stderr) under OUT/failures/. The exit
status is 1 when any case failed. ``--only 17,42`` reruns chosen cases of the same seed.
"""

from __future__ import annotations

import os
import sys

import click
import ggfuzz


def _common(fn):
    for opt in reversed([
        click.option("--cases", default=100, show_default=True, type=click.IntRange(1), help="Cases to draw."),
        click.option("--seed", default=0, show_default=True, type=click.IntRange(0), help="Case i depends on "
                     "(seed, i) only."),
        click.option("--out", default="fuzz-out", show_default=True, type=click.Path(file_okay=False),
                     help="Summary, reproducers, generated models."),
        click.option("--jobs", "-j", default=1, show_default=True, type=click.IntRange(1), help="Cases at once."),
        click.option("--timeout", default=ggfuzz.DEFAULT_TIMEOUT, show_default=True, type=click.FloatRange(1),
                     help="Seconds per command before it counts as a hang."),
        click.option("--exec", "how", default="fork", show_default=True, type=click.Choice(["fork", "subprocess"]),
                     help="fork: commands forked from this process (fast); subprocess: each a fresh process."),
        click.option("--only", default=None, help="Comma-separated case numbers to run (of the same seed)."),
    ]):
        fn = opt(fn)
    return fn


def _indices(only: str | None) -> list[int] | None:
    return [int(x) for x in only.split(",") if x.strip()] if only else None


def _finish(summaries: list[ggfuzz.Summary]) -> None:
    for s in summaries:
        click.echo(s.line())
        click.echo(f"  summary: {os.path.join(s.out, 'summary-' + s.kind + '.json')}")
    if any(s.failures or s.harness_errors for s in summaries):
        sys.exit(1)


@click.group()
def main() -> None:
    """Fuzz ggml-hybrid: model files, command lines, signals and the Python API."""


@main.command()
@_common
def gguf(cases: int, seed: int, out: str, jobs: int, timeout: float, how: str, only: str | None) -> None:
    """Mutated GGUF files through `inspect`, `run -n 2 --logits-out` and `plan`."""
    _finish([ggfuzz.run_gguf(cases, seed, out, jobs, timeout, how, indices=_indices(only))])


@main.command()
@_common
def cli(cases: int, seed: int, out: str, jobs: int, timeout: float, how: str, only: str | None) -> None:
    """Random command lines (flags, option values, config files, paths) over a valid model."""
    _finish([ggfuzz.run_cli(cases, seed, out, jobs, timeout, how, indices=_indices(only))])


@main.command()
@_common
@click.option("--grace", default=20.0, show_default=True, type=click.FloatRange(1),
              help="Seconds a run may take to end after Ctrl-C before it counts as a hang.")
@click.option("--modes", default="resident,disk,disk-share,disk-auto", show_default=True,
              help="Expert modes to draw from (comma-separated).")
def signals(cases: int, seed: int, out: str, jobs: int, timeout: float, how: str, only: str | None,
            grace: float, modes: str) -> None:
    """Ctrl-C at random moments of runs (resident, disk experts, CPU share); always real processes."""
    from ggfuzz.signal_cases import MODES

    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in chosen if m not in MODES]
    if bad or not chosen:
        raise click.BadParameter(f"{bad or modes!r}: modes are {', '.join(MODES)}", param_hint="--modes")
    _finish([ggfuzz.run_signals(cases, seed, out, jobs, timeout, indices=_indices(only), grace=grace,
                                modes=chosen)])


@main.command()
@_common
def api(cases: int, seed: int, out: str, jobs: int, timeout: float, how: str, only: str | None) -> None:
    """Bad arguments to the Python API (each call forked: a crash is a result, not the end)."""
    _finish([ggfuzz.run_api(cases, seed, out, jobs, timeout, indices=_indices(only))])


@main.command()
@click.option("--cases", default=2000, show_default=True, type=click.IntRange(1), help="Requests to send.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0), help="Request i depends on (seed, i).")
@click.option("--out", default="fuzz-out", show_default=True, type=click.Path(file_okay=False),
              help="Summary, server log, generated models.")
@click.option("--jobs", "-j", default=4, show_default=True, type=click.IntRange(1), help="Requests at once.")
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(1),
              help="Seconds per request before it counts as a hang.")
@click.option("--idle", default=200, show_default=True, type=click.IntRange(0),
              help="Idle connections held open while /health must still answer.")
def server(cases: int, seed: int, out: str, jobs: int, timeout: float, idle: int) -> None:
    """Hostile requests against one real `ggml-hybrid serve` (bodies, values, framing), then idle connections."""
    import json

    from ggfuzz import server_cases

    os.makedirs(out, exist_ok=True)
    summary = server_cases.run(cases, seed, out, jobs, timeout, idle)
    watch = summary["health_throughout"] or {}
    click.echo(f"server: {cases} requests in {summary['seconds']} s: {json.dumps(summary['classes'])}; "
               f"/health throughout: {watch.get('checks')} checks, slowest {watch.get('slowest_seconds')} s, "
               f"{len(watch.get('bad', []))} bad (during the slowest: {watch.get('slowest_during')}); "
               f"/health under {idle} idle connections: {summary['idle']['health']}; exit status "
               f"{summary['exit_status']}; log {summary['log_bytes']} bytes, {summary['log_tracebacks']} tracebacks")
    for f in summary["failures"][:20]:
        click.echo(f"  {f}")
    click.echo(f"  summary: {os.path.join(out, 'summary-server.json')}")
    if not server_cases.passed(summary):
        sys.exit(1)


@main.command()
@click.option("--cases", default=100, show_default=True, type=click.IntRange(1), help="Connections, each a case.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0), help="Case i depends on (seed, i) only.")
@click.option("--messages", default=8, show_default=True, type=click.IntRange(1), help="Messages per case.")
@click.option("--out", default="fuzz-out", show_default=True, type=click.Path(file_okay=False), help="Summary.")
def rpc(cases: int, seed: int, messages: int, out: str) -> None:
    """Hostile byte sequences to `ggml-hybrid rpc-server` (loopback, one thread); the server must answer a fresh
    client after each case."""
    import json
    import subprocess
    import time

    from ggfuzz import rpc_cases

    proc, port = rpc_cases.start_server()
    try:
        result = rpc_cases.fuzz(port, seed, cases, messages)
    finally:
        code, err = rpc_cases.stop_server(proc)
    result.update(seed=seed, server_exit=code, server_stderr_tail=err[-2000:],
                  date=time.strftime("%Y-%m-%d %H:%M:%S"), load=subprocess.run(["uptime"], capture_output=True,
                                                                            text=True).stdout.strip())
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "summary-rpc.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    ok = result["failed"] is None and code == 0
    click.echo(f"rpc: {result['cases']} cases, {result['messages']} messages ({result['kept']} kept the connection "
               f"open) in {result['seconds']:.1f} s "
               f"({', '.join(f'{k} {n}' for k, n in result['kinds'].items())}); "
               + ("server alive after every case" if ok else f"FAILED at case {result['failed']}: {result['error']}"))
    click.echo(f"  summary: {path}")
    if not ok:
        sys.exit(1)


@main.command(name="all")
@_common
def all_kinds(cases: int, seed: int, out: str, jobs: int, timeout: float, how: str, only: str | None) -> None:
    """Every kind with the same number of cases (signals: a tenth of it, at least 2)."""
    idx = _indices(only)
    _finish([ggfuzz.run_gguf(cases, seed, out, jobs, timeout, how, indices=idx),
             ggfuzz.run_cli(cases, seed, out, jobs, timeout, how, indices=idx),
             ggfuzz.run_api(cases, seed, out, jobs, timeout, indices=idx),
             ggfuzz.run_signals(max(2, cases // 10), seed, out, 1, timeout, indices=idx)])


if __name__ == "__main__":
    main()
