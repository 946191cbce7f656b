"""``ggml-hybrid run``: generate text from a model."""

from __future__ import annotations

import json

import click
import numpy as np

from .flags import _layout_flags, _layout_items, _options, _progress, _resolve_model
from .main import main


@main.command()
@click.argument("model")
@click.option("--prompt", "-p", help="Prompt text.")
@click.option("--tokens", help="Prompt as comma-separated token ids (instead of --prompt).")
@click.option("-n", "--n-predict", default=32, show_default=True, type=click.IntRange(0), help="Tokens to generate.")
@click.option("--moe-cpu-share", help="Shorthand for --session-option moe_cpu_share=X (a number in [0, 1] or auto).")
@click.option("--expert-cache-slots", type=click.IntRange(0), help="Shorthand for expert_cache_slots=N.")
@click.option("--threads", "-t", type=click.IntRange(1, 512), help="Shorthand for n_threads=N.")
@click.option("--session-option", "-o", "session_options", multiple=True, metavar="[ROLE.]KEY=VALUE",
              help="A session option; repeatable. See `ggml-hybrid options`.")
@click.option("--config", type=click.Path(dir_okay=False), help="TOML file with models and their session options.")
@_layout_flags
@click.option("--seed", type=click.IntRange(0), help="Sampling seed (with --temp > 0).")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0), help="0 = greedy.")
@click.option("--top-k", default=40, show_default=True, type=click.IntRange(0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--ignore-eos", is_flag=True, help="Generate -n tokens even past the end-of-sequence token.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streamed text and stats.")
@click.option("--logits-out", type=click.Path(dir_okay=False, writable=True),
              help="Write every evaluated position's logits, float32 [positions, vocab], to this .npy file.")
def run(model, prompt, tokens, n_predict, moe_cpu_share, expert_cache_slots, threads, session_options, config, seed,
        temp, top_k, top_p, ignore_eos, as_json, logits_out, **layout):
    """Generate text from MODEL (a GGUF file, or a model name or role in --config)."""
    from ..model.generate import GenerationStats, generate
    from ..model.moe_model import MoEModel
    from ..model.sampling import Sampler
    from .report import format_stats, run_report

    if (prompt is None) == (tokens is None):
        raise click.UsageError("give exactly one of --prompt and --tokens")
    if prompt is not None:
        try:
            prompt.encode("utf-8")  # bytes that are not UTF-8 on the command line arrive as lone surrogates
        except UnicodeEncodeError:
            raise click.BadParameter("the prompt is not valid UTF-8 text", param_hint="--prompt") from None
    path, role, base = _resolve_model(model, config)
    opts = _options(session_options, role, base, {"moe_cpu_share": moe_cpu_share,
                                                  "expert_cache_slots": expert_cache_slots, "n_threads": threads,
                                                  **_layout_items(layout)})
    sampler = Sampler(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
    ids = None
    if tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            raise click.BadParameter(f"{tokens!r} is not a comma-separated list of integers",
                                     param_hint="--tokens") from None
        if not ids:
            raise click.BadParameter("no token ids given", param_hint="--tokens")
    cb, finish = _progress(not as_json)
    try:
        m = MoEModel(path, opts, progress=cb)
    finally:
        finish()
    with m:
        if ids is None:
            ids = m.tokenizer.encode(prompt)
            if not ids:
                raise click.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
        else:
            bad = [t for t in ids if not 0 <= t < m.hp.n_vocab]
            if bad:
                raise click.BadParameter(f"token id {bad[0]} is outside the vocabulary 0..{m.hp.n_vocab - 1}",
                                         param_hint="--tokens")
        st = GenerationStats()
        pieces = []
        for piece in generate(m, ids, n_predict, sampler, st, keep_logits=logits_out is not None,
                              stop_at_eos=not ignore_eos):
            pieces.append(piece)
            if not as_json:
                click.echo(piece, nl=False)
        if logits_out is not None:
            with open(logits_out, "wb") as f:  # np.save would add ".npy" to a file name without it
                np.save(f, st.all_logits())
        report = run_report(m, st, "".join(pieces))
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo()
        click.echo(format_stats(report), err=True)
