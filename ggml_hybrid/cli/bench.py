"""``ggml-hybrid bench``: two session configurations of one model, side by side."""

from __future__ import annotations

import json
from typing import Any

import click

from ..options import SessionOptions
from .flags import model_argument, pick_model, session_flags, session_from_flags
from .main import main


@main.command()
@model_argument
@session_flags
@click.option("--a", "a_opts", default="", help="Session options of side A over the flags: 'key=value key=value' "
              "(or commas).")
@click.option("--b", "b_opts", default="", help="Session options of side B over the flags.")
@click.option("--runs", default=4, show_default=True, type=click.IntRange(1), help="Blocks of A,B,B,A.")
@click.option("-n", "--predict", "--n-predict", "n_predict", default=16, show_default=True, type=click.IntRange(2),
              help="Tokens generated per run.")
@click.option("-p", "--prompt", default="The quick brown fox jumps over the lazy dog.", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench(model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None, a_opts: str,
          b_opts: str, runs: int, n_predict: int, prompt: str, as_json: bool, **flags: Any) -> None:
    """Time two session configurations of MODEL side by side in one process (the flags apply to both)."""
    from .abbench import ab_bench, format_table

    path, role, base = session_from_flags(pick_model(model, model_flag, hf_repo, hf_file, quiet=as_json), flags)
    split = lambda s: [x for x in s.replace(",", " ").split() if x]
    a = SessionOptions.parse(split(a_opts), role=role, base=base)
    b = SessionOptions.parse(split(b_opts), role=role, base=base)
    r = ab_bench(path, a, b, runs=runs, n_predict=n_predict, prompt=prompt)
    click.echo(json.dumps(r) if as_json else format_table(r))
