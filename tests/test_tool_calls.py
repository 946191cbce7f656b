"""Tool calls in every family format, in-process (issues 39 and 40): schemas as pydantic and zod write them (``$defs``,
``definitions``, ``$ref``), forced calls valid under them (``jsonschema`` is the oracle), ``const`` and ``enum`` of the
schema's own type, keys and schemas a format cannot carry refused, calls cut by ``max_tokens`` answered as text, tools
without a description, tools with a ``response_format``, tool names as OpenAI's rule has them, and parsers whose work
grows linearly with the text (measured at n and 16n: a quadratic parser costs 256 times more, a linear one 16)."""

from __future__ import annotations

import enum
import json
import time
from typing import Annotated, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")

from pydantic import BaseModel, Field  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.gguf.store import GGUFStore  # noqa: E402
from ggml_hybrid.runtime.grammar import Grammar  # noqa: E402
from ggml_hybrid.runtime.sampling import Sampler  # noqa: E402
from ggml_hybrid.server.protocol import APIError  # noqa: E402
from ggml_hybrid.server.tools import (  # noqa: E402
    FORMATS,
    ToolRequest,
    ToolStream,
    chat_message,
    read_tools,
    tools_grammar,
)
from ggml_hybrid.synthetic import write_model  # noqa: E402
from ggml_hybrid.text.chat import ChatTemplate  # noqa: E402
from ggml_hybrid.text.tokenizer import Tokenizer  # noqa: E402

