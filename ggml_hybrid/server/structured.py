"""Structured output: the request fields that constrain what is generated, read and compiled.

Three ways to ask, at most one per request:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (a JSON value valid
  under ``schema``); llama-server's ``{"type": "json_object", "schema": {...}}`` too;
- llama-server's ``json_schema`` (the schema itself);
- llama-server's ``grammar`` (GBNF text).

Each is compiled against the model's vocabulary (:class:`~ggml_hybrid.runtime.grammar.Grammar`, llguidance) before
the request is queued: a schema or grammar that does not compile, or passes a bound, is a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError, MissingDependencyError
from ..runtime.grammar import Grammar, TokenBytes
from .protocol import APIError, bad

MAX_SCHEMA_DEPTH = 64  # nesting of a schema's objects and arrays beyond this is refused before compiling


@dataclass(frozen=True)
class Structure:
    """What a request asks its text to be: ``kind`` is ``json_schema``, ``gbnf`` or ``lark``; ``param`` the field
    it came from (for errors)."""

    kind: str
    source: Any
    param: str


def depth(v: Any, limit: int) -> int:
    """The nesting depth of a JSON value, counted up to ``limit + 1`` (iteratively: no recursion limit to hit)."""
    stack = [(v, 1)]
    deepest = 0
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
    return deepest


def _schema(v: Any, param: str) -> dict[str, Any] | bool:
    if not isinstance(v, (dict, bool)):
        raise bad(f"'{param}' must be a JSON Schema (an object), got {type(v).__name__}.", param)
    if depth(v, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise bad(f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels.", param)
    return v


def read_structure(body: dict[str, Any]) -> Structure | None:
    """The structure a request body asks for (None: free text), its fields checked (400 otherwise)."""
    asks: list[Structure] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise bad("'response_format' must be an object such as {\"type\": \"json_object\"}.", "response_format")
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema")
            asks.append(Structure("json_schema", {"type": "object"} if schema is None else
                                  _schema(schema, "response_format.schema"), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("'response_format.json_schema' must be an object with a 'schema'.",
                          "response_format.json_schema")
            schema = js.get("schema", {})
            asks.append(Structure("json_schema", _schema(schema, "response_format.json_schema.schema"),
                                  "response_format.json_schema.schema"))
        elif kind != "text":
            raise bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                      "response_format.type")
    if body.get("json_schema") is not None:
        asks.append(Structure("json_schema", _schema(body["json_schema"], "json_schema"), "json_schema"))
    if body.get("grammar") is not None:
        g = body["grammar"]
        if not isinstance(g, str) or not g.strip():
            raise bad("'grammar' must be GBNF text (a non-empty string).", "grammar")
        asks.append(Structure("gbnf", g, "grammar"))
    if len(asks) > 1:
        given = ", ".join(a.param for a in asks)
        raise bad(f"give one of 'response_format', 'json_schema' and 'grammar' (got {given}).", asks[1].param)
    return asks[0] if asks else None


def schema_structure(v: Any, param: str) -> Structure:
    """A JSON schema given in another API's field (``param``: Anthropic's ``output_config.format.schema``), checked
    as ``response_format``'s are."""
    return Structure("json_schema", _schema(v, param), param)


def compile_structure(tok: TokenBytes, st: Structure) -> Grammar:
    """``st`` compiled for ``tok``'s vocabulary (400 naming the field when it cannot be)."""
    try:
        if st.kind == "json_schema":
            return Grammar.json_schema(tok, st.source, f"'{st.param}'")
        if st.kind == "gbnf":
            return Grammar.gbnf(tok, st.source, f"'{st.param}'")
        return Grammar.lark(tok, st.source, f"'{st.param}'")
    except GrammarError as exc:
        raise bad(f"{exc}.", st.param, "invalid_grammar") from None
    except MissingDependencyError as exc:
        raise APIError(501, f"{exc}.", st.param, "unsupported_parameter") from None


__all__ = ["MAX_SCHEMA_DEPTH", "Structure", "compile_structure", "depth", "read_structure", "schema_structure"]
