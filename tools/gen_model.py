#!/usr/bin/env python3
"""Write a small random-weight MoE language model in a real GGUF layout (llama.cpp loads it too).

    python tools/gen_model.py OUT.gguf [--arch qwen3moe|qwen2moe|llama|olmoe|glm4moe|deepseek2|gpt-oss|qwen3next|
        qwen35moe] [--type q8_0]
        [--layers 2] [--embd 64] [--heads 4] [--kv-heads 2] [--head-dim 32] [--ff 64] [--experts 8] [--used 2]
        [--vocab 384] [--seed 0] [--set FIELD=VALUE ...]

``--set`` sets any other ModelSpec field (ggml_hybrid/model/synthetic/spec.py), e.g.
``--set expert_type=mxfp4`` (gpt-oss), ``--set n_dense_lead=1``, ``--set vocab=spm``, ``--set d_state=128``
``--set attn_interval=4`` (qwen3next, qwen35moe: delta-net head size, one attention layer in four).
Matrices are quantized with GGML's own routines; the vocabulary is trained on a fixed
corpus. The same arguments always give the same file.
"""

from __future__ import annotations

import dataclasses
import sys

import click

from ggml_hybrid.synthetic import ARCHS, ModelSpec, write_model


@click.command(help=__doc__)
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--arch", type=click.Choice(ARCHS), default="qwen3moe", show_default=True)
@click.option("--type", "weight_type", default="f32", show_default=True)
@click.option("--layers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--embd", default=64, show_default=True, type=click.IntRange(1))
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1))
@click.option("--kv-heads", default=2, show_default=True, type=click.IntRange(1))
@click.option("--head-dim", default=32, show_default=True, type=click.IntRange(2))
@click.option("--ff", default=64, show_default=True, type=click.IntRange(1), help="expert feed-forward width")
@click.option("--shared-ff", default=64, show_default=True, type=click.IntRange(1), help="shared expert width")
@click.option("--experts", default=8, show_default=True, type=click.IntRange(1))
@click.option("--used", default=2, show_default=True, type=click.IntRange(1))
@click.option("--vocab", default=384, show_default=True, type=click.IntRange(300))
@click.option("--tie-embeddings", is_flag=True, help="no output.weight (qwen3moe, llama)")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
@click.option("--set", "fields", multiple=True, metavar="FIELD=VALUE", help="another ModelSpec field")
def main(out, arch, weight_type, layers, embd, heads, kv_heads, head_dim, ff, shared_ff, experts, used, vocab,
         tie_embeddings, seed, fields):
    extra = {}
    types = {f.name: f.type for f in dataclasses.fields(ModelSpec)}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise click.UsageError(f"--set {item}: expected FIELD=VALUE with a ModelSpec field")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(types[name], str)
        try:
            extra[name] = kind(value)
        except ValueError:
            raise click.UsageError(f"--set {item}: {value!r} is not a {types[name]}") from None
    try:
        spec = ModelSpec(arch=arch, n_layer=layers, n_embd=embd, n_head=heads, n_head_kv=kv_heads,
                         head_dim=head_dim, n_ff_exp=ff, n_ff_shexp=shared_ff, n_expert=experts, n_used=used,
                         vocab_size=vocab, weight_type=weight_type, tie_embeddings=tie_embeddings, seed=seed, **extra)
        click.echo(write_model(out, spec))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
