"""The ``ggml-hybrid`` command line: run, inspect, bench, demo.

Every user error (missing file, bad option, bad value) is one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys

import click
import numpy as np

from ..errors import GgmlHybridError
from ..options import OptionError, SessionOptions
from ..units import format_bytes


class _Group(click.Group):
    """Click's own usage errors, and ours, as one line and exit status 2."""

    def main(self, args=None, prog_name=None, **kw):
        try:
            rv = super().main(args=args, prog_name=prog_name or "ggml-hybrid", standalone_mode=False, **kw)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            sys.exit(2)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(2)
        except (GgmlHybridError, ValueError, OSError) as exc:
            click.echo(f"error: {' '.join(str(exc).split())}", err=True)
            sys.exit(2)
        sys.exit(rv or 0)


def _progress(enabled: bool):
    """A loading progress bar on a terminal; (callback, finish)."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    state = {}

    def cb(done, total):
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = click.progressbar(length=total, label="loading", file=sys.stderr)
            bar.__enter__()
        bar.update(done - bar.pos)

    def finish():
        if "bar" in state:
            state["bar"].__exit__(None, None, None)

    return cb, finish


# llama.cpp's layout flags, each shorthand for a session option
_LAYOUT_FLAGS = [
    (("-ot", "--override-tensor", "override_tensor"), dict(multiple=True, metavar="REGEX=DEVICE[,...]",
                                                           help="Tensor layout by regex (searched, first match wins).")),
    (("-ngl", "--n-gpu-layers", "n_gpu_layers"), dict(type=click.IntRange(-1), help="Layers on the devices; -1 = all.")),
    (("--cpu-moe", "cpu_moe"), dict(is_flag=True, default=None, help="All routed expert weights on the CPU.")),
    (("--n-cpu-moe", "n_cpu_moe"), dict(type=click.IntRange(0), help="Routed expert weights of the first N layers on the CPU.")),
    (("-nkvo", "--no-kv-offload", "no_kv_offload"), dict(is_flag=True, default=None,
                                                          help="KV cache in host memory, attention on the CPU.")),
    (("-ctk", "--cache-type-k", "cache_type_k"), dict(type=click.Choice(["f32", "f16", "q8_0"]))),
    (("-ctv", "--cache-type-v", "cache_type_v"), dict(type=click.Choice(["f32", "f16", "q8_0"]))),
    (("-c", "--ctx-size", "n_ctx"), dict(type=click.IntRange(0), help="Context size (0 = model's, at most 4096).")),
    (("-b", "--batch-size", "batch_size"), dict(type=click.IntRange(1))),
    (("-ub", "--ubatch-size", "ubatch_size"), dict(type=click.IntRange(1))),
    (("-fa", "--flash-attn", "flash_attn"), dict(is_flag=True, default=None)),
    (("-sm", "--split-mode", "split_mode"), dict(type=click.Choice(["layer", "none"]))),
    (("-ts", "--tensor-split", "tensor_split"), dict(help="Proportions of layers per device, e.g. 3,1.")),
]


def _layout_flags(fn):
    for decls, kw in reversed(_LAYOUT_FLAGS):
        fn = click.option(*decls, **kw)(fn)
    return fn


def _layout_items(values: dict) -> dict:
    out = {}
    for key, v in values.items():
        if key == "override_tensor":
            out[key] = ",".join(v) if v else None
        elif isinstance(v, bool):
            out[key] = "true" if v else None
        else:
            out[key] = v
    return out


def _options(items, role, base, explicit: dict) -> SessionOptions:
    shorthand = [f"{k}={v}" for k, v in explicit.items() if v is not None]
    return SessionOptions.parse(list(items) + shorthand, role=role, base=base)


def _resolve_model(model: str, config):
    """(path, role, base options) from a path or a config entry name/role."""
    import os

    from .config import load_config, pick

    if config is None:
        return model, None, None
    entry = pick(load_config(config), model)
    if entry is None:
        if os.path.exists(model):
            return model, None, None
        raise OptionError(f"model {model!r} is neither a file nor a model name or role in {config}")
    return entry.path, entry.role, entry.options


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ggml-hybrid", prog_name="ggml-hybrid")
def main():
    """Run Mixture-of-Experts GGUF models with experts on disk, in a device cache, or on the CPU."""


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


@main.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def inspect(model, as_json):
    """Architecture, experts, bytes per tensor class and quant types of MODEL (header only)."""
    from ..deploy.model_info import describe, format_text

    d = describe(model)
    click.echo(json.dumps(d) if as_json else format_text(d))


@main.command()
@click.argument("model")
@click.option("--a", "a_opts", default="", help="Session options of side A: 'key=value key=value' (or commas).")
@click.option("--b", "b_opts", default="", help="Session options of side B.")
@click.option("--runs", default=4, show_default=True, type=click.IntRange(1), help="Blocks of A,B,B,A.")
@click.option("-n", "--n-predict", default=16, show_default=True, type=click.IntRange(2))
@click.option("--config", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True)
def bench(model, a_opts, b_opts, runs, n_predict, config, as_json):
    """Time two session configurations of MODEL side by side in one process."""
    from .abbench import ab_bench, format_table

    path, role, base = _resolve_model(model, config)
    split = lambda s: [x for x in s.replace(",", " ").split() if x]
    a = SessionOptions.parse(split(a_opts), role=role, base=base)
    b = SessionOptions.parse(split(b_opts), role=role, base=base)
    r = ab_bench(path, a, b, runs=runs, n_predict=n_predict)
    click.echo(json.dumps(r) if as_json else format_table(r))


@main.command()
@click.option("-n", "--n-predict", default=24, show_default=True, type=click.IntRange(1))
@click.option("--threads", "-t", type=click.IntRange(1, 512))
@click.option("--json", "as_json", is_flag=True)
def demo(n_predict, threads, as_json):
    """Generate a small MoE model and run it resident, cached and hybrid; check the logits agree."""
    from .demo import format_demo, run_demo

    r = run_demo(n_predict=n_predict, n_threads=threads, echo=(lambda s: None) if as_json else click.echo)
    click.echo(json.dumps(r) if as_json else format_demo(r))
    if not r["all_identical"]:
        sys.exit(1)


@main.command()
@click.argument("model")
@click.option("--vram", help="Device memory, one size per device: 24G or 80G,80G (plans for CUDA0, CUDA1, ...).")
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


@main.command()
@click.option("--virtual-devices", type=click.IntRange(1, 16), help="Without a GPU: CPU instances playing devices.")
@click.option("--json", "as_json", is_flag=True)
def devices(virtual_devices, as_json):
    """The device names that layout options accept (CUDA0, ... or DEV0, ... and CPU)."""
    from ..deploy.devices import describe_devices

    opts = SessionOptions(virtual_devices=virtual_devices) if virtual_devices else SessionOptions()
    rows = describe_devices(opts)
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        mem = f", {format_bytes(r['memory_total'])}" if r["memory_total"] else ""
        click.echo(f"{r['name']:<6} {r['kind']:<13} {r['description']}{mem}")


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


if __name__ == "__main__":  # pragma: no cover
    main()
