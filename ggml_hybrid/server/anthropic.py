"""Anthropic's Messages API (``POST /v1/messages``): its request read into the chat pipeline, its answers and events.

A request is translated into the OpenAI chat request the server already reads (:func:`to_chat`): ``system`` becomes
a system message, ``text`` blocks text, an assistant's ``tool_use`` blocks its ``tool_calls``, a user's
``tool_result`` blocks ``tool`` messages, ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``) OpenAI's, ``stop_sequences`` ``stop``. So the model's own template renders it and the same
grammars force calls. The answer is Anthropic's message (``content`` blocks, ``stop_reason``, ``usage``) or, streamed,
its events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``); errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Mapping
from typing import Any

from .protocol import APIError, bad
from .tools import Call

# Anthropic's error type per HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
# request fields this server does not implement (a value other than these is refused, naming the field)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {"thinking": (None,), "container": (None,), "mcp_servers": (None, []),
                                            "service_tier": (None, "auto", "standard_only")}
# Anthropic's fields, and ``seed`` (this server's extension: reproducible draws, as on the OpenAI endpoints)
_KNOWN = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "tools", "tool_choice", "metadata", "seed", *_UNSUPPORTED}


def error_body(e: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


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
    return blocks


def _tool_result_text(b: dict[str, Any], param: str) -> str:
    c = b.get("content", "")
    text = "".join(x["text"] for x in _text(c, f"{param}.content")) if c else ""
    return f"Error: {text}" if b.get("is_error") else text


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat request a Messages request asks for (fields checked: 400 naming the field)."""
    for name in body:
        if name not in _KNOWN:
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    for name, nothing in _UNSUPPORTED.items():
        if body.get(name) not in nothing:
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required.", "max_tokens")
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": "".join(b["text"] for b in _text(system, "system"))})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("'messages' must be a non-empty array of messages.", "messages")
    for i, m in enumerate(given):
        p = f"messages[{i}]"
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
            msgs.append(msg)
            continue
        blocks = _text(m.get("content"), f"{p}.content", ("text", "tool_result"))
        parts: list[str] = []
        for j, b in enumerate(blocks):
            if b["type"] == "tool_result":
                msgs.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                             "content": _tool_result_text(b, f"{p}.content[{j}]")})
            else:
                parts.append(b["text"])
        if parts:
            msgs.append({"role": "user", "content": "".join(parts)})
    out: dict[str, Any] = {"model": body.get("model"), "messages": msgs, "max_tokens": body["max_tokens"],
                           "stream": body.get("stream", False),
                           "temperature": body.get("temperature", 1.0)}  # Anthropic's default
    t = out["temperature"]
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 <= t <= 1:
        raise bad(f"'temperature' must be a number in 0..1, got {t!r}.", "temperature")
    for k in ("top_p", "top_k", "seed"):
        if body.get(k) is not None:
            out[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("'stop_sequences' must be an array of strings.", "stop_sequences")
        out["stop"] = stops
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be an array of tools.", "tools")
        conv = []
        for i, tl in enumerate(tools):
            if not isinstance(tl, dict) or tl.get("type", "custom") != "custom":
                raise bad(f"'tools[{i}]' must be a custom tool {{\"name\", \"description\", \"input_schema\"}} (server "
                          "tools are not supported).", f"tools[{i}]")
            fn = {"name": tl.get("name"), "parameters": tl.get("input_schema", {"type": "object"})}
            if tl.get("description") is not None:
                fn["description"] = tl["description"]
            conv.append({"type": "function", "function": fn})
        out["tools"] = conv
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'.", "tool_choice.type")
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind, {"type": "function", "function": {"name": choice.get("name")}})
        if choice.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False
    return out


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


def message(rid: str, model: str, content: str, calls: list[Call], finish: str | None, stopped_by: str | None,
            n_prompt: int, n_out: int) -> dict[str, Any]:
    """The non-streamed answer."""
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks(content, calls),
            "stop_reason": stop_reason(finish, calls, stopped_by), "stop_sequence": stopped_by,
            "usage": {"input_tokens": n_prompt, "output_tokens": n_out}}


def event(kind: str, **doc: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **doc})}


class MessageEvents:
    """A streamed answer's events: text as it comes (one text block), then each call as a tool_use block."""

    def __init__(self, rid: str, model: str, n_prompt: int) -> None:
        self.rid, self.model, self.n_prompt = rid, model, n_prompt
        self.index = 0
        self.text_open = False

    def start(self) -> list[dict[str, str]]:
        msg: dict[str, Any] = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                               "content": [], "stop_reason": None, "stop_sequence": None,
                               "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
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

    def end(self, calls: list[Call], finish: str | None, stopped_by: str | None, n_out: int) -> list[dict[str, str]]:
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
                                                 "stop_sequence": stopped_by}, usage={"output_tokens": n_out}))
        out.append(event("message_stop"))
        return out

    def error(self, e: APIError) -> list[dict[str, str]]:
        """A generation that failed mid-stream: Anthropic's ``error`` event."""
        return [event("error", error=error_body(e)["error"])]


def asked(headers: Mapping[str, str]) -> bool:
    """Whether a request comes from an Anthropic client (its SDK sends ``anthropic-version`` with every request)."""
    return "anthropic-version" in headers


def model_info(name: str, created: int) -> dict[str, Any]:
    """Anthropic's model object (``GET /v1/models`` and ``/v1/models/{id}`` asked with Anthropic's headers)."""
    when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": name, "display_name": name, "created_at": when}


__all__ = ["ERROR_TYPES", "MessageEvents", "asked", "blocks", "error_body", "event", "message", "model_info",
           "new_id", "stop_reason", "to_chat", "tool_use_id"]
