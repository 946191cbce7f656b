"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) through ``ggml-hybrid
serve``: every answer and event validated by openai-python's own pydantic models (``openai.types.responses``), and
each generation checked against the chat endpoint, which runs the same engine: with the same seed and settings the
same conversation gives the same prompt and the same text."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import urllib.request

import gguf
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("jinja2")
from helpers import WEATHER_TOOL, rewrite_gguf  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from test_server import Server, get, post  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402

N_CTX = 4096
EVENTS = TypeAdapter(ResponseStreamEvent)
# the weather tool as the Responses API gives a function tool: flat
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
COLOUR = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("responses")
    base = write_model(d / "base.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    for fmt in ("hermes", "glm"):
        rewrite_gguf(base, d / f"{fmt}.gguf", set_keys={
            "tokenizer.chat_template": ((TEMPLATES / FAMILY_TEMPLATES[fmt]).read_text(), gguf.GGUFValueType.STRING)})
    os.replace(base, d / "chatml.gguf")
    slow = write_model(d / "slow.gguf", arch="qwen3moe", weight_type="q8_0", seed=4, n_layer=4, n_embd=256,
                       n_ff_exp=256, head_dim=64, n_expert=16, n_used=4)
    cfg = d / "server.toml"
    # glm: small ubatches, so that prompt reuse (up to a multiple of ubatch_size) reaches a short prompt
    cfg.write_text("".join(f'[models.{n}]\npath = "{n}.gguf"\n[models.{n}.session_options]\nn_ctx = {N_CTX}\n'
                           f'n_threads = 1\nn_parallel = 2\n{"ubatch_size = 8" if n == "glm" else ""}\n\n'
                           for n in ("chatml", "hermes", "glm")))
    return {"dir": d, "config": str(cfg), "slow": slow, "chatml": str(d / "chatml.gguf")}


@pytest.fixture(scope="module")
def server(files):
    with Server(["--config", files["config"]]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0, err


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def sse(url: str, body: dict) -> list[dict]:
    """The events of a streamed POST, each ``data`` parsed (and its ``event`` name checked against its type)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    out, name = [], None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                doc = json.loads(line[5:])
                assert doc["type"] == name, (name, doc["type"])
                out.append(doc)
    return out


def validated(doc: dict) -> Response:
    """A response object as openai-python's model reads it, strictly (every required field, every type)."""
    return Response.model_validate(doc, strict=False)


def chat_twin(client, model: str, messages: list[dict], **kw):
    """The chat endpoint's answer to the same conversation: the oracle of a response's prompt and text."""
    return client.chat.completions.create(model=model, messages=messages, **kw)


def sdk_stream(client, **kw) -> Response:
    """The response a streamed ``responses.create`` of the SDK ends with (``completed`` or ``incomplete``)."""
    last = None
    for e in client.responses.create(stream=True, **kw):
        last = e
    assert last is not None and last.type in ("response.completed", "response.incomplete"), last
    return last.response


def _text(resp: Response) -> str:
    return "".join(p.text for item in resp.output if item.type == "message" for p in item.content
                   if p.type == "output_text")


# -- plain and streamed text ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["chatml", "hermes"])
def test_a_response_is_the_chat_answer_to_the_same_conversation(server, client, model):
    body = {"model": model, "instructions": "Be brief.", "input": "Hello there", "max_output_tokens": 24,
            "temperature": 1.0, "seed": 7}
    status, doc = post(server.url + "/v1/responses", json.dumps(body))
    assert status == 200, doc
    r = validated(doc)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status in ("completed", "incomplete") and r.error is None
    assert r.instructions == "Be brief." and r.max_output_tokens == 24 and r.temperature == 1.0
    twin = chat_twin(client, model, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello there"}],
                     max_tokens=24, temperature=1.0, seed=7)
    assert _text(r) == twin.choices[0].message.content
    assert r.usage.input_tokens == twin.usage.prompt_tokens
    assert r.usage.output_tokens == twin.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status == "incomplete") == (twin.choices[0].finish_reason == "length")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # the SDK's own call, and its output_text helper
    sdk = client.responses.create(model=model, instructions="Be brief.", input="Hello there", max_output_tokens=24,
                                  temperature=1.0, extra_body={"seed": 7})
    assert sdk.output_text == _text(r)


def test_the_streamed_events_are_openais_and_add_up_to_the_answer(server, client):
    body = {"model": "hermes", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me"}]}],
            "max_output_tokens": 20, "temperature": 1.0, "seed": 3}
    events = sse(server.url + "/v1/responses", {**body, "stream": True})
    typed = [EVENTS.validate_python(e) for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    end = "response.incomplete" if events[-1]["response"]["status"] == "incomplete" else "response.completed"
    n_delta = kinds.count("response.output_text.delta")  # (0 when the model ends at once: the same items, empty)
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n_delta,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = validated(events[-1]["response"])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == _text(final) == events[-4]["text"]
    assert typed[-2].item.id == final.output[0].id == events[2]["item"]["id"]
    # the same request unstreamed says the same
    status, doc = post(server.url + "/v1/responses", json.dumps(body))
    assert status == 200 and _text(validated(doc)) == text
    # and the SDK's stream reads it (its helper, responses.stream, wants response.completed: a finished answer)
    got = sdk_stream(client, model="hermes", input=body["input"], max_output_tokens=20, temperature=1.0,
                     extra_body={"seed": 3})
    assert got.output_text == text and got.id != final.id


# -- tools ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["hermes", "glm"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_a_function_call_item_valid_under_its_schema(server, model, stream):
    body = {"model": model, "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 400, "temperature": 1.0, "seed": 5}
    if stream:
        events = sse(server.url + "/v1/responses", {**body, "stream": True})
        for e in events:
            EVENTS.validate_python(e)
        kinds = [e["type"] for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert kinds[-1] == "response.completed"
        doc = events[-1]["response"]
        args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    else:
        status, doc = post(server.url + "/v1/responses", json.dumps(body))
        assert status == 200, doc
    r = validated(doc)
    assert r.status == "completed"
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    if stream:
        assert args == calls[0].arguments
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"


def test_a_call_and_its_output_continue_the_conversation_as_chat_does(server, client):
    """The output items go back as input (what agents do), with the call's output: the prompt is the chat endpoint's
    for the same messages, and so is the text."""
    first = client.responses.create(model="hermes", input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=400,
                                    temperature=1.0, extra_body={"seed": 5}, store=False)
    call = next(i for i in first.output if i.type == "function_call")
    items = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model="hermes", input=items, tools=[WEATHER], max_output_tokens=16,
                                     temperature=1.0, extra_body={"seed": 9})
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                       "function": {"name": call.name,
                                                                                    "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    twin = chat_twin(client, "hermes", messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=1.0, seed=9)
    assert second.usage.input_tokens == twin.usage.prompt_tokens
    twin_calls = twin.choices[0].message.tool_calls or []
    assert [c.type for c in second.output if c.type == "function_call"] == ["function_call"] * len(twin_calls)
    if not twin_calls:
        assert second.output_text == twin.choices[0].message.content


# -- structured output ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_is_followed(server, client, stream):
    fmt = {"type": "json_schema", "name": "colour", "schema": COLOUR, "strict": True}
    kw = dict(model="chatml", input="Pick a colour", text={"format": fmt}, max_output_tokens=200, temperature=1.0)
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), COLOUR)
    assert r.text.format.type == "json_schema" and r.text.format.name == "colour"


def test_text_format_json_object(client):
    r = client.responses.create(model="chatml", input="JSON please", text={"format": {"type": "json_object"}},
                                max_output_tokens=300, temperature=0.0)
    if r.status == "completed":  # a random model may write an object longer than its budget
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_bad_schema_is_a_400_naming_text_format(server):
    status, doc = post(server.url + "/v1/responses", json.dumps({
        "model": "chatml", "input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                             "schema": {"type": "object", "minProperties": "two"}}}}))
    assert status == 400 and doc["error"]["param"].startswith("text.format"), doc


def test_the_servers_defaults_apply_and_are_repeated(files):
    """``serve --temp 0.3 --top-p 0.5 -n 5``: a request silent on them runs with them, and says so."""
    with Server([files["chatml"], "-np", "1", "-c", "512", "-t", "1", "--temp", "0.3", "--top-p", "0.5",
                 "-n", "5"]) as s:
        r = s.client().responses.create(model="chatml", input="Hello", extra_body={"seed": 4})
        assert (r.temperature, r.top_p, r.max_output_tokens) == (0.3, 0.5, 5)
        assert r.usage.output_tokens <= 5
        twin = s.client().chat.completions.create(model="chatml", messages=[{"role": "user", "content": "Hello"}],
                                                  seed=4)
        assert r.output_text == twin.choices[0].message.content
        rc, err = s.stop()
    assert rc == 0, err


# -- the store ------------------------------------------------------------------------------------------

def test_previous_response_id_continues_without_the_old_instructions(server, client):
    r1 = client.responses.create(model="chatml", instructions="Speak like a pirate.", input="Hello",
                                 max_output_tokens=12, temperature=1.0, extra_body={"seed": 1})
    r2 = client.responses.create(model="chatml", previous_response_id=r1.id, input="And then?",
                                 max_output_tokens=12, temperature=1.0, extra_body={"seed": 2})
    assert r2.previous_response_id == r1.id and r2.instructions is None
    # OpenAI's rule: the previous turn's instructions are not carried over
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": r1.output_text},
                {"role": "user", "content": "And then?"}]
    twin = chat_twin(client, "chatml", messages, max_tokens=12, temperature=1.0, seed=2)
    assert r2.usage.input_tokens == twin.usage.prompt_tokens
    assert r2.output_text == twin.choices[0].message.content
    # a third turn chains through both
    r3 = client.responses.create(model="chatml", previous_response_id=r2.id, input="Bye", max_output_tokens=4,
                                 temperature=1.0, extra_body={"seed": 3})
    twin3 = chat_twin(client, "chatml", [*messages, {"role": "assistant", "content": r2.output_text},
                                         {"role": "user", "content": "Bye"}], max_tokens=4, temperature=1.0, seed=3)
    assert r3.usage.input_tokens == twin3.usage.prompt_tokens


def test_the_prompt_a_slot_holds_is_reused_and_counted(client):
    r1 = client.responses.create(model="glm", input="The cache runs the hits first, then the misses",
                                 max_output_tokens=8, temperature=0.0)
    r2 = client.responses.create(model="glm", previous_response_id=r1.id, input="and more", max_output_tokens=8,
                                 temperature=0.0)
    cached = r2.usage.input_tokens_details.cached_tokens
    assert 0 < cached < r2.usage.input_tokens


def test_get_and_delete_a_stored_response(server, client):
    r = client.responses.create(model="chatml", input="Keep me", max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    status, doc = get(server.url + f"/v1/responses/{r.id}")
    validated(json.loads(doc))
    deleted = client.responses.delete(r.id)
    assert deleted is None  # the SDK returns nothing; the server's answer:
    status, doc = post(server.url + f"/v1/responses/{r.id}", "", method="DELETE")
    assert status == 404 and doc["error"]["code"] == "response_not_found"
    for path in (f"/v1/responses/{r.id}", "/v1/responses/resp_nothing"):
        status, body = get(server.url + path)
        assert status == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="chatml", previous_response_id=r.id, input="x")


def test_store_false_keeps_nothing(server, client):
    r = client.responses.create(model="chatml", input="Forget me", max_output_tokens=4, store=False)
    assert r.store is False
    assert get(server.url + f"/v1/responses/{r.id}")[0] == 404
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="chatml", previous_response_id=r.id, input="x")
    assert e.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_latest_in_count_and_bytes():
    from ggml_hybrid.server.response_store import ResponseStore

    s = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        assert s.put(f"r{i}", {"i": i}, [])
    assert [s.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    big = {"text": "x" * 4000}
    assert s.put("big1", big, []) and s.put("big2", big, [])
    # two of 4 kB and the newest small one fit in 10 kB; the older small ones left first
    assert s.get("big1") and s.get("big2") and s.get("r4") and not s.get("r3")
    assert s.bytes <= 10_000 and len(s) == 3
    assert s.put("big3", big, []) and not s.get("big1") and s.get("big3")
    assert not s.put("huge", {"text": "x" * 20_000}, []) and s.get("huge") is None  # alone over the bound
    assert s.delete("big3") and not s.delete("big3") and s.get("big3") is None
    assert s.bytes == sum(x.size for x in s._items.values())


async def _asgi(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request through the ASGI app, in-process."""
    out: dict = {"body": b""}
    data = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("t", 1), "root_path": ""}
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client stays: never a disconnect
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    await app(scope, receive, send)
    return out["status"], json.loads(out["body"])


def test_an_evicted_response_is_a_404_like_an_unknown_one(files):
    from ggml_hybrid.server.app import create_app
    from ggml_hybrid.server.config import ModelEntry
    from ggml_hybrid.server.models import ModelSet
    from ggml_hybrid.server.response_store import ResponseStore

    ms = ModelSet([ModelEntry("m", files["chatml"], None, SessionOptions(n_threads=1, n_ctx=256))])
    app = create_app(ms, response_store=ResponseStore(max_count=2))
    loaded = threading.Event()
    ms.start_loading(lambda msg: None, lambda name, s: loaded.set())

    async def go():
        ids = []
        for i in range(3):
            status, doc = await _asgi(app, "POST", "/v1/responses", {"model": "m", "input": f"turn {i}",
                                                                     "max_output_tokens": 2})
            assert status == 200, doc
            ids.append(doc["id"])
        assert (await _asgi(app, "GET", f"/v1/responses/{ids[0]}"))[0] == 404  # the oldest left
        assert (await _asgi(app, "GET", f"/v1/responses/{ids[2]}"))[0] == 200
        status, doc = await _asgi(app, "POST", "/v1/responses", {"model": "m", "input": "x",
                                                                 "previous_response_id": ids[0]})
        assert status == 404 and doc["error"]["param"] == "previous_response_id"
        status, doc = await _asgi(app, "POST", "/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 2,
                                                                 "previous_response_id": ids[1]})
        assert status == 200, doc

    try:
        assert loaded.wait(60)
        # (the renderer the loader thread started outlives that thread: main's lifeline pipe, not PR_SET_PDEATHSIG)
        asyncio.run(go())
    finally:
        ms.close()


# -- bad input ------------------------------------------------------------------------------------------

MIB_INSTRUCTIONS = "x" * (1 << 20)
BAD = [
    ({"input": [{"type": "web_search_call", "id": "w"}]}, 400, "input[0].type"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "x", "instructions": MIB_INSTRUCTIONS}, 400, "instructions"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400,
     "input[0].arguments"),
    ({"input": "x", "instructions": 3}, 400, "instructions"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": "get_weather"}, 400, "tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name"),
    ({"input": "x", "text": "json"}, 400, "text"),
    ({"input": "x", "max_output_tokens": "many"}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "top_p": "1"}, 400, "top_p"),
    ({"input": "x", "metadata": {"k": 1}}, 400, "metadata"),
    ({"input": "x", "store": "yes"}, 400, "store"),
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "x", "stream_options": {"include_obfuscation": True}}, 400, "stream_options"),
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "x", "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("extra, status, param", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_are_openais_errors_naming_the_field(server, extra, status, param):
    got, doc = post(server.url + "/v1/responses", json.dumps({"model": "chatml", **extra}))
    assert got == status, doc
    assert set(doc) == {"error"} and {"message", "type", "param", "code"} <= set(doc["error"]), doc
    assert doc["error"]["param"] == param, doc
    if extra.get("instructions") == MIB_INSTRUCTIONS:  # a prompt that cannot fit: llama-server's type, with n_ctx
        assert doc["error"]["type"] == "exceed_context_size_error" and doc["error"]["n_ctx"] == N_CTX, doc
        assert doc["error"]["code"] == "context_length_exceeded"
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"} and doc["error"]["type"] == \
            "invalid_request_error", doc
    assert param.split("[")[0].split(".")[0] in doc["error"]["message"] or got == 404, doc


def test_bad_requests_leave_the_other_clients_alone(server, client):
    """A client streaming a seeded answer while bad requests pour in gets the answer it gets alone: it reads its first
    event, holds its stream open while every bad request is answered, then reads the rest."""
    kw = dict(model="chatml", input="Once upon a time", max_output_tokens=200, temperature=1.0, extra_body={
        "seed": 21})
    alone = sdk_stream(client, **kw).output_text
    started, bad_done = threading.Event(), threading.Event()
    got: dict[str, object] = {}

    def stream() -> None:
        try:
            events = client.responses.create(stream=True, **kw)
            first = next(iter(events))
            started.set()
            assert bad_done.wait(300)
            last = first
            for e in events:
                last = e
            got["text"] = last.response.output_text
        finally:
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(300)
        for extra, status, _ in BAD:
            assert post(server.url + "/v1/responses", json.dumps({"model": "chatml", **extra}))[0] == status
        assert get(server.url + "/health")[0] == 200
    finally:
        bad_done.set()
        t.join(300)
    assert got["text"] == alone


def test_a_stream_cut_by_the_server_ends_with_error_and_response_failed(files):
    with Server([files["slow"], "-np", "1", "-c", "4096", "-t", "1", "-a", "m", "--drain-timeout", "0"]) as s:
        # a string the grammar keeps open for 3,000 tokens: the generation cannot end before the drain cuts it
        long = {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 20000}}
        body = {"model": "m", "input": "Go on", "max_output_tokens": 3000, "temperature": 0, "stream": True,
                "text": {"format": long}}
        req = urllib.request.Request(s.url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                        s.proc.send_signal(signal.SIGTERM)  # the drain ends at once: what runs is cancelled
        rc, err = s.stop()
    assert rc == 0, err
    for e in events:
        EVENTS.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], [e["type"] for e in events[-3:]]
    assert events[-2]["code"] == "server_error"
    failed = validated(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_grammar_failure_in_a_stream_names_the_responses_field():
    """A generation its grammar fails mid-way ends the stream with a 400-class ``error`` event (the shared
    structured.failure) naming the field as the Responses request names it, not as the chat request it was read into."""
    from ggml_hybrid.server.protocol import bad
    from ggml_hybrid.server.response_store import ResponseStore
    from ggml_hybrid.server.responses import Answer, ResponseEvents, read_request

    store = ResponseStore()
    turn = read_request({"model": "m", "input": "Go", "stream": True, "text": {"format": {
        "type": "json_schema", "name": "n", "schema": {"type": "array"}}}}, store)
    turn.echo.update(temperature=1.0, top_p=1.0, max_output_tokens=16)  # as the route fills them in
    ev = ResponseEvents(Answer(turn, "m", store), lambda r: {})
    events = [json.loads(e["data"]) for e in [*ev.start(), *ev.text("q1"), *ev.error(bad(
        "The generation failed mid-way, its grammar's fault: too many items.", "response_format.json_schema.schema",
        "invalid_grammar"))]]
    for e in events:
        EVENTS.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "invalid_grammar" and events[-2]["param"] == "text.format.schema", events[-2]
    assert validated(events[-1]["response"]).status == "failed"
