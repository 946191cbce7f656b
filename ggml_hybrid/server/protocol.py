"""OpenAI's request and response shapes: every request field checked, every error in OpenAI's form.

A request body is read into a :class:`Generation` (what to generate, how to sample, when to stop)
or refused with an :class:`APIError`, which carries the HTTP status and OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``): a field of the wrong JSON type, a value
outside its rule, an unsupported option, too many choices. Sampling ranges are the sampler's own
rules (:class:`~ggml_hybrid.runtime.sampling.Sampler` checks them; its message is passed on).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import GgmlHybridError, shorten
from ..runtime.engine import Request
from ..runtime.logprobs import MAX_TOP_LOGPROBS
from ..runtime.sampling import Sampler

MAX_BODY_BYTES = 16 << 20   # a request body beyond this is refused (413) before it is parsed
MAX_CHOICES = 16            # prompts x n per request
MAX_STOP = 4                # stop strings, as OpenAI
# stop strings where an API sets no count (Anthropic's stop_sequences, llama-server's stop): each is checked against
# the text's tail after every token, at a cost that grows with its length squared, so both are bounded
MAX_STOP_CHARS = 256        # characters in one stop string
MAX_STOP_TOTAL = 4096       # characters in all of them
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has none: until the end)

# OpenAI's documented ranges (the sampler is safe beyond them, but a value there is a client's mistake)
RANGES = {"temperature": (0.0, 2.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
# llama.cpp server's sampling defaults (its "common" sampler), which OpenAI clients get when they send none
DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 64}


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's error object; ``extra``: fields added to that object
    (llama-server's ``n_prompt_tokens`` and ``n_ctx`` of a context overflow)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, extra: dict[str, Any] | None = None) -> None:
        # it may quote what the client sent: cut, and a lone surrogate (which UTF-8 cannot carry) escaped
        message = shorten(message).encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code,
                          **self.extra}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def context_overflow(message: str, param: str, n_ctx: int, n_prompt: int | None = None) -> APIError:
    """A prompt longer than a sequence's context: OpenAI's ``context_length_exceeded`` code, llama-server's
    ``exceed_context_size_error`` type with its ``n_ctx`` and (where the prompt was counted) ``n_prompt_tokens``."""
    extra: dict[str, Any] = {"n_ctx": n_ctx}
    if n_prompt is not None:
        extra["n_prompt_tokens"] = n_prompt
    return APIError(400, message, param, "context_length_exceeded", "exceed_context_size_error", extra)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("We could not parse the JSON body of your request: it is not valid JSON.") from None
    if not isinstance(doc, dict):
        raise bad(f"The request body must be a JSON object, got {type(doc).__name__}.")
    return doc


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets: the sampling settings, the seed and the tokens to generate.

    ``serve --temp/--top-k/... --seed -n --ignore-eos`` set them server-wide, as llama-server's flags do; without
    them the sampling settings are :data:`DEFAULTS` (llama-server's), the seed random and ``max_tokens`` each
    route's own (completions: OpenAI's 16; chat: until the end)."""

    sampling: Mapping[str, float | int] = field(default_factory=lambda: dict(DEFAULTS))
    seed: int | None = None
    n_predict: int | None = None  # None: each route's own default; -1: until the end; n >= 1: n tokens
    ignore_eos: bool = False  # generate past end-of-generation tokens (``serve --ignore-eos``)

    def max_tokens(self, route_default: int | None) -> int | None:
        if self.n_predict is None:
            return route_default
        return None if self.n_predict < 0 else self.n_predict


@dataclass
class Generation:
    """A generation request as checked: which model, what to generate, how, and when to stop."""

    model: str
    stream: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    n: int
    sampling: dict[str, Any]
    seed: int | None
    ignore_eos: bool
    include_usage: bool
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest
    cache_prompt: bool = True    # llama.cpp's: reuse what a slot holds of the prompt (bit for bit a cold run)
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat
    structure: Any = None  # server/structured.py's Structure: what the text must be (None: free)
    tools: Any = None      # server/tools.py's ToolRequest (chat): the tools and the choice among them
    return_progress: bool = False  # llama-server's: streamed prompt-processing progress chunks

    def sampler(self, choice: int) -> Sampler:
        """The sampler of choice ``choice`` (seeded choices draw from seed + choice)."""
        seed = None if self.seed is None else (self.seed + choice) % (1 << 63)
        return Sampler(seed=seed, **self.sampling)

    @property
    def n_choices(self) -> int:
        return self.n * max(1, len(self.prompts))


# -- fields -----------------------------------------------------------------------------------------

def _get(body: dict[str, Any], name: str, types: tuple[type, ...], what: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise bad(f"'{name}' must be {what}, got {_json_type(v)}.", name)
    return v


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None, default: int | None = None) -> int | None:
    v = _get(body, name, (int, float), "an integer", default)
    if v is None:
        return None
    if isinstance(v, float):
        if not v.is_integer():
            raise bad(f"'{name}' must be an integer, got {v!r}.", name)
        v = int(v)
    if v < lo or (hi is not None and v > hi):
        rule = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad(f"'{name}' must be an integer {rule}, got {v}.", name)
    return int(v)


