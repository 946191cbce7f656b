"""Structured output and tool calls through ``ggml-hybrid serve``, driven by the official ``openai`` client: a
generated model (its free text is noise) made to write JSON under schemas, and to call tools in each family's
format through the family's own chat template (``tests/fixtures/templates``)."""

from __future__ import annotations

import datetime
import json
import os
import time

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
sandbox = pytest.importorskip("jinja2.sandbox")

from helpers import WEATHER_TOOL, rewrite_gguf  # noqa: E402
from test_server import Server, get, post  # noqa: E402
from test_structured import FAMILY_TEMPLATES, SCHEMAS, TEMPLATES, _schemas  # noqa: E402

from ggml_hybrid.gguf.store import GGUFStore  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402
from ggml_hybrid.text.tokenizer import Tokenizer  # noqa: E402

N_CTX = 4096
TOOLS = [WEATHER_TOOL,
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 999}},
             "required": ["a", "b"]}}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured")
    base = write_model(d / "base.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    names = ["chatml"]
    for fmt, tpl in FAMILY_TEMPLATES.items():
        rewrite_gguf(base, d / f"{fmt}.gguf", set_keys={
            "tokenizer.chat_template": ((TEMPLATES / tpl).read_text(), gguf.GGUFValueType.STRING)})
        names.append(fmt)
    os.replace(base, d / "chatml.gguf")
    cfg = d / "server.toml"
    cfg.write_text("".join(f'[models.{n}]\npath = "{n}.gguf"\n[models.{n}.session_options]\nn_ctx = {N_CTX}\n'
                           f'n_threads = 1\nn_parallel = 2\n\n' for n in names))
    return {"dir": d, "config": str(cfg)}


@pytest.fixture(scope="module")
def server(files):
    with Server(["--config", files["config"]]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def tok(files) -> Tokenizer:
    t = Tokenizer.from_gguf(GGUFStore(str(files["dir"] / "chatml.gguf")))
    assert isinstance(t, Tokenizer)
    return t


def _chat(client, **kw):
    return client.chat.completions.create(model=kw.pop("model", "chatml"), messages=kw.pop("messages", USER),
                                          temperature=kw.pop("temperature", 1.0), **kw)


# -- JSON under schemas --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_choice_at_temperature_1_validates(client, name):
    schema = SCHEMAS[name]
    r = _chat(client, n=4, max_tokens=2000, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_free_output_is_not_json(client):
    """The same model, unconstrained, writes noise: the oracle can fail."""
    r = _chat(client, n=4, max_tokens=30, seed=1)
    bad = 0
    for c in r.choices:
        try:
            json.loads(c.message.content)
        except ValueError:
            bad += 1
    assert bad == 4


def test_llama_server_fields_and_completions(server, client):
    schema = SCHEMAS["enum"]
    r = client.completions.create(model="chatml", prompt="Colour:", max_tokens=50, temperature=1, n=3,
                                  extra_body={"json_schema": schema})
    for c in r.choices:
        assert json.loads(c.text) in schema["enum"]
    r = client.completions.create(model="chatml", prompt="Answer:", max_tokens=50, temperature=1, n=3,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert {c.text for c in r.choices} <= {"yes.", "no."}
    r = _chat(client, max_tokens=2000, response_format={"type": "json_object"}, seed=5)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    st_, body = post(server.url + "/v1/chat/completions", json.dumps(
        {"model": "chatml", "messages": USER, "max_tokens": 2000, "temperature": 1,
         "response_format": {"type": "json_object", "schema": SCHEMAS["object"]}}))
    assert st_ == 200
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMAS["object"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_drawn_schemas_through_the_server(client, schema, seed):
    r = _chat(client, seed=seed, max_tokens=3000, response_format={
        "type": "json_schema", "json_schema": {"name": "drawn", "schema": schema}})
    c = r.choices[0]
    assert c.finish_reason == "stop", (schema, c.message.content)
    jsonschema.validate(json.loads(c.message.content), schema)


def _assemble(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function is not None:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_streamed_json_is_the_unstreamed_json(client):
    kw = dict(seed=11, max_tokens=2000, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMAS["nested"]}})
    whole = _chat(client, **kw).choices[0]
    content, calls, finish = _assemble(_chat(client, stream=True, **kw))
    assert (content, calls, finish) == (whole.message.content, [], whole.finish_reason)


# -- tools ----------------------------------------------------------------------------------------------

def _oracle_prompt(fmt: str, messages: list[dict], tools: list[dict], bos: str, eos: str) -> str:
    """The family's template rendered by Jinja2 here (Hugging Face's conventions), apart from the server's renderer:
    what the server's prompt must be."""
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])

    def tojson(v, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(msg):
        raise ValueError(msg)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda f: datetime.datetime.now().strftime(f))
    msgs = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}  # OpenAI's null content is empty text (not Jinja's "None")
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        msgs.append(m)
    return env.from_string((TEMPLATES / FAMILY_TEMPLATES[fmt]).read_text()).render(
        messages=msgs, tools=tools, add_generation_prompt=True, bos_token=bos, eos_token=eos)


@pytest.mark.parametrize("fmt", sorted(FAMILY_TEMPLATES))
def test_tool_round_trip_through_each_family_template(client, tok, fmt):
    r = _chat(client, model=fmt, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=3,
              parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # the call and its result go back; the server's prompt is the template's own rendering of them
    cid = "abcdefghi" if fmt == "mistral" else call.id  # Mistral's template wants 9-character ids
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": cid, "name": call.function.name, "content": "sunny, 21 C"}]
    r2 = _chat(client, model=fmt, messages=history, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}}, max_tokens=1500, seed=4)
    c2 = r2.choices[0]
    assert c2.finish_reason == "tool_calls" and c2.message.tool_calls[0].function.name == "add"
    jsonschema.validate(json.loads(c2.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])
    bos, eos = tok.tokens[tok.bos_id], tok.tokens[tok.eos_id]
    want = _oracle_prompt(fmt, history, [TOOLS[1]], bos, eos)
    ids = tok.encode(want, add_bos=False if want.startswith(bos) else None, special=True)
    assert r2.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "glm"])
