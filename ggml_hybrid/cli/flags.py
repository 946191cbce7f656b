"""What the commands share: the model argument, one set of session and layout flags, argument checks.

``run``, ``plan`` and ``bench`` (and any later command that loads a model) take the same flags,
with llama.cpp's names and meanings (``common/arg.cpp`` of the pinned llama.cpp), each a shorthand
for a session option (``ggml-hybrid options``). A flag and ``-o KEY=VALUE`` for the same option
with different values is an error, as is one flag given twice with different values; a flag that
llama.cpp has but that would do nothing here is refused with the reason, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, get_args

import click

from ..errors import OptionError
from ..options import MAX_DEVICES, MAX_DRAFT, EvictionPolicy, KVCacheType, SessionOptions, SplitMode
from ..runtime.sampling import LLAMA_DEFAULTS
from ..server.config import load_config, pick

SEED_MAX = 2**32 - 1

# -- the model: a positional argument or -m/--model, as llama.cpp users type it ------------------


def model_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("-hff", "--hf-file", "hf_file", metavar="FILE", help=(
        "The file of the -hf repository to use, instead of choosing one by quant tag."))(fn)
    fn = click.option("-hf", "-hfr", "--hf-repo", "hf_repo", metavar="REPO[:QUANT]", help=(
        "The model from the Hugging Face Hub: OWNER/NAME, optionally with a quant tag (default Q4_K_M, then Q8_0, "
        "then the first GGUF), downloaded into the hub cache, as llama.cpp's -hf."))(fn)
    fn = click.option("-m", "--model", "model_flag", metavar="FNAME",
                      help="The model: a GGUF file, or a model name or role in --config (or give it as MODEL).")(fn)
    return click.argument("model", required=False)(fn)


def check_model_args(model: str | None, model_flag: str | None, hf_repo: str | None = None,
                     hf_file: str | None = None) -> str:
    """The one model argument given (MODEL, -m or -hf), checked without downloading anything."""
    given = [(f, v) for f, v in (("MODEL", model), ("-m/--model", model_flag), ("-hf", hf_repo)) if v is not None]
    if len(given) > 1:
        raise click.UsageError("give the model once: " + " or ".join(f"as {f} ({v!r})" for f, v in given))
    if hf_file is not None and hf_repo is None:
        raise click.UsageError(f"--hf-file {hf_file!r} names a file of a Hugging Face repository: give -hf REPO too")
    if not given:
        raise click.UsageError("missing the model: give MODEL, -m/--model FNAME or -hf REPO[:QUANT]")
    return given[0][1]


def pick_model(model: str | None, model_flag: str | None, hf_repo: str | None = None, hf_file: str | None = None,
               *, quiet: bool = False) -> str:
    """The model path from MODEL, -m or -hf (downloaded first, with a progress bar unless ``quiet``)."""
    chosen = check_model_args(model, model_flag, hf_repo, hf_file)
    if hf_repo is not None:
        from .hub import fetch

        return fetch(hf_repo, hf_file, progress=not quiet, note=None if quiet else lambda s: click.echo(s, err=True))
    return chosen


def resolve_model(model: str, config: str | None) -> tuple[str, str | None, SessionOptions | None]:
    """(path, role, base options) from a path or a config entry name/role."""
    if config is None:
        return model, None, None
    entry = pick(load_config(config), model)
    if entry is None:
        if os.path.exists(model):
            return model, None, None
        raise OptionError(f"model {model!r} is neither a file nor a model name or role in {config}")
    return entry.path, entry.role, entry.options


# -- the session flags -------------------------------------------------------------------------------


def _unsupported(flag: str, why: str) -> Callable[[Any], str]:
    def conv(value: Any) -> str:
        raise click.UsageError(f"{flag} is not supported by ggml-hybrid: {why}")
    return conv


def _threads(value: int) -> str | None:
    return None if value <= 0 else str(value)  # llama.cpp: N <= 0 means its default (all cores; here the idle ones)


def _on_off_auto(value: str) -> str:
    return {"on": "true", "off": "false", "auto": "auto"}[value]


def _ngl(value: str) -> str:
    v = value.strip().lower()
    if v == "all":
        return "-1"
    if v == "auto":
        raise click.UsageError("-ngl auto (fit the layers to free device memory) is not supported by ggml-hybrid; "
                               "give a number or 'all', and see `ggml-hybrid plan --vram ...` for a layout that fits")
    try:
        n = int(v)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number, 'all' or 'auto'", param_hint="-ngl") from None
    return str(n)


# llama.cpp's -sm modes that split a layer's weights across devices: known, refused with a reason
_SPLIT_UNSUPPORTED = ("row", "tensor")


def _split_mode(value: str) -> str:
    if value in _SPLIT_UNSUPPORTED:
        raise click.UsageError(f"-sm {value} (weights split across devices by rows) is not supported by ggml-hybrid; "
                               "use -sm layer or -sm none")
    return value


def _device(value: str) -> str:
    if value.strip().lower() == "none":
        raise click.UsageError("-dev none (no device) is not supported by ggml-hybrid, which always has a device "
                               "(a GPU, or a CPU instance playing one); use -ngl 0 to keep every layer on the CPU")
    return value


# llama.cpp's --spec-type names (common/speculative.cpp) that ggml-hybrid does not run, and why
_SPEC_TYPES_ELSEWHERE = {
    "draft-simple": "a separate draft model (-md) is not supported; draft-mtp drafts with the model's own head",
    "draft-eagle3": "EAGLE-3 draft heads are not supported; draft-mtp drafts with the model's own head",
    "draft-dflash": "DFlash drafts are not supported; draft-mtp drafts with the model's own head",
    "draft-dspark": "DSpark drafts are not supported; draft-mtp drafts with the model's own head",
    "ngram-simple": "n-gram drafts are not supported; draft-mtp drafts with the model's own head",
    "ngram-map-k": "n-gram drafts are not supported; draft-mtp drafts with the model's own head",
    "ngram-map-k4v": "n-gram drafts are not supported; draft-mtp drafts with the model's own head",
    "ngram-mod": "n-gram drafts are not supported; draft-mtp drafts with the model's own head",
    "ngram-cache": "n-gram drafts are not supported; draft-mtp drafts with the model's own head",
}


def _spec_type(value: str) -> str:
    """``--spec-type``: llama.cpp's comma-separated list; here one of none and draft-mtp."""
    names = [x.strip() for x in value.split(",") if x.strip()] or [""]
    for n in names:
        if n in _SPEC_TYPES_ELSEWHERE:
            raise click.UsageError(f"--spec-type {n} is not supported by ggml-hybrid: {_SPEC_TYPES_ELSEWHERE[n]}")
        if n not in ("none", "draft-mtp"):
            raise click.UsageError(f"--spec-type {n!r}: not a speculative decoding type; ggml-hybrid runs none and "
                                   "draft-mtp (replayed drafts, for benchmarks: --draft-replay)")
    kinds = set(names) - {"none"}
    return "draft-mtp" if kinds else "none"


