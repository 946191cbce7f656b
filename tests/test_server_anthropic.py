"""Anthropic's Messages API as Anthropic's own client sees it (the ``anthropic`` SDK, unmodified, against a live
``ggml-hybrid serve``): ``msg_``/``toolu_`` ids, ``output_config`` (``messages.parse`` and ``format``, ``effort``),
``cache_control`` wherever Anthropic takes it with prompt reuse reported as ``cache_read_input_tokens``,
``count_tokens``, ``stop_sequences`` beyond OpenAI's four, and Anthropic's error shape for every error on its paths
(the API key's 401 included). The oracles: the model's tokenizer on the ChatML rendering (prompt sizes), the fixed-cut
rule of prompt reuse computed from those tokens, jsonschema/pydantic (structured answers)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Literal

import pytest

anthropic_sdk = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
from test_server import Server  # noqa: E402

from ggml_hybrid.gguf.store import GGUFStore  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402
from ggml_hybrid.text.tokenizer import Tokenizer  # noqa: E402

KEY = "sk-ant-test"
UB = 8  # the server's -ub: prompt reuse cuts at its multiples
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                         "required": ["city", "days"]}}
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    days: Literal[1, 2, 3]
    sunny: bool


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("anthropic")
    return {"m": write_model(d / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)}


@pytest.fixture(scope="module")
def server(files):
    # one slot: a request's prompt meets the previous one's cells (prompt reuse is then predictable)
    with Server([files["m"], "-c", "1024", "-t", "1", "-np", "1", "-ub", str(UB), "--api-key", KEY]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def claude(server):
    return anthropic_sdk.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(files) -> Tokenizer:
    t = Tokenizer.from_gguf(GGUFStore(files["m"]))
    assert isinstance(t, Tokenizer)
    return t


def chatml(system: str | None, user: str) -> str:
    """The prompt the file's template (none: ChatML) renders: the oracle of its size."""
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def total_input(u) -> int:
    return u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens


def post(server, path: str, body: object, key: str | None = KEY, headers: dict | None = None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["x-api-key"] = key
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_anthropic_error(doc: dict, kind: str) -> None:
    assert set(doc) == {"type", "error"} and doc["type"] == "error", doc
    assert doc["error"]["type"] == kind and isinstance(doc["error"]["message"], str), doc


# -- ids, usage, reuse -----------------------------------------------------------------------------------------

def test_a_message_has_a_msg_id_and_anthropic_usage(claude, tok):
    m = claude.messages.create(model="m", max_tokens=6, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}], extra_body={"seed": 1})
    assert m.id.startswith("msg_") and len(m.id) > len("msg_")
    want = len(tok.encode(chatml("Be brief.", "Hello"), special=True))
    assert total_input(m.usage) == want
    # the first prompt in its slot reuses nothing, and leaves its cells up to the last multiple of -ub for the next
    assert m.usage.cache_read_input_tokens == 0 and m.usage.cache_creation_input_tokens == want // UB * UB


