"""OpenAI's Responses API (``POST /v1/responses``): its request read into the chat pipeline, its answer and events.

A request is translated into the chat request the server already reads (:func:`read_request`): ``instructions`` becomes
a system message, ``input`` (a string, or items: messages with text parts, ``function_call`` and
``function_call_output`` items) the messages, the flat function ``tools`` and ``tool_choice`` chat's,
``text.format`` chat's ``response_format``, ``max_output_tokens`` ``max_tokens``; with ``previous_response_id`` the
stored conversation of that response comes first (:mod:`.response_store`; its instructions are not carried over, as
OpenAI does). So the model's own template renders it, the same grammars constrain it, the same parsers read calls back
and the same engine runs it. The answer is a response object (:class:`Answer`: ``output`` items, a
``message`` with one ``output_text`` part, then each call as a ``function_call``; ``status`` ``completed``, or
``incomplete`` at ``max_output_tokens``; ``usage`` with the prompt tokens reused) or, streamed, its events
(:class:`ResponseEvents`). A field this server does not implement is refused with a 400 naming it, unless its value
asks for nothing; every error names the Responses field (:func:`renamed`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..runtime.engine import Request
from .protocol import DEFAULTS, APIError, bad, now, usage
from .response_store import ResponseStore
from .tools import Call, new_call_id

# fields read here, and those whose values asking for nothing are accepted (any other value: a 400 naming the field)
_READ = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
         "temperature", "top_p", "seed", "stream", "stream_options", "store", "previous_response_id", "metadata",
         "user", "safety_identifier", "prompt_cache_key", "reasoning"}
_NOTHING: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "include": (None, []), "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"), "top_logprobs": (None, 0), "max_tool_calls": (None,),
    "conversation": (None,), "prompt": (None,), "context_management": (None,), "moderation": (None,),
    "image": (None,), "access_programs": (None,), "background_options": (None,), "prompt_cache_options": (None,),
    "prompt_cache_retention": (None,),
}
_TOOL_TYPE = "function"  # the only one: no built-in tools (web_search, file_search, computer_use, mcp...)
_ITEM_TYPES = ("message", "function_call", "function_call_output")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA = 16  # OpenAI's: 16 pairs, keys of at most 64 characters, values of at most 512
# a chat field's name as the Responses request calls it (the errors of the chat readers are renamed so)
_RENAMES = [(r"^messages(?=$|[.\[])", "input"), (r"^max_tokens$", "max_output_tokens"),
            (r"^response_format\.json_schema\.schema", "text.format.schema"), (r"^response_format", "text.format"),
            (r"^(tools\[\d+\])\.function\.", r"\1."), (r"^tool_choice\.function\.", "tool_choice."),
            (r"^prompt$", "input")]


def renamed(e: APIError) -> APIError:
    """A chat reader's error with the field named as the Responses request names it."""
    if e.param is None:
        return e
    new = e.param
    for pat, rep in _RENAMES:
        new = re.sub(pat, rep, new)
    if new == e.param:
        return e
    return APIError(e.status, e.message.replace(f"'{e.param}'", f"'{new}'"), new, e.code, e.kind, e.extra)


