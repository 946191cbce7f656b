"""``ggml-hybrid gen OUT.gguf``: write a small random-weight MoE language model (``ggml_hybrid.synthetic``).

The file has a real GGUF layout (llama.cpp loads it too): every family's tensor names, shapes and metadata
keys, a vocabulary trained on a fixed corpus, matrices quantized with GGML's own routines. The same arguments
always give the same file. ``tools/gen_model.py`` is this command.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from ..synthetic import ARCHS, ModelSpec
from .main import main

_KINDS: dict[str, Any] = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes", "on")}


def spec_fields(items: tuple[str, ...]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` items as ModelSpec fields of their declared types."""
    types = {f.name: str(f.type) for f in dataclasses.fields(ModelSpec)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise click.BadParameter(f"{item!r}: expected FIELD=VALUE with FIELD one of {', '.join(types)}",
                                     param_hint="--set")
        try:
            out[name] = _KINDS.get(types[name], str)(value)
        except ValueError:
            raise click.BadParameter(f"{item!r}: {value!r} is not a {types[name]}", param_hint="--set") from None
    return out


@main.command()
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--arch", type=click.Choice(ARCHS), default="qwen3moe", show_default=True, help="The family.")
@click.option("--type", "weight_type", default="f32", show_default=True,
              help="GGML type of the matrices (f32, f16, q8_0, q4_0, q4_k, ...).")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--embd", default=64, show_default=True, type=click.IntRange(1), help="Embedding width.")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--head-dim", default=32, show_default=True, type=click.IntRange(2))
@click.option("--ff", default=64, show_default=True, type=click.IntRange(1), help="Expert feed-forward width.")
@click.option("--shared-ff", default=64, show_default=True, type=click.IntRange(1), help="Shared expert width.")
@click.option("--experts", default=8, show_default=True, type=click.IntRange(1), help="Routed experts per layer.")
@click.option("--used", default=2, show_default=True, type=click.IntRange(1), help="Experts used per token.")
@click.option("--vocab", default=384, show_default=True, type=click.IntRange(300))
@click.option("--tie-embeddings", is_flag=True, help="No output.weight (qwen3moe, llama).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
@click.option("--set", "fields", multiple=True, metavar="FIELD=VALUE", help=(
    "Another ModelSpec field (ggml_hybrid/synthetic/spec.py), e.g. expert_type=mxfp4 (gpt-oss), n_dense_lead=1, "
    "vocab=spm (llama); repeatable."))
def gen(out: str, arch: str, weight_type: str, layers: int, embd: int, heads: int, kv_heads: int, head_dim: int,
        ff: int, shared_ff: int, experts: int, used: int, vocab: int, tie_embeddings: bool, seed: int,
        fields: tuple[str, ...]) -> None:
    """Write a small random-weight MoE language model of any supported family to OUT (a GGUF file).

    The text it generates is noise (random weights); it runs, plans and serves as a published model does.
    """
    from ..files import AtomicFile, check_output
    from ..synthetic import write_model

    out = check_output(out, [], "OUT")
    try:
        given = dict(arch=arch, n_layer=layers, n_embd=embd, n_head=heads, n_head_kv=kv_heads, head_dim=head_dim,
                     n_ff_exp=ff, n_ff_shexp=shared_ff, n_expert=experts, n_used=used, vocab_size=vocab,
                     weight_type=weight_type, tie_embeddings=tie_embeddings, seed=seed)
        spec = ModelSpec(**{**given, **spec_fields(fields)})  # --set has the last word
        spec.check()
    except (TypeError, ValueError) as exc:
        raise click.UsageError(" ".join(str(exc).split())) from None
    # written beside OUT and renamed into place: an interrupted or failed write leaves no partial model
    af = AtomicFile(out)
    try:
        write_model(af.tmp, spec)
    except BaseException as exc:
        af.discard()
        if isinstance(exc, ValueError):
            raise click.UsageError(" ".join(str(exc).split())) from None
        raise
    af.commit()
    click.echo(out)


__all__ = ["gen", "spec_fields"]
