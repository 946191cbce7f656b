"""Constrained decoding without a server: grammars (llguidance) over a generated model's vocabulary, drawn from
with random logits (a model whose free text is noise), checked by ``jsonschema`` and by the families' own chat
templates (the format a model is tuned to write is the one its template writes for an assistant's calls)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from helpers import WEATHER_TOOL  # noqa: E402

from ggml_hybrid.errors import GrammarError  # noqa: E402
from ggml_hybrid.gguf.store import GGUFStore  # noqa: E402
from ggml_hybrid.runtime.grammar import MAX_GRAMMAR_CHARS, Grammar, closed_schema  # noqa: E402
from ggml_hybrid.runtime.sampling import Sampler  # noqa: E402
from ggml_hybrid.server.tools import (  # noqa: E402
    FORMATS,
    ToolRequest,
    ToolStream,
    template_messages,
    tool_format,
    tools_grammar,
)
from ggml_hybrid.synthetic import write_model  # noqa: E402
from ggml_hybrid.text.chat import ChatTemplate  # noqa: E402
from ggml_hybrid.text.tokenizer import Tokenizer  # noqa: E402

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
FAMILY_TEMPLATES = {"hermes": "Qwen-Qwen3-0.6B.jinja", "qwen3_xml": "Qwen3.5-4B.jinja", "glm": "GLM-4.6.jinja",
                    "deepseek": "deepseek-ai-DeepSeek-V3.1.jinja",
                    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja", "harmony": "openai-gpt-oss-120b.jinja"}

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"]},
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "array": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["id", "tags"]},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"]},
    "optional": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "null"},
                                                  "z": {"type": "string", "maxLength": 5}}, "required": ["x"]},
    "anyof": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}, {"const": "fixed"}]},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    p = write_model(tmp_path_factory.mktemp("g") / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    t = Tokenizer.from_gguf(GGUFStore(str(p)))
    assert isinstance(t, Tokenizer)
    return t


def draw(tok: Any, grammar: Grammar, seed: int, limit: int = 3000, temperature: float = 1.0) -> tuple[str, bool]:
    """Random logits through the mask and the sampler, as the engine does: (text, ended at an end-of-generation
    token or the grammar's end)."""
    rng = np.random.default_rng(seed)
    c = grammar.constraint()
    s = Sampler(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    out: list[int] = []
    for _ in range(limit):
        t = s(c.mask(rng.standard_normal(tok.n_vocab) * 3))
        c.accept(t)
        if t in tok.eog_ids:
            return tok.decode(out), True
        out.append(t)
        if c.done:
            return tok.decode(out), True
    return tok.decode(out), False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_draw_under_a_schema_validates(tok, name):
    schema = SCHEMAS[name]
    g = Grammar.json_schema(tok, schema)
    for seed in range(8):
        text, ended = draw(tok, g, seed)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)


def test_sentencepiece_vocabulary(tmp_path):
    """Mixtral's SentencePiece vocabulary (byte tokens, the space prefix its encoder adds) under the same schemas."""
    p = write_model(tmp_path / "mx.gguf", arch="llama", vocab="spm", weight_type="q8_0", seed=4, vocab_size=512)
    spm = Tokenizer.from_gguf(GGUFStore(str(p)))
    for name in ("object", "nested", "anyof"):
        g = Grammar.json_schema(spm, SCHEMAS[name])
        for seed in range(3):
            text, ended = draw(spm, g, seed)
            assert ended, text
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_free_draws_are_not_json(tok):
    """The oracle can fail: the same noise without the mask is not JSON (so the mask is what makes it valid)."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        text = tok.decode([int(rng.integers(0, tok.n_vocab)) for _ in range(40)])
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_is_any_object(tok):
    g = Grammar.json_schema(tok, {"type": "object"})
    for seed in range(4):
        text, ended = draw(tok, g, seed, limit=4000)
        if ended:
            assert isinstance(json.loads(text), dict)


def test_greedy_under_a_schema(tok):
    text, ended = draw(tok, Grammar.json_schema(tok, SCHEMAS["enum"]), 0, temperature=0.0)
    assert ended and json.loads(text) in ("red", "green", "blue")


def test_gbnf(tok):
    g = Grammar.gbnf(tok, 'root ::= ("yes" | "no") " " [0-9]{1,3} "!"')
    for seed in range(6):
        text, ended = draw(tok, g, seed)
        assert ended
        word, num = text[:-1].split(" ")
        assert word in ("yes", "no") and num.isdigit() and 1 <= len(num) <= 3 and text.endswith("!")


def test_closed_schema_keeps_what_it_names():
    s = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}}},
         "$defs": {"x": {"properties": {"b": {}}}}, "anyOf": [{"properties": {}}]}
    c = closed_schema(s)
    assert c["additionalProperties"] is False
    assert "additionalProperties" not in c["properties"]  # the map of properties is not a schema
    assert c["properties"]["properties"]["additionalProperties"] is False
    assert c["$defs"]["x"]["additionalProperties"] is False and c["anyOf"][0]["additionalProperties"] is False
    assert closed_schema({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


@pytest.mark.parametrize("bad, msg", [
    ({"type": "objekt"}, "objekt"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}, "a"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no text can match it"),
    ({"type": "string", "format": "nonsense"}, "nonsense"),
])
def test_invalid_schemas_are_refused(tok, bad, msg):
    with pytest.raises(GrammarError, match=msg):
        Grammar.json_schema(tok, bad)


@pytest.mark.parametrize("text", ['root ::= (', 'root ::= "a', 'start ::= "x"', 'root ::= [z-a]',
                                  'root ::= undefined-rule', 'root ::= root', 'root ::= a\na ::= b\nb ::= a'])
def test_unparsable_grammars_are_refused(tok, text):
    with pytest.raises(GrammarError):
        Grammar.gbnf(tok, text)


def test_huge_schemas_are_refused_in_bounded_time(tok):
    import time

    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="characters"):
        Grammar.json_schema(tok, big)
    assert len(json.dumps(big)) > MAX_GRAMMAR_CHARS
    # under the size bound but past llguidance's bounds (alternatives of many long literals): refused, quickly
    wide = {"enum": [f"{i:05d}" * 40 for i in range(1200)]}
    try:
        Grammar.json_schema(tok, wide)
    except GrammarError:
        pass
    assert time.perf_counter() - t0 < 20


# -- hypothesis: schemas drawn ------------------------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "integer"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda xs: {"enum": xs}),
)


def _obj(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req}))


_schemas = st.recursive(_leaf, lambda ch: st.one_of(
    _obj(ch), st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, ch, st.integers(0, 3))),
    max_leaves=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_drawn_schemas(tok, schema, seed):
    text, ended = draw(tok, Grammar.json_schema(tok, schema), seed, limit=4000)
    assert ended, (schema, text)
    jsonschema.validate(json.loads(text), schema)


# -- tool formats -------------------------------------------------------------------------------------

TOOLS = [WEATHER_TOOL,
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _source(fmt: str) -> str:
    return (TEMPLATES / FAMILY_TEMPLATES[fmt]).read_text()


@pytest.mark.parametrize("fmt", sorted(FAMILY_TEMPLATES))
def test_each_template_is_recognised(fmt):
    assert tool_format(_source(fmt)).name == fmt


@pytest.mark.parametrize("fmt", sorted(FAMILY_TEMPLATES))
def test_calls_the_template_writes_parse_back(fmt):
    """The oracle is the family's own template: what it renders for an assistant's calls is what the model writes;
    the parser must read the same calls back."""
    t = ChatTemplate(_source(fmt), "<s>", "</s>")
    calls = [{"id": "abcdefghi", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}},
             {"id": "bcdefghij", "type": "function",
              "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 41})}}]
    if fmt == "harmony":
        calls = calls[:1]  # gpt-oss's template renders one call per assistant message
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = t.render(user, add_generation_prompt=True, tools=TOOLS)
    full = t.render(template_messages(user + [{"role": "assistant", "content": None, "tool_calls": calls}]),
                    add_generation_prompt=False, tools=TOOLS)
    k = 0
    while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
        k += 1
    written = full[k:]
    got = tool_format(_source(fmt)).calls(written, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], written


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_always_parse(tok, fmt, choice):
    f = next(x for x in FORMATS if x.name == fmt)
    req = ToolRequest(TOOLS, choice, "add" if choice == "named" else None, parallel=False)
    g = tools_grammar(tok, f, req)
    names = set()
    for seed in range(6):
        text, ended = draw(tok, g, seed)
        assert ended, text
        calls = f.calls(text, TOOLS)
        assert len(calls) == 1, text
        c = calls[0]
        names.add(c.name)
        tool = next(t for t in TOOLS if t["function"]["name"] == c.name)
        args = json.loads(c.arguments)
        jsonschema.validate(args, tool["function"]["parameters"])
        if choice == "named":
            assert c.name == "add"


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "deepseek"])
def test_forced_parallel_calls(tok, fmt):
    f = next(x for x in FORMATS if x.name == fmt)
    g = tools_grammar(tok, f, ToolRequest(TOOLS, "required", None, parallel=True))
    counts = []
    for seed in range(6):
        text, ended = draw(tok, g, seed, limit=6000)
        if ended:
            calls = f.calls(text, TOOLS)
            assert calls, text
            counts.append(len(calls))
    assert counts


@given(pieces=st.lists(st.text(alphabet="ab <_tolc>\n", max_size=6), max_size=12))
@settings(max_examples=200, deadline=None)
def test_streamed_content_is_the_unstreamed_content(pieces):
    """ToolStream's content, however the text is cut, is what the whole text parses to."""
    f = next(x for x in FORMATS if x.name == "hermes")
    tail = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    for text_pieces in (pieces, pieces + [tail[:7], tail[7:]]):
        s = ToolStream(f, TOOLS)
        sent = "".join(s.push(p) for p in text_pieces)
        rest, calls, _ = s.end()
        text = "".join(text_pieces)
        want = f.content(text) if f.calls(text, TOOLS) else text
        assert sent + rest == want
        assert [c.name for c in calls] == [c.name for c in f.calls(text, TOOLS)]


def test_forced_markers_that_are_control_tokens(tok, tmp_path):
    """A vocabulary that holds the call marker as one control token (Mistral's [TOOL_CALLS]): the forced grammar
    writes that token (llguidance never matches a control token to plain text), and the call parses."""
    import gguf
    from helpers import rewrite_gguf

    src = tmp_path / "base.gguf"
    write_model(src, arch="qwen3moe", weight_type="q8_0", seed=4)
    tokens = tok.tokens + ["[TOOL_CALLS]"]
    types = list(GGUFStore(str(src)).meta("tokenizer.ggml.token_type")) + [3]
    dst = rewrite_gguf(src, tmp_path / "mistral.gguf", set_keys={
        "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    mtok = Tokenizer.from_gguf(GGUFStore(dst))
    marker = len(tokens) - 1
    assert marker in mtok.control
    f = next(x for x in FORMATS if x.name == "mistral")
    g = tools_grammar(mtok, f, ToolRequest(TOOLS, "required", None, parallel=False))
    for seed in range(4):
        c = g.constraint()
        rng = np.random.default_rng(seed)
        first = int(np.argmax(c.mask(rng.standard_normal(mtok.n_vocab))))
        assert first == marker  # the only token that can start the call
        c.accept(first)
        text, ended = draw(mtok, _Continue(g, c), seed)
        calls = f.calls(mtok.decode([marker]) + text, TOOLS)
        assert ended and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments),
                            next(t for t in TOOLS if t["function"]["name"] == calls[0].name)["function"]["parameters"])


class _Continue:
    """A grammar stand-in whose constraint() is one already started (draw() goes on from it)."""

    def __init__(self, g, c):
        self.g, self.c = g, c

    def constraint(self):
        return self.c
