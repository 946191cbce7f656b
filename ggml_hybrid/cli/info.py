"""``ggml-hybrid inspect``, ``devices`` and ``options``: what a file, this machine and the options are."""

from __future__ import annotations

import json

import click

from ..options import MAX_DEVICES, SessionOptions
from ..units import format_bytes
from .flags import model_argument, pick_model
from .main import main


@main.command()
@model_argument
@click.option("--json", "as_json", is_flag=True)
def inspect(model, model_flag, hf_repo, hf_file, as_json):
    """Architecture, experts, bytes per tensor class and quant types of MODEL (header only)."""
    from ..plan.model_info import describe, format_text

    d = describe(pick_model(model, model_flag, hf_repo, hf_file, quiet=as_json))
    click.echo(json.dumps(d) if as_json else format_text(d))


@main.command()
@click.option("--virtual-devices", type=click.IntRange(1, MAX_DEVICES),
              help="Without a GPU: CPU instances playing devices.")
@click.option("--rpc", metavar="HOST:PORT[,...]", help="RPC servers whose devices to list (asked now).")
@click.option("--json", "as_json", is_flag=True)
def devices(virtual_devices, rpc, as_json):
    """The device names that layout options accept (RPC0, ..., CUDA0, ..., Vulkan0, ... or DEV0, ... and CPU)."""
    from ..placement.devices import backend_notes, describe_devices

    items = [f"virtual_devices={virtual_devices}"] if virtual_devices else []
    opts = SessionOptions.parse(items + ([f"rpc={rpc}"] if rpc is not None else []))
    rows = describe_devices(opts)
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        mem = f", {format_bytes(r['memory_total'])}" if r["memory_total"] else ""
        if "link_bytes_per_s" in r:  # an RPC device: the link measured to its server
            mem += f"; link {r['link_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, round trip {r['link_rtt_s'] * 1e3:.2f} ms"
        click.echo(f"{r['name']:<7} {r['kind']:<13} {r['description']}{mem}")
    for note in backend_notes():
        click.echo(note)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def options(as_json):
    """List the session options with their types, defaults and rules."""
    rows = SessionOptions.describe()
    if as_json:
        click.echo(json.dumps([dict(zip(("name", "type", "default", "rule", "doc"), r)) for r in rows]))
        return
    for name, type_, default, rule, doc in rows:
        click.echo(f"{name} ({type_}, default {default!r}): {doc} Must be {rule}.")
