"""The checks a grammar or JSON schema passes before llguidance compiles it, and the child process that runs them
(run as a script: only the standard library and llguidance).

llguidance compiles a grammar by recursion in Rust: each rule a rule refers to, and each ``$ref`` a schema follows,
is a few stack frames deeper (measured: 2.4-3.4 KB of stack per level of a chain of rules or of ``$ref`` s, up to
9.7 KB where each hop also passes a ``properties``). A chain of 2,500 ``$ref`` s or 4,000 GBNF rules (about 100 KB,
well inside :data:`MAX_GRAMMAR_CHARS`) overflows an 8 MiB thread stack, and a stack overflow is a SIGSEGV that no
handler survives. So, before llguidance sees a text:

- its size is bounded (:data:`MAX_GRAMMAR_CHARS`), a schema's nesting too (:data:`MAX_SCHEMA_DEPTH`);
- its *levels* are counted (:func:`schema_levels`, :func:`grammar_levels`): the longest path through the schema's
  subschemas and the ``$ref`` s it follows, or through the rules a grammar's rules refer to (what the compiler
  recurses along), at most :data:`MAX_LEVELS`;
- a schema's numeric bounds must be numbers llguidance holds exactly (:data:`MAX_EXACT_INT`: it reads them as 64-bit
  floats and clamps integers to 64 bits, so ``"minimum": 1e30`` gave ``9223372036854775807``, and bounds near
  ``-2**63`` crashed it), and a client's schema may not carry llguidance's own options (``x-guidance``);
- then llguidance validates it (without a vocabulary) in *this* process, on a thread of :data:`CHECK_STACK` bytes of
  stack, under :data:`MEMORY_LIMIT` bytes of address space; the parent bounds each call's time and kills this
  process when it is exceeded (:mod:`.grammar_pool`). Whatever slips past the counts can only take this process
  down, which the parent reports as a refusal and replaces.

Protocol, on stdin/stdout: one JSON document per line. A request is ``{"kind": "json_schema" | "gbnf" | "lark",
"source": schema-or-text, "what": str}``; the answer ``{"ok": spec}`` (llguidance's grammar text, ready for
``LLMatcher``) or ``{"error": "bound" | "invalid" | "memory", "message": str}``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import IO, Any

MAX_GRAMMAR_CHARS = 256 << 10  # a grammar or schema text beyond this is refused before it is compiled
MAX_SCHEMA_DEPTH = 64          # nesting of a schema document's objects and arrays
MAX_SCHEMA_VALUES = MAX_GRAMMAR_CHARS // 2  # a JSON value takes 2 characters at least: more cannot fit the size
MAX_LEVELS = 1000              # the compiler's recursion: rule references or subschemas and $refs along one path
MAX_EXACT_INT = 1 << 53        # the largest integer a 64-bit float holds exactly (llguidance's numeric bounds)
CHECK_STACK = 64 << 20         # stack of the thread that validates here: MAX_LEVELS x 9.7 KB fits it 6 times
MEMORY_LIMIT = 2 << 30         # bytes of address space this process may map (llguidance and Python: ~200 MiB)
# llguidance's own bounds (its defaults are sized for one user's machine; these keep one request's compile under
# about a second and its lexer within tens of MiB)
LIMITS: dict[str, Any] = {"max_grammar_size": 200_000, "max_lexer_states": 50_000, "initial_lexer_fuel": 1_000_000,
          "step_lexer_fuel": 200_000, "step_max_items": 50_000}
# llguidance's documented speeds of the work its step limits count (lexer fuel: 14,000 a millisecond; Earley items:
# 20,000 a millisecond): a mask within those limits takes at most about their sum, 16.8 ms. Its Earley completions are
# not counted by them: an ambiguous grammar (``root ::= root root``) costs more with every token (0.4 s a token near
# 1,000 tokens) within every step limit. So the CPU time one token's grammar work takes (its mask, or taking the token)
# is bounded too, at twice that sum: past it the request ends with a GrammarError (runtime/grammar.py).
LEXER_FUEL_PER_MS = 14_000
ITEMS_PER_MS = 20_000
STEP_SECONDS = 2 * (LIMITS["step_lexer_fuel"] / LEXER_FUEL_PER_MS + LIMITS["step_max_items"] / ITEMS_PER_MS) / 1000
# JSON whitespace as llama.cpp's json-schema-to-grammar allows it: none, one space, or a newline and an indent
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class CheckError(ValueError):
    """A text refused here: ``kind`` is ``bound`` (over a bound this module sets) or ``invalid`` (llguidance's
    verdict, or a text that does not parse)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# -- JSON schemas ------------------------------------------------------------------------------------------