def test_prompt_reuse_is_reported_as_cache_reads_with_cache_control_everywhere(claude, tok):
    system = "You answer questions about the weather of northern cities in one short sentence, politely always."
    kw = dict(model="m", max_tokens=4, extra_body={"seed": 3},
              system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    first = claude.messages.create(**kw, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Oslo?", "cache_control": {"type": "ephemeral"}}]}])
    second = claude.messages.create(**kw, cache_control={"type": "ephemeral"},
                                    messages=[{"role": "user", "content": "Bergen?"}])
    with claude.messages.stream(**kw, messages=[{"role": "user", "content": "Tromso?"}]) as s:
        streamed = s.get_final_message()
    # the oracle: each prompt reuses the previous one's cells up to the last multiple of -ub within their common
    # prefix (the fixed-cut rule), and leaves its own up to its last multiple of -ub
    ids = [tok.encode(chatml(system, u), special=True) for u in ("Oslo?", "Bergen?", "Tromso?")]
    prompts = [len(p) for p in ids]
    assert [total_input(x.usage) for x in (first, second, streamed)] == prompts
    shared = [next(i for i, (a, b) in enumerate(zip(p, q)) if a != b) for p, q in zip(ids, ids[1:])]
    assert shared[0] >= 2 * UB  # the system prompt is long enough for the check to mean something
    assert second.usage.cache_read_input_tokens == shared[0] // UB * UB
    assert streamed.usage.cache_read_input_tokens == shared[1] // UB * UB
    for m, n in zip((first, second, streamed), prompts):
        assert m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens == n // UB * UB


# -- structured output and effort ------------------------------------------------------------------------------

def test_messages_parse_returns_the_pydantic_model(claude):
    for seed in range(3):
        m = claude.messages.parse(model="m", max_tokens=200, output_format=Weather, extra_body={"seed": seed},
                                  messages=[{"role": "user", "content": "Weather in Paris for two days?"}])
        assert m.stop_reason == "end_turn"
        assert isinstance(m.parsed_output, Weather)


def test_output_config_format_is_followed_streamed_or_not(claude):
    kw = dict(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
              output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    for seed in range(3):
        whole = claude.messages.create(**kw, extra_body={"seed": seed})
        jsonschema.validate(json.loads(whole.content[0].text), SCHEMA)
        with claude.messages.stream(**kw, extra_body={"seed": seed}) as s:
            text = s.get_final_text()
        assert text == whole.content[0].text


def test_effort_is_accepted_and_changes_nothing(claude):
    kw = dict(model="m", max_tokens=12, messages=[{"role": "user", "content": "Tell me a story"}],
              extra_body={"seed": 7})
    plain = claude.messages.create(**kw)
    for effort in ("low", "max"):
        m = claude.messages.create(**kw, output_config={"effort": effort})
        assert [b.text for b in m.content] == [b.text for b in plain.content]


# -- count_tokens, stop sequences, tools -------------------------------------------------------------------------

def test_count_tokens_is_the_rendered_prompt(claude, tok):
    n = claude.messages.count_tokens(model="m", system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    assert n.input_tokens == len(tok.encode(chatml("Be brief.", "Hello"), special=True))
    m = claude.messages.create(model="m", max_tokens=2, tools=[TOOL], messages=[{"role": "user", "content": "Hi"}])
    assert claude.messages.count_tokens(model="m", tools=[TOOL], messages=[
        {"role": "user", "content": "Hi"}]).input_tokens == total_input(m.usage)


def test_more_than_four_stop_sequences(claude):
    stops = ["e", "a", "o", "i", "u", "\n"]
    for seed in range(3):
        m = claude.messages.create(model="m", max_tokens=40, stop_sequences=stops, extra_body={"seed": seed},
                                   messages=[{"role": "user", "content": "Hello"}])
        text = "".join(b.text for b in m.content if b.type == "text")
        assert not any(s in text for s in stops), text
        assert (m.stop_reason == "stop_sequence") == (m.stop_sequence is not None)
        assert m.stop_sequence is None or m.stop_sequence in stops


def test_stop_sequence_bounds_name_stop_sequences(server):
    for stops, where in ((["x" * 300], "stop_sequences[0]"), (["abcd" * 60] * 20, "stop_sequences")):
        status, doc = post(server, "/v1/messages", {"model": "m", "max_tokens": 4, "stop_sequences": stops,
                                                    "messages": [{"role": "user", "content": "x"}]})
        assert status == 400
        assert_anthropic_error(doc, "invalid_request_error")
        assert f"'{where}'" in doc["error"]["message"] and "'stop'" not in doc["error"]["message"]


def test_tool_use_has_toolu_ids(claude):
    tools = [{**TOOL, "cache_control": {"type": "ephemeral"}}]
    m = claude.messages.create(model="m", max_tokens=300, tools=tools, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body={"seed": 2})
    assert m.id.startswith("msg_") and m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert use and all(b.id.startswith("toolu_") for b in use)
    jsonschema.validate(use[0].input, TOOL["input_schema"])


# -- errors: Anthropic's shape on Anthropic's paths --------------------------------------------------------------

def test_a_missing_or_wrong_key_is_an_authentication_error(server):
    c = anthropic_sdk.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic_sdk.AuthenticationError) as exc:
        c.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert_anthropic_error(exc.value.body, "authentication_error")
    for key in (None, "sk-wrong"):
        status, doc = post(server, "/v1/messages/count_tokens", {"messages": []}, key=key)
        assert status == 401
        assert_anthropic_error(doc, "authentication_error")


@pytest.mark.parametrize("path, body, status, kind, fragment", [
    ("/v1/messages", b"{not json", 400, "invalid_request_error", "JSON"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "cache_control": {"type": "persistent"}}, 400, "invalid_request_error", "'cache_control'"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
     400, "invalid_request_error", "'messages[0].content[0].cache_control.ttl'"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "output_config": {"effort": "extreme"}}, 400, "invalid_request_error", "output_config.effort"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     400, "invalid_request_error", "output_config.format.schema"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "output_config": {"format": {"type": "text"}}}, 400, "invalid_request_error",
     "output_config.format"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{
        "name": "t", "input_schema": {}, "cache_control": {"type": "ephemeral", "extra": 1}}]},
     400, "invalid_request_error", "tools[0].cache_control.extra"),
    ("/v1/messages/nothing", {}, 404, "not_found_error", "/v1/messages/nothing"),
])
def test_errors_on_anthropic_paths_are_anthropic_errors(server, claude, path, body, status, kind, fragment):
    got, doc = post(server, path, body)
    assert got == status, doc
    assert_anthropic_error(doc, kind)
    assert fragment in doc["error"]["message"], doc
    assert claude.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}]).id


def test_wrong_method_and_oversized_body_are_anthropic_errors(server):
    req = urllib.request.Request(server.url + "/v1/messages", headers={"x-api-key": KEY})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 405
    assert_anthropic_error(json.loads(exc.value.read()), "invalid_request_error")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/messages")
    conn.putheader("x-api-key", KEY)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(64 << 20))  # announced, never sent: refused before it is read
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413
    assert_anthropic_error(json.loads(r.read()), "request_too_large")
    conn.close()


def test_anthropics_clients_get_anthropic_errors_anywhere(server):
    """The SDK sends ``anthropic-version`` on every request: an error on another path is still in its shape."""
    status, doc = post(server, "/v1/chat/completions", b"{not json", headers={"anthropic-version": "2023-06-01"})
    assert status == 400
    assert_anthropic_error(doc, "invalid_request_error")
    status, doc = post(server, "/v1/no/such/path", {}, key=None, headers={"anthropic-version": "2023-06-01"})
    assert status == 401
    assert_anthropic_error(doc, "authentication_error")
    status, doc = post(server, "/v1/chat/completions", b"{not json")  # an OpenAI client: OpenAI's shape
    assert status == 400 and set(doc["error"]) >= {"message", "type", "param", "code"}