def _num(body: dict[str, Any], name: str) -> float | None:
    v = _get(body, name, (int, float), "a number")
    if v is None:
        return None
    if not float("-inf") < float(v) < float("inf"):
        raise bad(f"'{name}' must be a finite number, got {v!r}.", name)
    return float(v)


# options this server does not implement, and the values of each that ask for nothing
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "suffix": (None, ""),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


def _unsupported(body: dict[str, Any], supported: tuple[str, ...]) -> None:
    for name, nothing in _UNSUPPORTED.items():
        if name in supported:  # read by the endpoint's own module (server/structured.py, server/tools.py)
            continue
        v = body.get(name)
        # `True == 1`: compare types too, so logprobs=true is not taken for best_of=1's 1
        if not any(type(v) is type(x) and v == x for x in nothing):
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or an array of strings.", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} strings, got {len(stops)}.", "stop")
    return tuple(s for s in stops if s)


def read_stops(v: Any, param: str) -> tuple[str, ...]:
    """Stop strings of an API that sets no count on them (Anthropic's ``stop_sequences``, llama-server's ``stop``):
    an array of strings, each of at most :data:`MAX_STOP_CHARS` characters, :data:`MAX_STOP_TOTAL` in all."""
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{param}' must be an array of strings.", param)
    for i, s in enumerate(v):
        if len(s) > MAX_STOP_CHARS:
            raise bad(f"'{param}[{i}]' has {len(s)} characters; a stop sequence has at most {MAX_STOP_CHARS}.",
                      f"{param}[{i}]")
    total = sum(len(s) for s in v)
    if total > MAX_STOP_TOTAL:
        raise bad(f"'{param}' has {total} characters in all; at most {MAX_STOP_TOTAL} are taken.", param)
    return tuple(s for s in v if s)


def _common(body: dict[str, Any], max_tokens_default: int | None, supported: tuple[str, ...] = (),
            defaults: Defaults | None = None) -> Generation:
    d = defaults if defaults is not None else Defaults()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be the name of a model from GET /v1/models, got {_json_type(model)}.", "model")
    model = model or ""  # left out: the server's one model (Routes.lookup; with several it is required)
    _unsupported(body, supported)
    stream = _get(body, "stream", (bool,), "a boolean", False)
    opts = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = bool(stream) and _get(opts, "include_usage", (bool,), "a boolean", False)
    max_tokens = _int(body, "max_tokens", 1)
    mct = _int(body, "max_completion_tokens", 1)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad("give one of 'max_tokens' and 'max_completion_tokens' (they differ).", "max_completion_tokens")
    max_tokens = max_tokens if max_tokens is not None else mct if mct is not None else d.max_tokens(max_tokens_default)
    n = _int(body, "n", 1, MAX_CHOICES, 1)
    assert n is not None
    sampling: dict[str, Any] = {}
    for name, default in d.sampling.items():
        v: float | int | None
        if name in ("top_k", "repeat_last_n"):
            v = _int(body, name, -1 if name == "repeat_last_n" else 0)
            if v == -1:  # llama.cpp: -1 = the whole context; our window is the sequence, which is no longer
                v = 1 << 31
        else:
            v = _num(body, name)
        sampling[name] = default if v is None else v
    for name, (lo, hi) in RANGES.items():  # OpenAI's ranges: beyond them a value means nothing but trouble
        v = sampling[name]
        if not lo <= v <= hi:
            raise bad(f"'{name}' must be a number in {lo:g}..{hi:g}, got {v!r}.", name)
    seed = _int(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is None:
        seed = d.seed
    elif seed < 0:
        seed = None  # llama.cpp: -1 (any negative) = a random seed
    try:
        Sampler(**sampling)
    except GgmlHybridError as exc:
        param = next((k for k in sampling if f"Sampler: {k}" in str(exc)), None)
        raise bad(str(exc).replace("Sampler: ", ""), param) from None
    ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean", d.ignore_eos)
    cache_prompt = _get(body, "cache_prompt", (bool,), "a boolean", True)
    progress = bool(stream) and _get(body, "return_progress", (bool,), "a boolean", False)
    return Generation(model, bool(stream), max_tokens, _stop(body), n, sampling, seed, bool(ignore_eos),
                      include_usage, cache_prompt=bool(cache_prompt), return_progress=bool(progress))


def read_generation(body: dict[str, Any], max_tokens_default: int | None, supported: tuple[str, ...] = (),
                    defaults: Defaults | None = None) -> Generation:
    """The fields every generation route shares (model, sampling, limits, stop strings, stream), checked; another
    API's route (llama-server's ``/completion``) reads its own fields around them."""
    return _common(body, max_tokens_default, supported, defaults)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, with ``logprobs`` only), as OpenAI's."""
    on = _get(body, "logprobs", (bool,), "a boolean", False)
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if on else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' ``logprobs``: how many of the likeliest tokens to list with each (0..20)."""
    if "top_logprobs" in body and body["top_logprobs"] is not None:
        raise bad("'top_logprobs' is a chat parameter; completions take 'logprobs': an integer in "
                  f"0..{MAX_TOP_LOGPROBS}.", "top_logprobs")
    if isinstance(body.get("logprobs"), bool):
        raise bad(f"'logprobs' must be an integer in 0..{MAX_TOP_LOGPROBS} for completions, got a boolean.",
                  "logprobs")
    return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def completion_request(body: dict[str, Any], defaults: Defaults | None = None) -> Generation:
    """``POST /v1/completions``: ``prompt`` is a string, an array of strings, token ids, or arrays of them."""
    g = _common(body, COMPLETION_MAX_TOKENS, ("response_format",), defaults)
    g.logprobs = _completion_logprobs(body)
    p = body.get("prompt")
    rule = "'prompt' must be a string, an array of strings, an array of token ids, or an array of those arrays."
    if isinstance(p, str):
        prompts: list[str | list[int]] = [p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        prompts = [list(x) for x in p]
    else:
        raise bad(rule, "prompt")
    g.prompts = prompts
    if g.n_choices > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n={g.n} is {g.n_choices} completions; at most {MAX_CHOICES} per request.",
                  "n")
    return g


