"""The families' tool-call formats: how a call is read back from the text, and the grammar that forces one.

| format | families | a call as the model writes it |
| --- | --- | --- |
| ``hermes`` | Qwen3, Qwen2.5 | ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` |
| ``qwen3_xml`` | Qwen3.5, Qwen3-Coder | ``<tool_call><function=N><parameter=K>V</parameter></function></tool_call>`` |
| ``glm`` | GLM-4.5/4.6 | ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` |
| ``deepseek`` | DeepSeek V3.1 | ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` |
| ``mistral`` | Mistral | ``[TOOL_CALLS][{"name": N, "arguments": {...}}]`` |
| ``harmony`` | gpt-oss | ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}`` |

**Reading** (:meth:`ToolFormat.parse`) scans the text once, left to right: each marker is looked for with ``str.find``
from where the scan stands (never searched again over text already passed) and each JSON value is read by the
``json`` module's decoder where it starts, so the work is linear in the text whatever it holds (no regular expression
that backtracks over model text). A call counts when it is whole: its arguments read and its end marker written. A
text that ends inside a call says so (:attr:`Parsed.open`), and a call whose end marker never came but whose
arguments are whole is :attr:`Parsed.unclosed` (gpt-oss ends a call with ``<|call|>``, an end-of-generation token
that is never text): :mod:`.tools` decides with the finish reason.

In the key/value formats (``qwen3_xml``, ``glm``) a value is raw text where the tool's schema allows only strings
(:func:`~.tool_schema.string_only`: its ``type``, a ``const``, an ``enum`` of strings), JSON otherwise, as the
families' templates write them; so a string ``const`` is not quoted and a string ``enum`` value ``"true"`` stays a
string.

**Forcing** (:attr:`ToolFormat.forced`): the format's grammar rules, from :mod:`.tool_grammar`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .tool_grammar import KeyValue, json_forced, parameters
from .tool_schema import string_only


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``
    id: str = ""


@dataclass
class Parsed:
    """The calls read from a text; ``open``: the text ends inside a call whose arguments are not whole (or not a
    call); ``unclosed``: the last call's arguments are whole, its end marker never came."""

    calls: list[Call] = field(default_factory=list)
    open: bool = False
    unclosed: bool = False


@dataclass(frozen=True)
class Reading:
    """What a generation's text answers with tools offered: the ``content``, the calls, the finish reason."""

    content: str
    calls: list[Call]
    finish: str | None


# -- reading ----------------------------------------------------------------------------------------

_WS = re.compile(r"\s*")  # anchored at a position: linear, no backtracking


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # NaN and Infinity are not JSON


class _Doc(str):
    """The text as the JSON decoder is given it: its errors count the lines before where they happened
    (``JSONDecodeError``'s ``lineno``/``colno``), which costs the length of the text so far at each failed read, and
    a text that holds many call openings fails many reads; nothing here reads those numbers, so they are not counted."""

    def count(self, *args: Any) -> int:
        return 0

    def rfind(self, *args: Any) -> int:
        return -1


def _ws(text: str, i: int) -> int:
    m = _WS.match(text, i)
    return m.end() if m else i


def _json_at(text: str, i: int) -> tuple[bool, Any, int]:
    """(read, the JSON value that starts at ``i``, where it ends)."""
    try:
        v, end = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return False, None, i
    return True, v, end


class _Text:
    """A text scanned left to right: each marker's next place is searched once per stretch of text (the place found
    stands until the scan passes it), so all the searches together read the text once per marker."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._next: dict[str, int] = {}

    def find(self, marker: str, pos: int) -> int:
        i = self._next.get(marker)
        if i is None or 0 <= i < pos:
            i = self.text.find(marker, pos)
            self._next[marker] = i
        return i

    def first(self, markers: tuple[str, ...], pos: int) -> int:
        found = [i for i in (self.find(m, pos) for m in markers) if i >= 0]
        return min(found) if found else -1


def _arguments(doc: Any) -> dict[str, Any] | None:
    """A call's arguments: an object (or JSON text of one, as some templates write it); None: not arguments."""
    if isinstance(doc, str):
        ok, v, end = _json_at(doc, _ws(doc, 0))
        if not ok or _ws(doc, end) != len(doc):
            return None
        doc = v
    return doc if isinstance(doc, dict) else None


def _call(name: Any, args: Any, cid: Any = "") -> Call | None:
    a = {} if args is None else _arguments(args)
    if not isinstance(name, str) or not name or a is None:
        return None
    return Call(name, json.dumps(a, ensure_ascii=False), cid if isinstance(cid, str) else "")


class _Cut(Exception):
    """The text ends inside a call."""