def test_streamed_tool_calls_are_the_unstreamed_calls(client, fmt):
    kw = dict(model=fmt, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=8)
    whole = _chat(client, **kw).choices[0]
    content, calls, finish = _assemble(_chat(client, stream=True, **kw))
    assert finish == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"] for c in calls)


def test_forced_calls_always_parse(client):
    for seed in range(6):
        r = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=seed, n=2)
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_and_none(client):
    r = _chat(client, tools=TOOLS, tool_choice="auto", max_tokens=20, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=20, seed=1)
    assert r.choices[0].message.tool_calls is None


# -- bad input -----------------------------------------------------------------------------------------

def _body(**kw):
    return json.dumps({"model": "chatml", "messages": USER, "max_tokens": 4, **kw})


DEEP: dict = {"type": "object"}
for _ in range(100):
    DEEP = {"type": "object", "properties": {"a": DEEP}}

BAD = [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(json_schema={"type": "string", "pattern": "(("}), "json_schema"),
    (dict(json_schema=[1, 2]), "json_schema"),
    (dict(json_schema=DEEP), "json_schema"),
    (dict(json_schema={"enum": ["x" * 64] * 5000}), "json_schema"),
    (dict(grammar="root ::= ("), "grammar"),
    (dict(grammar='root ::= "a" | undefined-rule'), "grammar"),
    (dict(grammar=""), "grammar"),
    (dict(grammar='root ::= "a"', json_schema={"type": "string"}), "grammar"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}], tool_choice="required"), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0]"),
    (dict(tools="get_weather"), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                        "arguments": "{nope"}}]}]),
     "messages"),
]


