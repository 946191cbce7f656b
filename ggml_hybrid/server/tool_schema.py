"""What a tool's ``parameters`` schema says, as the call formats need it: references followed and moved, the
schemas whose values are strings only, the root an object.

A tool's ``parameters`` is the root its own ``$ref``s point into (``#/$defs/Addr``, ``#/definitions/Id``,
``#/properties/a``, ``#``: what pydantic and zod-to-json-schema write). A format that compiles a part of it on its own
(the key/value formats compile each argument's value alone) gives that part the whole root under ``$defs``
(:func:`alone`), its pointers moved there (:func:`rebase`), so every reference still resolves.
"""

from __future__ import annotations

from typing import Any

from ..runtime.grammar_check import json_pointer as pointer  # the schema a local $ref points to

# the keywords whose values are schemas: one schema (or a list of them: ``items`` in drafts 4-7), or a map of them
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems", "anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
MAX_REF_STEPS = 64  # a chain of references longer than this is not followed (a cycle, or an attack)
ROOT_NAME = "tool_parameters"  # where :func:`alone` puts the root, under ``$defs``


def _each(v: Any, fn: Any) -> Any:
    """``fn`` over a schema or a list of schemas (anything else as it is)."""
    if isinstance(v, dict):
        return fn(v)
    if isinstance(v, list):
        return [fn(x) if isinstance(x, dict) else x for x in v]
    return v


def rebase(schema: Any, prefix: str) -> Any:
    """``schema`` with each local ``$ref`` (``#`` or ``#/...``) pointing ``prefix`` deeper (``#/$defs/x`` under
    prefix ``/$defs/r`` is ``#/$defs/r/$defs/x``); other references (anchors, other documents) as they are."""
    if not isinstance(schema, dict):
        return schema

    def go(s: dict[str, Any]) -> dict[str, Any]:
        return rebase(s, prefix)  # type: ignore[no-any-return]

    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + prefix + v[1:]
        elif k in _ONE:
            out[k] = _each(v, go)
        elif k in _MAP and isinstance(v, dict):
            out[k] = {n: _each(s, go) for n, s in v.items()}
        else:
            out[k] = v
    return out


def has_ref(schema: Any) -> bool:
    """Whether ``schema`` or a schema in it holds a ``$ref`` (iteratively: no recursion limit to hit)."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, list):
            stack.extend(s)
            continue
        if not isinstance(s, dict):
            continue
        if "$ref" in s or "$dynamicRef" in s or "$recursiveRef" in s:
            return True
        stack.extend(s[k] for k in _ONE if k in s)
        stack.extend(v for k in _MAP if isinstance(s.get(k), dict) for v in s[k].values())
    return False


def alone(root: dict[str, Any], schema: Any) -> Any:
    """``schema`` (a part of ``root``) as a document of its own: with the root under ``$defs`` and every pointer
    moved there when it refers to anything; as it is otherwise."""
    if not has_ref(schema) or not isinstance(schema, dict):
        return schema
    prefix = f"/$defs/{ROOT_NAME}"
    base = {k: v for k, v in root.items() if k != "$id"}  # an $id would make the copy a document of its own
    # its own $defs, if any, are reached through the root's copy now (every pointer was moved there)
    return {**rebase(schema, prefix), "$defs": {ROOT_NAME: rebase(base, prefix)}}


def resolved(root: Any, schema: Any) -> Any:
    """``schema`` with its ``$ref`` followed (a chain of them, up to :data:`MAX_REF_STEPS`) when it holds only a
    reference and annotations; itself otherwise."""
    for _ in range(MAX_REF_STEPS):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or set(schema) - ANNOTATIONS - {"$ref", "$defs", "definitions"}:
            return schema
        target = pointer(root, ref)
        if target is None:
            return schema
        schema = target
    return schema


# keywords that say nothing of which values are valid
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$anchor", "contentEncoding", "contentMediaType", "strict"}


def string_only(root: Any, schema: Any, depth: int = 0) -> bool:
    """Whether every value valid under ``schema`` is a string (its ``type``, ``const``, ``enum`` or branches say
    so): the key/value formats write such a value as raw text, and read raw text back as the string."""
    s = resolved(root, schema)
    if not isinstance(s, dict) or depth > MAX_REF_STEPS:
        return False
    t = s.get("type")
    if t == "string" or t == ["string"]:
        return True
    if "const" in s:
        return isinstance(s["const"], str)
    enum = s.get("enum")
    if isinstance(enum, list) and enum:
        return all(isinstance(e, str) for e in enum)
    for k in ("anyOf", "oneOf"):
        branches = s.get(k)
        if isinstance(branches, list) and branches and all(string_only(root, b, depth + 1) for b in branches):
            return True
    every = s.get("allOf")
    if isinstance(every, list) and any(string_only(root, b, depth + 1) for b in every):
        return True
    ref = s.get("$ref")
    return isinstance(ref, str) and string_only(root, pointer(root, ref), depth + 1)


def allows_object(schema: dict[str, Any]) -> bool:
    """Whether the root's ``type`` (when it has one) allows an object: a call's arguments are one."""
    t = schema.get("type")
    if t is None:
        return True
    return t == "object" or (isinstance(t, list) and "object" in t)


def as_object(schema: dict[str, Any]) -> dict[str, Any]:
    """The root as the schema of an object (``type: object``: its other types can never be a call's arguments)."""
    return {**schema, "type": "object"}


__all__ = ["ANNOTATIONS", "MAX_REF_STEPS", "allows_object", "alone", "as_object", "has_ref", "pointer", "rebase",
           "resolved", "string_only"]
