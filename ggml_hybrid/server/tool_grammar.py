"""The grammars that force a tool call in a family's format (:mod:`.tool_formats` reads calls back).

Each builds Lark rules (llguidance's dialect) whose rule ``calls`` is one call (or several) of the tools given, the
arguments under each tool's ``parameters`` with the root kept as the root of every ``%json`` block
(:func:`~.tool_schema.alone`), so ``$defs``/``$ref`` resolve. The JSON formats write the arguments as one JSON value
(:func:`json_forced`); the key/value formats (:class:`KeyValue`) write the required keys in order, a string-only value
as raw text (its length, pattern, ``enum`` and ``const`` kept), any other as JSON. What a format cannot force a call
valid under is refused (:class:`Refused`).
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..runtime.grammar import json_options
from .tool_schema import ANNOTATIONS, alone, as_object, resolved, string_only


class Refused(Exception):
    """A tool a format cannot carry (or cannot force a valid call of): ``name`` the tool, the message the rule."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


# the vocabulary's control tokens by text while a forced grammar is built (tools.tools_grammar): a marker that is one
# control token (Mistral's [TOOL_CALLS], DeepSeek's <｜tool▁calls▁begin｜> in files that mark them so) must be that
# token in the grammar, since llguidance never matches a control token to plain text
SPECIALS: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("tool_specials", default=None)


def lark_str(s: str) -> str:
    """``s`` as a Lark literal; the control tokens written in it as themselves (``<[id]>``)."""
    specials = SPECIALS.get()
    if not specials:
        return json.dumps(s)
    pat = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
    parts = [f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in re.split(f"({pat})", s) if p]
    if not parts:
        return '""'
    return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


def _lit(s: str) -> list[str]:
    return [lark_str(s)] if s else []


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters``, as the schema of an object."""
    return as_object(tool["function"].get("parameters") or {})


def _json_block(schema: Any) -> str:
    return f"%json {json.dumps(json_options(schema))}"


def json_forced(prefix: Callable[[str], str], suffix: str, between: str, open_: str = "", close: str = ""
                 ) -> Callable[[list[dict[str, Any]], bool], list[str]]:
    """Formats whose arguments are one JSON object: ``open_ call (between call)* close``, each call its name's
    ``prefix``, the arguments under the tool's schema (the root of the ``%json`` block), then ``suffix``."""
    def build(tools: list[dict[str, Any]], many: bool) -> list[str]:
        alts = [" ".join([f"call{k}:", *_lit(prefix(t["function"]["name"])), _json_block(parameters(t)),
                          *_lit(suffix)]) for k, t in enumerate(tools)]
        rest = f"({' '.join([*_lit(between), 'call'])})*" if many else ""
        return [" ".join(["calls:", *_lit(open_), "call", rest, *_lit(close)]),
                "call: " + " | ".join(f"call{k}" for k in range(len(tools))), *alts]
    return build


# the root keywords a key/value call cannot follow (it writes the required keys, each value under its own schema)
_KV_ROOT_REFUSED = ("anyOf", "oneOf", "allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                    "dependencies", "propertyNames", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
                    "enum", "const")
_STRING_KEYS = {"type", "minLength", "maxLength", "pattern", "format"}


