"""Tool calling: OpenAI's ``tools`` and ``tool_choice``, the model family's call format, and calls parsed back.

The tools are given to the model's own chat template (it receives ``tools`` as Hugging Face templates do, and
assistant messages with ``tool_calls`` and ``tool`` messages with their results); what the model writes is
parsed back in its family's format (:data:`FORMATS`, recognised by a marker in the template):

| format | families | a call as the model writes it |
| --- | --- | --- |
| ``hermes`` | Qwen3, Qwen2.5 | ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` |
| ``qwen3_xml`` | Qwen3.5, Qwen3-Coder | ``<tool_call><function=N><parameter=K>V</parameter></function></tool_call>`` |
| ``glm`` | GLM-4.5/4.6 | ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` |
| ``deepseek`` | DeepSeek V3.1 | ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` |
| ``mistral`` | Mistral | ``[TOOL_CALLS][{"name": N, "arguments": {...}}]`` |
| ``harmony`` | gpt-oss | ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}`` |

``tool_choice`` ``required`` or a named function is enforced by a grammar (:meth:`ToolFormat.forced`) whose
arguments follow each tool's ``parameters`` schema, so a forced call always parses; ``auto`` leaves the model
free and parses what it writes; ``none`` renders no tools.
"""

from __future__ import annotations

import contextvars
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError
from ..runtime.grammar import Grammar, TokenBytes, json_options
from .protocol import bad
from .structured import check_schema_field

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
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


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``
    id: str = ""
    raw: bool = False  # key/value formats: every value still its text (typed by the tool's schema: :func:`typed`)


def typed(call: Call, tools: list[dict[str, Any]] | None) -> Call:
    """A key/value call's values typed: text where the tool's schema says string (or the value is not JSON), the
    JSON value otherwise (the templates write non-strings as JSON)."""
    if not call.raw:
        return call
    props: dict[str, Any] = {}
    for t in tools or []:
        if t["function"]["name"] == call.name:
            props = t["function"].get("parameters", {}).get("properties") or {}
    args = {}
    for k, v in json.loads(call.arguments).items():
        kind = props.get(k, {}).get("type") if isinstance(props.get(k), dict) else None
        args[k] = v if kind == "string" else _value(v)
    return Call(call.name, json.dumps(args, ensure_ascii=False), call.id)


def _check_schema(schema: Any, param: str) -> None:
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:  # the server extra brings it; without it the grammar compiler still checks the schema
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad(f"'{param}' is not a valid JSON Schema: {exc.message}", param, "invalid_tool_schema") from None


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
    seen: set[str] = set()
    checked = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad(f"'{p}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}.", p)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise bad(f"'{p}.function.name' must be 1-64 letters, digits, '_', '.' or '-', got {name!r}.",
                      f"{p}.function.name")
        if name in seen:
            raise bad(f"'{p}.function.name': the tool {name!r} is given twice.", f"{p}.function.name")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"'{p}.function.description' must be a string.", f"{p}.function.description")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"'{p}.function.parameters' must be a JSON Schema object.", f"{p}.function.parameters")
        check_schema_field(params, f"{p}.function.parameters", "invalid_tool_schema")  # bounds before llguidance
        _check_schema(params, f"{p}.function.parameters")
        fn: dict[str, Any] = {"name": name, "parameters": params}
        if desc is not None:
            fn["description"] = desc
        checked.append({"type": "function", "function": fn})
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


# -- formats --------------------------------------------------------------------------------------