def _load_mode(value: str) -> str | None:
    if value in ("auto", "mmap"):
        return None  # what ggml-hybrid always does
    return _unsupported(f"-lm {value}", "the model is always memory-mapped (CPU-placed tensors and disk experts are "
                        "used in place from the mapping); auto and mmap are accepted")(value)


class _SlotsType(click.ParamType):
    """``--expert-cache-slots``: an integer >= 1 or ``auto`` (the free device memory decides)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return click.IntRange(1).convert(value, param, ctx)


@dataclass(frozen=True)
class Flag:
    """One session flag: click's declarations (the dest last) and settings, the option it sets."""

    decls: tuple[str, ...]
    key: str | None  # the session option; None: a flag refused by ``convert``
    kwargs: dict[str, Any] = field(default_factory=dict)
    convert: Callable[[Any], str | None] = str  # click's value -> the option's text (None: leave the default)
    implies: tuple[str, ...] = ()  # key=value items the flag implies (when it sets a value)

    @property
    def dest(self) -> str:
        return self.decls[-1]


# the choices of the options' Literal types (options.py), the one list of each
_KV_TYPES = click.Choice(get_args(KVCacheType))

SESSION_FLAGS: tuple[Flag, ...] = (
    Flag(("-t", "--threads", "threads"), "n_threads", dict(type=int, metavar="N", help=(
        "CPU threads for single-token steps and the CPU share (default: one per core other processes leave idle, "
        "measured at load; N <= 0 = that default).")), _threads),
    Flag(("-tb", "--threads-batch", "threads_batch"), "n_threads_batch", dict(type=int, metavar="N", help=(
        "CPU threads for the prompt (batches of several tokens) (default: as -t).")), _threads),
    Flag(("--poll", "poll"), "poll", dict(type=click.IntRange(0, 100), metavar="0..100", help=(
        "How long idle CPU threads spin for work before they sleep (default 0: they sleep at once; llama.cpp: 50)."
    ))),
    Flag(("--repack", "repack"), "repack", dict(is_flag=True, default=None, help=(
        "Repack CPU weights for GGML's faster CPU kernels where the type allows (the default).")),
        lambda v: "true" if v else None),
    Flag(("-nr", "--no-repack", "no_repack"), "repack", dict(is_flag=True, default=None, help=(
        "Keep CPU weights as in the file (no repacking).")), lambda v: "false" if v else None),
    Flag(("-c", "--ctx-size", "--ctx", "ctx_size"), "n_ctx", dict(type=click.IntRange(0), metavar="N", help=(
        "Context size, KV cache cells (default 0: the model's, at most 4096)."))),
    Flag(("-np", "--parallel", "parallel"), "n_parallel", dict(type=click.IntRange(1, 256), metavar="N", help=(
        "Sequences held at once, each with its own -c cells (llama.cpp splits -c among them) (default 1)."))),
    Flag(("-b", "--batch-size", "batch_size"), "batch_size", dict(type=click.IntRange(1), metavar="N", help=(
        "Logical batch: most tokens handed to one eval step (default 2048)."))),
    Flag(("-ub", "--ubatch-size", "ubatch_size"), "ubatch_size", dict(type=click.IntRange(1), metavar="N", help=(
        "Physical batch: most tokens in one graph computation; sizes the compute buffers (default 512)."))),
    Flag(("-ctk", "--cache-type-k", "cache_type_k"), "cache_type_k", dict(type=_KV_TYPES, help=(
        "KV cache type of K (default f16)."))),
    Flag(("-ctv", "--cache-type-v", "cache_type_v"), "cache_type_v", dict(type=_KV_TYPES, help=(
        "KV cache type of V (default f16); q8_0 needs -fa on."))),
    Flag(("-fa", "--flash-attn", "flash_attn"), "flash_attn", dict(
        type=click.Choice(["on", "off", "auto"]), help=(
            "Fused flash attention: on, off, or auto = on where the backends support it (default off)."
        )), _on_off_auto),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers", "n_gpu_layers"), "n_gpu_layers", dict(metavar="N|all", help=(
        "Repeating layers on the devices, the last ones first, the output head counting as one more (default all)."
    )), _ngl),
    Flag(("-ot", "--override-tensor", "override_tensor"), "override_tensor", dict(
        multiple=True, metavar="REGEX=DEVICE[,...]", help="Tensor layout by regex (searched, first match wins)."),
        lambda v: ",".join(v) if v else None),
    Flag(("-cmoe", "--cpu-moe", "cpu_moe"), "cpu_moe", dict(is_flag=True, default=None, help=(
        "All routed expert weights on the CPU.")), lambda v: "true" if v else None),
    Flag(("-ncmoe", "--n-cpu-moe", "n_cpu_moe"), "n_cpu_moe", dict(type=click.IntRange(0), metavar="N", help=(
        "Routed expert weights of the first N layers on the CPU."))),
    Flag(("-nkvo", "--no-kv-offload", "no_kv_offload"), "no_kv_offload", dict(is_flag=True, default=None, help=(
        "KV cache in host memory, attention on the CPU.")), lambda v: "true" if v else None),
    Flag(("-sm", "--split-mode", "split_mode"), "split_mode", dict(
        type=click.Choice([*get_args(SplitMode), *_SPLIT_UNSUPPORTED]), help=(
            "How layers spread over several devices: layer (default) or none (row, tensor: not supported)."
        )), _split_mode),
    Flag(("-ts", "--tensor-split", "tensor_split"), "tensor_split", dict(metavar="N0,N1,...", help=(
        "Proportions of the offloaded layers per device, e.g. 3,1."))),
    Flag(("-dev", "--device", "device"), "devices", dict(metavar="DEV1,DEV2,...", help=(
        "The devices to use, in order (see `ggml-hybrid devices`).")), _device),
    Flag(("--rpc", "rpc"), "rpc", dict(metavar="HOST:PORT[,...]", help=(
        "RPC servers (ggml-hybrid rpc-server) whose devices to use, named RPC0, RPC1, ... before any GPU."))),
    Flag(("--rpc-timeout", "rpc_timeout"), "rpc_timeout", dict(type=int, metavar="SECONDS", help=(
        "Seconds an RPC server may take to connect, take a message or reply before the run gives up "
        "(default 120; 0 = no limit)."))),
    Flag(("--check-tensors", "check_tensors"), "check_tensors", dict(is_flag=True, default=None, help=(
        "Check every weight for NaN/inf at load, as llama.cpp's --check-tensors.")), lambda v: "true" if v else None),
    Flag(("--virtual-devices", "virtual_devices"), "virtual_devices", dict(
        type=click.IntRange(1, MAX_DEVICES), metavar="N", help="Without a GPU: N CPU instances play devices.")),
    Flag(("--disk-experts", "disk_experts"), "disk_experts", dict(is_flag=True, default=None, help=(
        "Routed experts stay on disk (the mapped file) and stream into a device cache.")),
        lambda v: "true" if v else None),
    Flag(("--expert-cache-slots", "expert_cache_slots"), "expert_cache_slots", dict(
        type=_SlotsType(), metavar="N|auto", help=(
            "Expert cache slots per layer (implies --disk-experts); auto: as many as the free device memory holds "
            "after the dense weights, KV cache and compute buffers, less a margin (`plan` shows the choice).")),
        implies=("disk_experts=true",)),
    Flag(("--expert-eviction", "expert_eviction"), "expert_eviction", dict(
        type=click.Choice(get_args(EvictionPolicy)), help="Expert cache victim order (default freq).")),
    Flag(("--moe-cpu-share", "moe_cpu_share"), "moe_cpu_share", dict(metavar="X|auto", help=(
        "Share of the cache misses the CPU runs: a number in [0, 1] or auto (a non-zero share implies "
        "--disk-experts)."))),
    Flag(("--host-tier", "--host-cache", "host_tier"), "host_tier_bytes", dict(metavar="SIZE|auto", help=(
        "Host-RAM expert tier between the expert cache and the file: whole experts read from the GGUF by I/O "
        "threads (O_DIRECT where allowed), at most SIZE (e.g. 8G); auto = the memory available less a margin "
        "(implies --disk-experts; needs --expert-cache-slots, but where a CPU playing the device computes straight "
        "from the tier: no CPU share, experts it does not repack). --host-cache is the same flag.")),
         implies=("disk_experts=true",)),
    Flag(("--spec-type", "spec_type"), "spec_type", dict(metavar="TYPE", help=(
        "Speculative decoding: draft-mtp = drafts from the model's own next-token-prediction head, verified in one "
        "step through the expert cache; none (default). Greedy output is unchanged.")), _spec_type),
    Flag(("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", "draft_max"), "draft_max", dict(
        type=click.IntRange(1, MAX_DRAFT), metavar="N", help="Most draft tokens per verify step (default 3).")),
    Flag(("--spec-draft-n-min", "--draft-min", "--draft-n-min", "draft_min"), "draft_min", dict(
        type=click.IntRange(0, MAX_DRAFT), metavar="N", help=(
            "Drafts shorter than this are dropped (default 0)."))),
    Flag(("--spec-draft-p-min", "--draft-p-min", "draft_p_min"), "draft_p_min", dict(
        type=click.FloatRange(0, 1), metavar="P", help=(
            "Drafting stops at a token the head gives less than this probability among its top 10 (default 0)."))),
    Flag(("-lm", "--load-mode", "load_mode"), None, dict(
        type=click.Choice(["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]), help=(
            "Model loading: auto and mmap (the default) only; the file is always memory-mapped.")), _load_mode),
    Flag(("--no-mmap", "no_mmap"), None, dict(is_flag=True, default=None, hidden=True),
         _unsupported("--no-mmap", "the model is always memory-mapped (CPU-placed tensors and disk experts are used "
                      "in place from the mapping)")),
    Flag(("--mlock", "mlock"), None, dict(is_flag=True, default=None, hidden=True),
         _unsupported("--mlock", "locking the mapped model in RAM is not implemented; the page cache keeps what is "
                      "used")),
    Flag(("-mg", "--main-gpu", "main_gpu"), None, dict(hidden=True),
         _unsupported("-mg", "choose the device with -dev (with -sm none the first device given is used)")),
)

