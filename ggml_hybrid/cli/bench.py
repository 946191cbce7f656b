"""``ggml-hybrid bench``: two session configurations of one model, side by side."""

from __future__ import annotations

import json

import click

from ..options import SessionOptions
from .flags import _resolve_model
from .main import main


@main.command()
@click.argument("model")
@click.option("--a", "a_opts", default="", help="Session options of side A: 'key=value key=value' (or commas).")
@click.option("--b", "b_opts", default="", help="Session options of side B.")
@click.option("--runs", default=4, show_default=True, type=click.IntRange(1), help="Blocks of A,B,B,A.")
@click.option("-n", "--n-predict", default=16, show_default=True, type=click.IntRange(2))
@click.option("--config", type=click.Path(dir_okay=False))
@click.option("--rpc", metavar="HOST:PORT[,...]", help="RPC servers whose devices both sides use (rpc=...).")
@click.option("--json", "as_json", is_flag=True)
def bench(model, a_opts, b_opts, runs, n_predict, config, rpc, as_json):
    """Time two session configurations of MODEL side by side in one process."""
    from .abbench import ab_bench, format_table

    path, role, base = _resolve_model(model, config)
    split = lambda s: [x for x in s.replace(",", " ").split() if x]
    if rpc is not None:  # a list of servers is one item: its commas are not separators
        base = SessionOptions.parse([f"rpc={rpc}"], role=role, base=base)
    a = SessionOptions.parse(split(a_opts), role=role, base=base)
    b = SessionOptions.parse(split(b_opts), role=role, base=base)
    r = ab_bench(path, a, b, runs=runs, n_predict=n_predict)
    click.echo(json.dumps(r) if as_json else format_table(r))