def _json_call(name: str, args: Any) -> Call:
    return Call(name, json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _value(text: str) -> Any:
    """An XML-ish argument value: JSON when it parses as JSON (numbers, objects), else the text."""
    v = _loads(text)
    return text if v is None else v


def _parse_hermes(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
        doc = _loads(m.group(1))
        if isinstance(doc, dict) and isinstance(doc.get("name"), str):
            calls.append(_json_call(doc["name"], doc.get("arguments", {})))
    return calls


def _parse_qwen3_xml(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", text, re.S):
        args = dict(re.findall(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S))
        calls.append(Call(m.group(1).strip(), json.dumps(args, ensure_ascii=False), raw=True))
    return calls


def _parse_glm(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(r"<tool_call>\s*([^\n<]+)(.*?)(?:</tool_call>|$)", text, re.S):
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", m.group(2), re.S)
        calls.append(Call(m.group(1).strip(), json.dumps(dict(pairs), ensure_ascii=False), raw=True))
    return calls


_DS_CALL, _DS_SEP, _DS_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>", \
    "<\uff5ctool\u2581call\u2581end\uff5c>"
_DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"


def _parse_deepseek(text: str) -> list[Call]:
    calls = []
    pat = re.escape(_DS_CALL) + r"(?:function" + re.escape(_DS_SEP) + r")?(.*?)" + re.escape(_DS_SEP) + \
        r"\s*(?:```json\s*)?(.*?)\s*(?:```\s*)?(?:" + re.escape(_DS_END) + "|$)"
    for m in re.finditer(pat, text, re.S):
        args = _loads(m.group(2))
        if isinstance(args, str):  # a template that wrote the JSON text with tojson: a JSON string of it
            args = _loads(args)
        calls.append(_json_call(m.group(1).strip(), args))
    return calls


def _parse_mistral(text: str) -> list[Call]:
    calls = []
    for m in re.finditer(r"\[TOOL_CALLS\]\s*(\[.*\])", text, re.S):
        doc = _loads(m.group(1))
        for c in doc if isinstance(doc, list) else []:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                calls.append(Call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False),
                                  c["id"] if isinstance(c.get("id"), str) else ""))
    return calls


def _parse_harmony(text: str) -> list[Call]:
    calls = []
    end = r"(?:<\|call\|>|<\|end\|>|<\|start\|>|<\|channel\|>|$)"
    for m in re.finditer(r"to=functions\.([A-Za-z0-9_.-]+).*?<\|message\|>(.*?)" + end, text, re.S):
        calls.append(_json_call(m.group(1), _loads(m.group(2).strip())))
    return calls


def _harmony_content(text: str) -> str:
    m = re.search(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", text, re.S)
    if m:
        return m.group(1)
    return "" if "to=functions." in text else text


# the vocabulary's control tokens by text while a forced grammar is built (tools_grammar): a marker that is one
# control token (Mistral's [TOOL_CALLS], DeepSeek's <｜tool▁calls▁begin｜> in files that mark them so) must be that
# token in the grammar, since llguidance never matches a control token to plain text
_SPECIALS: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("tool_specials", default=None)


def _lark_str(s: str) -> str:
    """``s`` as a Lark literal; the control tokens written in it as themselves (``<[id]>``)."""
    specials = _SPECIALS.get()
    if not specials:
        return json.dumps(s)
    pat = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
    parts = [f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in re.split(f"({pat})", s) if p]
    if not parts:
        return '""'
    return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


def _args_schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = tool["function"].get("parameters") or {"type": "object"}
    return schema


def _hermes_forced(tools: list[dict[str, Any]], many: bool) -> str:
    alts = []
    for k, t in enumerate(tools):
        schema = {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": _args_schema(t)},
                  "required": ["name", "arguments"], "additionalProperties": False}
        alts.append(f"call{k}: \"<tool_call>\\n\" %json {json.dumps(json_options(schema))} \"\\n</tool_call>\"")
    return _joined("call", " | ".join(f"call{k}" for k in range(len(tools))), alts, many, "\"\\n\"")


def _joined(rule: str, calls: str, alts: list[str], many: bool, sep: str) -> str:
    head = f"start: {rule} ({sep} {rule})*" if many else f"start: {rule}"
    return "\n".join([head, f"{rule}: {calls}", *alts])


def _json_args_forced(prefix: Callable[[str], str], suffix: str, between: str, open_: str = "", close: str = ""
                      ) -> Callable[[list[dict[str, Any]], bool], str]:
    """Formats whose arguments are one JSON object: ``open_ call (between call)* close``, each call its name's
    ``prefix``, the arguments under the tool's schema, then ``suffix``."""
    def lit(s: str) -> list[str]:
        return [_lark_str(s)] if s else []

    def build(tools: list[dict[str, Any]], many: bool) -> str:
        alts = [" ".join([f"call{k}:", *lit(prefix(t["function"]["name"])), "%json",
                          json.dumps(json_options(_args_schema(t))), *lit(suffix)]) for k, t in enumerate(tools)]
        calls = " | ".join(f"call{k}" for k in range(len(tools)))
        rest = f"({' '.join([*lit(between), 'call'])})*" if many else ""
        return "\n".join([" ".join(["start:", *lit(open_), "call", rest, *lit(close)]), f"call: {calls}", *alts])
    return build


def _xml_value(schema: Any) -> str:
    """The grammar of one key/value argument's value: a string as raw text (no '<', at most ``maxLength``), an enum
    of strings as its literals, anything else as JSON under its schema (the templates write values so)."""
    if isinstance(schema, dict):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            return "(" + " | ".join(_lark_str(e) for e in enum) + ")"
        if schema.get("type") == "string" and "const" not in schema:
            n = schema.get("maxLength")
            return f"/[^<]{{0,{int(n)}}}/" if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else "/[^<]*/"
    return f"%json {json.dumps(json_options(schema if isinstance(schema, (dict, bool)) else {}))}"


def _xml_forced(head: Callable[[str], str], arg: Callable[[str], tuple[str, str]], tail: str, between: str
                ) -> Callable[[list[dict[str, Any]], bool], str]:
    """Formats whose arguments are key/value elements: the schema's required properties in order, each value
    :func:`_xml_value`."""
    def build(tools: list[dict[str, Any]], many: bool) -> str:
        alts = []
        for k, t in enumerate(tools):
            props = _args_schema(t).get("properties") or {}
            req = [p for p in (_args_schema(t).get("required") or []) if p in props]
            parts = [_lark_str(head(t["function"]["name"]))]
            for p in req:
                a, b = arg(p)
                parts.append(f"{_lark_str(a)} {_xml_value(props[p])} {_lark_str(b)}")
            parts.append(_lark_str(tail))
            alts.append(f"call{k}: " + " ".join(parts))
        calls = " | ".join(f"call{k}" for k in range(len(tools)))
        body = f"start: call ({_lark_str(between)} call)*" if many else "start: call"
        return "\n".join([body, f"call: {calls}", *alts])
    return build


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format: how to tell it from its template, where calls start in the text, how to
    parse them, and the grammar that forces a call."""

    name: str
    marker: str                       # text of the template that identifies the family
    start: str                        # the text a call begins with ("" : calls may be anywhere: hold it all)
    parse: Callable[[str], list[Call]]
    forced: Callable[[list[dict[str, Any]], bool], str]  # (tools offered, several calls) -> Lark grammar

    def calls(self, text: str, tools: list[dict[str, Any]] | None) -> list[Call]:
        """The calls in ``text``, their arguments typed by ``tools``' schemas."""
        return [typed(c, tools) for c in self.parse(text)]

    def content(self, text: str) -> str:
        """The text a client sees as ``content`` beside the calls."""
        if self.name == "harmony":
            return _harmony_content(text)
        i = text.find(self.start) if self.start else -1
        return text if i < 0 else text[:i].rstrip()


FORMATS = [
    ToolFormat("qwen3_xml", "<function=", "<tool_call>", _parse_qwen3_xml,
               _xml_forced(lambda n: f"<tool_call>\n<function={n}>\n",
                           lambda p: (f"<parameter={p}>\n", "\n</parameter>\n"), "</function>\n</tool_call>", "\n")),
    ToolFormat("glm", "<arg_key>", "<tool_call>", _parse_glm,
               _xml_forced(lambda n: f"<tool_call>{n}\n", lambda p: (f"<arg_key>{p}</arg_key>\n<arg_value>",
                                                                      "</arg_value>\n"), "</tool_call>", "\n")),
    ToolFormat("deepseek", _DS_SEP, _DS_CALLS, _parse_deepseek,
               _json_args_forced(lambda n: f"{_DS_CALL}{n}{_DS_SEP}", _DS_END, "", _DS_CALLS,
                                 "<\uff5ctool\u2581calls\u2581end\uff5c>")),
    ToolFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", _parse_mistral,
               _json_args_forced(lambda n: f"{{\"name\": {json.dumps(n)}, \"arguments\": ", "}", ", ",
                                 "[TOOL_CALLS][", "]")),
    # one call per message (its <|call|> ends the turn): never several
    ToolFormat("harmony", "<|channel|>", "", _parse_harmony, lambda tools, many: _json_args_forced(
        lambda n: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>", "", "")(tools, False)),
    ToolFormat("hermes", "<tool_call>", "<tool_call>", _parse_hermes, _hermes_forced),
]
HERMES = FORMATS[-1]
# the texts the forced grammars write that a vocabulary may hold as single control tokens
_MARKERS = {"[TOOL_CALLS]", _DS_CALLS, _DS_CALL, _DS_SEP, _DS_END, "<\uff5ctool\u2581calls\u2581end\uff5c>",
            "<tool_call>", "</tool_call>", "<|channel|>", "<|constrain|>", "<|message|>", "<arg_key>", "</arg_key>",
            "<arg_value>", "</arg_value>"}


def tool_format(template_source: str) -> ToolFormat:
    """The family format of a chat template (Hermes' ``<tool_call>`` JSON when no marker is found: the most common,
    and what ChatML models are tuned on)."""
    for f in FORMATS:
        if f.marker in template_source:
            return f
    return HERMES


def template_messages(messages: list[Any]) -> list[Any]:
    """The request's messages with each assistant's ``tool_calls`` shaped for templates (:func:`template_calls`)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("tool_calls") is not None:
            m = {**m, "tool_calls": template_calls(m["tool_calls"], i)}
        out.append(m)
    return out


def tools_grammar(tok: TokenBytes, fmt: ToolFormat, req: ToolRequest) -> Grammar:
    """The grammar of a forced call (``tool_choice`` required or named) in ``fmt``: one call (several when
    ``parallel_tool_calls``) of the offered tools, arguments under each tool's schema."""
    control: set[int] = getattr(tok, "control", set())
    specials = {tok.tokens[i]: i for i in control if tok.tokens[i] and fmt.marker and tok.tokens[i] in _MARKERS}
    reset = _SPECIALS.set(specials)
    try:
        text = fmt.forced(req.offered(), req.parallel and req.choice == "required")
    finally:
        _SPECIALS.reset(reset)
    try:
        return Grammar.lark(tok, text, "the tools' call grammar")
    except GrammarError as exc:
        raise bad(f"{exc}.", "tools", "invalid_tool_schema") from None


def chat_message(choice: dict[str, Any], fmt: ToolFormat, text: str, tools: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """A non-streamed chat choice with the calls in ``text`` parsed out (``finish_reason`` ``tool_calls``)."""
    calls = fmt.calls(text, tools)
    if not calls:
        return choice
    msg = {"role": "assistant", "content": fmt.content(text) or None, "tool_calls": openai_calls(calls)}
    return {**choice, "message": msg, "finish_reason": "tool_calls"}


class ToolStream:
    """A streamed choice's text with tools offered: text that cannot be the start of a call goes out as content at
    once; from where a call may begin it is held, and at the end parsed (:meth:`end`). What a client assembles is
    what :func:`chat_message` answers without streaming."""

    def __init__(self, fmt: ToolFormat, tools: list[dict[str, Any]]) -> None:
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> str:
        self.text += piece
        start = self.fmt.start
        if not start:
            return ""  # calls may be anywhere (harmony): everything waits for the end
        i = self.text.find(start)
        if i < 0:
            i = len(self.text)
            for k in range(min(len(start) - 1, len(self.text)), 0, -1):
                if self.text.endswith(start[:k]):
                    i -= k
                    break
        safe = len(self.text[:i].rstrip())  # trailing whitespace before a call is not content
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def end(self) -> tuple[str, list[Call]]:
        """The content not sent yet, and the calls."""
        calls = self.fmt.calls(self.text, self.tools)
        content = (self.fmt.content(self.text) if calls else self.text)
        return content[self.sent:], calls


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


__all__ = ["Call", "FORMATS", "HERMES", "ToolFormat", "ToolRequest", "ToolStream", "chat_message", "new_call_id",
           "openai_calls", "read_tools", "stream_calls", "template_calls", "template_messages", "tool_format",
           "tools_grammar", "typed"]
