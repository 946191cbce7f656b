"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): its request read into the
chat pipeline, its answers, events and errors.

A request is translated into the OpenAI chat request the server already reads (:func:`read_request`): ``system``
becomes a system message, ``text`` blocks text, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's
``tool_result`` blocks ``tool`` messages, ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``) OpenAI's. So the model's own template renders it and the same grammars force calls.
``stop_sequences`` are the stop strings (bounded in length, not in count: :func:`~.protocol.read_stops`),
``output_config.format`` (a JSON schema) goes through the structured-output path (:mod:`.structured`),
``output_config.effort`` is accepted and changes nothing (no model served here has an effort setting), and
``cache_control`` is accepted wherever Anthropic takes it (top level, system blocks, content blocks, tools): prompt
reuse is automatic here (every prompt's cells stay in its slot for the next request that begins alike), and
``usage`` reports it in Anthropic's terms (:func:`usage`). The answer is Anthropic's message (``msg_`` id,
``content`` blocks, ``stop_reason``, ``usage``) or, streamed, its events (``message_start``,
``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). Every error on these paths,
and every error of a request that carries Anthropic's ``anthropic-version`` header, is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (:func:`owns`), the API-key middleware's 401 included.
"""

from __future__ import annotations

import datetime
import json
import uuid
from dataclasses import dataclass
from typing import Any

from .protocol import APIError, bad, read_stops
from .structured import Structure, schema_structure
from .tools import Call

PATH = "/v1/messages"  # this API's paths: /v1/messages and what is under it

# Anthropic's error type per HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
# request fields this server does not implement (a value other than these is refused, naming the field)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"thinking": (None,), "container": (None,), "mcp_servers": (None, []),
                                            "service_tier": (None, "auto", "standard_only")}
# Anthropic's fields, and ``seed`` (this server's extension: reproducible draws, as on the OpenAI endpoints)
_KNOWN = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "tools", "tool_choice", "metadata", "seed", "cache_control", "output_config", *_UNSUPPORTED}
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort: accepted, and it changes nothing here
CACHE_TTLS = ("5m", "1h")


def owns(path: str, headers: Any = None) -> bool:
    """Whether an answer to ``path`` (with request ``headers``, a mapping or ASGI's list of byte pairs) takes
    Anthropic's shapes: this API's paths, and any request made by Anthropic's clients (which send
    ``anthropic-version``)."""
    if path == PATH or path.startswith(PATH + "/"):
        return True
    if headers is None:
        return False
    if isinstance(headers, list):
        return any(name.lower() == b"anthropic-version" for name, _ in headers)
    return "anthropic-version" in headers


def error_body(e: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _cache_control(v: Any, param: str) -> None:
    """A ``cache_control`` marker: ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (accepted; reuse is automatic)."""
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") != "ephemeral":
        raise bad(f"'{param}' must be {{\"type\": \"ephemeral\"}} (with an optional 'ttl' of "
                  f"{' or '.join(repr(t) for t in CACHE_TTLS)}), got {json.dumps(v)[:80]}.", param)
    for k in v:
        if k not in ("type", "ttl"):
            raise bad(f"'{param}.{k}' is not a field of cache_control.", f"{param}.{k}")
    if v.get("ttl") is not None and v["ttl"] not in CACHE_TTLS:
        raise bad(f"'{param}.ttl' must be {' or '.join(repr(t) for t in CACHE_TTLS)}, got {v['ttl']!r}.",
                  f"{param}.ttl")


def _text(blocks: Any, param: str, allow: tuple[str, ...] = ("text",)) -> list[dict[str, Any]]:
    """A content field as blocks (a string is one text block), each of a type in ``allow``."""
    if isinstance(blocks, str):
        return [{"type": "text", "text": blocks}]
    if not isinstance(blocks, list):
        raise bad(f"'{param}' must be a string or an array of content blocks.", param)
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind not in allow:
            raise bad(f"'{param}[{j}].type': a block of type {kind!r} is not supported here (supported: "
                      f"{', '.join(allow)}).", f"{param}[{j}].type")
        if kind == "text" and not isinstance(b.get("text"), str):
            raise bad(f"'{param}[{j}].text' must be a string.", f"{param}[{j}].text")
        _cache_control(b.get("cache_control"), f"{param}[{j}].cache_control")
    return blocks


def _tool_result_text(b: dict[str, Any], param: str) -> str:
    c = b.get("content", "")
    text = "".join(x["text"] for x in _text(c, f"{param}.content")) if c else ""
    return f"Error: {text}" if b.get("is_error") else text


@dataclass
class MessagesRequest:
    """A Messages request as read: the OpenAI chat request it asks for, its stop strings, its structure."""

    chat: dict[str, Any]
    stop: tuple[str, ...]
    structure: Structure | None
    effort: str | None


def read_request(body: dict[str, Any], count_only: bool = False) -> MessagesRequest:
    """A Messages request (``count_only``: a count_tokens one, which needs no ``max_tokens``), its fields checked
    (400 naming the field)."""
    for name in body:
        if name not in _KNOWN:
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    for name, nothing in _UNSUPPORTED.items():
        if body.get(name) not in nothing:
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    if body.get("max_tokens") is None and not count_only:
        raise bad("'max_tokens' is required.", "max_tokens")
    _cache_control(body.get("cache_control"), "cache_control")
    structure, effort = _output_config(body.get("output_config"))
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": "".join(b["text"] for b in _text(system, "system"))})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("'messages' must be a non-empty array of messages.", "messages")
    for i, m in enumerate(given):
        msgs.extend(_message(m, f"messages[{i}]"))
    out: dict[str, Any] = {"model": body.get("model"), "messages": msgs,
                           "max_tokens": body.get("max_tokens") if not count_only else None,
                           "stream": False if count_only else body.get("stream", False),
                           "temperature": body.get("temperature", 1.0)}  # Anthropic's default
    t = out["temperature"]
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 <= t <= 1:
        raise bad(f"'temperature' must be a number in 0..1, got {t!r}.", "temperature")
    for k in ("top_p", "top_k", "seed"):
        if body.get(k) is not None:
            out[k] = body[k]
    stops = read_stops(body.get("stop_sequences"), "stop_sequences")
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind, {"type": "function", "function": {"name": choice.get("name")}})
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    return MessagesRequest(out, stops, structure, effort)


def _output_config(v: Any) -> tuple[Structure | None, str | None]:
    """``output_config``: ``format`` (``{"type": "json_schema", "schema"}``: the answer is JSON valid under the
    schema) and ``effort`` (accepted; no model here has an effort setting, so it changes nothing)."""
    if v is None:
        return None, None
    if not isinstance(v, dict):
        raise bad("'output_config' must be an object such as {\"format\": {\"type\": \"json_schema\", "
                  "\"schema\": {...}}}.", "output_config")
    for k in v:
        if k not in ("format", "effort"):
            raise bad(f"'output_config.{k}' is not supported by this server.", f"output_config.{k}",
                      "unsupported_parameter")
    effort = v.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"'output_config.effort' must be one of {', '.join(EFFORTS)}, got {effort!r}.",
                  "output_config.effort")
    fmt = v.get("format")
    if fmt is None:
        return None, effort
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                  "output_config.format")
    if "schema" not in fmt:
        raise bad("'output_config.format.schema' is required: the JSON schema of the answer.",
                  "output_config.format.schema")
    return schema_structure(fmt["schema"], "output_config.format.schema"), effort


def _message(m: Any, p: str) -> list[dict[str, Any]]:
    """The chat messages of Anthropic's message ``m`` (at ``p``): a user's tool results are tool messages."""
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
        raise bad(f"'{p}.role' must be 'user' or 'assistant', got {role!r}.", f"{p}.role")
    if role == "assistant":
        blocks = _text(m.get("content"), f"{p}.content", ("text", "tool_use"))
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = []
        for j, b in enumerate(blocks):
            if b["type"] == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad(f"'{p}.content[{j}]' must be a tool_use block with a 'name' and an 'input' object.",
                              f"{p}.content[{j}]")
                calls.append({"id": str(b.get("id", "")), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out: list[dict[str, Any]] = []
    blocks = _text(m.get("content"), f"{p}.content", ("text", "tool_result"))
    parts: list[str] = []
    for j, b in enumerate(blocks):
        if b["type"] == "tool_result":
            out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                        "content": _tool_result_text(b, f"{p}.content[{j}]")})
        else:
            parts.append(b["text"])
    if parts:
        out.append({"role": "user", "content": "".join(parts)})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools.", "tools")
    conv = []
    for i, tl in enumerate(tools):
        if not isinstance(tl, dict) or tl.get("type", "custom") != "custom":
            raise bad(f"'tools[{i}]' must be a custom tool {{\"name\", \"description\", \"input_schema\"}} (server "
                      "tools are not supported).", f"tools[{i}]")
        _cache_control(tl.get("cache_control"), f"tools[{i}].cache_control")
        fn = {"name": tl.get("name"), "parameters": tl.get("input_schema", {"type": "object"})}
        if tl.get("description") is not None:
            fn["description"] = tl["description"]
        conv.append({"type": "function", "function": fn})
    return conv


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish: str | None, calls: list[Call], stopped_by: str | None) -> str:
    if calls:
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stopped_by else "end_turn"


def blocks(content: str, calls: list[Call]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for c in calls:
        out.append({"type": "tool_use", "id": c.id or tool_use_id(), "name": c.name, "input": json.loads(c.arguments)})
    return out


@dataclass(frozen=True)
class PromptUse:
    """A prompt's tokens in Anthropic's terms: ``read`` were reused from a slot (``cache_read_input_tokens``),
    ``created`` were evaluated and stay in the slot for a later prompt that begins alike, up to the last fixed cut
    (``cache_creation_input_tokens``), the rest were evaluated and are not reusable (``input_tokens``); the three
    add up to the prompt, as Anthropic's do."""

    total: int
    read: int = 0
    created: int = 0

    def usage(self, n_out: int | None = None) -> dict[str, int]:
        out = {"input_tokens": self.total - self.read - self.created, "cache_creation_input_tokens": self.created,
               "cache_read_input_tokens": self.read}
        if n_out is not None:
            out["output_tokens"] = n_out
        return out


def message(rid: str, model: str, content: str, calls: list[Call], finish: str | None, stopped_by: str | None,
            prompt: PromptUse, n_out: int) -> dict[str, Any]:
    """The non-streamed answer."""
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks(content, calls),
            "stop_reason": stop_reason(finish, calls, stopped_by), "stop_sequence": stopped_by,
            "usage": prompt.usage(n_out)}