SESSION_DESTS = frozenset(f.dest for f in SESSION_FLAGS) | {"session_options", "config"}


def session_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The shared session flags, ``-o KEY=VALUE`` and ``--config`` as options of a command."""
    for f in reversed(SESSION_FLAGS):
        fn = click.option(*f.decls, **f.kwargs)(fn)
    fn = click.option("--config", type=click.Path(dir_okay=False), help=(
        "TOML file of models and their session options; MODEL may be a name or role in it."))(fn)
    return click.option("-o", "--session-option", "session_options", multiple=True, metavar="[ROLE.]KEY=VALUE",
                        help="A session option; repeatable. See `ggml-hybrid options`.")(fn)


def flag_items(values: dict[str, Any]) -> list[str]:
    """The ``key=value`` items the session flags in ``values`` (by dest) stand for."""
    items = []
    for f in SESSION_FLAGS:
        v = values.get(f.dest)
        if v is None or v == () or v is False:
            continue
        text = f.convert(v)
        if text is None or f.key is None:
            continue
        items.append(f"{f.key}={text}")
        items.extend(f.implies)
        if f.key == "moe_cpu_share" and not _is_zero(text):
            items.append("disk_experts=true")  # a CPU share of cache misses needs the cache
    return items


def _is_zero(text: str) -> bool:
    try:
        return float(text) == 0.0
    except ValueError:
        return False


class Session(NamedTuple):
    path: str
    role: str | None
    options: SessionOptions


def session_items(values: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(--config, the ``key=value`` items of -o and the session flags), popped from ``values``."""
    shared = {k: values.pop(k) for k in list(values) if k in SESSION_DESTS}
    return shared["config"], _dedupe(list(shared["session_options"]) + flag_items(shared))