def chat_request(body: dict[str, Any], defaults: Defaults | None = None) -> Generation:
    """``POST /v1/chat/completions``: ``messages`` as OpenAI's (text content only)."""
    g = _common(body, None, ("response_format", "tools", "tool_choice"), defaults)
    g.logprobs = _chat_logprobs(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages.", "messages")
    g.messages = msgs
    return g


# -- responses -----------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; ``cached``: prompt tokens reused from a slot (``prompt_tokens_details.cached_tokens``)."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def model_object(name: str, created: int) -> dict[str, Any]:
    """OpenAI's model object (``GET /v1/models``, ``/v1/models/{id}``)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "ggml-hybrid"}


def null_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    """A chunk of a stream whose last chunk brings the usage (``include_usage``): ``"usage": null`` until then, as
    OpenAI's chunks say."""
    if include_usage and "usage" not in chunk:
        chunk["usage"] = None
    return chunk


def timings(r: Request) -> dict[str, float]:
    """llama.cpp's ``timings`` extension (OpenAI clients ignore it): the prompt (from taking a slot to the
    first token, other sequences' steps included) and the decode (first token to the last)."""
    start = r.started_at if r.started_at is not None else r.queued_at
    first = r.first_token_at if r.first_token_at is not None else start
    end = r.finished_at if r.finished_at is not None else first
    prompt_ms, predicted_ms = (first - start) * 1e3, (end - first) * 1e3
    n = r.completion_tokens
    evaluated = r.prompt_tokens - r.n_reused
    return {"prompt_n": evaluated, "cache_n": r.n_reused, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / evaluated if evaluated > 0 else 0.0,
            "prompt_per_second": evaluated / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / (n - 1) if n > 1 else 0.0,
            "predicted_per_second": (n - 1) / predicted_ms * 1e3 if n > 1 and predicted_ms > 0 else 0.0,
            "queued_ms": (start - r.queued_at) * 1e3,
            # speculative decoding, as llama-server reports it: draft tokens verified and kept (when there were any)
            **({"draft_n": r.n_drafted, "draft_n_accepted": r.n_accepted} if r.n_drafted else {})}


def prompt_progress(r: Request) -> dict[str, float]:
    """llama-server's ``prompt_progress`` of a request: the prompt's tokens, those reused, those done so far
    (reused ones included) and the milliseconds since it took a slot."""
    start = r.started_at if r.started_at is not None else r.queued_at
    return {"total": r.prompt_tokens, "cache": r.n_reused, "processed": r.prompt_done,
            "time_ms": (time.perf_counter() - start) * 1e3}


def choice(kind: str, index: int, text: str, finish: str | None, stream: bool, first: bool = False,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if not stream:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict[str, Any]], stream: bool,
             use: dict[str, int] | None = None, fingerprint: str | None = None) -> dict[str, Any]:
    obj = ("chat.completion.chunk" if stream else "chat.completion") if kind == "chat" else "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                           "system_fingerprint": fingerprint, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


__all__ = ["APIError", "COMPLETION_MAX_TOKENS", "DEFAULTS", "Defaults", "Generation", "MAX_BODY_BYTES", "MAX_CHOICES",
           "MAX_STOP_CHARS", "MAX_STOP_TOTAL", "bad", "chat_request", "choice", "completion_request",
           "context_overflow", "envelope", "model_object", "new_id", "now", "null_usage", "parse_json",
           "prompt_progress", "read_generation", "read_stops", "timings", "usage"]