@dataclass(frozen=True)
class KeyValue:
    """A key/value format's text: ``head(N)``, per argument ``key(K)`` value ``value_end``, then ``tail``; a key must
    not hold ``key_stop`` (where the format ends a key), a raw value not ``value_close``."""

    fmt: str
    head: Callable[[str], str]
    key: Callable[[str], str]
    value_end: str
    value_close: str
    tail: str
    key_stop: str

    def check_keys(self, name: str, root: Any) -> None:
        """Refused: a key of the tool's that this format cannot write (the reader would end it early)."""
        if not isinstance(root, dict):
            return
        keys = [*(root.get("properties") or {}), *[k for k in root.get("required") or [] if isinstance(k, str)]]
        for k in keys:
            if self.key_stop in k:
                raise Refused(name, f"the {self.fmt} call format cannot carry the argument name {k!r}: a name "
                                    f"must not hold {self.key_stop!r}")

    def written(self, name: str, root: dict[str, Any]) -> list[tuple[str, Any]]:
        """The arguments a forced call writes (the required ones, in order) with their schemas; Refused when such a
        call could break the root's rules."""
        for kw in _KV_ROOT_REFUSED:
            if kw in root:
                raise Refused(name, f"the {self.fmt} call format writes each argument as a key/value element; a forced "
                                    f"call cannot follow the root's {kw!r}")
        req = [k for k in root.get("required") or [] if isinstance(k, str)]
        lo, hi = root.get("minProperties", 0), root.get("maxProperties")
        if (isinstance(lo, int) and lo > len(req)) or (isinstance(hi, int) and hi < len(req)):
            raise Refused(name, f"the {self.fmt} call format writes the {len(req)} required arguments only; a forced "
                                "call cannot follow the root's 'minProperties'/'maxProperties'")
        for pat in root.get("patternProperties") or {}:
            try:
                hit = [k for k in req if re.search(pat, k)]
            except re.error:
                hit = req
            if hit:
                raise Refused(name, f"the {self.fmt} call format cannot force 'patternProperties' {pat!r} on the "
                                    f"argument {hit[0]!r}")
        props = root.get("properties") or {}
        extra = root.get("additionalProperties", True)
        out = []
        for k in req:
            if k in props:
                out.append((k, props[k]))
            elif extra is False:
                raise Refused(name, f"no {self.fmt} call (nor any other) is valid: 'required' names {k!r}, which "
                                    "'properties' does not list and 'additionalProperties' forbids")
            else:
                out.append((k, extra if isinstance(extra, dict) else {}))
        return out

    def value(self, name: str, root: Any, schema: Any, term: str, rules: list[str]) -> str:
        """The grammar of one argument's value: raw text for a string-only schema, JSON otherwise."""
        if not string_only(root, schema):
            return _json_block(alone(root, schema) if isinstance(schema, (dict, bool)) else {})
        return self._raw(name, root, schema, term, rules, 0)

    def _raw(self, name: str, root: Any, schema: Any, term: str, rules: list[str], depth: int) -> str:
        s = resolved(root, schema)
        refuse = Refused(name, f"the {self.fmt} call format writes a string argument as raw text; a forced call cannot "
                               f"follow this string schema: {json.dumps(schema)[:200]}")
        if not isinstance(s, dict) or depth > 8:
            raise refuse
        lits = [s["const"]] if "const" in s else s.get("enum")
        if isinstance(lits, list):
            lits = _valid(root, schema, [x for x in lits if isinstance(x, str)])
            if not lits or any(self.value_close in x for x in lits):
                raise refuse
            return "(" + " | ".join(lark_str(x) for x in lits) + ")"
        if s.get("type") in ("string", ["string"]) and not set(s) - ANNOTATIONS - _STRING_KEYS:
            return self._regex(s, term, rules, refuse)
        if isinstance(s.get("anyOf"), list) and not set(s) - ANNOTATIONS - {"anyOf", "type"}:
            return "(" + " | ".join(self._raw(name, root, b, f"{term}_{i}", rules, depth + 1)
                                    for i, b in enumerate(s["anyOf"])) + ")"
        raise refuse

    @staticmethod
    def _regex(s: dict[str, Any], term: str, rules: list[str], refuse: Refused) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if not isinstance(lo, int) or isinstance(lo, bool) or (hi is not None and not isinstance(hi, int)):
            raise refuse
        span = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}" if lo else "*"
        parts = [f"/[^<]{span}/"]
        pat = s.get("pattern")
        if isinstance(pat, str):  # JSON Schema's pattern is a search: anchored only where it says so
            head = pat.startswith("^")
            tail = pat.endswith("$") and not pat.endswith("\\$")
            core = pat[1 if head else 0:len(pat) - 1 if tail else len(pat)]
            parts.append("/" + ("" if head else "(.|\\n)*") + "(" + _slashes(core) + ")" +
                         ("" if tail else "(.|\\n)*") + "/")
        rules.append(f"{term}: " + " & ".join(parts))
        return term

    def forced(self, tools: list[dict[str, Any]], many: bool) -> list[str]:
        rules: list[str] = []
        alts = []
        for k, t in enumerate(tools):
            name = t["function"]["name"]
            root = parameters(t)
            self.check_keys(name, root)
            parts = _lit(self.head(name))
            for j, (key, schema) in enumerate(self.written(name, root)):
                parts += [*_lit(self.key(key)), self.value(name, root, schema, f"V{k}_{j}", rules),
                          *_lit(self.value_end)]
            alts.append(f"call{k}: " + " ".join([*parts, *_lit(self.tail)]))
        calls = "call (" + lark_str("\n") + " call)*" if many else "call"
        return [f"calls: {calls}", "call: " + " | ".join(f"call{k}" for k in range(len(tools))), *alts, *rules]


def _slashes(regex: str) -> str:
    """``regex`` with each unescaped ``/`` escaped (a Lark regex literal ends at one)."""
    out, esc = [], False
    for ch in regex:
        out.append("\\/" if ch == "/" and not esc else ch)
        esc = ch == "\\" and not esc
    return "".join(out)


def _valid(root: Any, schema: Any, values: list[str]) -> list[str]:
    """The ``values`` valid under ``schema`` (a part of ``root``); all of them without jsonschema (the server extra
    brings it) or when it cannot read the schema (the grammar compiler then names what is wrong with it)."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        return values
    doc = alone(root, schema)
    try:
        v = jsonschema.validators.validator_for(doc, default=jsonschema.Draft202012Validator)(doc)
        return [x for x in values if v.is_valid(x)]
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.RefResolutionError, RecursionError):
        return values


__all__ = ["KeyValue", "Refused", "SPECIALS", "json_forced", "lark_str", "parameters"]