def _cut_off(text: str, p: int, marker: str) -> bool:
    """Whether the text from ``p`` is the start of ``marker`` cut by its end (or nothing)."""
    return len(text) - p < len(marker) and marker.startswith(text[p:])


def _json_calls(text: str, start: str, end: str, read: Callable[[Any], list[Call] | None]) -> Parsed:
    """A format whose calls are ``start`` JSON ``end`` (``end`` "": the JSON's own end closes the call); ``read``
    turns the JSON into calls (None: it is not a call)."""
    t, out, pos = _Text(text), Parsed(), 0
    while (i := t.find(start, pos)) >= 0:
        ok, doc, k = _json_at(text, _ws(text, i + len(start)))
        calls = read(doc) if ok else None
        if calls is not None:
            k = _ws(text, k)
            if not end or text.startswith(end, k):
                out.calls += calls
                pos = k + len(end)
                continue
            if k == len(text):
                out.calls += calls
                out.unclosed = True
                return out
        # no whole call here: it ends at its end marker (or where the next begins), or the text ends inside it
        e = t.find(end or start, i + len(start))
        if e < 0:
            out.open = True
            return out
        pos = e
    return out


def _parse_hermes(text: str, schemas: dict[str, Any]) -> Parsed:
    def read(d: Any) -> list[Call] | None:
        c = _call(d.get("name"), d.get("arguments")) if isinstance(d, dict) else None
        return None if c is None else [c]
    return _json_calls(text, "<tool_call>", "</tool_call>", read)


def _parse_mistral(text: str, schemas: dict[str, Any]) -> Parsed:
    def read(d: Any) -> list[Call] | None:
        calls = [_call(c.get("name"), c.get("arguments"), c.get("id", "")) if isinstance(c, dict) else None
                 for c in (d if isinstance(d, list) else [d])]
        return [c for c in calls if c is not None] if calls and None not in calls else None
    return _json_calls(text, "[TOOL_CALLS]", "", read)


_DS_CALLS, _DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
_DS_CALL, _DS_SEP, _DS_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>", \
    "<\uff5ctool\u2581call\u2581end\uff5c>"


def _named_json(text: str, name: str, j: int, ends: tuple[str, ...], out: Parsed) -> int | None:
    """A call named ``name`` whose JSON arguments start at ``j`` and end at one of ``ends``: appended to ``out``; the
    place after it (None: the text ended there; -1: not a whole call)."""
    ok, doc, k = _json_at(text, j)
    if not ok:
        return -1
    k = _ws(text, k)
    if text.startswith("```", k):  # a fence some DeepSeek versions write around the arguments
        k = _ws(text, k + 3)
    call = _call(name, doc)
    if call is None:
        return -1
    if k == len(text):
        out.calls.append(call)
        out.unclosed = True
        return None
    end = next((e for e in ends if text.startswith(e, k)), None)
    if end is None:
        return -1
    out.calls.append(call)
    return k


def _parse_deepseek(text: str, schemas: dict[str, Any]) -> Parsed:
    t, out, pos = _Text(text), Parsed(), 0
    while (i := t.find(_DS_CALL, pos)) >= 0:
        sep = t.find(_DS_SEP, i + len(_DS_CALL))
        if sep < 0:
            out.open = True
            return out
        j = _ws(text, sep + len(_DS_SEP))
        if text.startswith("```json", j):
            j = _ws(text, j + 7)
        k = _named_json(text, text[i + len(_DS_CALL):sep].strip(), j, (_DS_END,), out)
        if k is None:
            return out
        e = k if k >= 0 else t.find(_DS_END, j)
        if e < 0:
            out.open = True
            return out
        pos = e + len(_DS_END)
    return out


_H_NAME = re.compile(r"[A-Za-z0-9_-]*")
_H_ENDS = ("<|call|>", "<|end|>", "<|start|>", "<|channel|>", "<|return|>")


def _parse_harmony(text: str, schemas: dict[str, Any]) -> Parsed:
    t, out, pos = _Text(text), Parsed(), 0
    while (i := t.find("to=functions.", pos)) >= 0:
        m = _H_NAME.match(text, i + 13)
        ne = m.end() if m else i + 13
        body = t.find("<|message|>", ne)
        if body < 0:
            out.open = True
            return out
        j = _ws(text, body + 11)
        # <|call|> ends generation, so a call the model ends is never closed in the text: unclosed, whole
        k = _named_json(text, text[i + 13:ne], j, _H_ENDS, out)
        if k is None:
            return out
        e = k if k >= 0 else t.first(_H_ENDS, j)
        if e < 0:
            out.open = True
            return out
        pos = e
    return out


