"""``ggml-hybrid replay``: a routing trace through expert caches of several sizes and policies, as a table, JSON or
a picture (:mod:`ggml_hybrid.moe.traces.plot`). ``tools/replay_trace.py`` has the full set of cost options."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import click

from ..options import SessionOptions
from .main import main

LRU, BELADY = "lru", "belady"


def _comma_list(kind: click.ParamType) -> Callable[[click.Context, click.Parameter, Sequence[str]], tuple[Any, ...]]:
    """A repeatable option whose values may also be comma-separated: --slots 2,4 --slots 8 is 2, 4, 8."""
    def convert(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> tuple[Any, ...]:
        return tuple(kind.convert(p.strip(), param, ctx) for v in values for p in str(v).split(",") if p.strip())
    return convert


def sweep(path: str, slots: Sequence[int], policies: Sequence[str], shares: Sequence[float],
          expert_bytes: int | None) -> tuple[Any, list[Any]]:
    """The trace at ``path`` and its replays for every (policy, share, slots); the defaults: slots from
    :func:`~ggml_hybrid.moe.traces.plot.default_slots`, policies LRU, the runtime's default and Belady's, share 0."""
    from ..moe.traces import TraceError, read_trace, replay
    from ..moe.traces.plot import default_slots

    tr = read_trace(path, warn=False)
    slots = list(slots) or default_slots(tr.n_expert, tr.n_used)
    for n in slots:
        if n > tr.n_expert:
            raise TraceError(f"--slots {n} exceeds the trace's n_expert={tr.n_expert}")
    policies = list(dict.fromkeys(p.lower() for p in policies)) or list(
        dict.fromkeys([LRU, SessionOptions().expert_eviction, BELADY]))
    runs = [(p, s, n) for p in policies for s in (list(shares) or [0.0]) for n in slots]
    return tr, [replay(tr, n, p, share=s, expert_bytes=expert_bytes) for p, s, n in runs]


def report(path: str, tr: Any, results: Sequence[Any]) -> dict[str, Any]:
    """``--json``'s document: the trace, and per replay its totals (``misses``: the loads a curve draws)."""
    return {"runtime_policy": SessionOptions().expert_eviction,
            "trace": {"path": path, "n_layer": tr.n_layer, "n_expert": tr.n_expert, "n_used": tr.n_used,
                      "calls": tr.n_calls, "tokens": tr.tokens},
            "results": [r.to_dict(layers=False) for r in results]}


@main.command()
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--slots", "slots", multiple=True, callback=_comma_list(click.IntRange(min=1)),
              help="Expert slots per layer (repeat, or commas: --slots 2,4,8; default: a sweep up to every expert).")
@click.option("--policy", "policies", multiple=True,
              callback=_comma_list(click.Choice(["freq", "lru", "lfu", "belady"], case_sensitive=False)),
              help="Eviction policy (repeat, or commas; default: lru, the runtime's default, belady).")
@click.option("--share", "shares", multiple=True, callback=_comma_list(click.FloatRange(0.0, 1.0)),
              help="moe_cpu_share, in [0, 1] (repeat, or commas; default 0). 'auto' and its costs: "
              "tools/replay_trace.py.")
@click.option("--expert-bytes", type=click.IntRange(min=1), help="Bytes of one expert (bytes_moved; default 1).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False),
              help="Also draw the heatmap and the loads-against-slots curves to FILE (.png or .html; needs the "
              "'plot' extra: matplotlib).")
def replay(trace: str, slots: tuple[int, ...], policies: tuple[str, ...], shares: tuple[float, ...],
           expert_bytes: int | None, as_json: bool, plot: str | None) -> None:
    """Replay TRACE (a routing trace: moe_trace_path) for every --slots, --policy and --share: loads, CPU misses,
    hit rate."""
    from ..moe.traces.plot import check_plot_path, write_plot

    if plot is not None:
        check_plot_path(plot)
    tr, results = sweep(trace, slots, policies, shares, expert_bytes)
    if plot is not None:
        write_plot(plot, tr, results, f"routing trace {os.path.basename(trace)}")
    if as_json:
        click.echo(json.dumps(report(trace, tr, results), indent=1))
        return
    click.echo(f"trace {trace}: {tr.n_layer} layers, {tr.n_expert} experts, top-{tr.n_used}, {tr.n_calls} calls")
    head = f"{'policy':<7} {'slots':>5} {'share':>5} {'hit rate':>8} {'loads':>8} {'cpu':>7}"
    click.echo(head + "\n" + "-" * len(head))
    for r in results:
        click.echo(f"{r.policy:<7} {r.n_slots:>5} {r.share:>5g} {r.hit_rate:>8.3f} {r.misses:>8} {r.cpu:>7}")
    if plot is not None:
        click.echo(f"wrote {plot}")