_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


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


def check_shape(v: Any, what: str) -> None:
    """Refuse a JSON value that nests deeper than :data:`MAX_SCHEMA_DEPTH` or holds more than
    :data:`MAX_SCHEMA_VALUES` values, stopping as soon as it knows (iteratively; Python bytecode, which lets other
    threads run, unlike a serializer's single call): what any other walk of a schema may then afford."""
    stack = [(v, 1)]
    n = 0
    while stack:
        x, d = stack.pop()
        n += 1
        if d > MAX_SCHEMA_DEPTH:
            raise CheckError("bound", f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if n > MAX_SCHEMA_VALUES:
            raise CheckError("bound", f"{what} holds more than {MAX_SCHEMA_VALUES} values (more than "
                                      f"{MAX_GRAMMAR_CHARS} characters)")
        if isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)


def check_options(schema: Any, what: str) -> None:
    """Refuse a request's schema that carries llguidance's own options (``x-guidance``, read at its top only)."""
    if isinstance(schema, dict) and "x-guidance" in schema:
        raise CheckError("bound", f"{what} carries 'x-guidance' (llguidance's own options: whitespace, separators, "
                                  "lenient, coerce_one_of): not accepted, since they let the text be other than JSON "
                                  "valid under the schema; the server sets them")


def json_pointer(root: Any, ref: str) -> Any:
    """The schema a local ``$ref`` (``#`` or ``#/json/pointer``) names in ``root``; None for any other ref."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _subschemas(node: Any, root: Any) -> Iterator[Any]:
    """The schemas ``node`` compiles into: its subschemas, and the target of its ``$ref`` (``$defs`` are not
    compiled where they stand, only where a ``$ref`` leads)."""
    if not isinstance(node, dict):
        return
    for k in _ONE:
        if isinstance(node.get(k), dict):
            yield node[k]
    for k in _MAP:
        if isinstance(node.get(k), dict):
            yield from (v for v in node[k].values() if isinstance(v, dict))
    for k in _LIST:
        if isinstance(node.get(k), list):
            yield from (v for v in node[k] if isinstance(v, dict))
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = json_pointer(root, ref)
        if isinstance(target, dict):
            yield target


def _longest(start: Any, children: Callable[[Any], Iterator[Any]],
             weight: Callable[[Any], int] = lambda node: 1) -> int:
    """The weight of the heaviest path from ``start`` down the graph ``children(node)`` lists (each node weighs
    ``weight(node)``, 1 unless told), each node's own weight-to-the-bottom computed once; an edge back to a node on
    the current path (a recursive schema or grammar, which the compiler closes with a placeholder) counts one.
    Iterative: a path may be far longer than Python's recursion."""
    memo: dict[int, int] = {}
    on_path = {id(start)}
    stack: list[list[Any]] = [[start, iter(children(start)), 0]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], _END)
        if child is _END:
            stack.pop()
            on_path.discard(id(frame[0]))
            memo[id(frame[0])] = total = frame[2] + weight(frame[0])
            if stack:
                stack[-1][2] = max(stack[-1][2], total)
            continue
        key = id(child)
        if key in memo:
            frame[2] = max(frame[2], memo[key])
        elif key in on_path:
            frame[2] = max(frame[2], 1)
        else:
            on_path.add(key)
            stack.append([child, iter(children(child)), 0])
    return memo[id(start)]


_END = object()


def schema_levels(schema: Any) -> int:
    """How deep llguidance's compiler recurses into ``schema``: the longest path through its subschemas and the
    ``$ref`` s they follow."""
    return _longest(schema, lambda node: _subschemas(node, schema))