def _harmony_content(text: str) -> str:
    """gpt-oss's final message (what a client reads as ``content`` beside calls); without one, nothing."""
    head = "<|channel|>final<|message|>"
    i = text.find(head)
    if i < 0:
        return ""
    e = _Text(text).first(("<|end|>", "<|return|>"), i + len(head))
    return text[i + len(head):e if e >= 0 else len(text)]


def _arg_schema(root: Any, key: str) -> Any:
    """The schema of argument ``key`` under the tool's ``parameters`` (``additionalProperties`` for a key it does not
    list)."""
    if not isinstance(root, dict):
        return {}
    props = root.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    extra = root.get("additionalProperties", True)
    return extra if isinstance(extra, dict) else {}


def _json_or_text(raw: str) -> Any:
    ok, v, end = _json_at(raw, _ws(raw, 0))
    return v if ok and _ws(raw, end) == len(raw) else raw


@dataclass(frozen=True)
class _KVText:
    """How a key/value format's text reads: ``head`` N (up to one of ``name_ends``, ``name_skip`` of it the
    format's), then per argument ``key_open`` K ``key_close`` [``value_open``] V ``value_close``, then ``end``;
    ``trim``: a value's first and last newline are the format's."""

    head: str
    name_ends: tuple[str, ...]
    name_skip: int
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    end: str
    trim: bool


def _kv_value(t: _Text, v: int, sp: _KVText, root: Any, schema: Any) -> tuple[Any, int]:
    """The value that starts at ``v`` and the place after its closing marker: raw text for a string-only schema,
    JSON otherwise (read by the decoder first, so a closing marker inside a JSON string does not end it)."""
    text = t.text
    raw_string = string_only(root, schema)
    if not raw_string:
        ok, val, k = _json_at(text, v)
        if ok:
            k2 = k + 1 if sp.trim and text.startswith("\n", k) else k
            if text.startswith(sp.value_close, k2):
                return val, k2 + len(sp.value_close)
    e = t.find(sp.value_close, v)
    if e < 0:
        raise _Cut
    raw = text[v:e]
    if sp.trim and raw.endswith("\n"):
        raw = raw[:-1]
    return (raw if raw_string else _json_or_text(raw)), e + len(sp.value_close)


def _kv_arg(t: _Text, p: int, sp: _KVText, root: Any) -> tuple[str, Any, int] | None:
    """The argument at ``p``: (key, value, the place after it); None: no argument there (_Cut: the text ends in
    it)."""
    text = t.text
    if not text.startswith(sp.key_open, p):
        if _cut_off(text, p, sp.key_open):
            raise _Cut
        return None
    ke = t.find(sp.key_close, p + len(sp.key_open))
    if ke < 0:
        raise _Cut
    key = text[p + len(sp.key_open):ke]
    v = ke + len(sp.key_close)
    if sp.value_open:
        v = _ws(text, v)
        if not text.startswith(sp.value_open, v):
            if _cut_off(text, v, sp.value_open):
                raise _Cut
            return None
        v += len(sp.value_open)
    if sp.trim and text.startswith("\n", v):
        v += 1
    val, after = _kv_value(t, v, sp, root, _arg_schema(root, key))
    return key, val, after


def _parse_kv(text: str, schemas: dict[str, Any], sp: _KVText) -> Parsed:
    t, out, pos = _Text(text), Parsed(), 0
    try:
        while (i := t.find(sp.head, pos)) >= 0:
            ne = t.first(sp.name_ends, i + len(sp.head))
            if ne < 0:
                raise _Cut
            name = text[i + len(sp.head):ne].strip()
            root = schemas.get(name)
            args: dict[str, Any] = {}
            p = ne + sp.name_skip
            while True:
                p = _ws(text, p)
                if text.startswith(sp.end, p):
                    if name:
                        out.calls.append(Call(name, json.dumps(args, ensure_ascii=False)))
                    pos = p + len(sp.end)
                    break
                got = _kv_arg(t, p, sp, root)
                if got is not None:
                    args[got[0]], p = got[1], got[2]
                    continue
                if _cut_off(text, p, sp.end):
                    raise _Cut
                e = t.find(sp.end, p)  # anything else: not a call, up to its end
                if e < 0:
                    raise _Cut
                pos = e + len(sp.end)
                break
    except _Cut:
        out.open = True
    return out


_QWEN3_XML_TEXT = _KVText("<function=", (">",), 1, "<parameter=", ">", "", "</parameter>", "</function>", True)
_GLM_TEXT = _KVText("<tool_call>", ("\n", "<"), 0, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                    "</tool_call>", False)


def _parse_qwen3_xml(text: str, schemas: dict[str, Any]) -> Parsed:
    return _parse_kv(text, schemas, _QWEN3_XML_TEXT)