def session_from_flags(model: str, values: dict[str, Any]) -> Session:
    """(model path, role, options) from the model argument and the shared flags (popped from ``values``)."""
    flags = {k: values.get(k) for k in ("batch_size", "ubatch_size")}
    config, items = session_items(values)
    path, role, base = resolve_model(model, config)
    return Session(path, role, clamp_ubatch(SessionOptions.parse(items, role=role, base=base), flags))


def clamp_ubatch(opts: SessionOptions, flags: dict[str, Any]) -> SessionOptions:
    """``-ub`` above ``-b`` is clamped to ``-b`` with a warning, as llama.cpp does (a physical batch cannot be larger
    than the logical one); ``flags``: the flags' values (by dest). Set through ``-o``/a config file, the same is an
    error naming both options (the options are taken as written)."""
    if opts.ubatch_size <= opts.batch_size or (flags.get("ubatch_size") is None and flags.get("batch_size") is None):
        return opts
    click.echo(f"warning: -ub {opts.ubatch_size} is larger than -b {opts.batch_size}: using -ub {opts.batch_size} "
               "(as llama.cpp)", err=True)
    return dataclasses.replace(opts, ubatch_size=opts.batch_size)


def flags_for(items: list[str]) -> list[str]:
    """The command-line flags that stand for ``key=value`` session items (``-o key=value`` where none does):
    a plan's options as the user types them."""
    keys = {x.split("=", 1)[0] for x in items}
    out: list[str] = []
    for item in items:
        key, _, value = item.partition("=")
        if key == "disk_experts" and value == "true" and "expert_cache_slots" in keys:
            continue  # implied by --expert-cache-slots
        flag = next((f for f in SESSION_FLAGS if f.key == key and _converts(f, value)), None)
        if flag is None:
            out += ["-o", item]
        elif flag.kwargs.get("is_flag"):
            out.append(flag.decls[0])
        else:
            out += [flag.decls[0], str(_example(flag, value))]
    return out


