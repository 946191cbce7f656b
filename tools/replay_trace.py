#!/usr/bin/env python3
"""Replay MoE routing traces through expert caches, or write synthetic traces.

Replay a trace (``replay`` may be left out when the trace path is not ``replay`` or ``synth``)::

    python tools/replay_trace.py [replay] TRACE --slots 8 [--slots 16 ...]
        [--policy freq --policy lru --policy lfu --policy belady]   (default: all four)
        [--share 0 --share 0.5 --share auto]          (default: 0)
        [--cpu-rule reuse --cpu-rule rows]            (default: reuse, the runtime's)
        [--bus-gbps 25] [--cpu-gbps 20] [--device-us-per-row 2] [--cpu-us-per-row 30]
        [--expert-bytes 2654208] [--json]

prints one row per (policy, slots, share): hit rate, loads (misses loaded over the bus), misses run
on the CPU, bytes moved and the modeled time per token (see ``ggml_hybrid.moe.traces``), and names the
runtime's default eviction policy (the ``expert_eviction`` session option's default). ``--cpu-rule rows``
replays the CPU share's rule before the request history (misses of equal rows taken by lower expert id),
to compare with the runtime's reuse-aware rule. GB/s are
10^9 bytes per second. The default expert size is one Q4_K expert of 3 x 2048 x 768 weights; the
default costs are illustrative, set them for the machine being modeled. ``--json`` prints
``{"trace": ..., "cost": ..., "results": [...]}`` with per-layer breakdowns instead of the table.

Replay a recorded run's lookahead predictions (a trace written with ``moe_prefetch=true``; see
``ggml_hybrid.moe.traces.replay_prefetch``)::

    python tools/replay_trace.py prefetch TRACE --slots 8 [--slots 16 ...] [--policy lru|lfu]
        [--max-experts N] [--expert-bytes 2654208] [--json]

prints per slot count the prediction's recall and precision, the loads on the critical path (demand
misses not covered by a prefetch), the experts prefetched (used, wasted), every byte moved, and beside
them the same policy's loads without prefetch and Belady's.

Write a synthetic trace (see ``ggml_hybrid.moe.traces.synthetic_trace``)::

    python tools/replay_trace.py synth OUT --layers 16 --experts 64 --used 8 --calls 500
        [--tokens 1] [--hot-fraction 0.2] [--hot-traffic 0.8] [--reuse 0.5] [--seed 0]

A user error (bad option, unreadable or corrupted trace, impossible slot count) prints one line
on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import os
import sys
from typing import get_args

import click

from ggml_hybrid.moe.traces import (
    CPU_RULES,
    POLICIES,
    LinkCost,
    TraceError,
    parse_share,
    read_trace,
    replay,
    replay_prefetch,
    synthetic_trace,
)
from ggml_hybrid.options import EvictionPolicy, SessionOptions

RUNTIME_POLICY = SessionOptions().expert_eviction

PROG = "replay_trace"
Q4K_EXPERT_BYTES = 3 * 2048 * 768 * 144 // 256  # Q4_K stores 256 weights in 144 bytes


class _OneLineGroup(click.Group):
    """A group whose user errors are one line on stderr with exit status 2, and whose default command is replay."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["replay", *args]
        return super().parse_args(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except (click.ClickException, TraceError, OSError) as e:
            msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
            click.echo(f"{PROG}: error: {' '.join(msg.split())}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)


class _Share(click.ParamType):
    name = "SHARE"

    def convert(self, value, param, ctx):
        try:
            return parse_share(value)
        except TraceError as e:
            self.fail(str(e), param, ctx)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _comma_list(kind: click.ParamType):
    """A repeatable option whose values may also be comma-separated: --slots 2,4 --slots 8 is 2, 4, 8."""
    def convert(ctx, param, values):
        return tuple(kind.convert(part.strip(), param, ctx) for v in values for part in str(v).split(",")
                     if part.strip())
    return convert


@click.group(cls=_OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Replay MoE routing traces through expert caches, or write synthetic traces."""


@cli.command("replay")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--slots", "slots", multiple=True, required=True, callback=_comma_list(click.IntRange(min=1)),
              help="expert slots per layer (repeat, or commas: --slots 2,4,8)")
@click.option("--policy", "policies", multiple=True,
              callback=_comma_list(click.Choice(POLICIES, case_sensitive=False)),
              help="eviction policy (repeat, or commas; default: all)")
@click.option("--share", "shares", multiple=True, callback=_comma_list(_Share()),
              help="moe_cpu_share: a number in [0, 1] or 'auto' (repeat, or commas; default 0)")
@click.option("--cpu-rule", "cpu_rules", multiple=True, callback=_comma_list(click.Choice(CPU_RULES)),
              help="the CPU share's tie-break: reuse (the runtime's) or rows (the rule before); repeat or commas")
@click.option("--bus-gbps", type=click.FloatRange(min=0, min_open=True), default=25.0, show_default=True,
              help="host->device bus bandwidth, GB/s")
@click.option("--cpu-gbps", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="CPU expert-weight read bandwidth, GB/s")
@click.option("--device-us-per-row", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="device compute per (token, expert) row, microseconds")
@click.option("--cpu-us-per-row", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="CPU compute per (token, expert) row, microseconds")
@click.option("--expert-bytes", type=click.IntRange(min=1), default=Q4K_EXPERT_BYTES, show_default=True,
              help="bytes of one expert (gate, up and down)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def replay_cmd(trace, slots, policies, shares, cpu_rules, bus_gbps, cpu_gbps, device_us_per_row, cpu_us_per_row,
               expert_bytes, as_json):
    """Replay TRACE for every combination of --slots, --policy and --share."""
    tr = read_trace(trace, warn=False)
    if tr.truncated:
        click.echo(f"{PROG}: note: {trace}: dropped an incomplete final record ({tr.truncated_bytes} bytes)",
                   err=True)
    cost = LinkCost(bus_bytes_per_s=bus_gbps * 1e9, cpu_bytes_per_s=cpu_gbps * 1e9,
                    device_s_per_row=device_us_per_row / 1e6, cpu_s_per_row=cpu_us_per_row / 1e6,
                    expert_bytes=expert_bytes)
    for n in slots:
        if n > tr.n_expert:
            raise TraceError(f"--slots {n} exceeds the trace's n_expert={tr.n_expert}")
    policies = [p.lower() for p in policies] or list(POLICIES)
    shares = list(shares) or [0.0]
    rules = list(cpu_rules) or ["reuse"]
    runs = [(p, n, s, rule) for p in policies for n in slots for s in shares
            for rule in (rules if s != 0.0 else rules[:1])]  # share 0 runs nothing on the CPU: one rule is enough
    results = [replay(tr, n, p, share=s, cost=cost, cpu_rule=rule) for p, n, s, rule in runs]
    if as_json:
        doc = {"runtime_policy": RUNTIME_POLICY,
               "trace": {"path": trace, "n_layer": tr.n_layer, "n_expert": tr.n_expert, "n_used": tr.n_used,
                         "calls": tr.n_calls, "tokens": tr.tokens, "truncated": tr.truncated},
               "cost": cost.to_dict(),
               "results": [{**r.to_dict(), "cpu_rule": rule, "modeled_us_per_token": r.modeled_s_per_token * 1e6}
                           for r, (_, _, _, rule) in zip(results, runs)]}
        click.echo(json.dumps(doc, indent=1))
        return
    click.echo(f"trace {trace}: {tr.n_layer} layers, {tr.n_expert} experts, top-{tr.n_used}, "
               f"{tr.n_calls} calls, {tr.tokens:g} tokens")
    click.echo(f"cost: bus {bus_gbps:g} GB/s, cpu {cpu_gbps:g} GB/s, device {device_us_per_row:g} us/row, "
               f"cpu {cpu_us_per_row:g} us/row, expert {_human(expert_bytes)}")
    click.echo(f"runtime default eviction: {RUNTIME_POLICY} (expert_eviction); CPU share rule: reuse")
    head = (f"{'policy':<7} {'slots':>5} {'share':>5} {'rule':>5} {'hit rate':>8} {'loads':>8} {'cpu':>7} "
            f"{'bytes moved':>12} {'us/token':>10}")
    click.echo(head)
    click.echo("-" * len(head))
    for r, (_, _, _, rule) in zip(results, runs):
        share = r.share if r.share == "auto" else f"{r.share:g}"
        rule = rule if r.share != 0.0 else "-"
        click.echo(f"{r.policy:<7} {r.n_slots:>5} {share:>5} {rule:>5} {r.hit_rate:>8.3f} {r.misses:>8} {r.cpu:>7} "
                   f"{_human(r.bytes_moved):>12} {r.modeled_s_per_token * 1e6:>10.1f}")


@cli.command("synth")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--layers", type=int, default=16, show_default=True, help="MoE layers")
@click.option("--experts", type=int, default=64, show_default=True, help="experts per layer")
@click.option("--used", type=int, default=8, show_default=True, help="experts per token (top-k)")
@click.option("--calls", type=int, default=500, show_default=True, help="layer calls (cycling through the layers)")
@click.option("--tokens", type=int, default=1, show_default=True, help="tokens per call")
@click.option("--hot-fraction", type=float, default=0.2, show_default=True, help="share of experts that are hot")
@click.option("--hot-traffic", type=float, default=0.8, show_default=True, help="share of traffic to hot experts")
@click.option("--reuse", type=float, default=0.5, show_default=True,
              help="probability of keeping each expert of the previous call of the layer")
@click.option("--seed", type=int, default=0, show_default=True)
def synth_cmd(out, layers, experts, used, calls, tokens, hot_fraction, hot_traffic, reuse, seed):
    """Write a synthetic routing trace to OUT."""
    tr = synthetic_trace(layers, experts, used, calls, tokens_per_call=tokens, hot_fraction=hot_fraction,
                         hot_traffic=hot_traffic, reuse=reuse, seed=seed)
    tr.write(out)
    click.echo(f"wrote {out}: {tr.n_calls} calls, {layers} layers, {experts} experts, top-{used}, "
               f"{tokens} tokens/call, {os.path.getsize(out)} bytes")


@cli.command("prefetch")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--slots", "slots", multiple=True, required=True, callback=_comma_list(click.IntRange(min=1)),
              help="expert slots per layer (repeat, or commas: --slots 2,4,8)")
@click.option("--policy", type=click.Choice(get_args(EvictionPolicy), case_sensitive=False), default=RUNTIME_POLICY,
              show_default=True, help="the runtime's eviction policy (expert_eviction)")
@click.option("--max-experts", type=click.IntRange(min=0), default=None,
              help="experts one call may prefetch (default: the trace's n_used, as moe_prefetch_bytes=0)")
@click.option("--expert-bytes", type=click.IntRange(min=1), default=Q4K_EXPERT_BYTES, show_default=True,
              help="bytes of one expert (gate, up and down)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def prefetch_cmd(trace, slots, policy, max_experts, expert_bytes, as_json):
    """Replay TRACE's recorded predictions: critical-path loads and bytes moved beside Belady's."""
    tr = read_trace(trace, warn=False)
    for n in slots:
        if n > tr.n_expert:
            raise TraceError(f"--slots {n} exceeds the trace's n_expert={tr.n_expert}")
    results = [replay_prefetch(tr, n, policy.lower(), max_experts, expert_bytes) for n in slots]
    if as_json:
        click.echo(json.dumps({"trace": trace, "results": [r.to_dict() for r in results]}, indent=1))
        return
    click.echo(f"trace {trace}: {tr.n_layer} layers, {tr.n_expert} experts, top-{tr.n_used}, {tr.n_calls} calls")
    head = (f"{'slots':>5} {'recall':>6} {'precision':>9} {'critical loads':>14} {'prefetched':>10} {'used':>6} "
            f"{'wasted':>6} {'bytes moved':>12} {'no prefetch':>11} {'Belady':>7}")
    click.echo(head)
    click.echo("-" * len(head))
    for r in results:
        click.echo(f"{r.n_slots:>5} {r.recall:>6.3f} {r.precision:>9.3f} {r.demand_loads:>14} {r.prefetched:>10} "
                   f"{r.prefetch_used:>6} {r.prefetch_wasted:>6} {_human(r.bytes_moved):>12} {r.baseline_loads:>11} "
                   f"{r.belady_loads:>7}")


if __name__ == "__main__":
    cli(prog_name=PROG)
