"""Structured output: the request fields that constrain what is generated, read and compiled.

Three ways to ask, at most one per request:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (a JSON value valid
  under ``schema``); llama-server's ``{"type": "json_object", "schema": {...}}`` too;
- llama-server's ``json_schema`` (the schema itself);
- llama-server's ``grammar`` (GBNF text).

Each is compiled against the model's vocabulary (:class:`~ggml_hybrid.runtime.grammar.Grammar`, llguidance) before
the request is queued, in the compile pool (checked in a child process, then compiled on a thread of its own:
:mod:`~ggml_hybrid.runtime.grammar_pool`), never on the threads that tokenize and render: a schema or grammar that does
not compile, passes a bound (:mod:`~ggml_hybrid.runtime.grammar_check`) or outruns the compile's time is a 400 naming
the field. A schema's shape is checked here as soon as the body is read (its nesting and size, no ``x-guidance``),
the rest with the compile; and ``stop`` strings are refused with a structure: the grammar ends the text where it is
whole, and a stop string could only cut it where it does not parse (OpenAI answers ``"stop"`` then; here ``"stop"``
always parses).
A grammar that llguidance cannot continue mid-generation fails that request with the same typed 400
(:func:`generation_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import GrammarError, MissingDependencyError
from ..runtime.engine import Request
from ..runtime.grammar import Grammar, TokenBytes
from ..runtime.grammar_check import MAX_SCHEMA_DEPTH, CheckError, check_options, check_shape, depth
from .protocol import APIError, Generation, bad


@dataclass(frozen=True)
class Structure:
    """What a request asks its text to be: ``kind`` is ``json_schema``, ``gbnf`` or ``lark``; ``param`` the field
    it came from (for errors)."""

    kind: str
    source: Any
    param: str


def check_schema_field(v: Any, param: str, code: str = "invalid_grammar") -> dict[str, Any] | bool:
    """``v`` if it can be a JSON Schema this server compiles (an object or a boolean, nested at most
    ``MAX_SCHEMA_DEPTH`` deep, not too large, no ``x-guidance``); a 400 naming ``param`` otherwise. What costs a walk
    of the schema's references (its levels, its bounds) is checked with the compile, off the event loop."""
    if not isinstance(v, (dict, bool)):
        raise bad(f"'{param}' must be a JSON Schema (an object), got {type(v).__name__}.", param)
    try:
        check_shape(v, f"'{param}'")
        check_options(v, f"'{param}'")
    except CheckError as exc:
        raise bad(f"{exc}.", param, code) from None
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
            asks.append(Structure("json_schema", {"type": "object"}, "response_format") if schema is None else
                        Structure("json_schema", check_schema_field(schema, "response_format.schema"),
                                  "response_format.schema"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("'response_format.json_schema' must be an object with a 'schema'.",
                          "response_format.json_schema")
            schema = js.get("schema", {})
            asks.append(Structure("json_schema", check_schema_field(schema, "response_format.json_schema.schema"),
                                  "response_format.json_schema.schema"))
        elif kind != "text":
            raise bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                      "response_format.type")
    if body.get("json_schema") is not None:
        asks.append(Structure("json_schema", check_schema_field(body["json_schema"], "json_schema"), "json_schema"))
    if body.get("grammar") is not None:
        g = body["grammar"]
        if not isinstance(g, str) or not g.strip():
            raise bad("'grammar' must be GBNF text (a non-empty string).", "grammar")
        asks.append(Structure("gbnf", g, "grammar"))
    if len(asks) > 1:
        given = ", ".join(a.param for a in asks)
        raise bad(f"give one of 'response_format', 'json_schema' and 'grammar' (got {given}).", asks[1].param)
    if asks:
        refuse_stops(asks[0], body.get("stop"), "stop")
    return asks[0] if asks else None


def refuse_stops(st: Structure, stops: Any, param: str) -> None:
    """A 400 when stop strings (``param``: ``stop``, Anthropic's ``stop_sequences``) come with a structure: the
    grammar ends the text where it is whole, and a stop string could only cut it where it does not parse."""
    items = [stops] if isinstance(stops, str) else stops if isinstance(stops, (list, tuple)) else []
    if any(isinstance(x, str) and x for x in items):  # empty ones stop nothing (the engine drops them)
        raise bad(f"'{param}' cannot be combined with '{st.param}': the grammar ends the text where it is whole, and "
                  "a stop string could only cut it where it does not parse (leave it out, or write the end into the "
                  "grammar).", param)


def schema_structure(v: Any, param: str) -> Structure:
    """A JSON schema given in another API's field (``param``: Anthropic's ``output_config.format.schema``), checked
    as ``response_format``'s are."""
    return Structure("json_schema", check_schema_field(v, param), param)


def compile_structure(tok: TokenBytes, st: Structure) -> Grammar:
    """``st`` compiled for ``tok``'s vocabulary (400 naming the field when it cannot be). Blocks until the compile
    pool answers (within its time): call it from a thread."""
    try:
        return Grammar.compile(tok, st.kind, st.source, f"'{st.param}'")
    except GrammarError as exc:
        raise bad(f"{exc}.", st.param, "invalid_grammar") from None
    except MissingDependencyError as exc:
        raise APIError(501, f"{exc}.", st.param, "unsupported_parameter") from None


def grammar_field(g: Generation) -> str | None:
    """The field a request's grammar came from (for its errors): its structure's, ``tools`` for a forced call."""
    if g.structure is not None:
        return str(g.structure.param)
    return "tools" if g.tools is not None and g.tools.forced else None


def failure(r: Request, param: str | None) -> APIError:
    """The answer to a request that ended without its text: failed (:func:`generation_error`), or stopped by the
    server's shutdown (503)."""
    if r.finish_reason == "error":
        return generation_error(r.exception, r.error, param)
    return APIError(503, "The server shut down before the request finished.", code="shutting_down")


def generation_error(exc: BaseException | None, error: str | None, param: str | None) -> APIError:
    """The answer to a generation that failed: its grammar's fault (llguidance could not go on: a right-recursive
    rule past llguidance's row limit, a mask over its work bound) is a 400 naming the field (``param``: the structure's,
    or ``tools`` for a forced call); anything else a 500 ``generation_failed``."""
    if isinstance(exc, GrammarError):
        return bad(f"The generation failed mid-way, its grammar's fault: {exc}.", param, "invalid_grammar")
    return APIError(500, f"Generation failed: {error}", code="generation_failed")


__all__ = ["MAX_SCHEMA_DEPTH", "Structure", "check_schema_field", "compile_structure", "depth", "failure",
           "generation_error", "grammar_field", "read_structure", "refuse_stops", "schema_structure"]