FMT = {f.name: f for f in FORMATS}
NAMES = sorted(FMT)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    p = write_model(tmp_path_factory.mktemp("tc") / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    t = Tokenizer.from_gguf(GGUFStore(str(p)))
    assert isinstance(t, Tokenizer)
    return t


def draw_ids(tok: Any, grammar: Grammar, seed: int, limit: int = 4000) -> tuple[list[int], bool]:
    """Random logits through the grammar's mask and a seeded sampler (as the engine does): the token ids, and
    whether the grammar ended (an end-of-generation token or its end) within ``limit``."""
    rng = np.random.default_rng(seed)
    c = grammar.constraint()
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    out: list[int] = []
    for _ in range(limit):
        t = s(c.mask(rng.standard_normal(tok.n_vocab) * 3))
        c.accept(t)
        if t in tok.eog_ids:
            return out, True
        out.append(t)
        if c.done:
            return out, True
    return out, False


def tool(name: str, params: dict[str, Any], description: str | None = "a tool") -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def checked(tools: list[dict[str, Any]], choice: Any = "required", parallel: bool = False) -> ToolRequest:
    req = read_tools({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})
    assert req is not None
    return req


def forced_calls(tok: Any, fmt: str, tools: list[dict[str, Any]], seeds: range, name: str | None = None
                 ) -> list[tuple[str, dict[str, Any]]]:
    """Forced calls drawn in ``fmt`` and read back the way the server reads them, each checked against its tool's
    schema by jsonschema."""
    req = checked(tools, {"type": "function", "function": {"name": name}} if name else "required")
    g = tools_grammar(tok, FMT[fmt], req)
    out = []
    for seed in seeds:
        ids, ended = draw_ids(tok, g, seed)
        text = tok.decode(ids)
        assert ended, text
        msg = chat_message({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"},
                           FMT[fmt], text, req.tools)
        assert msg["finish_reason"] == "tool_calls", text
        calls = msg["message"]["tool_calls"]
        assert len(calls) == 1, text
        fn = calls[0]["function"]
        args = json.loads(fn["arguments"])
        schema = next(t for t in tools if t["function"]["name"] == fn["name"])["function"]["parameters"]
        jsonschema.validate(args, schema)
        out.append((fn["name"], args))
    return out


# -- schemas as client libraries write them (issue 39 item 2, issue 40 E8) ---------------------------------------

class Colour(str, enum.Enum):
    red = "red"
    yes = "true"      # a string that reads as JSON: it must stay a string
    number = "123"


class Addr(BaseModel):
    street: str = Field(max_length=8)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    home: Addr
    colour: Colour
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=2)
    work: Addr | None = None


PYDANTIC = Person.model_json_schema()
# zod-to-json-schema's shapes: `definitions`, a reference to another property, and the root referred to by "#"
ZOD = {"type": "object", "definitions": {"Id": {"type": "integer", "minimum": 1, "maximum": 9}},
       "properties": {"a": {"$ref": "#/definitions/Id"},
                      "b": {"$ref": "#/properties/a"},
                      "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
       "required": ["a", "b"], "additionalProperties": False}


def test_the_schemas_are_what_the_libraries_write():
    assert "$defs" in PYDANTIC and PYDANTIC["properties"]["home"] == {"$ref": "#/$defs/Addr"}
    assert PYDANTIC["properties"]["colour"] == {"$ref": "#/$defs/Colour"}


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("schema", [PYDANTIC, ZOD], ids=["pydantic", "zod"])
def test_forced_calls_with_references_are_valid(tok, fmt, schema):
    calls = forced_calls(tok, fmt, [tool("save", schema)], range(4))
    for _, args in calls:
        if "colour" in args:
            assert args["colour"] in ("red", "true", "123")  # strings, as the enum says


@pytest.mark.parametrize("fmt", NAMES)
def test_strict_and_nested_objects(tok, fmt):
    params = {"type": "object", "properties": {
        "outer": {"type": "object", "properties": {"inner": {"type": "object", "properties": {
            "v": {"type": "boolean"}}, "required": ["v"], "additionalProperties": False}},
            "required": ["inner"], "additionalProperties": False}},
        "required": ["outer"], "additionalProperties": False}
    t = tool("nest", params)
    t["function"]["strict"] = True
    forced_calls(tok, fmt, [t], range(3))


# -- const and enum as the schema's type says (E7) ----------------------------------------------------------------

TYPED = {"type": "object", "properties": {
    "speed": {"type": "string", "const": "fast"},
    "flag": {"enum": ["true", "123"]},
    "word": {"type": "string", "enum": ["null", "7"]},
    "level": {"enum": [1, 2]},
    "tag": {"const": "x"}},
    "required": ["speed", "flag", "word", "level", "tag"]}


@pytest.mark.parametrize("fmt", NAMES)
def test_const_and_enum_come_back_as_their_type(tok, fmt):
    for _, args in forced_calls(tok, fmt, [tool("typed", TYPED)], range(6)):
        assert args["speed"] == "fast" and args["tag"] == "x"
        assert args["flag"] in ("true", "123") and args["word"] in ("null", "7")
        assert args["level"] in (1, 2) and isinstance(args["level"], int)


# -- what a format cannot carry is refused, naming the tool ---------------------------------------------------------

@pytest.mark.parametrize("fmt, key", [("qwen3_xml", "a>b"), ("glm", "a</arg_key>b")])
def test_keys_a_key_value_format_cannot_carry_are_refused(tok, fmt, key):
    """qwen3_xml ends a key at '>' (``<parameter=K>``), glm at ``</arg_key>``: such a key would be split."""
    tools = [tool("ok", {"type": "object", "properties": {"x": {"type": "integer"}}}),
             tool("odd", {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]})]
    with pytest.raises(APIError) as e:
        tools_grammar(tok, FMT[fmt], checked(tools))
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"
    assert repr(key) in e.value.message and fmt in e.value.message


@pytest.mark.parametrize("key", ["a>b", "a\nb", "", "a<b", "</tool_call>", "a</arg_key>b", "</parameter>"])
@pytest.mark.parametrize("fmt", NAMES)
def test_odd_keys_are_carried_or_refused(tok, fmt, key):
    """A key holding a format's markers, a newline or nothing: a forced call keeps it whole, or the tool is
    refused."""
    params = {"type": "object", "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9}}, "required": [key]}
    try:
        calls = forced_calls(tok, fmt, [tool("odd", params)], range(2))
    except APIError as e:
        assert e.status == 400 and e.param == "tools[0].function.parameters" and repr(key) in e.message
        return
    assert all(list(args) == [key] for _, args in calls)


@pytest.mark.parametrize("fmt", NAMES)
def test_keys_that_only_the_schema_requires(tok, fmt):
    """A required key that ``properties`` does not list: written under ``additionalProperties``, or refused where
    no value is allowed."""
    params = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": {"type": "boolean"}}
    forced_calls(tok, fmt, [tool("extra", params)], range(2))


@pytest.mark.parametrize("fmt", ["qwen3_xml", "glm"])
@pytest.mark.parametrize("params", [
    {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"], "additionalProperties": False},
    {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
], ids=["anyOf", "minProperties", "unlisted-required", "root-ref"])
def test_root_schemas_a_key_value_format_cannot_force_are_refused(tok, fmt, params):
    with pytest.raises(APIError) as e:
        tools_grammar(tok, FMT[fmt], checked([tool("f", params)]))
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters" and fmt in e.value.message


@pytest.mark.parametrize("params", [{"type": "string"}, {"type": "array", "items": {}}, {"type": ["integer", "null"]}])
def test_parameters_that_are_not_an_object_are_refused(params):
    with pytest.raises(APIError) as e:
        read_tools({"tools": [tool("f", params)]})
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters" and "object" in e.value.message


@pytest.mark.parametrize("fmt", NAMES)
def test_a_schema_without_type_still_forces_an_object(tok, fmt):
    params = {"properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a"]}
    for _, args in forced_calls(tok, fmt, [tool("f", params)], range(3)):
        assert isinstance(args, dict) and 0 <= args["a"] <= 5


@pytest.mark.parametrize("fmt", ["qwen3_xml", "glm"])
def test_raw_string_arguments_keep_their_bounds(tok, fmt):
    """Key/value formats write strings as raw text: its length and pattern are still the schema's."""
    params = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "word": {"type": "string", "minLength": 2, "maxLength": 3},
        "any": {"type": "string", "pattern": "ab", "maxLength": 6}},
        "required": ["code", "word", "any"]}
    forced_calls(tok, fmt, [tool("s", params)], range(6))


# -- tool names (E15) ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["get_weather\n", "a.b", "x" * 65, "", "caf\u00e9", "a b", "a\u0660"])
def test_names_outside_openais_rule_are_refused(name):
    with pytest.raises(APIError) as e:
        read_tools({"tools": [tool(name, {"type": "object"})]})
    assert e.value.status == 400 and e.value.param == "tools[0].function.name"
    assert "^[a-zA-Z0-9_-]{1,64}$" in e.value.message and repr(name) in e.value.message


def test_names_inside_the_rule_are_taken():
    req = read_tools({"tools": [tool("get-weather_2", {"type": "object"}), tool("x" * 64, {"type": "object"})]})
    assert req is not None and [t["function"]["name"] for t in req.tools] == ["get-weather_2", "x" * 64]


# -- a tool without a description (issue 39 item 5) ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", NAMES)
def test_a_tool_without_description_renders_in_every_template(fmt):
    from ggml_hybrid.server.tools import template_tools

    t = ChatTemplate((TEMPLATES / FAMILY_TEMPLATES[fmt]).read_text(), "<s>", "</s>")
    req = checked([tool("ping_host", {"type": "object", "properties": {"host": {"type": "string"}}},
                        description=None)], "auto")
    with_desc = t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                         tools=template_tools(checked([tool("ping_host", {"type": "object", "properties": {
                             "host": {"type": "string"}}}, description="")], "auto")))
    out = t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=template_tools(req))
    assert out == with_desc  # no description renders as an empty one (llama.cpp's rule)
    if fmt != "deepseek":  # DeepSeek V3.1's template does not list the tools
        assert "ping_host" in out


