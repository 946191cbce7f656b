"""The server fuzzer's tool-call shapes (issue 40: E4, E6, E7, E8, E15): requests with tools against a model of each
family's tool-call format (the families' own chat templates, ``tests/fixtures/templates``).

A case is one chat request, drawn from ``(seed, i)`` alone, one of:

- ``cut``: a forced call (``required`` or a named tool) of a tool drawn from a few schemas (pydantic's ``$defs``,
  zod's ``definitions`` and ``#`` references, string ``const``/``enum`` that read as JSON, nested objects) with a
  small ``max_tokens``, so that most calls are cut by it; streamed or not;
- ``spaces``: tools offered (``auto``) and a GBNF ``grammar`` that forces the family's call opening and then a long
  run of whitespace (E4's shape);
- ``names``: a tool whose name or argument names a format cannot carry (a trailing newline, a dot, ``>``).

Besides the server's classes, an answer is ``bad_call`` when it says ``tool_calls`` with a call whose arguments are
not valid under its tool's schema (``jsonschema``), or gives calls with ``finish_reason`` ``length``.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

# the families' templates (each a format of server/tool_formats.py), as the tests keep them
TEMPLATES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "fixtures", "templates")
FAMILIES = {"hermes": "Qwen-Qwen3-0.6B.jinja", "qwen3_xml": "Qwen3.5-4B.jinja", "glm": "GLM-4.6.jinja",
            "deepseek": "deepseek-ai-DeepSeek-V3.1.jinja", "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            "harmony": "openai-gpt-oss-120b.jinja"}
# where a forced call in each format begins (the grammar of the `spaces` case forces it, then whitespace)
OPENINGS = {"hermes": "<tool_call>\n{\"name\": \"f\", \"arguments\": ", "qwen3_xml": "<tool_call>\n<function=f>\n",
            "glm": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>", "mistral": "[TOOL_CALLS][",
            "deepseek": "<\uff5ctool\u2581call\u2581begin\uff5c>f<\uff5ctool\u2581sep\uff5c>",
            "harmony": "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"}
SCHEMAS = [
    {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                        "required": ["city"]}},
     "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "home": {"$ref": "#/$defs/Addr"}},
     "required": ["name", "home"]},
    {"type": "object", "definitions": {"Id": {"type": "integer", "minimum": 0, "maximum": 99}},
     "properties": {"a": {"$ref": "#/definitions/Id"}, "b": {"$ref": "#/properties/a"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"speed": {"type": "string", "const": "fast"}, "flag": {"enum": ["true", "123"]},
                                      "n": {"enum": [1, 2]}}, "required": ["speed", "flag", "n"]},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {"v": {"type": "boolean"}},
                                            "required": ["v"]}}, "required": ["o"]},
]


def config(folder: str, base: str, n_ctx: int) -> str:
    """The server config entries of a model per format (``base`` with each family's template, written under
    ``folder``)."""
    from .server_cases import _with_template

    out = []
    for fmt, name in FAMILIES.items():
        path = os.path.join(folder, f"tools-{fmt}.gguf")
        with open(os.path.join(TEMPLATES, name)) as f:
            _with_template(base, path, f.read())
        out.append(f'[models.t-{fmt}]\npath = "{path}"\n[models.t-{fmt}.session_options]\nn_ctx = {n_ctx}\n'
                   'n_threads = 1\nn_parallel = 1\n')
    return "".join(out)


def body(rng: random.Random) -> tuple[dict[str, Any], str]:
    """A request body and what it is (``cut``, ``spaces`` or ``names``)."""
    fmt = rng.choice(sorted(FAMILIES))
    schema = rng.choice(SCHEMAS)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    if rng.random() < 0.5:
        tool["function"]["description"] = "a tool"
    b: dict[str, Any] = {"model": f"t-{fmt}", "messages": [{"role": "user", "content": "call it"}],
                         "stream": rng.random() < 0.4, "seed": rng.randint(0, 1000)}
    kind = rng.choices(["cut", "spaces", "names"], [60, 25, 15])[0]
    if kind == "cut":
        b.update(tools=[tool], tool_choice=rng.choice(["required", {"type": "function", "function": {"name": "f"}}]),
                 max_tokens=rng.choice([1, 3, 8, 16, 30, 60, 200]))
    elif kind == "spaces":
        run = rng.choice([" ", "\n", " \n", "\t"])
        b.update(tools=[tool], max_tokens=rng.choice([40, 120, 200]),
                 grammar=f"root ::= {json.dumps(OPENINGS[fmt])} \"a\" ws \"b\"\nws ::= {json.dumps(run)}*")
    else:
        name, key = rng.choice([("f\n", "a"), ("f.g", "a"), ("f", "a>b"), ("f", "a</arg_key>b"), ("x" * 65, "a")])
        tool = {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}}}
        b.update(tools=[tool], tool_choice="required", max_tokens=60)
    return b, kind


def check(b: dict[str, Any], doc: dict[str, Any] | None, stream: list[dict[str, Any]] | None) -> str | None:
    """What is wrong with an answer's calls (None: nothing): a call invalid under its tool's schema, or calls with
    ``finish_reason`` ``length``."""
    import jsonschema

    tools = {t["function"]["name"]: t["function"]["parameters"] for t in b.get("tools") or []}
    calls, finish = [], None
    if doc is not None:
        for c in doc.get("choices", []):
            calls += [tc["function"] for tc in (c.get("message") or {}).get("tool_calls") or []]
            finish = c.get("finish_reason")
    for ev in stream or []:
        for c in ev.get("choices", []):
            for tc in (c.get("delta") or {}).get("tool_calls") or []:
                f = tc.get("function") or {}
                if "name" in f:
                    calls.append({"name": f["name"], "arguments": ""})
                if calls and f.get("arguments"):
                    calls[-1]["arguments"] += f["arguments"]
            finish = c.get("finish_reason") or finish
    if calls and finish != "tool_calls":
        return f"calls with finish_reason {finish!r}"
    for c in calls:
        schema = tools.get(c["name"])
        if schema is None:
            return f"a call of {c['name']!r}, no such tool"
        try:
            jsonschema.validate(json.loads(c["arguments"]), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"a call of {c['name']!r} invalid under its schema: {str(exc)[:200]}"
    return None


__all__ = ["FAMILIES", "SCHEMAS", "body", "check", "config"]
