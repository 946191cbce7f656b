"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` read and checked, the calls a text holds answered in OpenAI's
shapes.

The tools are given to the model's own chat template (it receives ``tools`` as Hugging Face templates do, a tool
without ``description`` with an empty one as llama.cpp gives it, and assistant messages with ``tool_calls`` and
``tool`` messages with their results); what the model writes is read back in its family's format
(:mod:`.tool_formats`, recognised by a marker in the template).

``tool_choice`` ``required`` or a named function is enforced by a grammar (:func:`tools_grammar`) whose arguments
follow each tool's ``parameters`` schema, so a forced call always parses and is valid under it; ``auto`` leaves the
model free (with a ``response_format``: free to call a tool or to answer under the format's schema, one grammar for
both) and reads what it writes; ``none`` renders no tools. A call the text ends inside (cut by ``max_tokens``) is not
a call: the answer is the text, with its finish reason (:func:`read_calls`). Reading runs in linear time, and the
server runs it off its event loop.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError
from ..runtime.grammar import Grammar, TokenBytes, json_options
from .protocol import bad
from .structured import check_schema_field
from .tool_formats import FORMATS, HERMES, MARKERS, Call, Reading, ToolFormat, tool_format
from .tool_grammar import SPECIALS, Refused
from .tool_schema import allows_object