# -- calls cut by max_tokens (E6) ---------------------------------------------------------------------------------

CUT_TOOL = tool("add", {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                          "s": {"type": "string", "maxLength": 6}},
                        "required": ["a", "s"]})


# where a call in each format is whole (its end marker; gpt-oss's <|call|> ends generation and is never text)
CALL_END = {"hermes": "</tool_call>", "qwen3_xml": "</function>", "glm": "</tool_call>",
            "deepseek": "<\uff5ctool\u2581call\u2581end\uff5c>", "mistral": None, "harmony": None}


@pytest.mark.parametrize("fmt", NAMES)
def test_a_cut_call_is_not_a_call(tok, fmt):
    """Every prefix of a forced call that ends before the call's end marker, ended by max_tokens, is text with
    finish_reason "length", streamed or not; the whole call is a call."""
    req = checked([CUT_TOOL])
    g = tools_grammar(tok, FMT[fmt], req)
    for seed in range(3):
        ids, ended = draw_ids(tok, g, seed)
        assert ended
        whole = tok.decode(ids)
        for finish in ("stop", "length") if CALL_END[fmt] else ("stop",):
            full = chat_message(_choice(whole, finish), FMT[fmt], whole, req.tools)
            assert full["finish_reason"] == "tool_calls", (finish, whole)
        prefixes = [tok.decode(ids[:k]) for k in range(len(ids))]
        for text in prefixes:
            m = chat_message(_choice(text, "length"), FMT[fmt], text, req.tools)
            if CALL_END[fmt] and CALL_END[fmt] in text:
                assert m["finish_reason"] == "tool_calls", text  # whole, only its envelope cut
                continue
            assert m["finish_reason"] == "length" and "tool_calls" not in m["message"], (fmt, text)
            assert m["message"]["content"] == text
        for text in prefixes:  # streamed, in pieces of three characters: the same
            if CALL_END[fmt] and CALL_END[fmt] in text:
                continue
            s = ToolStream(FMT[fmt], req.tools)
            sent = "".join(s.push(text[i:i + 3]) for i in range(0, len(text), 3))
            rest, calls, finish = s.end("length")
            assert (sent + rest, calls, finish) == (text, [], "length")


