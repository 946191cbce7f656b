"""``ggml-hybrid plan``: what a model needs per device and in host memory, before loading it.

It takes the session flags of ``run``; it reads the file's metadata and writes nothing.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from ..options import SessionOptions
from ..plan.k8s import DEFAULT_IMAGE, DEFAULT_PORT
from .flags import flags_for, model_argument, pick_model, session_flags, session_from_flags
from .main import main


def _with(opts: SessionOptions, combination: str) -> list[str]:
    """The given options with the combination's over them (the experts' placement entirely the combination's)."""
    from ..plan.planner import EXPERT_KEYS

    items = combination.split()
    keys = {x.split("=", 1)[0] for x in items} | set(EXPERT_KEYS)
    return [x for x in opts.to_items() if x.split("=", 1)[0] not in keys] + items


def _keep(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """--trace and --plot: kept in the context (read by :func:`plan`), not passed as arguments."""
    ctx.meta[f"plan.{param.name}"] = value


def _plot(path: str, p: Any, opts: SessionOptions, trace: str, plot_file: str) -> None:
    """The trace's curves for this model: its experts' bytes, the runtime's policies, the share asked for."""
    import os

    from ..moe.traces import TraceError, read_trace
    from ..moe.traces.plot import check_plot_path, write_plot
    from .replay import sweep

    check_plot_path(plot_file)
    if not p.moe:
        raise TraceError(f"--plot: {path!r} has no routed experts: there is nothing to replay")
    head = read_trace(trace, warn=False)
    if (head.n_expert, head.n_used) != (p.experts.count, p.experts.used):
        raise TraceError(f"--trace {trace!r}: {head.n_expert} experts, top-{head.n_used}; the model has "
                         f"{p.experts.count}, top-{p.experts.used}: a trace of another model")
    share = opts.moe_cpu_share
    shares = [0.0] if share in (0.0, "auto") else [0.0, float(share)]
    tr, results = sweep(trace, [], [], shares, p.experts.bytes_per_expert)
    write_plot(plot_file, tr, results, f"{os.path.basename(path)}: routing trace {os.path.basename(trace)}")
    click.echo(f"wrote {plot_file}", err=True)


@main.command()
@model_argument
@session_flags
@click.option("--vram", help="Device memory, one size per device: 24G or 80G,80G (plans for CUDA0, CUDA1, ... or the "
              "devices of -dev).")
@click.option("--ram", help="Host memory for the warnings, e.g. 64G.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "k8s"]), default="text", show_default=True,
              help="k8s: a Deployment running `ggml-hybrid serve` with these options, resources and probes.")
@click.option("--json", "as_json", is_flag=True, help="The same as --format json.")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True, help="Container image (--format k8s).")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(1, 65535),
              help="The server's port (--format k8s).")
@click.option("--api-key-secret", metavar="NAME", default=None,
              help="--format k8s: the server takes its API keys from this Secret's 'api-keys' entry (one key a line).")
@click.option("--trace", type=click.Path(dir_okay=False), expose_value=False, callback=_keep,
              help="A routing trace of this model (moe_trace_path): with --plot, its loads-against-slots curves.")
@click.option("--plot", type=click.Path(dir_okay=False), expose_value=False, callback=_keep,
              help="Draw --trace's heatmap and loads-against-slots curves for this model to FILE (.png or .html).")
def plan(model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None, vram: str | None,
         ram: str | None, fmt: str, as_json: bool, image: str, port: int, api_key_secret: str | None,
         **flags: Any) -> None:
    """What MODEL needs per device and in host memory under the given options, from metadata alone."""
    from ..plan.planner import format_k8s, format_text
    from ..plan.planner import plan as make_plan
    from ..units import parse_size

    if as_json:
        if fmt not in ("text", "json"):
            raise click.UsageError(f"--json and --format {fmt}: choose one output format")
        fmt = "json"
    if api_key_secret is not None and fmt != "k8s":
        raise click.UsageError("--api-key-secret is for --format k8s (the Deployment's server reads its keys there)")
    trace, plot_file = (click.get_current_context().meta.get(f"plan.{k}") for k in ("trace", "plot"))
    if (trace is None) != (plot_file is None):
        raise click.UsageError("--trace and --plot go together: the curves of a trace for this model")
    path, _, opts = session_from_flags(pick_model(model, model_flag, hf_repo, hf_file, quiet=fmt != "text"), flags)
    sizes = [parse_size(x) for x in vram.split(",")] if vram else None
    p = make_plan(path, opts, vram=sizes, ram=parse_size(ram) if ram else None)
    if trace is not None and plot_file is not None:
        _plot(path, p, opts, trace, plot_file)
    if fmt == "json":
        click.echo(json.dumps(p.to_dict()))
    elif fmt == "k8s":
        click.echo(format_k8s(p, image=image, port=port, api_key_secret=api_key_secret), nl=False)
    else:
        click.echo(format_text(p))
        c = getattr(p, "combination", None)
        if c is not None and c.fits:
            # run holds one sequence and needs a prompt to run as printed; serve holds several
            cmd = ["serve"] if opts.n_parallel > 1 else ["run", "-p", "Hello", "-n", "32"]
            click.echo("  try: " + shlex.join(["ggml-hybrid", cmd[0], path, *flags_for(_with(opts, c.options)),
                                               *cmd[1:]]))