def _converts(flag: Flag, value: str) -> bool:
    """Whether ``flag`` given its own spelling of ``value`` sets the option to ``value``."""
    try:
        return flag.convert(_example(flag, value)) == value
    except (click.ClickException, ValueError, TypeError):
        return False


def _example(flag: Flag, value: str) -> Any:
    """The flag's own value for the option text ``value`` (``-fa on`` for flash_attn=true)."""
    if flag.kwargs.get("is_flag"):
        return True
    if flag.convert is _on_off_auto:
        return {"true": "on", "false": "off", "auto": "auto"}.get(value, value)
    if flag.kwargs.get("type") is int or isinstance(flag.kwargs.get("type"), click.IntRange):
        return int(value)
    return value


def warn_busy_threads(opts: SessionOptions) -> None:
    """A warning on stderr when ``-t`` asks for more threads than other processes leave cores idle: GGML's
    threads meet at a barrier after every op, so one sharing its core with a busy process stalls all of them
    (decode many times slower). The default thread count (no ``-t``) is one per idle core, so it is never warned."""
    from ..machine import IDLE_FRACTION, idle_cores, usable_cores

    n = opts.n_threads
    if not n:
        return
    idle = idle_cores()
    if idle is None:
        return
    most = max(1, math.floor(idle + (1 - IDLE_FRACTION)))
    if n <= most:
        return
    click.echo(f"warning: -t {n}: only {idle:.1f} of {usable_cores()} cores are idle (other processes use the rest); "
               "a thread that shares its core with them stalls every other thread at each op, so this can run many "
               "times slower than fewer threads: leave -t out (one thread per idle core) or give at most "
               f"{most}", err=True)