def _choice(text: str, finish: str) -> dict[str, Any]:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}


# -- tools with a response_format (issue 39 item 4) -----------------------------------------------------------------

ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "ok": {"type": "boolean"}}, "required": ["city", "ok"]}
WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                               "required": ["city"]})


@pytest.mark.parametrize("fmt", NAMES)
def test_auto_with_a_response_format_is_a_call_or_the_answer(tok, fmt):
    req = checked([WEATHER], "auto")
    g = tools_grammar(tok, FMT[fmt], req, answer=ANSWER)
    kinds = set()
    for seed in range(16):
        ids, ended = draw_ids(tok, g, seed)
        text = tok.decode(ids)
        assert ended, text
        m = chat_message(_choice(text, "stop"), FMT[fmt], text, req.tools)
        if m["finish_reason"] == "tool_calls":
            for c in m["message"]["tool_calls"]:
                jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER["function"]["parameters"])
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(m["message"]["content"]), ANSWER)
            kinds.add("answer")
    assert kinds == {"call", "answer"}


# -- parsers that run in linear time (E4) -------------------------------------------------------------------------

HEADS = {"hermes": "<tool_call>", "qwen3_xml": "<tool_call>\n<function=f>\n<parameter=a>\n",
         "glm": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>",
         "deepseek": "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>f"
                     "<\uff5ctool\u2581sep\uff5c>",
         "mistral": "[TOOL_CALLS]", "harmony": "<|channel|>commentary to=functions.f <|constrain|>json<|message|>"}