def event(kind: str, **doc: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **doc})}


class MessageEvents:
    """A streamed answer's events: text as it comes (one text block), then each call as a tool_use block."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = rid, model
        self.index = 0
        self.text_open = False

    def start(self, prompt: PromptUse) -> list[dict[str, str]]:
        msg: dict[str, Any] = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                               "content": [], "stop_reason": None, "stop_sequence": None,
                               "usage": prompt.usage(0)}
        return [event("message_start", message=msg)]

    def text(self, piece: str) -> list[dict[str, str]]:
        if not piece:
            return []
        out = []
        if not self.text_open:
            out.append(event("content_block_start", index=self.index, content_block={"type": "text", "text": ""}))
            self.text_open = True
        out.append(event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": piece}))
        return out

    def end(self, calls: list[Call], finish: str | None, stopped_by: str | None, prompt: PromptUse,
            n_out: int) -> list[dict[str, str]]:
        out = []
        if self.text_open:
            out.append(event("content_block_stop", index=self.index))
            self.index += 1
        for c in calls:
            out.append(event("content_block_start", index=self.index, content_block={
                "type": "tool_use", "id": c.id or tool_use_id(), "name": c.name, "input": {}}))
            out.append(event("content_block_delta", index=self.index,
                             delta={"type": "input_json_delta", "partial_json": c.arguments}))
            out.append(event("content_block_stop", index=self.index))
            self.index += 1
        out.append(event("message_delta", delta={"stop_reason": stop_reason(finish, calls, stopped_by),
                                                 "stop_sequence": stopped_by}, usage=prompt.usage(n_out)))
        out.append(event("message_stop"))
        return out


def model_info(name: str, created: int) -> dict[str, Any]:
    """Anthropic's model object (``GET /v1/models`` and ``/v1/models/{id}`` asked by Anthropic's client)."""
    when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": when}


__all__ = ["EFFORTS", "ERROR_TYPES", "PATH", "MessageEvents", "MessagesRequest", "PromptUse", "blocks", "error_body",
           "event", "message", "model_info", "new_id", "owns", "read_request", "stop_reason", "tool_use_id"]