# OpenAI's rule for a function's name (Anthropic's for a tool's is the same)
NAME_RULE = "^[a-zA-Z0-9_-]{1,64}$"
NAME_RE = re.compile(NAME_RULE[1:-1])  # used with fullmatch: "$" would let a trailing newline through
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers (OpenAI's tool objects, checked) and ``choice``: ``auto``, ``none``,
    ``required`` or ``named`` (``name`` then says which)."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def offered(self) -> list[dict[str, Any]]:
        """The tools the model may call (a named choice: that one)."""
        if self.choice == "named":
            return [t for t in self.tools if t["function"]["name"] == self.name]
        return self.tools

    def index(self, name: str) -> int:
        """Where the tool ``name`` is in the request's ``tools``."""
        return next(i for i, t in enumerate(self.tools) if t["function"]["name"] == name)


def template_tools(req: ToolRequest) -> list[dict[str, Any]]:
    """The offered tools as the chat template receives them: each with a ``description`` (empty when the request gave
    none: llama.cpp's rule, and what templates that print it, such as gpt-oss's, need)."""
    return [{**t, "function": {**t["function"], "description": t["function"].get("description", "")}}
            for t in req.offered()]


def _check_schema(schema: Any, param: str) -> None:
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:  # the server extra brings it; without it the grammar compiler still checks the schema
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad(f"'{param}' is not a valid JSON Schema: {exc.message}", param, "invalid_tool_schema") from None


def _read_tool(t: Any, p: str) -> dict[str, Any]:
    """One of ``tools``, checked (``p``: where it is, for errors)."""
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise bad(f"'{p}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}.", p)
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise bad(f"'{p}.function.name' must match {NAME_RULE} (letters, digits, '_' and '-', 1 to 64 of them), "
                  f"got {name!r}.", f"{p}.function.name")
    desc = f.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad(f"'{p}.function.description' must be a string.", f"{p}.function.description")
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise bad(f"'{p}.function.strict' must be a boolean.", f"{p}.function.strict")
    params = f.get("parameters", {"type": "object", "properties": {}})
    pp = f"{p}.function.parameters"
    if not isinstance(params, dict):
        raise bad(f"'{pp}' must be a JSON Schema object.", pp)
    check_schema_field(params, pp, "invalid_tool_schema")  # nesting, size, x-guidance: before anything walks it
    _check_schema(params, pp)
    if not allows_object(params):
        raise bad(f"'{pp}' must describe an object (a call's arguments are one), got 'type': "
                  f"{json.dumps(params.get('type'))}.", pp, "invalid_tool_schema")
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if desc is not None:
        fn["description"] = desc
    return {"type": "function", "function": fn}


def read_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's ``tools`` and ``tool_choice`` (None: no tools), checked (400 naming the field otherwise)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' asks for a tool call but no 'tools' are given.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of {\"type\": \"function\", \"function\": {...}} objects.", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}.", "tools")
    checked: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        tool = _read_tool(t, f"tools[{i}]")
        name = tool["function"]["name"]
        if any(c["function"]["name"] == name for c in checked):
            raise bad(f"'tools[{i}].function.name': the tool {name!r} is given twice.", f"tools[{i}].function.name")
        checked.append(tool)
    seen = {t["function"]["name"] for t in checked}
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(checked, choice or "auto", None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in seen:
            raise bad(f"'tool_choice.function.name' {name!r} is not one of the tools given.",
                      "tool_choice.function.name")
        return ToolRequest(checked, "named", name, parallel)
    raise bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
              "{\"name\": ...}}.", "tool_choice")


# -- message shapes the templates receive ---------------------------------------------------------

def template_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates expect them: ``arguments`` an object (OpenAI sends a
    JSON string; Hugging Face templates index it or write it with ``tojson``)."""
    if not isinstance(calls, list):
        raise bad(f"'messages[{i}].tool_calls' must be an array.", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad(f"'messages[{i}].tool_calls[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                      "{\"name\", \"arguments\"}}.", "messages")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"'messages[{i}].tool_calls[{j}].function.arguments' is not JSON text.", "messages") from None
        cid = c.get("id") if isinstance(c.get("id"), str) else ""
        out.append({"id": cid, "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def template_messages(messages: list[Any]) -> list[Any]:
    """The request's messages with each assistant's ``tool_calls`` shaped for templates (:func:`template_calls`)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("tool_calls") is not None:
            m = {**m, "tool_calls": template_calls(m["tool_calls"], i)}
        out.append(m)
    return out


def _refused(req: ToolRequest, exc: Refused) -> Exception:
    p = f"tools[{req.index(exc.name)}].function.parameters"
    return bad(f"'{p}' (the tool {exc.name!r}): {exc}.", p, "invalid_tool_schema")


def check_tools(fmt: ToolFormat, req: ToolRequest) -> None:
    """400 for a tool whose argument names ``fmt`` cannot write (whatever ``tool_choice``: the reader could not read
    such a call back whole)."""
    for t in req.tools:
        try:
            fmt.check(t["function"]["name"], t["function"]["parameters"])
        except Refused as exc:
            raise _refused(req, exc) from None


def tools_grammar(tok: TokenBytes, fmt: ToolFormat, req: ToolRequest, answer: Any = None) -> Grammar:
    """The grammar of a call in ``fmt`` of the offered tools, arguments under each tool's schema: one call, or several
    when ``parallel_tool_calls`` allows (never for a named tool); with ``answer`` (a JSON schema: ``tool_choice``
    ``auto`` with a ``response_format``), either the call(s) or a JSON value valid under ``answer``."""
    control: set[int] = getattr(tok, "control", set())
    specials = {tok.tokens[i]: i for i in control if tok.tokens[i] and fmt.marker and tok.tokens[i] in MARKERS}
    reset = SPECIALS.set(specials)
    try:
        rules = fmt.forced(req.offered(), req.parallel and req.choice != "named")
    except Refused as exc:
        raise _refused(req, exc) from None
    finally:
        SPECIALS.reset(reset)
    top = ["start: calls"] if answer is None else \
        ["start: calls | answer", f"answer: %json {json.dumps(json_options(answer))}"]
    try:
        return Grammar.lark(tok, "\n".join([*top, *rules]), "the tools' call grammar")
    except GrammarError as exc:
        raise bad(f"{exc}.", "tools", "invalid_tool_schema") from None


def read_calls(fmt: ToolFormat, text: str, tools: list[dict[str, Any]], finish: str | None) -> Reading:
    """:meth:`ToolFormat.read`: the content, the whole calls ``text`` holds, and the finish reason."""
    return fmt.read(text, tools, finish)


def chat_message(choice: dict[str, Any], fmt: ToolFormat, text: str, tools: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """A non-streamed chat choice with the calls in ``text`` read out (``finish_reason`` ``tool_calls``)."""
    r = read_calls(fmt, text, tools, choice.get("finish_reason"))
    if not r.calls:
        return choice
    msg = {"role": "assistant", "content": r.content or None, "tool_calls": openai_calls(r.calls)}
    return {**choice, "message": msg, "finish_reason": r.finish}


class ToolStream:
    """A streamed choice's text with tools offered: text that cannot be the start of a call goes out as content at
    once; from where a call may begin it is held, and at the end read (:meth:`end`). What a client assembles is
    what :func:`chat_message` answers without streaming. Each piece costs time in its own length (the start marker
    is searched in the piece and the few characters before it), so a long stream stays linear."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]]) -> None:
        self.fmt, self.tools = fmt, tools
        self._all: list[str] = []      # every piece (joined once, at the end)
        self._n = 0                    # characters pushed
        self._cut = 0                  # where a call may begin (the start marker, or a piece of it at the end)
        self._content_end = 0          # the end of text[:_cut] without its trailing whitespace
        self._unsent: list[str] = []   # text[sent:] in pieces
        self.sent = 0
        self.held = not fmt.start      # calls may be anywhere (harmony): everything waits for the end

    def push(self, piece: str) -> str:
        if not piece:
            return ""
        self._all.append(piece)
        if self.held:
            return ""
        start = self.fmt.start
        self._n += len(piece)
        self._unsent.append(piece)
        base = self._cut  # the window searched: the text after what is known not to be a call (a piece of the
        # start marker at most) and the new piece
        window = "".join(self._all_tail(base))
        j = window.find(start)
        if j >= 0:
            cut = base + j
            self.held = True
        else:
            k = next((k for k in range(min(len(start) - 1, len(window)), 0, -1) if window.endswith(start[:k])), 0)
            cut = self._n - k
        covered = window[self._cut - base:cut - base]  # the text newly known not to be a call
        if covered.strip():
            self._content_end = self._cut + len(covered.rstrip())
        self._cut = cut
        return self._send(self._content_end)

    def _all_tail(self, base: int) -> list[str]:
        """The pieces that hold text[base:] (less than the start marker's length before the newest piece)."""
        out, at = [], self._n
        for p in reversed(self._all):
            out.append(p)
            at -= len(p)
            if at <= base:
                break
        out.reverse()
        if at < base:
            out[0] = out[0][base - at:]
        return out

    def _send(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        text = "".join(self._unsent)
        out, rest = text[:upto - self.sent], text[upto - self.sent:]
        self._unsent = [rest] if rest else []
        self.sent = upto
        return out

    def end(self, finish: str | None = "stop") -> tuple[str, list[Call], str | None]:
        """The content not sent yet, the calls, and the finish reason (``tool_calls`` with calls)."""
        r = read_calls(self.fmt, "".join(self._all), self.tools, finish)
        return r.content[self.sent:], r.calls, r.finish


def stream_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """The ``delta.tool_calls`` entries of ``calls``, as OpenAI streams them: the id, type and name with empty
    arguments, then the arguments."""
    out = []
    for k, c in enumerate(openai_calls(calls)):
        out.append({"index": k, "id": c["id"], "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": ""}})
        out.append({"index": k, "function": {"arguments": c["function"]["arguments"]}})
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[Call]) -> list[dict[str, Any]]:
    return [{"id": c.id or new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


__all__ = ["Call", "FORMATS", "HERMES", "NAME_RULE", "Reading", "ToolFormat", "ToolRequest", "ToolStream",
           "chat_message", "check_tools", "new_call_id", "openai_calls", "read_calls", "read_tools", "stream_calls",
           "template_calls", "template_messages", "template_tools", "tool_format", "tools_grammar"]
