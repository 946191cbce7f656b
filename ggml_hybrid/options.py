"""Typed, documented session options, read from ``key=value`` items or a flat config mapping.

A key is bare (``n_threads=4``: every role) or role-scoped (``draft.n_threads=2``: only
the session whose role is ``draft``). Precedence, lowest first: the base options (the
defaults unless given), bare keys, role-scoped keys, then ``merged(**explicit)``.
Everything is validated before anything is returned, including keys scoped to other
roles, so a typo is reported whichever session reads the config first.
``SessionOptions.describe()`` lists every field for docs generation.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union, cast, get_args

from ._native import lib
from .errors import OptionError
from .ggml.backend import THREADS_PER_CORE, max_threads
from .ggml.rpc import endpoint_list
from .units import parse_size

__all__ = ["MAX_DRAFT", "EvictionPolicy", "ExecutorKind", "KVCacheType", "OptionError", "SessionOptions", "SpecType",
           "SplitMode"]

# a GGML scheduler takes at most GGML_SCHED_MAX_BACKENDS backends, the host CPU included
MAX_DEVICES: int = lib.HY_MAX_INSTANCES
_ROLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_INT_RE = re.compile(r"[+-]?[0-9]+")  # int() alone also takes "1_000" and non-ASCII digits
_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_BOOL_RULE = "a boolean (true/false, 1/0, yes/no, on/off)"
# one rule for thread counts, the CPU backend's own (ggml.backend.max_threads)
_THREADS_RULE = f"an integer in 1..{max_threads()} ({THREADS_PER_CORE} x the cores) or none"



class _Bad(Exception):
    """A converter rejected a value; ``_convert`` adds the key, the value and the rule."""


def _typed(v: Any, *types: type) -> None:
    # bool subclasses int, but ``n_threads: true`` in a config is a mistake, not 1
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise _Bad(f"got {type(v).__name__}")


def _share(v: Any) -> Union[float, str]:
    if isinstance(v, str):
        if v.strip().lower() == "auto":
            return "auto"
        try:
            v = float(v)
        except ValueError:
            raise _Bad() from None
    else:
        _typed(v, int, float)
        try:
            v = float(v)
        except OverflowError:  # an int beyond float range
            raise _Bad() from None
    if not 0.0 <= v <= 1.0:  # also rejects nan and inf
        raise _Bad()
    return cast(float, v) + 0.0  # folds -0.0 into 0.0 so equal options print alike


def _slots(v: Any) -> Union[int, str]:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    return cast(int, _int(0)(v))


def _int(lo: int, hi: Optional[int] = None, nullable: bool = False) -> Callable[[Any], Optional[int]]:
    def conv(v: Any) -> Optional[int]:
        if nullable and (v is None or isinstance(v, str) and v.strip().lower() in ("", "none")):
            return None
        if isinstance(v, str):
            if not _INT_RE.fullmatch(v.strip()):
                raise _Bad()
            try:
                v = int(v)
            except ValueError:  # past the interpreter's int-from-string digit limit
                raise _Bad() from None
        else:
            _typed(v, int)
        if v < lo or (hi is not None and v > hi):
            raise _Bad()
        return cast(int, v)
    return conv


def _bool(v: Any) -> bool:
    if isinstance(v, str) and v.strip().lower() in _BOOLS:
        return _BOOLS[v.strip().lower()]
    if isinstance(v, str):
        raise _Bad()
    _typed(v, bool)
    return cast(bool, v)


def _unit(v: Any) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise _Bad() from None
    else:
        _typed(v, int, float)
        v = float(v)
    if not 0.0 <= v <= 1.0:  # also rejects nan
        raise _Bad()
    return cast(float, v) + 0.0


def _bool_or_auto(v: Any) -> Union[bool, str]:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    return _bool(v)


def _size_or_auto(v: Any) -> Union[int, str]:
    if isinstance(v, str):
        if v.strip().lower() == "auto":
            return "auto"
        try:
            return parse_size(v)
        except OptionError:
            raise _Bad() from None
    _typed(v, int)
    if v < 0:
        raise _Bad()
    return cast(int, v)


_DEVICE_RE = re.compile(r"(RPC|CUDA|Vulkan|DEV)[0-9]+")


def device_list(text: Optional[str]) -> list[str]:
    """``"CUDA1,CUDA0"`` -> ["CUDA1", "CUDA0"]: device names, each once."""
    names = [x.strip() for x in (text or "").split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise _Bad("device names separated by commas, each once")
    for n in names:
        if not _DEVICE_RE.fullmatch(n):
            raise _Bad(f"{n!r} is not a device name (RPC0, ..., CUDA0, ..., Vulkan0, ... or DEV0, ...; the host is "
                       "always used)")
    return names


def _device_list(v: Any) -> Optional[str]:
    text = _text(v)
    if text is None:
        return None
    return ",".join(device_list(text))


# the options whose value is one of a few names: each Literal is the one list of its names
EvictionPolicy = Literal["freq", "lru", "lfu"]
KVCacheType = Literal["f32", "f16", "q8_0"]
SplitMode = Literal["layer", "none"]
ExecutorKind = Literal["native", "python"]
# speculative decoding: none, the model's own next-token-prediction head (llama.cpp's --spec-type draft-mtp), or
# drafts replayed from a given token sequence (benchmarks and tests only)
SpecType = Literal["none", "draft-mtp", "replay"]
MAX_DRAFT = 64  # most draft tokens per verify step (llama.cpp's --spec-draft-n-max takes any; 3 by default)


def _choice(choices: Any) -> Callable[[Any], str]:
    names = get_args(choices)

    def conv(v: Any) -> str:
        _typed(v, str)
        if v.strip().lower() not in names:
            raise _Bad()
        return cast(str, v.strip().lower())
    return conv


def _one_of(choices: Any) -> str:
    """The rule text of a choice option: ``one of 'a', 'b'``."""
    return "one of " + ", ".join(repr(n) for n in get_args(choices))


def _path(v: Any) -> Optional[str]:
    if v is None or (isinstance(v, str) and v.lower() in ("", "none")):
        return None
    _typed(v, str)
    return cast(str, v)  # not stripped: a path may legitimately end in a space


def _text(v: Any) -> Optional[str]:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
        return None
    _typed(v, str)
    return cast(str, v.strip())


def override_items(text: Optional[str]) -> list[tuple[str, re.Pattern[str], str]]:
    """``"re1=DEV,re2=DEV"`` -> [(pattern, compiled, device)], in order (llama.cpp's -ot syntax)."""
    out = []
    for item in (x.strip() for x in (text or "").split(",")):
        if not item:
            continue
        pattern, sep, dev = item.rpartition("=")
        if not sep or not pattern or not dev.strip():
            raise _Bad(f"item {item!r} is not REGEX=DEVICE")
        try:
            out.append((pattern, re.compile(pattern), dev.strip()))
        except re.error as exc:
            raise _Bad(f"{pattern!r} is not a valid regular expression: {exc}") from None
    return out


def _overrides(v: Any) -> Optional[str]:
    text = _text(v)
    override_items(text)
    return text


def tensor_split_parts(text: str) -> list[float]:
    """``"3,1"`` (or ``"3/1"``) -> [3.0, 1.0]: non-negative finite proportions with a positive sum."""
    try:
        parts = [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise _Bad() from None
    if not parts or any(not 0 <= p < float("inf") for p in parts) or sum(parts) <= 0:
        raise _Bad()
    return parts


def _proportions(v: Any) -> Optional[str]:
    text = _text(v)
    if text is not None:
        tensor_split_parts(text)
    return text




def rpc_endpoints(text: Optional[str]) -> list[str]:
    """The ``rpc`` option's rule: GGML's RPC endpoint list (:func:`ggml_hybrid.ggml.rpc.endpoint_list`), at most
    :data:`MAX_DEVICES` servers."""
    try:
        out = endpoint_list(text or "")
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    if len(out) > MAX_DEVICES:
        raise _Bad(f"{len(out)} servers; a session has at most {MAX_DEVICES} devices")
    return out


def _endpoints(v: Any) -> Optional[str]:
    text = _text(v)
    return None if text is None else ",".join(rpc_endpoints(text))


def _opt(default: Any, type_: str, rule: str, doc: str, conv: Callable[[Any], Any]) -> Any:
    return field(default=default, metadata={"type": type_, "rule": rule, "doc": doc, "conv": conv})


@dataclass(frozen=True)
class SessionOptions:
    """Options of one inference session; see ``describe()`` for each field's type, rule and meaning.

    The constructor takes canonical typed values only (``n_threads=4``, not ``"4"``); text goes
    through ``parse``, config mappings through ``from_dict``. The path ``none`` is reserved for
    "no trace" (write ``./none`` for a file of that name).
    """

    moe_cpu_share: Union[float, str] = _opt(
        0.0, "float | 'auto'", "a number in [0, 1] or 'auto'",
        "Fraction of MoE expert work run on the CPU; 0 keeps the default path, 'auto' lets the scheduler choose.",
        _share)
    expert_cache_slots: Union[int, str] = _opt(
        0, "int | 'auto'", "an integer >= 0 or 'auto'",
        "Expert slots in the device cache per layer; 0 = no cache, experts resident; 'auto' = as many as the free "
        "device memory holds after the dense weights, the KV cache and the compute buffers, less a margin.",
        _slots)
    expert_eviction: EvictionPolicy = _opt(
        "freq", "str", _one_of(EvictionPolicy),
        "Expert cache victim order: the fewest requests over the layer's history, ties by the least recent ('freq'), "
        "least recently used ('lru') or least frequently used since loaded ('lfu').",
        _choice(EvictionPolicy))
    n_threads: Optional[int] = _opt(
        None, "int | None", _THREADS_RULE,
        "CPU threads for CPU-side work (llama.cpp -t); none = the cores other processes leave idle, measured at "
        "load (all of them on an idle machine).", _int(1, max_threads(), nullable=True))
    disk_experts: bool = _opt(
        False, "bool", _BOOL_RULE, "Load expert weights from disk on demand instead of keeping them in memory.", _bool)
    cpu_moe: bool = _opt(False, "bool", _BOOL_RULE, "Keep the MoE expert weights of all layers on the CPU.", _bool)
    n_cpu_moe: int = _opt(
        0, "int", "an integer >= 0", "Keep the MoE expert weights of the first N layers on the CPU.", _int(0))
    trace_path: Optional[str] = _opt(
        None, "str | None", "a file path or none", "File to record routing traces to; none = no tracing.", _path)
    n_ctx: int = _opt(
        0, "int", "an integer >= 0", "Context size (KV cache cells); 0 = the model's training context, at most 4096.",
        _int(0))
    n_parallel: int = _opt(
        1, "int", "an integer in 1..256",
        "Sequences held at once, one KV slot of n_ctx cells each (llama.cpp -np, which splits n_ctx instead).",
        _int(1, 256))
    batch_size: int = _opt(
        2048, "int", "an integer >= 1", "Logical batch: most tokens handed to one eval step (llama.cpp -b).", _int(1))
    ubatch_size: int = _opt(
        512, "int", "an integer >= 1", "Physical batch: most tokens in one graph computation (llama.cpp -ub).",
        _int(1))
    cache_type_k: KVCacheType = _opt(
        "f16", "str", _one_of(KVCacheType), "KV cache type of K (llama.cpp -ctk).", _choice(KVCacheType))
    cache_type_v: KVCacheType = _opt(
        "f16", "str", _one_of(KVCacheType), "KV cache type of V (llama.cpp -ctv); q8_0 needs flash_attn.",
        _choice(KVCacheType))
    flash_attn: Union[bool, str] = _opt(
        False, "bool | 'auto'", f"{_BOOL_RULE} or 'auto'",
        "Fused flash attention (llama.cpp -fa on|off); 'auto' = on when every backend that runs attention "
        "supports it for this model, as llama.cpp decides.", _bool_or_auto)
    n_gpu_layers: int = _opt(
        -1, "int", "an integer >= -1", "Repeating layers offloaded to the devices, the last ones first; -1 = all "
        "(and the output) (llama.cpp -ngl).", _int(-1))
    override_tensor: Optional[str] = _opt(
        None, "str | None", "REGEX=DEVICE items separated by commas, or none",
        "Tensor layout by regular expression over GGUF names, searched, first match wins (llama.cpp -ot).",
        _overrides)
    split_mode: SplitMode = _opt(
        "layer", "str", _one_of(SplitMode), "How layers are spread over several devices (llama.cpp -sm).",
        _choice(SplitMode))
    tensor_split: Optional[str] = _opt(
        None, "str | None", "comma-separated proportions or none",
        "Share of the offloaded layers per device, e.g. 3,1 (llama.cpp -ts); none = equal.", _proportions)
    no_kv_offload: bool = _opt(
        False, "bool", _BOOL_RULE, "KV cache in host memory and attention on the CPU (llama.cpp -nkvo).", _bool)
    check_tensors: bool = _opt(
        False, "bool", _BOOL_RULE, "Check every tensor's values at load (no NaN or infinity, as llama.cpp's "
        "--check-tensors); reads the whole file.", _bool)
    virtual_devices: int = _opt(
        1, "int", f"an integer in 1..{MAX_DEVICES}",
        "Without a GPU or RPC server: how many CPU backend instances play the devices (DEV0, DEV1, ...).",
        _int(1, MAX_DEVICES))
    moe_executor: ExecutorKind = _opt(
        "native", "str", _one_of(ExecutorKind),
        "Who runs a disk layer's calls: the native executor (C, no Python per call) or the Python reference.",
        _choice(ExecutorKind))
    rpc: Optional[str] = _opt(
        None, "str | None", "HOST:PORT items separated by commas, or none",
        "RPC servers (ggml-hybrid rpc-server) whose devices the session uses, named RPC0, RPC1, ... in this "
        "order, before any GPU (llama.cpp --rpc).", _endpoints)
    rpc_timeout: int = _opt(
        120, "int", "an integer >= 0 (seconds; 0 = no limit)",
        "Seconds an RPC server may take to accept a connection, take a message or send a reply before the "
        "session gives up on it (an RPCError); 0 waits for ever.", _int(0))
    n_threads_batch: Optional[int] = _opt(
        None, "int | None", _THREADS_RULE,
        "CPU threads of the CPU backends for batches of more than one token (the prompt); none = n_threads "
        "(llama.cpp -tb).", _int(1, max_threads(), nullable=True))
    devices: Optional[str] = _opt(
        None, "str | None", "comma-separated device names (see `ggml-hybrid devices`) or none",
        "The devices to use, in this order (llama.cpp -dev); none = every device.", _device_list)
    poll: int = _opt(
        0, "int", "an integer in 0..100",
        "How long idle CPU threads spin waiting for the next graph before they sleep, 0 = sleep at once "
        "(llama.cpp --poll, whose default is 50).", _int(0, 100))
    repack: bool = _opt(
        True, "bool", _BOOL_RULE,
        "Repack the weights that live on CPU backends into GGML's CPU extra buffer types where the type and CPU "
        "allow (Q4_0, Q4_K, IQ4_NL, MXFP4 on AVX2), for its faster kernels; false = llama.cpp's --no-repack.",
        _bool)
    host_tier_bytes: Union[int, str] = _opt(
        0, "int | 'auto'", "a size >= 0 (bytes, or with a K/M/G/T suffix) or 'auto'; > 0 needs disk_experts",
        "Host-RAM expert tier between the device's slots and the file: whole experts read from the GGUF by I/O "
        "threads (O_DIRECT where allowed) into at most this many bytes of host memory, which also feed the CPU "
        "worker and, on a CPU-only run with unrepacked experts, are computed from directly; 0 = none (loads read "
        "the mapping); 'auto' = the memory available at load less a margin.", _size_or_auto)

    moe_prefetch: bool = _opt(
        False, "bool", _BOOL_RULE,
        "Lookahead prefetch: in each disk layer's call of up to 16 tokens, apply the next disk layer's router to "
        "the call's input and load the predicted misses into that layer's slots ahead of its call (with "
        "host_tier_bytes, first read them ahead into the host tier, at once; docs/moe.md); results never change.",
        _bool)
    moe_prefetch_bytes: int = _opt(
        0, "int", "an integer >= 0 (bytes)",
        "Most bytes one layer call prefetches into the next layer (whole experts), and with host_tier_bytes reads "
        "ahead into the host tier; 0 = the bytes of the next layer's n_expert_used experts. Below one expert: "
        "predictions are counted, nothing is loaded.", _int(0))
    moe_route_trace: Optional[str] = _opt(
        None, "str | None", "a routing trace file (.ghtrace) or none",
        "Benchmarks only (ggml-hybrid bench, tools/bench): each disk layer's routed experts are the next token rows "
        "of this trace instead of the router's choice, so a generated model pays a real model's loads; the output "
        "is not the model's own.", _path)

    spec_type: SpecType = _opt(
        "none", "str", _one_of(SpecType),
        "Speculative decoding (llama.cpp --spec-type): 'draft-mtp' drafts with the model's own next-token-prediction "
        "head and verifies the drafts in one step through the expert cache; 'replay' drafts a given token sequence "
        "(benchmarks and tests only; docs/speculative.md).", _choice(SpecType))
    draft_max: int = _opt(
        3, "int", f"an integer in 1..{MAX_DRAFT}",
        "Most draft tokens per verify step (llama.cpp --spec-draft-n-max / --draft-max).", _int(1, MAX_DRAFT))
    draft_min: int = _opt(
        0, "int", f"an integer in 0..{MAX_DRAFT}, at most draft_max",
        "A draft shorter than this is dropped and the step decodes one token (llama.cpp --spec-draft-n-min / "
        "--draft-min).", _int(0, MAX_DRAFT))
    draft_p_min: float = _opt(
        0.0, "float", "a number in [0, 1]",
        "Drafting stops at a token whose probability under the head (its top 10, as llama.cpp's draft sampler) is "
        "below this (llama.cpp --spec-draft-p-min / --draft-p-min).", _unit)
    draft_backoff: bool = _opt(
        True, "bool", _BOOL_RULE,
        "Pause the draft head after verify steps that accept nothing, for 2, 4, ... up to 64 tokens (a probe "
        "then), catching its cache up in one batch when it resumes: speculation that does not pay costs about "
        "nothing. Tokens never change.", _bool)

    def __post_init__(self) -> None:
        for f in fields(self):
            given = getattr(self, f.name)
            value = _convert(f.name, f.name, given)
            # text accepted here would make ``SessionOptions(n_threads="4")`` differ from its own to_dict()
            if isinstance(given, str) and value != given:
                raise OptionError(f"{f.name}={given}: the constructor takes the canonical value {value!r}; "
                                  f"use SessionOptions.parse for text")
            object.__setattr__(self, f.name, value)
        if self.draft_min > self.draft_max:
            raise OptionError(f"draft_min={self.draft_min}: must not exceed draft_max={self.draft_max}")

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str, str]]:
        """``(name, type, default, rule, doc)`` for every field, in declaration order."""
        return [(f.name, f.metadata["type"], f.default, f.metadata["rule"], f.metadata["doc"]) for f in fields(cls)]

    @classmethod
    def parse(cls, items: Iterable[str], role: Optional[str] = None,
              base: Optional[SessionOptions] = None) -> SessionOptions:
        """Options from ``key=value`` / ``role.key=value`` strings over ``base`` (default: the defaults)."""
        if isinstance(items, (str, bytes)):  # iterating it would report every character as an item
            raise OptionError(f"{items!r}: pass a list of 'key=value' strings, not one string")
        try:
            items = list(items)
        except TypeError:
            raise OptionError(f"{items!r}: expected an iterable of 'key=value' strings") from None
        pairs = []
        for item in items:
            if not isinstance(item, str):
                raise OptionError(f"{item!r}: expected a 'key=value' string, got {type(item).__name__}")
            key, sep, text = item.partition("=")
            if not sep:
                raise OptionError(f"{item!r}: missing '=' (expected key=value or role.key=value)")
            pairs.append((key, text))
        return cls._build(pairs, role, base)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], role: Optional[str] = None,
                  base: Optional[SessionOptions] = None) -> SessionOptions:
        """Options from a flat config mapping (keys ``key`` or ``role.key``, values typed or text)."""
        if not isinstance(d, Mapping):
            raise OptionError(f"expected a mapping of options, got {type(d).__name__}")
        for key in d:
            if not isinstance(key, str):
                raise OptionError(f"{key!r}: option names must be strings, got {type(key).__name__}")
        return cls._build(list(d.items()), role, base)

    def merged(self, **explicit: Any) -> SessionOptions:
        """A copy with ``explicit`` values (highest precedence), validated like ``from_dict`` values."""
        changes = {_known(name, name, value): _convert(name, name, value) for name, value in explicit.items()}
        return dataclasses.replace(self, **changes)

    def to_items(self) -> list[str]:
        """``key=value`` strings for the non-default fields; ``parse`` reads them back to an equal object."""
        return [f"{f.name}={_format(getattr(self, f.name))}" for f in fields(self)
                if getattr(self, f.name) != f.default]

    def to_dict(self) -> dict[str, Any]:
        """Every field with its typed value; ``from_dict`` reads it back to an equal object."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def _build(cls, pairs: list[tuple[str, Any]], role: Optional[str],
               base: Optional[SessionOptions]) -> SessionOptions:
        if role is not None and not (isinstance(role, str) and _ROLE_RE.fullmatch(role)):
            raise OptionError(f"role={role!r}: role names must match {_ROLE_RE.pattern}")
        if base is not None and not isinstance(base, SessionOptions):
            raise OptionError(f"base={base!r}: expected SessionOptions or None, got {type(base).__name__}")
        scopes: dict[Optional[str], dict[str, tuple[Any, Any]]] = {}  # scope (None = bare) -> name -> (value, given)
        for key, given in pairs:
            label = key.strip()
            scope, _, name = label.rpartition(".") if "." in label else (None, "", label)
            if scope is not None and not _ROLE_RE.fullmatch(scope):
                raise OptionError(f"{label}={_show(given)}: role {scope!r} must match {_ROLE_RE.pattern}")
            value = _convert(label, _known(label, name, given), given)
            seen = scopes.setdefault(scope, {})
            if name in seen and seen[name][0] != value:
                raise OptionError(f"{label} given twice with different values: "
                                  f"{_show(seen[name][1])} and {_show(given)}")
            seen[name] = (value, given)
        values = (base or cls()).to_dict()
        for scope in (None, role) if role is not None else (None,):
            values.update({name: v for name, (v, _) in scopes.get(scope, {}).items()})
        return cls(**values)


_FIELDS = {f.name: f for f in fields(SessionOptions)}


def _show(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _known(label: str, name: str, given: Any) -> str:
    if not name:
        raise OptionError(f"{label}={_show(given)}: empty option name")
    if name not in _FIELDS:
        close = difflib.get_close_matches(name, _FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known options: {', '.join(_FIELDS)}"
        raise OptionError(f"{label}={_show(given)}: unknown option {name!r}; {hint}")
    return name


def _convert(label: str, name: str, given: Any) -> Any:
    meta = _FIELDS[name].metadata
    try:
        return meta["conv"](given)
    except _Bad as e:
        why = f" ({e})" if e.args else ""
        raise OptionError(f"{label}={_show(given)}: must be {meta['rule']}{why}") from None


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "none" if value is None else repr(value) if isinstance(value, float) else str(value)