def _dedupe(items: list[str]) -> list[str]:
    """An implied item repeated by two flags (disk_experts=true) is one item."""
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


# -- sampling -------------------------------------------------------------------------------------------

# (declarations, the sampler's name, click type, help) of llama.cpp's sampling flags
_SAMPLING: tuple[tuple[tuple[str, ...], str, Any, str], ...] = (
    (("--temp", "--temperature", "temp"), "temperature", click.FloatRange(0), "Temperature; 0 = greedy"),
    (("--top-k", "top_k"), "top_k", click.IntRange(0), "Top-k (0 = off)"),
    (("--top-p", "top_p"), "top_p", click.FloatRange(0, 1, min_open=True), "Top-p (1 = off)"),
    (("--min-p", "min_p"), "min_p", click.FloatRange(0, 1), "Min-p (0 = off)"),
    (("--repeat-penalty", "repeat_penalty"), "repeat_penalty", click.FloatRange(0, min_open=True),
     "Penalize the last --repeat-last-n tokens (1 = off)"),
    (("--repeat-last-n", "repeat_last_n"), "repeat_last_n", click.IntRange(0),
     "Tokens the penalties look back over (0 = penalties off)"),
    (("--presence-penalty", "presence_penalty"), "presence_penalty", float, "Presence penalty (0 = off)"),
    (("--frequency-penalty", "frequency_penalty"), "frequency_penalty", float, "Frequency penalty (0 = off)"),
)
SAMPLING_DESTS = tuple(d[-1] for d, _, _, _ in _SAMPLING)


