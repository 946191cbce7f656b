"""``ggml-hybrid run``: generate text from a model, as llama.cpp's ``llama-completion -no-cnv`` does, or chat
in the terminal with the model's chat template (``-cnv``, :mod:`.conversation`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from .flags import (
    check_model_args,
    explicit,
    model_argument,
    pick_model,
    progress_bar,
    sampling_flags,
    session_flags,
    session_from_flags,
    warn_busy_threads,
)
from .main import EXIT_INTERRUPTED, ignore_interrupts, main

if TYPE_CHECKING:
    from ..options import SessionOptions
    from ..runtime.moe_model import MoEModel
    from ..runtime.speculative import Speculator

_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}


def process_escapes(text: str) -> str:
    """llama.cpp's prompt escapes (``-e``, on by default): \\n \\r \\t \\' \\" \\\\ and \\xHH; others stay."""
    raw = text.encode("utf-8", "surrogateescape")
    out = bytearray()
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == ord("\\") and i + 1 < len(raw):
            nxt = raw[i + 1]
            if nxt in _ESCAPES:
                out += _ESCAPES[nxt]
                i += 2
                continue
            hexd = raw[i + 2:i + 4]
            if nxt == ord("x") and len(hexd) == 2 and all(chr(h) in "0123456789abcdefABCDEF" for h in hexd):
                out.append(int(hexd, 16))
                i += 4
                continue
            out += raw[i:i + 2]
            i += 2
            continue
        out.append(c)
        i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise click.BadParameter("after escape processing the prompt is not valid UTF-8 text (use --no-escape "
                                 "to take it literally)", param_hint="--prompt") from None


