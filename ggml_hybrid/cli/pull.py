"""``ggml-hybrid pull REPO[:QUANT]``: a GGUF model from the Hugging Face Hub into its cache (:mod:`.hub`)."""

from __future__ import annotations

import click

from .hub import fetch
from .main import main


@main.command()
@click.argument("repo", metavar="REPO[:QUANT]")
@click.option("-hff", "--hf-file", "hf_file", metavar="FILE", help="The file of REPO to download (instead of a tag).")
def pull(repo: str, hf_file: str | None) -> None:
    """Download a GGUF model from the Hugging Face Hub into its cache; print the path to load.

    The quant tag picks the file as llama.cpp's -hf does (default Q4_K_M, then Q8_0, then the first GGUF).
    """
    click.echo(fetch(repo, hf_file, note=lambda s: click.echo(s, err=True)))


__all__ = ["pull"]