def _parse_glm(text: str, schemas: dict[str, Any]) -> Parsed:
    return _parse_kv(text, schemas, _GLM_TEXT)


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format: how to tell it from its template, where calls start in the text, how to
    read them back, and the grammar rules (``calls``) that force one."""

    name: str
    marker: str                       # text of the template that identifies the family
    start: str                        # the text a call begins with ("" : calls may be anywhere: hold it all)
    parse: Callable[[str, dict[str, Any]], Parsed]
    forced: Callable[[list[dict[str, Any]], bool], list[str]]  # (tools offered, several calls) -> Lark rules
    kv: KeyValue | None = None        # the key/value formats' text and rules

    def read(self, text: str, tools: list[dict[str, Any]], finish: str | None = "stop") -> Reading:
        """The calls ``text`` holds (their key/value arguments typed by ``tools``' schemas), and the finish reason:
        ``tool_calls`` when it holds whole calls. A text that ends inside a call, or a call whose end marker never
        came in a text cut by ``max_tokens`` (``finish`` "length"), holds none: the text is the content and the finish
        reason stays (a client must not run a call with cut arguments)."""
        got = self.parse(_Doc(text), {t["function"]["name"]: parameters(t) for t in tools})
        if not got.calls or got.open or (got.unclosed and finish != "stop"):
            return Reading(text, [], finish)
        return Reading(self.content(text), got.calls, "tool_calls")

    def calls(self, text: str, tools: list[dict[str, Any]], finish: str | None = "stop") -> list[Call]:
        return self.read(text, tools, finish).calls

    def content(self, text: str) -> str:
        """The text a client sees as ``content`` beside the calls."""
        if self.name == "harmony":
            return _harmony_content(text)
        i = text.find(self.start) if self.start else -1
        return text if i < 0 else text[:i].rstrip()

    def check(self, name: str, parameters: Any) -> None:
        """Refused: a tool whose argument names this format cannot write."""
        if self.kv is not None:
            self.kv.check_keys(name, parameters)


_QWEN3_XML = KeyValue("qwen3_xml", lambda n: f"<tool_call>\n<function={n}>\n", lambda k: f"<parameter={k}>\n",
                      "\n</parameter>\n", "</parameter>", "</function>\n</tool_call>", ">")
_GLM = KeyValue("glm", lambda n: f"<tool_call>{n}\n", lambda k: f"<arg_key>{k}</arg_key>\n<arg_value>",
                "</arg_value>\n", "</arg_value>", "</tool_call>", "</arg_key>")

FORMATS = [
    ToolFormat("qwen3_xml", "<function=", "<tool_call>", _parse_qwen3_xml, _QWEN3_XML.forced, _QWEN3_XML),
    ToolFormat("glm", "<arg_key>", "<tool_call>", _parse_glm, _GLM.forced, _GLM),
    ToolFormat("deepseek", _DS_SEP, _DS_CALLS, _parse_deepseek,
               json_forced(lambda n: f"{_DS_CALL}{n}{_DS_SEP}", _DS_END, "", _DS_CALLS, _DS_CALLS_END)),
    ToolFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", _parse_mistral,
               json_forced(lambda n: f"{{\"name\": {json.dumps(n)}, \"arguments\": ", "}", ", ", "[TOOL_CALLS][",
                            "]")),
    # one call per message (its <|call|> ends the turn): never several
    ToolFormat("harmony", "<|channel|>", "", _parse_harmony, lambda tools, many: json_forced(
        lambda n: f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>", "", "")(tools, False)),
    ToolFormat("hermes", "<tool_call>", "<tool_call>", _parse_hermes,
               json_forced(lambda n: f"<tool_call>\n{{\"name\": {json.dumps(n)}, \"arguments\": ", "}\n</tool_call>",
                            "\n")),
]
HERMES = FORMATS[-1]
# the texts the forced grammars write that a vocabulary may hold as single control tokens
MARKERS = {"[TOOL_CALLS]", _DS_CALLS, _DS_CALL, _DS_SEP, _DS_END, _DS_CALLS_END, "<tool_call>", "</tool_call>",
           "<|channel|>", "<|constrain|>", "<|message|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"}


def tool_format(template_source: str) -> ToolFormat:
    """The family format of a chat template (Hermes' ``<tool_call>`` JSON when no marker is found: the most common,
    and what ChatML models are tuned on)."""
    for f in FORMATS:
        if f.marker in template_source:
            return f
    return HERMES


__all__ = ["Call", "FORMATS", "HERMES", "MARKERS", "Parsed", "Reading", "ToolFormat", "tool_format"]