@pytest.mark.parametrize("kw, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, kw, param):
    status, body = post(server.url + "/v1/chat/completions", _body(**kw))
    assert status == 400, body
    assert body["error"]["param"] == param, body


def test_completions_refuse_tools(server):
    status, body = post(server.url + "/v1/completions", json.dumps({"model": "chatml", "prompt": "x", "tools": TOOLS}))
    assert status == 400 and body["error"]["param"] == "tools"


def test_huge_schemas_are_refused_quickly_and_the_server_stays_up(server, client):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(30_000)}}
    t0 = time.monotonic()
    status, body = post(server.url + "/v1/chat/completions", _body(json_schema=huge))
    assert status == 400 and body["error"]["param"] == "json_schema"
    many = {"anyOf": [{"type": "object", "properties": {f"k{i}_{j}": {"type": "string", "pattern": "[a-z]{3,40}"}
                                                          for j in range(20)}, "required": [f"k{i}_0"]}
                      for i in range(200)]}
    status, body = post(server.url + "/v1/chat/completions", _body(json_schema=many))
    assert status in (200, 400), body
    assert time.monotonic() - t0 < 60
    assert get(server.url + "/health")[0] == 200
    r = _chat(client, max_tokens=20, extra_body={"json_schema": SCHEMAS["enum"]})
    assert json.loads(r.choices[0].message.content) in SCHEMAS["enum"]["enum"]


# -- Anthropic's Messages API ----------------------------------------------------------------------------

anthropic_sdk = pytest.importorskip("anthropic")

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic_sdk.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_messages_text(claude, tok):
    m = claude.messages.create(model="chatml", max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}], extra_body={"seed": 2})
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 12
    # the prompt is the template's (ChatML here) rendering of the system and user turns
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert m.usage.input_tokens == len(tok.encode(want, special=True))


def test_messages_stop_sequences(claude):
    for seed in range(4):
        m = claude.messages.create(model="chatml", max_tokens=60, stop_sequences=["e"],
                                   messages=[{"role": "user", "content": "Hello"}], extra_body={"seed": seed})
        text = "".join(b.text for b in m.content if b.type == "text")
        assert "e" not in text
        assert (m.stop_reason, m.stop_sequence) in (("stop_sequence", "e"), ("end_turn", None), ("max_tokens", None))


@pytest.mark.parametrize("fmt", ["chatml", "glm", "harmony"])
def test_messages_tool_use_round_trip(claude, fmt):
    m = claude.messages.create(model=fmt, max_tokens=1500, tools=A_TOOLS, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Paris?"}], extra_body={"seed": 5})
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) >= 1
    tool = next(t for t in A_TOOLS if t["name"] == use[0].name)
    jsonschema.validate(use[0].input, tool["input_schema"])
    m2 = claude.messages.create(model=fmt, max_tokens=1500, tools=A_TOOLS, tool_choice={"type": "tool", "name": "add"},
                                messages=[{"role": "user", "content": "Weather in Paris?"},
                                          {"role": "assistant", "content": m.content},
                                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                                        "content": "sunny"}]}],
                                extra_body={"seed": 6})
    add = [b for b in m2.content if b.type == "tool_use"]
    assert m2.stop_reason == "tool_use" and add[0].name == "add"
    jsonschema.validate(add[0].input, A_TOOLS[1]["input_schema"])


@pytest.mark.parametrize("forced", [False, True])
def test_messages_stream_is_the_unstreamed_message(claude, forced):
    kw = dict(model="chatml", max_tokens=300 if forced else 40, messages=[{"role": "user", "content": "Hi"}],
              extra_body={"seed": 9})
    if forced:
        kw.update(tools=A_TOOLS, tool_choice={"type": "any"})
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert streamed.stop_reason == whole.stop_reason
    assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in streamed.content] == \
        [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    assert streamed.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=None), "max_tokens"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages[0].content[0].type"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (dict(temperature=1.5), "temperature"),
    (dict(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0]"),
    (dict(frobnicate=True), "frobnicate"),
])
def test_messages_bad_input_is_anthropic_400(server, kw, field):
    body = {"model": "chatml", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **kw}
    body = {k: v for k, v in body.items() if v is not None}
    status, doc = post(server.url + "/v1/messages", json.dumps(body))
    assert status == 400, doc
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert field in doc["error"]["message"], doc


def test_messages_unknown_model_is_anthropic_404(claude):
    with pytest.raises(anthropic_sdk.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