def not_found(rid: object, param: str | None = None) -> APIError:
    """An unknown (or evicted, or unstored) response id, in OpenAI's shape."""
    return APIError(404, f"No response with id {rid!r} is stored here (it was never stored, was deleted, or was "
                         "evicted: the store keeps the latest responses).", param, "response_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Turn:
    """A Responses request as read: the chat request it amounts to, the conversation it continues and adds (without
    the instructions: what is stored with the answer), and the fields the response object repeats."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    store: bool


# -- the request ------------------------------------------------------------------------------------

def _str(body: dict[str, Any], name: str, param: str | None = None) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(f"'{param or name}' must be a string.", param or name)
    return v


def _text_of(content: Any, param: str, role: str) -> str:
    """A message's content as text: a string, or text parts (``input_text``, ``output_text``; an assistant's
    ``refusal``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or an array of content parts.", param)
    out = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS:
            raise bad(f"'{p}.type': a content part of type {kind!r} is not supported by this server (text only: "
                      f"{', '.join(_TEXT_PARTS)}).", f"{p}.type", "unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise bad(f"'{p}.text' must be a string.", f"{p}.text")
        out.append(part["text"])
    return "".join(out)


def _arguments(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise bad(f"'{param}' must be a string of JSON text.", param)
    try:
        doc = json.loads(v) if v.strip() else {}
    except (ValueError, RecursionError):
        raise bad(f"'{param}' is not JSON text.", param) from None
    if not isinstance(doc, dict):
        raise bad(f"'{param}' must be a JSON object's text.", param)
    return v


def _calls_in(conversation: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in conversation for c in m.get("tool_calls") or [] if isinstance(c, dict)}


def _message(it: dict[str, Any], p: str) -> dict[str, Any]:
    role = it.get("role")
    if role not in _ROLES:
        raise bad(f"'{p}.role' must be one of {', '.join(_ROLES)}, got {role!r}.", f"{p}.role")
    return {"role": role, "content": _text_of(it.get("content"), f"{p}.content", role)}


def _function_call(it: dict[str, Any], p: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call."""
    call_id, name = it.get("call_id"), it.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"'{p}.call_id' must be a non-empty string.", f"{p}.call_id")
    if not isinstance(name, str) or not name:
        raise bad(f"'{p}.name' must be a non-empty string.", f"{p}.name")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _arguments(it.get("arguments"), f"{p}.arguments")}}


def _call_output(it: dict[str, Any], p: str, calls: set[str]) -> dict[str, Any]:
    """A ``function_call_output`` item as a tool message (its call among ``calls``, those before it)."""
    call_id = it.get("call_id")
    if not isinstance(call_id, str) or call_id not in calls:
        raise bad(f"'{p}.call_id': no function_call item with call_id {call_id!r} comes before this output "
                  "(in 'input' or in the conversation of 'previous_response_id').", f"{p}.call_id")
    return {"role": "tool", "tool_call_id": call_id, "content": _text_of(it.get("output"), f"{p}.output", "tool")}


def read_items(items: Any, before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages; ``before``: the stored conversation it follows (its calls may be answered)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty array of input items.", "input")
    out: list[dict[str, Any]] = []
    calls = _calls_in(before)
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"'{p}' must be an object (an input item).", p)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            out.append(_message(it, p))
        elif kind == "function_call":
            call = _function_call(it, p)
            calls.add(call["id"])
            if out and out[-1]["role"] == "assistant":  # one assistant turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(it, p, calls))
        else:
            raise bad(f"'{p}.type': an input item of type {kind!r} is not supported by this server (supported: "
                      f"{', '.join(_ITEM_TYPES)}).", f"{p}.type", "unsupported_parameter")
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The function tools as chat's, and as the response object repeats them."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, []
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of function tools {\"type\": \"function\", \"name\", \"parameters\"}.",
                  "tools")
    chat, echo = [], []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != _TOOL_TYPE:
            raise bad(f"'tools[{i}].type': {kind!r} tools are not supported by this server: it runs no built-in "
                      "tools (web search, file search, computer use, code interpreter, MCP, image generation, "
                      "shell...); give your own as 'function' tools.", f"tools[{i}].type", "unsupported_parameter")
        assert isinstance(t, dict)
        for name in t:
            if name not in ("type", "name", "description", "parameters", "strict"):
                raise bad(f"'tools[{i}].{name}' is not supported by this server.", f"tools[{i}].{name}",
                          "unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'tools[{i}].strict' must be a boolean.", f"tools[{i}].strict")
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": strict})
    return chat, echo


def _tool_choice(body: dict[str, Any]) -> tuple[Any, Any]:
    """``tool_choice`` as chat's, and as the response object repeats it."""
    c = body.get("tool_choice")
    if c is None:
        return None, "auto"
    if c in ("none", "auto", "required"):
        return c, c
    if isinstance(c, dict) and c.get("type") == "function":
        if not isinstance(c.get("name"), str):
            raise bad("'tool_choice.name' must be the name of a function tool.", "tool_choice.name")
        return {"type": "function", "function": {"name": c["name"]}}, {"type": "function", "name": c["name"]}
    raise bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...} (this "
              "server has no built-in tools and no 'allowed_tools' lists).", "tool_choice", "unsupported_parameter")


def _text(body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``text.format`` as chat's ``response_format``, and the ``text`` the response object repeats."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad("'text' must be an object such as {\"format\": {\"type\": \"json_object\"}}.", "text")
    for name in text:
        if name not in ("format", "verbosity"):
            raise bad(f"'text.{name}' is not supported by this server.", f"text.{name}", "unsupported_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise bad("'text.verbosity' is not supported by this server (the model's output is not steered; leave it "
                  "out or 'medium').", "text.verbosity", "unsupported_parameter")
    fmt = text.get("format", {"type": "text"})
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise bad("'text.format.name' is required: a name for the schema.", "text.format.name")
        if "schema" not in fmt:
            raise bad("'text.format.schema' is required: the JSON Schema the answer follows.", "text.format.schema")
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"],
                                                     "strict": fmt.get("strict")}}
        echo = {"type": "json_schema", "name": name, "schema": fmt["schema"], "strict": fmt.get("strict"),
                "description": fmt.get("description")}
        return rf, {"format": echo}
    raise bad(f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.", "text.format.type")


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    md = body.get("metadata")
    if md is None:
        return None
    if not isinstance(md, dict) or len(md) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in md.items()):
        raise bad(f"'metadata' must be an object of at most {MAX_METADATA} string values (keys of at most 64 "
                  "characters, values of at most 512).", "metadata")
    return md


def _reasoning(body: dict[str, Any]) -> None:
    """``reasoning``: accepted when it asks for nothing. The thinking of reasoning models is part of the text here
    (as on chat), so there is no effort to set and no reasoning item or summary to return."""
    r = body.get("reasoning")
    if r is None:
        return
    if not isinstance(r, dict) or any(v is not None for v in r.values()):
        raise bad("'reasoning' is not supported by this server: a reasoning model's thinking is part of its output "
                  "text, with no effort to set and no summary (leave it out, or null).", "reasoning",
                  "unsupported_parameter")


def _refused(body: dict[str, Any]) -> None:
    """A field this server does not implement, unless its value asks for nothing: a 400 naming it."""
    for name in body:
        if name not in _READ and name not in _NOTHING:
            raise bad(f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    for name, nothing in _NOTHING.items():
        v = body.get(name)
        if not any(type(v) is type(x) and v == x for x in nothing):
            raise bad(f"'{name}' is not supported by this server (leave it out).", name, "unsupported_parameter")
    _reasoning(body)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or any(
            k != "include_obfuscation" or v not in (None, False) for k, v in opts.items())):
        raise bad("'stream_options' is not supported by this server beyond {\"include_obfuscation\": false} (its "
                  "events carry no obfuscation padding).", "stream_options", "unsupported_parameter")


def _previous(body: dict[str, Any], store: ResponseStore) -> tuple[str | None, list[dict[str, Any]]]:
    """``previous_response_id`` and the conversation stored with it (a 404 when it is not stored)."""
    prev = body.get("previous_response_id")
    if prev is None:
        return None, []
    if not isinstance(prev, str):
        raise bad("'previous_response_id' must be a string.", "previous_response_id")
    found = store.get(prev)
    if found is None:
        raise not_found(prev, "previous_response_id")
    return prev, found.conversation


def read_request(body: dict[str, Any], store: ResponseStore) -> Turn:
    """The chat request a Responses request amounts to (fields checked: 400 naming the field; an unknown
    ``previous_response_id``: 404)."""
    _refused(body)
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise bad("'store' must be a boolean.", "store")
    prev, before = _previous(body, store)
    instructions = _str(body, "instructions")
    conversation = [*before, *read_items(body.get("input"), before)]
    msgs = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.get("model"), "messages": msgs, "stream": body.get("stream", False)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools, tools_echo = _tools(body)
    choice, choice_echo = _tool_choice(body)
    rf, text_echo = _text(body)
    chat.update({k: v for k, v in (("tools", tools), ("tool_choice", choice), ("response_format", rf))
                 if v is not None})
    # (the route sets max_output_tokens, temperature and top_p to what the generation runs with: the server's own
    # defaults may apply)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": _metadata(body) or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": prev, "temperature": body.get("temperature", DEFAULTS["temperature"]),
            "top_p": body.get("top_p", DEFAULTS["top_p"]), "tool_choice": choice_echo, "tools": tools_echo,
            "text": text_echo, "truncation": "disabled", "store": keep, "user": _str(body, "user"),
            "safety_identifier": _str(body, "safety_identifier"), "prompt_cache_key": _str(body, "prompt_cache_key"),
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "background": False}
    return Turn(chat, conversation, echo, keep)


# -- the answer -------------------------------------------------------------------------------------

def message_item(iid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status != "in_progress" else []}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(iid: str, call_id: str, c: Call, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": c.name,
            "arguments": c.arguments if status == "completed" else "", "status": status}


def response_usage(n_prompt: int, n_out: int, n_reused: int, n_written: int) -> dict[str, Any]:
    """The Responses API's ``usage``: ``cached_tokens`` the prompt tokens a slot held (reused), ``cache_write_tokens``
    those evaluated that stay in the slot for a later prompt that begins alike (up to the last fixed cut)."""
    u = usage(n_prompt, n_out, n_reused)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": n_reused, "cache_write_tokens": n_written},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class Answer:
    """One response of ``turn``: its id, creation time and the ids of its output items, so that the events of a
    stream and the object they end with (and a ``GET`` of it) agree."""

    def __init__(self, turn: Turn, model: str, store: ResponseStore) -> None:
        self.turn, self.model, self.store = turn, model, store
        self.id, self.created = new_id("resp"), now()
        self.message_id = new_id("msg")

    def obj(self, status: str, output: list[dict[str, Any]], use: dict[str, Any] | None,
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object."""
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": now() if status in ("completed", "incomplete") else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": use, **self.turn.echo}

    def output(self, text: str, calls: list[Call], finish: str | None) -> tuple[str, list[dict[str, Any]]]:
        """The status and output items of a generation that ended with ``finish``: the text as a message (left out
        when there are calls and no text), then the calls."""
        status = "incomplete" if finish == "length" and not calls else "completed"
        items = [message_item(self.message_id, text, status)] if text or not calls else []
        items += [call_item(new_id("fc"), c.id, c) for c in calls]
        return status, items

    def finish(self, text: str, calls: list[Call], finish: str | None, use: dict[str, Any]) -> dict[str, Any]:
        """The final response object (stored when asked)."""
        status, items = self.output(text, calls, finish)
        obj = self.obj(status, items, use)
        if self.turn.store:
            said: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                said["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            self.store.put(self.id, obj, [*self.turn.conversation, said])
        return obj


def with_ids(calls: list[Call]) -> list[Call]:
    """The calls with their call ids drawn (a call parsed from text has none)."""
    return [c if c.id else Call(c.name, c.arguments, new_call_id()) for c in calls]


def event(seq: Callable[[], int], kind: str, **doc: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq(), **doc})}


class ResponseEvents:
    """A streamed response's events: ``response.created`` and ``.in_progress``; the text as one message item
    (``output_item.added``, ``content_part.added``, ``output_text.delta`` ... ``.done``, ``content_part.done``,
    ``output_item.done``); each call as a ``function_call`` item (``output_item.added``,
    ``function_call_arguments.delta`` and ``.done``, ``output_item.done``); then ``response.completed`` (or
    ``.incomplete`` at ``max_output_tokens``), or ``error`` and ``response.failed``. Every event has its
    ``sequence_number``."""

    after_slot = False  # response.created at once, as OpenAI sends it

    def __init__(self, answer: Answer, usage_of: Callable[[Request], dict[str, Any]]) -> None:
        self.a, self.usage_of = answer, usage_of
        self.n = 0
        self.text_so_far: list[str] = []
        self.open = False

    def _seq(self) -> int:
        self.n += 1
        return self.n - 1

    def _ev(self, kind: str, **doc: Any) -> dict[str, str]:
        return event(self._seq, kind, **doc)

    def start(self, r: Request | None = None) -> list[dict[str, str]]:
        obj = self.a.obj("in_progress", [], None)
        return [self._ev("response.created", response=obj), self._ev("response.in_progress", response=obj)]

    def _open(self) -> list[dict[str, str]]:
        self.open = True
        mid = self.a.message_id
        return [self._ev("response.output_item.added", output_index=0, item=message_item(mid, "", "in_progress")),
                self._ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                         part=_text_part(""))]

    def text(self, piece: str) -> list[dict[str, str]]:
        if not piece:
            return []
        out = [] if self.open else self._open()
        self.text_so_far.append(piece)
        out.append(self._ev("response.output_text.delta", item_id=self.a.message_id, output_index=0, content_index=0,
                            delta=piece, logprobs=[]))
        return out

    def end(self, calls: list[Call], finish: str | None, r: Request) -> list[dict[str, str]]:
        calls = with_ids(calls)
        text = "".join(self.text_so_far)
        obj = self.a.finish(text, calls, finish, self.usage_of(r))
        out = []
        items = obj["output"]
        for k, item in enumerate(items):
            if item["type"] == "message":
                if not self.open:
                    out += self._open()
                mid = item["id"]
                out += [self._ev("response.output_text.done", item_id=mid, output_index=k, content_index=0, text=text,
                                 logprobs=[]),
                        self._ev("response.content_part.done", item_id=mid, output_index=k, content_index=0,
                                 part=_text_part(text)),
                        self._ev("response.output_item.done", output_index=k, item=item)]
                continue
            added = {**item, "arguments": "", "status": "in_progress"}
            out += [self._ev("response.output_item.added", output_index=k, item=added),
                    self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                             delta=item["arguments"]),
                    self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                             name=item["name"], arguments=item["arguments"]),
                    self._ev("response.output_item.done", output_index=k, item=item)]
        kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=obj))
        return out

    def error(self, e: APIError) -> list[dict[str, str]]:
        e = renamed(e)  # a grammar's fault names the Responses field (text.format, tools)
        code = "server_error" if e.status >= 500 else e.code or "invalid_request_error"
        obj = self.a.obj("failed", [], None, {"code": "server_error", "message": e.message})
        return [self._ev("error", code=code, message=e.message, param=e.param),
                self._ev("response.failed", response=obj)]


__all__ = ["Answer", "ResponseEvents", "Turn", "call_item", "message_item", "new_id", "not_found", "read_items",
           "read_request", "renamed", "response_usage", "with_ids"]