SHAPES = {"a-spaces-b": lambda h, n: h + "a" + " " * n + "b", "spaces": lambda h, n: h + " " * n,
          "newlines": lambda h, n: h + "{" + "\n " * (n // 2) + "x", "heads": lambda h, n: h * (n // len(h) + 1),
          "quotes": lambda h, n: h + '{"a": "' + "\\ " * (n // 2)}


def _cost(fn, n: int) -> float:
    """The least of five CPU times of ``fn(n)`` (this process's CPU time: other processes on a busy machine do not
    count), each repeated until it takes a measurable time."""
    reps = 1
    while True:
        t0 = time.process_time()
        for _ in range(reps):
            fn(n)
        if time.process_time() - t0 > 0.005 or reps >= 1 << 12:
            break
        reps *= 4
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            fn(n)
        best = min(best, (time.process_time() - t0) / reps)
    return best


def _linear(fn, n: int = 2_500) -> float:
    """How much more ``fn`` costs at 16n than at n: a linear parser about 16 times, a quadratic one about 256; the
    bound between them, 64, leaves room for the caches on the linear side. A ratio over the bound is measured again
    (up to three times, the least kept): a quadratic parser is over it every time, a linear one measured while the
    machine's caches were shared with other work is not."""
    ratio = float("inf")
    for _ in range(3):
        ratio = min(ratio, _cost(fn, 16 * n) / _cost(fn, n))
        if ratio < 64:
            break
    return ratio


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("fmt", NAMES)
def test_parsers_are_linear(fmt, shape):
    f, make = FMT[fmt], SHAPES[shape]
    tools = [tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}})]

    def parse(n: int) -> None:
        text = make(HEADS[fmt], n)
        chat_message(_choice(text, "stop"), f, text, tools)

    ratio = _linear(parse)  # up to 40,000 characters of whitespace after a call's opening (E4's case)
    assert ratio < 64, f"{fmt} {shape}: 16x the text cost {ratio:.1f}x the time"


@pytest.mark.parametrize("fmt", NAMES)
def test_a_stream_is_linear_in_its_pieces(fmt):
    f = FMT[fmt]
    tools = [tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}})]

    def stream(n: int) -> None:
        s = ToolStream(f, tools)
        s.push("a")
        for _ in range(n):
            s.push(" ")
        s.end()

    ratio = _linear(stream)
    assert ratio < 64, f"{fmt}: 16x the pieces cost {ratio:.1f}x the time"


# -- a stream is what the whole text reads as, however it is cut ---------------------------------------------------

WHOLE = {"hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
         "qwen3_xml": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
         "glm": "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
         "deepseek": HEADS["deepseek"] + '{"a": 1}' + CALL_END["deepseek"] + "<\uff5ctool\u2581calls\u2581end\uff5c>",
         "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "harmony": HEADS["harmony"] + '{"a": 1}'}


@pytest.mark.parametrize("fmt", NAMES)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_stream_reads_as_the_whole_text(fmt, data):
    """ToolStream's content, calls and finish reason, however the text is cut into pieces and whatever it ends with,
    are what the whole text reads as (:meth:`ToolFormat.read`)."""
    f = FMT[fmt]
    tools = [tool("f", {"type": "object", "properties": {"a": {"type": "integer"}}})]
    chars = sorted(set(WHOLE[fmt] + "ab \n"))
    text = data.draw(st.text(alphabet=chars, max_size=40))
    text += data.draw(st.sampled_from(["", WHOLE[fmt], WHOLE[fmt][:len(WHOLE[fmt]) // 2], " " + WHOLE[fmt] + "x"]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    finish = data.draw(st.sampled_from(["stop", "length"]))
    s = ToolStream(f, tools)
    sent = "".join(s.push(p) for p in pieces)
    rest, calls, fin = s.end(finish)
    want = f.read(text, tools, finish)
    assert (sent + rest, calls, fin) == (want.content, want.calls, want.finish)