def read_prompt_file(path: str) -> str:
    """The prompt from a file, one trailing newline dropped (as llama.cpp's -f)."""
    from ..files import not_a_file

    why = not_a_file(path)
    if why is not None:
        raise click.BadParameter(f"{path!r} {why}", param_hint="-f/--file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise click.BadParameter(f"{path!r} is not UTF-8 text", param_hint="-f/--file") from None
    return text[:-1] if text.endswith("\n") else text


@main.command()
@model_argument
@click.option("-p", "--prompt", help="Prompt text (escapes such as \\n are processed; see --no-escape).")
@click.option("-f", "--file", "prompt_file", metavar="FNAME", help="Read the prompt from a file (one trailing "
              "newline dropped).")
@click.option("--tokens", help="Prompt as comma-separated token ids (instead of -p or -f).")
@click.option("-e", "--escape/--no-escape", "escape", default=True,
              help="Process escapes (\\n, \\t, \\xHH, ...) in the prompt, as llama.cpp does (default: on).")
@session_flags
@sampling_flags(defaults=True)
@click.option("-cnv", "--conversation", "conversation", is_flag=True,
              help="Chat in the terminal with the model's chat template (-p/-f: the first message; -n: per reply).")
@click.option("-no-cnv", "--no-conversation", "no_conversation", is_flag=True,
              help="Complete the prompt (the default).")
@click.option("-sys", "--system-prompt", "system_prompt", help="The system message of a conversation (-cnv).")
@click.option("-sp", "--special", is_flag=True, help="Print control tokens such as <|im_end|> in a conversation "
              "(-cnv; hidden by default, as in llama.cpp).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streamed text and stats.")
@click.option("--logits-out", type=click.Path(dir_okay=False),
              help="Write every evaluated position's logits, float32 [positions, vocab], to this .npy file.")
@click.option("--draft-replay", metavar="FILE", help=(
    "Benchmarks only: speculative decoding with drafts replayed from FILE (the `--json` report of a run of this "
    "prompt, or a JSON list of token ids by position), each kept with probability --draft-accept: speculation's "
    "speed at a chosen acceptance on a model whose own head would be noise. Marked benchmark-only in the output."))
@click.option("--draft-accept", type=click.FloatRange(0, 1), metavar="P", help=(
    "With --draft-replay: the probability that a replayed draft token is right (default 1)."))
@click.option("--draft-seed", type=click.IntRange(0), metavar="N", help="With --draft-replay: its seed (default 0).")
@click.pass_context
def run(ctx: click.Context, model: str | None, model_flag: str | None, hf_repo: str | None, hf_file: str | None,
        prompt: str | None, prompt_file: str | None,
        tokens: str | None, escape: bool, n_predict: int, seed: int | None, temp: float, top_k: int, top_p: float,
        min_p: float, repeat_penalty: float, repeat_last_n: int, presence_penalty: float, frequency_penalty: float,
        ignore_eos: bool, conversation: bool, no_conversation: bool, system_prompt: str | None, special: bool,
        as_json: bool, logits_out: str | None, **flags: Any) -> None:
    """Generate text from MODEL (a GGUF file, or a model name or role in --config)."""
    from ..files import check_output
    from ..runtime.generate import GenerationStats, generate
    from ..runtime.moe_model import MoEModel
    from ..runtime.sampling import Sampler
    from .report import format_stats, run_report

    check_model_args(model, model_flag, hf_repo, hf_file)  # before the other checks; -hf downloads after them
    given = [x for x, v in (("-p/--prompt", prompt), ("-f/--file", prompt_file), ("--tokens", tokens)) if v is not None]
    if conversation:
        _check_conversation(no_conversation, tokens, as_json, logits_out)
        if len(given) > 1:
            raise click.UsageError(f"give at most one of -p/--prompt and -f/--file (got {', '.join(given)})")
    elif system_prompt is not None:
        raise click.UsageError("-sys/--system-prompt needs -cnv (a system message is part of a conversation)")
    elif special:
        raise click.UsageError("-sp/--special needs -cnv (without it every token is printed as written)")
    elif len(given) != 1:
        raise click.UsageError("give exactly one of -p/--prompt, -f/--file and --tokens"
                               + (f" (got {', '.join(given)})" if given else ""))
    _refuse_ignored(ctx, temp, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, tokens)
    replay = _replay_flags(flags, conversation)
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
    if prompt is not None:
        try:
            prompt.encode("utf-8")  # bytes that are not UTF-8 on the command line arrive as lone surrogates
        except UnicodeEncodeError:
            raise click.BadParameter("the prompt is not valid UTF-8 text", param_hint="--prompt") from None
        if escape:
            prompt = process_escapes(prompt)
    path, _, opts = session_from_flags(pick_model(model, model_flag, hf_repo, hf_file, quiet=as_json), flags)
    if not as_json:
        warn_busy_threads(opts)
    _check_options(opts, conversation)
    if logits_out is not None:
        logits_out = check_output(logits_out, [path], "--logits-out")
    sampler = Sampler(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                      repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, seed=None if seed in (None, -1) else seed)
    ids = _token_ids(tokens) if tokens is not None else None
    cb, finish = progress_bar(not as_json)
    try:
        m = MoEModel(path, opts, progress=cb)
    finally:
        finish()
    if not as_json:
        for w in m.warnings:
            click.echo(f"warning: {w}", err=True)
    if conversation:
        from .conversation import converse

        with m:
            converse(m, sampler, n_predict, system_prompt, prompt, ignore_eos, sys.stdin, special)
        return
    with m:
        if ids is None:
            assert prompt is not None
            ids = m.tokenizer.encode(prompt)
            if not ids:
                raise click.BadParameter("the prompt encodes to no tokens", param_hint="--prompt")
        else:
            bad = [t for t in ids if not 0 <= t < m.hp.n_vocab]
            if bad:
                raise click.BadParameter(f"token id {bad[0]} is outside the vocabulary 0..{m.hp.n_vocab - 1}",
                                         param_hint="--tokens")
        st = GenerationStats()
        pieces: list[str] = []
        interrupted = False
        gen = generate(m, ids, n_predict, sampler, st, keep_logits=logits_out is not None, stop_at_eos=not ignore_eos,
                       speculator=_replay_speculator(replay, m, ids))
        try:
            for piece in gen:
                pieces.append(piece)
                if not as_json:
                    click.echo(piece, nl=False)
        except KeyboardInterrupt:
            ignore_interrupts()  # a second Ctrl-C must not cut the report of the first short
            interrupted = True
            gen.close()  # (the interrupt may have come while printing): its timings end here
            st.stop_reason = "interrupted"
        if logits_out is not None:
            _save_logits(logits_out, st.all_logits())
        report = run_report(m, st, "".join(pieces))
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo()
        click.echo(format_stats(report), err=True)
    if interrupted:
        ctx.exit(EXIT_INTERRUPTED)


def _refuse_ignored(ctx: click.Context, temp: float, repeat_penalty: float, repeat_last_n: int,
                    presence_penalty: float, frequency_penalty: float, tokens: str | None) -> None:
    """A sampling flag given where it cannot change a token is an error, not silently ignored."""
    if temp == 0:
        idle = [f for f, p in (("--top-k", "top_k"), ("--top-p", "top_p"), ("--min-p", "min_p"), ("--seed", "seed"))
                if explicit(ctx, p)]
        if idle:
            raise click.UsageError(f"{', '.join(idle)}: no effect with greedy decoding (--temp 0); give a --temp "
                                   "above 0 (or leave it out: 0.8, as llama.cpp)")
    penalizing = repeat_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0
    if explicit(ctx, "repeat_last_n") and not penalizing:
        raise click.UsageError("--repeat-last-n: no effect without --repeat-penalty, --presence-penalty or "
                               "--frequency-penalty")
    if penalizing and repeat_last_n == 0:
        raise click.UsageError("--repeat-last-n 0 turns the penalties off; drop the penalty or look back over "
                               "some tokens")
    if tokens is not None and explicit(ctx, "escape"):
        raise click.UsageError("-e/--no-escape: no effect with --tokens (escapes apply to prompt text)")


def _check_options(opts: SessionOptions, conversation: bool) -> None:
    if opts.n_parallel > 1:
        raise click.UsageError(f"n_parallel={opts.n_parallel}: `run` generates one sequence; several share a model "
                               "in `ggml-hybrid serve`, and `plan -np N` sizes their KV cache")
    if conversation and opts.spec_type != "none":
        raise click.UsageError(f"spec_type={opts.spec_type}: a conversation (-cnv) does not speculate; speculative "
                               "decoding runs in `run` without -cnv, `serve` and `bench`")


@dataclass
class _Replay:
    """``--draft-replay FILE --draft-accept P --draft-seed N``: FILE's tokens (a list, or a ``run --json`` report)."""

    data: list[int] | dict[str, Any]
    accept: float
    seed: int


def _replay_flags(flags: dict[str, Any], conversation: bool) -> _Replay | None:
    """Take the ``--draft-*`` flags out of ``flags``; a replay file turns ``spec_type=replay`` on."""
    path, accept, seed = flags.pop("draft_replay", None), flags.pop("draft_accept", None), flags.pop("draft_seed", None)
    data = _replay_file(path, accept, seed, conversation)
    if data is None:
        return None
    flags["session_options"] = tuple(flags.get("session_options") or ()) + ("spec_type=replay",)
    return _Replay(data, 1.0 if accept is None else accept, seed or 0)


def _replay_speculator(replay: _Replay | None, m: MoEModel, ids: list[int]) -> Speculator | None:
    if replay is None:
        return None
    from ..runtime.speculative import ReplayDrafts, Speculator

    data = replay.data
    known = data if isinstance(data, list) else list(ids) + [int(t) for t in data["tokens"]]
    return Speculator(m, ReplayDrafts(known, accept=replay.accept, seed=replay.seed))


def _replay_file(path: str | None, accept: float | None, seed: int | None,
                 conversation: bool) -> list[int] | dict[str, Any] | None:
    """``--draft-replay``'s token ids: a JSON list, or a ``run --json`` report (its ``tokens`` follow the prompt)."""
    if path is None:
        for flag, v in (("--draft-accept", accept), ("--draft-seed", seed)):
            if v is not None:
                raise click.UsageError(f"{flag} needs --draft-replay")
        return None
    if conversation:
        raise click.UsageError("--draft-replay does not go with -cnv (replayed drafts are a benchmark's)")
    from ..files import not_a_file

    why = not_a_file(path)
    if why is not None:
        raise click.BadParameter(f"{path!r} {why}", param_hint="--draft-replay")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise click.BadParameter(f"{path!r} is not a JSON file: {exc}", param_hint="--draft-replay") from None
    ids = data.get("tokens") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise click.BadParameter(f"{path!r}: expected a JSON list of token ids or a `run --json` report with "
                                 "\"tokens\"", param_hint="--draft-replay")
    return data if isinstance(data, dict) else ids


def _check_conversation(no_conversation: bool, tokens: str | None, as_json: bool, logits_out: str | None) -> None:
    if no_conversation:
        raise click.UsageError("-cnv and -no-cnv: choose one")
    for flag, given in (("--tokens", tokens), ("--json", as_json), ("--logits-out", logits_out)):
        if given:
            raise click.UsageError(f"{flag} does not go with -cnv (a conversation is text in the terminal)")


def _token_ids(tokens: str) -> list[int]:
    try:
        ids = [int(t) for t in tokens.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"{tokens!r} is not a comma-separated list of integers",
                                 param_hint="--tokens") from None
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--tokens")
    return ids


def _save_logits(path: str, logits: np.ndarray) -> None:
    """Written whole or not at all: a temporary file renamed over ``path`` (np.save would also add .npy)."""
    from ..files import atomic_write

    with atomic_write(os.fspath(path)) as f:
        np.save(f, logits)