def _schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object ``schema`` compiles (each once)."""
    seen: set[int] = set()
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            yield node
            todo.extend(_subschemas(node, schema))


def _check_bounds(node: dict[str, Any], what: str) -> None:
    kind = node.get("type")
    integral = kind is None or kind == "integer" or (isinstance(kind, list) and "integer" in kind)
    for k in _BOUNDS:
        v = node.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # llguidance names a bound of the wrong type itself
        if isinstance(v, float) and not math.isfinite(v):
            raise CheckError("bound", f"{what}: '{k}' is {v}: a bound must be a finite number")
        if abs(v) > MAX_EXACT_INT and (isinstance(v, int) or integral):
            raise CheckError("bound", f"{what}: '{k}' is {v}: numeric bounds of integers beyond +-2**53 "
                                      f"({MAX_EXACT_INT}) are refused (llguidance holds bounds as 64-bit floats, "
                                      "which do not hold such integers exactly, and clamps integers to 64 bits)")


def check_schema(schema: Any, what: str, client: bool = True) -> None:
    """Refuse (:class:`CheckError`) a JSON schema that nests too deep, compiles too many levels deep, carries bounds
    llguidance does not hold exactly or (``client``: a request's schema) llguidance's own ``x-guidance`` options."""
    check_shape(schema, what)
    if client:
        check_options(schema, what)
    levels = schema_levels(schema)
    if levels > MAX_LEVELS:
        raise CheckError("bound", f"{what}: its subschemas and $ref chains go {levels} levels deep; at most "
                                  f"{MAX_LEVELS} are compiled")
    for node in _schema_nodes(schema):
        _check_bounds(node, what)


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists ``properties`` and says
    nothing of others (llama.cpp's json-schema-to-grammar reads such schemas so: a model writes only the keys
    named). Whatever it allows is valid under ``schema`` too. Iterative: the nesting is bounded, not the width."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    todo = [out]
    while todo:
        node = todo.pop()
        if "properties" in node and "additionalProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = False
        for k in ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems"):
            if isinstance(node.get(k), dict):
                node[k] = dict(node[k])
                todo.append(node[k])
        for k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            if isinstance(node.get(k), dict):
                node[k] = {n: dict(v) if isinstance(v, dict) else v for n, v in node[k].items()}
                todo.extend(v for v in node[k].values() if isinstance(v, dict))
        for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(k), list):
                node[k] = [dict(v) if isinstance(v, dict) else v for v in node[k]]
                todo.extend(v for v in node[k] if isinstance(v, dict))
    return out


def json_options(schema: Any) -> Any:
    """``schema`` closed (:func:`closed_schema`) and carrying llguidance's JSON options (llama.cpp's whitespace), for
    a ``%json`` block of a Lark grammar or a schema compiled alone."""
    out = closed_schema(schema)
    if isinstance(out, dict):
        own = out.get("x-guidance")
        out = {**out, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, **(own if isinstance(own, dict) else {})}}
    elif out is True:
        out = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return out


# -- grammars --------------------------------------------------------------------------------------------------

# llguidance's Lark lexer (parser/src/lark/lexer.rs): the tokens that matter here; any other character is one token
_LARK_TOKEN = re.compile(r"""
    (?P<skip>(?:\#|//)[^\n]*|[ \t]+)
  | (?P<nl>(?:\r?\n)+[ \t]*)
  | (?P<block>%(?:json|llguidance|regex)\b)
  | (?P<string>"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})|[^"\\\x00-\x1f\x7f])*"i?)
  | (?P<regexp>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)
  | (?P<colon>::?)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def _lark_lines(text: str) -> Iterator[list[tuple[str, Any]]]:
    """A Lark grammar's lines as (kind, value) tokens: names, colons, ``%json`` blocks (their JSON value), the rest
    as ``other``; comments and whitespace dropped. A block's JSON may span lines: it is one token."""
    decoder = json.JSONDecoder()
    line: list[tuple[str, Any]] = []
    i = 0
    while i < len(text):
        m = _LARK_TOKEN.match(text, i)
        assert m is not None  # 'other' takes any character
        kind, tok = m.lastgroup or "other", m.group()
        i = m.end()
        if kind == "nl":
            yield line
            line = []
        elif kind == "block":
            j = len(text) - len(text[i:].lstrip())
            try:
                value, i = decoder.raw_decode(text, j)
            except ValueError:
                raise CheckError("invalid", f"a {tok} block that is not JSON (at character {j})") from None
            line.append(("json" if tok == "%json" else "other", value))
        elif kind != "skip":
            line.append((kind, tok))
    yield line


def lark_rules(text: str) -> tuple[dict[str, list[str]], dict[str, list[Any]]]:
    """A Lark grammar's rules and tokens: for each name defined, the names its definition refers to, in order, and
    the JSON schemas of its ``%json`` blocks. A definition is a line that starts with a name and has a ``:``
    (``name:``, ``name.2:``, ``name[stop=""]:``); a line without one continues the definition before it."""
    refs: dict[str, list[str]] = {}
    blocks: dict[str, list[Any]] = {}
    current: str | None = None
    for line in _lark_lines(text):
        body = line
        colon = next((k for k, (kind, tok) in enumerate(line) if kind == "colon" and tok == ":"), None)
        if line and line[0][0] == "name" and colon is not None:
            current = str(line[0][1]).lstrip("!?")
            refs.setdefault(current, [])
            blocks.setdefault(current, [])
            body = line[colon + 1:]
        if current is None:
            continue
        refs[current].extend(str(tok) for kind, tok in body if kind == "name")
        blocks[current].extend(tok for kind, tok in body if kind == "json")
    return refs, blocks


def _rule_levels(start: str, refs: dict[str, list[str]], blocks: dict[str, int]) -> int:
    """The heaviest path from ``start`` through the rules the rules refer to; a rule holding ``%json`` blocks has
    the deepest block's levels below it as well."""
    if start not in refs:
        return 1
    names = {n: [n] for n in refs}  # one object per rule: the graph's nodes are told apart by identity
    block_nodes = {n: ("%json", levels) for n, levels in blocks.items() if levels}

    def children(node: Any) -> Iterator[Any]:
        if isinstance(node, list):
            yield from (names[r] for r in refs[node[0]] if r in names)
            if node[0] in block_nodes:
                yield block_nodes[node[0]]

    return _longest(names[start], children, lambda node: node[1] if isinstance(node, tuple) else 1)


def lark_levels(text: str, what: str) -> int:
    """How deep llguidance's compiler recurses into a Lark grammar: the heaviest path from ``start`` through the
    rules (and tokens) their definitions refer to, a ``%json`` block counting its schema's levels; each block is
    checked as a schema (:func:`check_schema`, its ``x-guidance`` allowed: the grammar's author sets it)."""
    refs, blocks = lark_rules(text)
    levels: dict[str, int] = {}
    for name, schemas in blocks.items():
        for k, schema in enumerate(schemas):
            check_schema(schema, f"{what}: the %json block {k} of {name!r}", client=False)
        levels[name] = max((schema_levels(s) for s in schemas), default=0)
    return _rule_levels("start", refs, levels)


def gbnf_rules(text: str, what: str = "the grammar") -> dict[str, list[str]]:
    """A GBNF grammar's rules, read by llguidance's own GBNF reader: for each, the rules it refers to, in order."""
    from llguidance.gbnf_to_lark import GrammarParser, RuleRefNode

    try:
        rules = GrammarParser().parse(text)
    except RecursionError:
        raise CheckError("invalid", f"{what} is not valid GBNF: its groups nest too deep to read") from None
    except Exception as exc:  # llguidance's reader raises its own error class, and Python's
        raise CheckError("invalid", f"{what} is not valid GBNF: {exc}") from None
    out: dict[str, list[str]] = {}
    for name, rule in rules.items():
        found: list[str] = []
        todo: list[Any] = [rule.alternatives]
        while todo:
            node = todo.pop()
            if isinstance(node, RuleRefNode):
                found.append(node.name)
            todo.extend(reversed(node.children()))
        out[name] = found
    return out


def grammar_levels(text: str, what: str) -> int:
    """How deep llguidance's compiler recurses into a GBNF grammar (or a Lark one, which llguidance's GBNF reader
    passes on as it is): the heaviest path from ``root`` through the rules the rules refer to."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    if is_lark_syntax(text):
        return lark_levels(text, what)
    return _rule_levels("root", gbnf_rules(text, what), {})


# -- the child process ----------------------------------------------------------------------------------------

def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise CheckError("bound", f"{what} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")


def spec_of(kind: str, source: Any, what: str) -> str:
    """llguidance's grammar text for ``source`` (a ``json_schema``, ``gbnf`` or ``lark`` text), after the checks
    above (:class:`CheckError` when one refuses it)."""
    import llguidance

    if kind == "json_schema":
        _check_size(json.dumps(source), what)
        check_schema(source, what)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_options(source)))
        except ValueError as exc:
            raise CheckError("invalid", f"{what}: {exc}") from None
    if not isinstance(source, str):
        raise CheckError("invalid", f"{what} must be text, got {type(source).__name__}")
    _check_size(source, what)
    levels = grammar_levels(source, what) if kind == "gbnf" else lark_levels(source, what)
    if levels > MAX_LEVELS:
        raise CheckError("bound", f"{what}: its rules refer to rules {levels} levels deep; at most {MAX_LEVELS} "
                                  "are compiled")
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(source)
    try:
        return llguidance.grammar_from("gbnf", source)
    except (ValueError, RecursionError) as exc:
        raise CheckError("invalid", f"{what} is not valid GBNF: {exc}") from None


def validate(spec: str, what: str, stack: int = CHECK_STACK) -> None:
    """llguidance's verdict on ``spec`` without a vocabulary, reached on a thread of ``stack`` bytes of stack (the
    parent's compile thread has several times :data:`CHECK_STACK`)."""
    import llguidance

    verdict: list[str] = []

    def run() -> None:
        limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        verdict.append(llguidance.LLMatcher.validate_grammar(spec, None, limits=limits))

    with _STACK_LOCK:
        old = threading.stack_size(stack)
        try:
            t = threading.Thread(target=run, name="grammar-check")
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if not verdict:
        raise CheckError("invalid", f"{what}: llguidance failed on it")
    if verdict[0]:
        raise CheckError("invalid", f"{what}: {verdict[0]}")


_STACK_LOCK = threading.Lock()  # threading.stack_size is the process's: set, start, restore, one at a time


def handle(req: dict[str, Any]) -> dict[str, Any]:
    what = str(req.get("what", "the grammar"))
    try:
        spec = spec_of(str(req["kind"]), req["source"], what)
        validate(spec, what, min(max(int(req.get("stack", CHECK_STACK)), 64 << 10), CHECK_STACK))
    except CheckError as exc:
        return {"error": exc.kind, "message": str(exc)}
    except MemoryError:
        return {"error": "memory", "message": f"{what}: checking it needed more memory than the checker may use"}
    except RecursionError:
        return {"error": "invalid", "message": f"{what}: it nests too deep to read"}
    except UnicodeError:  # a lone surrogate, which llguidance (Rust text) cannot hold
        return {"error": "invalid", "message": f"{what} is not valid Unicode text"}
    return {"ok": spec}


def _limit_self() -> None:
    """An address-space bound, Ctrl-C left to the parent, and (Linux) an end with the parent thread that started
    this process: PR_SET_PDEATHSIG follows that thread, which here is the compile thread that owns this checker for
    its whole life (the template renderer, started from threads that end sooner, watches a lifeline pipe instead)."""
    import resource
    import signal

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):  # a platform without it: the parent's time limit still holds
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(inp: IO[str], out: IO[str]) -> None:
    """Answer requests, one JSON line each, until ``inp`` ends."""
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in inp:
        try:
            req = json.loads(line)
        except ValueError:
            return
        out.write(json.dumps(handle(req), ensure_ascii=False) + "\n")
        out.flush()


def main() -> None:
    _limit_self()
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