def sampling_flags(defaults: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """llama.cpp's sampling flags, ``--ignore-eos``, ``-s/--seed`` and ``-n/--predict``, defined once: ``run``
    takes them with llama.cpp's defaults (``defaults``); ``serve`` without (a flag not given leaves each request's
    own default)."""
    where = "" if defaults else " for requests that give none (default: each request's own, llama-server's)"

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for decls, name, kind, text in reversed(_SAMPLING):
            fn = click.option(*decls, type=kind, default=LLAMA_DEFAULTS[name] if defaults else None,
                              show_default=defaults, help=text + where + ".")(fn)
        fn = click.option("--ignore-eos", is_flag=True, help=(
            "Generate past end-of-generation tokens" + where + "."))(fn)
        fn = click.option("-s", "--seed", type=click.IntRange(-1, SEED_MAX), help=(
            "Sampling seed (default -1 = random); with --temp > 0" + where + "."))(fn)
        return click.option("-n", "--predict", "--n-predict", "n_predict", default=-1 if defaults else None,
                            show_default=defaults, type=click.IntRange(-1), help=(
                                "Tokens to generate; -1 = until end of generation or a full context (as llama.cpp)"
                                + where + "."))(fn)
    return deco


# -- argument checks click does not make -----------------------------------------------------------


def _looks_negative_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def check_args(command: click.Command, args: list[str]) -> None:
    """Refuse what click would misread or silently last-win.

    Click reads an undeclared ``-cnv`` as ``-c nv`` and ``-tb2`` as ``-t b2``; llama.cpp has no
    attached short values, so a single-dash word that is no declared flag is an unknown option.
    One flag (or two spellings of it, ``-c``/``--ctx``) given twice with different values is an error.
    """
    names: dict[str, click.Option] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for o in [*param.opts, *param.secondary_opts]:
                names[o] = param
    seen: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-" or _looks_negative_number(arg):
            continue
        name, eq, attached = arg.partition("=")
        p = names.get(name)
        if p is None:
            if not arg.startswith("--") and len(arg) > 2:
                raise click.NoSuchOption(arg, message=f"No such option: {arg} (values follow their flag as a "
                                                      "separate argument, e.g. -c 512)")
            continue  # click reports it
        if p.is_flag or p.count:
            continue
        if eq:
            value = attached
        elif i < len(args):
            value = args[i]
            i += 1
        else:
            continue  # click reports the missing value
        if p.multiple or p.name is None:
            continue
        prev = seen.get(p.name)
        if prev is not None and prev[1] != value:
            raise click.UsageError(f"{prev[0]} {_shown(prev[1])} and {name} {_shown(value)}: one option given twice "
                                   "with different values")
        seen[p.name] = (name, value)


def _shown(value: str) -> str:
    """A flag's value as typed (``512``), quoted when it holds spaces, quotes or unprintable characters."""
    plain = value.isprintable() and value != "" and not any(c.isspace() or c in "'\"\\" for c in value)
    return value if plain else repr(value)


class Command(click.Command):
    """A command whose arguments pass :func:`check_args` before click parses them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        check_args(self, args)
        return super().parse_args(ctx, args)


def explicit(ctx: click.Context, name: str) -> bool:
    """Whether the parameter ``name`` was given on the command line (not a default)."""
    src = ctx.get_parameter_source(name)
    return src is not None and src.name not in ("DEFAULT", "DEFAULT_MAP")


# -- progress --------------------------------------------------------------------------------------


def progress_bar(enabled: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A loading progress bar on a terminal; (callback, finish)."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    state: dict[str, Any] = {}

    def cb(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = click.progressbar(length=total, label="loading", file=sys.stderr)
            bar.__enter__()
        bar.update(done - bar.pos)

    def finish() -> None:
        if "bar" in state:
            state["bar"].__exit__(None, None, None)

    return cb, finish
