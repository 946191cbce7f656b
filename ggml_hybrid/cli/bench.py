"""``ggml-hybrid bench``: llama.cpp's ``llama-bench`` tests (``pp512``, ``tg128``) on one session
(:mod:`.llamabench`), or, with ``--a``/``--b``, two session configurations side by side (:mod:`.abbench`)."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..options import SessionOptions
from .flags import model_argument, pick_model, session_flags, session_from_flags, warn_busy_threads
from .main import main

FORMATS = ("md", "csv", "json", "jsonl")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=flag) from None
    if not out or any(x < 0 for x in out):
        raise click.BadParameter(f"{text!r}: give token counts of 0 or more", param_hint=flag)
    return out


@main.command()
@model_argument
@session_flags
@click.option("-p", "--n-prompt", "n_prompt", default="512", show_default=True, metavar="N[,N...]",
              help="Prompt tests: N random tokens evaluated in one batch (0 = none).")
@click.option("-n", "--n-gen", "n_gen", default="128", show_default=True, metavar="N[,N...]",
              help="Generation tests: N random tokens evaluated one at a time (0 = none).")
@click.option("-r", "--repetitions", "--runs", "repetitions", default=5, show_default=True, type=click.IntRange(1),
              help="Repetitions of each test (with --a/--b: blocks of A,B,B,A).")
@click.option("--output", "output", type=click.Choice(FORMATS), help="Output format (also -o md|csv|json|jsonl, "
              "as llama-bench; default md).")
@click.option("--json", "as_json", is_flag=True, help="The same as --output json.")
@click.option("--a", "a_opts", default=None, help="A/B mode: session options of side A over the flags, "
              "'key=value key=value' (or commas).")
@click.option("--b", "b_opts", default=None, help="A/B mode: session options of side B over the flags.")
@click.option("--draft-accept", "draft_accept", metavar="P[,P...]", help=(
    "Benchmarks only: speculative decoding with drafts replayed from the plain greedy run, each right with "
    "probability P (one tgN row per P, marked BENCHMARK ONLY): speculation's speed at a chosen acceptance."))
def bench(model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None, n_prompt: str,
          n_gen: str, repetitions: int, output: str | None, as_json: bool, a_opts: str | None, b_opts: str | None,
          **flags: Any) -> None:
    """Time MODEL as llama-bench does (pp512 and tg128, mean ± standard deviation), or compare two session
    configurations side by side in one process (--a/--b)."""
    fmt = _output_format(flags, output, as_json)
    prompts, gens = _int_list(n_prompt, "-p/--n-prompt"), _int_list(n_gen, "-n/--n-gen")
    accepts = _accepts(flags, a_opts is not None or b_opts is not None)
    path, role, base = session_from_flags(pick_model(model, model_flag, hf_repo, hf_file, quiet=fmt != "md"), flags)
    warn_busy_threads(base)
    if a_opts is not None or b_opts is not None:
        _ab(path, role, base, a_opts or "", b_opts or "", prompts, gens, repetitions, fmt)
        return
    from ..machine import idle_cores
    from ..runtime.moe_model import MoEModel
    from .llamabench import describe, format_rows, noise_warnings, rows, run_tests

    if not any(prompts) and not any(gens):
        raise click.UsageError("-p 0 and -n 0: no test to run")
    with MoEModel(path, base) as m:
        for w in m.warnings:
            click.echo(f"warning: {w}", err=True)
        longest = max(prompts + gens)
        if longest > m.n_ctx:
            raise click.BadParameter(f"a test of {longest} tokens does not fit the context of {m.n_ctx} (-c)",
                                     param_hint="-p/-n")
        idle = idle_cores()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if m.options.spec_type != "none" and any(g == 1 for g in gens):
            raise click.BadParameter("a speculative tgN test generates after one token: give N >= 2",
                                     param_hint="-n/--n-gen")
        results = run_tests(m, prompts, gens, repetitions, accepts=accepts)
        out = rows(describe(m), results, stamp)
        warnings = noise_warnings(results, m.n_threads, idle)
    click.echo(format_rows(out, fmt))
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


def _accepts(flags: dict[str, Any], ab: bool) -> list[float]:
    """``--draft-accept``'s probabilities (taken out of ``flags``); any turns replayed drafts on."""
    text = flags.pop("draft_accept", None)
    if text is None:
        return []
    if ab:
        raise click.UsageError("--draft-accept does not go with --a/--b")
    flags["session_options"] = tuple(flags.get("session_options") or ()) + ("spec_type=replay",)
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers", param_hint="--draft-accept") \
            from None
    if not out or not all(0 <= a <= 1 for a in out):
        raise click.BadParameter(f"{text!r}: give probabilities in [0, 1]", param_hint="--draft-accept")
    return out


def _output_format(flags: dict[str, Any], output: str | None, as_json: bool) -> str:
    """llama-bench's ``-o FORMAT``: ``-o`` is also the session-option flag here, whose values hold ``=``."""
    given = [x for x in flags.get("session_options", ()) if x in FORMATS]
    flags["session_options"] = tuple(x for x in flags.get("session_options", ()) if x not in FORMATS)
    choices = set(given) | ({output} if output else set()) | ({"json"} if as_json else set())
    if len(choices) > 1:
        raise click.UsageError(f"output formats {', '.join(sorted(choices))}: choose one")
    return choices.pop() if choices else "md"


def _ab(path: str, role: str | None, base: SessionOptions, a_opts: str, b_opts: str, prompts: list[int],
        gens: list[int], runs: int, fmt: str) -> None:
    from .abbench import ab_bench, format_table

    if len(prompts) != 1 or len(gens) != 1 or prompts[0] < 1 or gens[0] < 2:
        raise click.UsageError("--a/--b time one prompt (-p N, N >= 1) and one generation (-n N, N >= 2)")
    if fmt in ("csv", "jsonl"):
        raise click.UsageError(f"--a/--b print md or json, not {fmt}")
    split = lambda s: [x for x in s.replace(",", " ").split() if x]
    a = SessionOptions.parse(split(a_opts), role=role, base=base)
    b = SessionOptions.parse(split(b_opts), role=role, base=base)
    r = ab_bench(path, a, b, runs=runs, n_predict=gens[0], n_prompt=prompts[0])
    click.echo(json.dumps(r) if fmt == "json" else format_table(r))
    for w in r["warnings"]:
        click.echo(f"warning: {w}", err=True)
