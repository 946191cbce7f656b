"""``ggml-hybrid plan``: what a model needs per device and in host memory, before loading it."""

from __future__ import annotations

import json

import click

from .flags import _layout_flags, _layout_items, _options, _resolve_model
from .main import main


@main.command()
@click.argument("model")
@click.option("--vram", help="Device memory, one size per device: 24G or 80G,80G (plans for CUDA0, CUDA1, ...; with "
              "--rpc for the session's devices, which are otherwise asked what they have free).")
@click.option("--ram", help="Host memory for the warnings, e.g. 64G.")
@click.option("--ctx", type=click.IntRange(1), help="Context size (n_ctx) per sequence.")
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(1), help="Parallel sequences.")
@click.option("--session-option", "-o", "session_options", multiple=True, metavar="[ROLE.]KEY=VALUE")
@click.option("--config", type=click.Path(dir_okay=False))
@_layout_flags
@click.option("--format", "fmt", type=click.Choice(["text", "json", "k8s"]), default="text", show_default=True)
def plan(model, vram, ram, ctx, parallel, session_options, config, fmt, **layout):
    """What MODEL needs per device and in host memory under the given options, from metadata alone."""
    from ..deploy.planner import format_k8s, format_text
    from ..deploy.planner import plan as make_plan
    from ..units import parse_size

    path, role, base = _resolve_model(model, config)
    explicit = _layout_items(layout)
    if ctx is not None:
        explicit["n_ctx"] = ctx
    opts = _options(session_options, role, base, explicit)
    sizes = [parse_size(x) for x in vram.split(",")] if vram else None
    p = make_plan(path, opts, vram=sizes, ram=parse_size(ram) if ram else None, parallel=parallel)
    if fmt == "json":
        click.echo(json.dumps(p))
    elif fmt == "k8s":
        click.echo(format_k8s(p))
    else:
        click.echo(format_text(p))
