"""Tool calls through ``ggml-hybrid serve`` in every family format, driven by the real clients (``openai``,
``anthropic``, ``openai-agents``): pydantic schemas with ``$defs`` forced, tools without a description, tools with a
``response_format``, calls cut by ``max_tokens``, tool names outside OpenAI's rule, and the reading of calls off the
event loop (issues 39 and 40)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Annotated, Literal

import gguf
import pytest

openai = pytest.importorskip("openai")
anthropic_sdk = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from helpers import rewrite_gguf  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from test_server import Server, post  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402
from test_tool_calls import PYDANTIC, TYPED, Addr, Person  # noqa: E402

from ggml_hybrid.errors import ChatTemplateLimitError  # noqa: E402
from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402

N_CTX = 4096
NAMES = sorted(FAMILY_TEMPLATES)
USER = [{"role": "user", "content": "Save Ada, who lives in Paris."}]
SAVE = {"type": "function", "function": {"name": "save_person", "description": "Save a person.",
                                         "parameters": PYDANTIC}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "hot": {"type": "boolean"}}, "required": ["city", "hot"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    base = write_model(d / "base.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    for fmt, tpl in FAMILY_TEMPLATES.items():
        rewrite_gguf(base, d / f"{fmt}.gguf", set_keys={
            "tokenizer.chat_template": ((TEMPLATES / tpl).read_text(), gguf.GGUFValueType.STRING)})
    cfg = d / "server.toml"
    cfg.write_text("".join(f'[models.{n}]\npath = "{n}.gguf"\n[models.{n}.session_options]\nn_ctx = {N_CTX}\n'
                           f'n_threads = 1\nn_parallel = 2\n\n' for n in FAMILY_TEMPLATES))
    with Server(["--config", str(cfg)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic_sdk.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _chat(client, fmt, **kw):
    return client.chat.completions.create(model=fmt, messages=kw.pop("messages", USER), temperature=1.0, **kw)


def _anthropic_tool(t: dict) -> dict:
    f = t["function"]
    out = {"name": f["name"], "input_schema": f["parameters"]}
    if "description" in f:
        out["description"] = f["description"]
    return out


# -- schemas with $defs, forced (issue 39 item 2, issue 40 E8) ------------------------------------------------------

@pytest.mark.parametrize("fmt", NAMES)
def test_a_pydantic_tool_is_forced_in_every_format(client, claude, fmt):
    r = _chat(client, fmt, tools=[SAVE], tool_choice="required", max_tokens=1500, seed=2, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    args = json.loads(c.message.tool_calls[0].function.arguments)
    jsonschema.validate(args, PYDANTIC)
    assert Person.model_validate(args).home == Addr.model_validate(args["home"])
    m = claude.messages.create(model=fmt, max_tokens=1500, tools=[_anthropic_tool(SAVE)],
                               tool_choice={"type": "tool", "name": "save_person"}, messages=USER,
                               extra_body={"seed": 3})
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(use) == 1
    jsonschema.validate(use[0].input, PYDANTIC)


@pytest.mark.parametrize("fmt", ["glm", "qwen3_xml"])
def test_const_and_enum_keep_their_type_through_the_server(client, fmt):
    t = {"type": "function", "function": {"name": "typed", "parameters": TYPED}}
    r = _chat(client, fmt, tools=[t], tool_choice="required", max_tokens=600, seed=4)
    args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(args, TYPED)
    assert args["speed"] == "fast" and isinstance(args["flag"], str)


# -- a tool without a description (issue 39 item 5) -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", NAMES)
def test_a_tool_without_description(client, claude, fmt):
    bare = {"type": "function", "function": {"name": "get_weather",
                                             "parameters": WEATHER["function"]["parameters"]}}
    r = _chat(client, fmt, tools=[bare], tool_choice="required", max_tokens=600, seed=5)
    assert r.choices[0].finish_reason == "tool_calls"
    m = claude.messages.create(model=fmt, max_tokens=600, tools=[_anthropic_tool(bare)], messages=USER,
                               tool_choice={"type": "any"}, extra_body={"seed": 5})
    assert m.stop_reason == "tool_use"


# -- calls cut by max_tokens (E6) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", NAMES)
def test_a_call_cut_by_max_tokens_is_not_a_call(client, claude, fmt):
    """The same forced call (the same seed) whole, then cut by max_tokens at a third, half and two thirds of it (inside
    its arguments: its envelope is shorter than a third): a cut call is the text with finish_reason "length"
    (Anthropic: stop_reason "max_tokens"), streamed or not."""
    whole = _chat(client, fmt, tools=[SAVE], tool_choice="required", max_tokens=1500, seed=6,
                  parallel_tool_calls=False)
    assert whole.choices[0].finish_reason == "tool_calls"
    n = whole.usage.completion_tokens
    for cut in (n // 3, n // 2, 2 * n // 3):
        kw = dict(tools=[SAVE], tool_choice="required", max_tokens=cut, seed=6, parallel_tool_calls=False)
        c = _chat(client, fmt, **kw).choices[0]
        assert c.finish_reason == "length" and c.message.tool_calls is None, (cut, c.message)
        assert c.message.content  # the text, as it came
        text, finish, calls = "", None, 0
        for ch in _chat(client, fmt, stream=True, **kw):
            if ch.choices:
                d = ch.choices[0].delta
                text += d.content or ""
                calls += len(d.tool_calls or [])
                finish = ch.choices[0].finish_reason or finish
        assert (text, finish, calls) == (c.message.content, "length", 0)
        akw = dict(model=fmt, max_tokens=cut, tools=[_anthropic_tool(SAVE)], messages=USER,
                   tool_choice={"type": "tool", "name": "save_person", "disable_parallel_tool_use": True},
                   extra_body={"seed": 6})
        m = claude.messages.create(**akw)
        assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["text"], (cut, m.content)
        with claude.messages.stream(**akw) as s:
            streamed = s.get_final_message()
        assert streamed.stop_reason == "max_tokens" and [b.type for b in streamed.content] == ["text"]


# -- tools with a response_format (issue 39 item 4) -----------------------------------------------------------------

RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.mark.parametrize("fmt", ["hermes", "glm", "harmony"])
def test_auto_with_a_response_format_calls_or_answers(client, fmt):
    kinds = set()
    for seed in range(10):
        c = _chat(client, fmt, tools=[WEATHER], response_format=RF, max_tokens=600, seed=seed).choices[0]
        if c.finish_reason == "tool_calls":
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            kinds.add("call")
        else:
            assert c.finish_reason == "stop", c.message
            jsonschema.validate(json.loads(c.message.content), ANSWER)
            kinds.add("answer")
    assert kinds == {"call", "answer"}


def test_anthropic_tools_with_output_config_use_a_tool_or_answer(claude):
    kinds = set()
    for seed in range(10):
        m = claude.messages.create(model="glm", max_tokens=600, tools=[_anthropic_tool(WEATHER)], messages=USER,
                                   extra_body={"seed": seed, "output_config": {"format": {
                                       "type": "json_schema", "schema": ANSWER}}})
        if m.stop_reason == "tool_use":
            use = [b for b in m.content if b.type == "tool_use"]
            jsonschema.validate(use[0].input, WEATHER["function"]["parameters"])
            kinds.add("call")
        else:
            assert m.stop_reason == "end_turn", m
            jsonschema.validate(json.loads("".join(b.text for b in m.content if b.type == "text")), ANSWER)
            kinds.add("answer")
    assert kinds == {"call", "answer"}
    m = claude.messages.create(model="glm", max_tokens=600, tools=[_anthropic_tool(WEATHER)], messages=USER,
                               tool_choice={"type": "any"}, extra_body={"seed": 1, "output_config": {"format": {
                                   "type": "json_schema", "schema": ANSWER}}})
    assert m.stop_reason == "tool_use"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_with_a_response_format_is_the_call(client, choice):
    c = _chat(client, "hermes", tools=[WEATHER], tool_choice=choice, response_format=RF, max_tokens=600,
              seed=1).choices[0]
    assert c.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    # after the tool's result, with tool_choice auto, the answer may follow the format
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [c.message.tool_calls[0].model_dump()]},
                      {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "sunny, 30 C"}]
    answers = 0
    for seed in range(6):
        c2 = _chat(client, "hermes", messages=history, tools=[WEATHER], response_format=RF, max_tokens=600,
                   seed=seed).choices[0]
        if c2.finish_reason == "stop":
            jsonschema.validate(json.loads(c2.message.content), ANSWER)
            answers += 1
    assert answers


def test_a_bad_response_format_with_a_forced_call_is_still_a_400(server):
    status, body = post(server.url + "/v1/chat/completions", json.dumps({
        "model": "hermes", "messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}))
    assert status == 400 and body["error"]["param"] == "response_format.json_schema.schema"


class Verdict(BaseModel):
    city: Literal["Paris", "Rome"]
    hot: bool


def test_openai_agents_output_type_with_a_required_tool(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """The weather in a city."""
        called.append(city)
        return "sunny, 30 C"

    model = agents.OpenAIChatCompletionsModel(model="hermes", openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                         output_type=Verdict, model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=400,
                                                             extra_body={"seed": 3}))
    result = asyncio.run(agents.Runner.run(agent, "Is it hot in Paris?", max_turns=12))
    assert isinstance(result.final_output, Verdict) and called
    jsonschema.validate(result.final_output.model_dump(), Verdict.model_json_schema())


# -- names and parameters (E15, E7) --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["get_weather\n", "get.weather", "x" * 65])
def test_names_outside_the_rule_are_a_400_on_both_apis(server, name):
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    status, body = post(server.url + "/v1/chat/completions", json.dumps(
        {"model": "hermes", "messages": USER, "tools": [tool], "max_tokens": 2}))
    assert status == 400 and body["error"]["param"] == "tools[0].function.name", body
    status, body = post(server.url + "/v1/messages", json.dumps(
        {"model": "hermes", "messages": USER, "max_tokens": 2, "tools": [{"name": name, "input_schema": {
            "type": "object"}}]}))
    assert status == 400 and body["type"] == "error" and "^[a-zA-Z0-9_-]{1,64}$" in body["error"]["message"]


def test_keys_a_format_cannot_carry_are_a_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "integer"}}}}}
    status, body = post(server.url + "/v1/chat/completions", json.dumps(
        {"model": "qwen3_xml", "messages": USER, "tools": [tool], "max_tokens": 2}))
    assert status == 400 and body["error"]["param"] == "tools[0].function.parameters" and "a>b" in \
        body["error"]["message"], body
    status, body = post(server.url + "/v1/chat/completions", json.dumps(
        {"model": "hermes", "messages": USER, "tools": [tool], "tool_choice": "required", "max_tokens": 300}))
    assert status == 200 and json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) \
        .keys() <= {"a>b"}


# -- reading calls off the event loop (E4) -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app_model(tmp_path_factory):
    from ggml_hybrid.server.app import create_app
    from ggml_hybrid.server.config import ModelEntry
    from ggml_hybrid.server.models import ModelSet

    path = write_model(tmp_path_factory.mktemp("inproc") / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    ms = ModelSet([ModelEntry("q3", str(path), None, SessionOptions(n_threads=1, n_ctx=512))])
    loaded = threading.Event()
    ms.start_loading(lambda msg: None, lambda name, s: loaded.set())
    assert loaded.wait(120)
    # a renderer process ends with the thread that started it (PR_SET_PDEATHSIG is a thread's, not a process's), and
    # each asyncio.run below ends its worker threads: the renderer is started here by a thread that lives as long as
    # these tests, so the requests' threads only borrow it (a render that finds the renderer of an ended thread
    # still dying fails; the first one here may, and is tried again)
    stop, ready = threading.Event(), threading.Event()

    def keep() -> None:
        template = ms.names["q3"].template
        for _ in range(5):
            try:
                template.render([{"role": "user", "content": "x"}], add_generation_prompt=True)
                break
            except ChatTemplateLimitError:
                continue
        ready.set()
        stop.wait()

    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    assert ready.wait(120)
    try:
        yield create_app(ms)
    finally:
        stop.set()
        keeper.join()
        ms.close()


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                          ("/v1/messages", False), ("/v1/messages", True)])
def test_calls_are_read_off_the_event_loop(app_model, monkeypatch, path, stream):
    """While a generation's text is being read for calls, /health answers: the reading holds until it has, and it
    would wait in vain (and say so) if it held the event loop."""
    from ggml_hybrid.server.tool_formats import ToolFormat

    entered, released = threading.Event(), threading.Event()
    waited: list[bool] = []
    read = ToolFormat.read

    def held(self, text, tools, finish="stop"):
        entered.set()
        waited.append(released.wait(60))
        return read(self, text, tools, finish)

    monkeypatch.setattr(ToolFormat, "read", held)
    body = {"model": "q3", "messages": USER, "max_tokens": 4, "stream": stream, "tools": [WEATHER]}
    if path == "/v1/messages":
        body["tools"] = [_anthropic_tool(WEATHER)]

    async def go():
        task = asyncio.create_task(_asgi(app_model, "POST", path, json.dumps(body).encode()))
        reading = asyncio.create_task(asyncio.to_thread(entered.wait, 120))
        await asyncio.wait({task, reading}, return_when=asyncio.FIRST_COMPLETED)
        assert reading.done() and reading.result(), (await task if task.done() else "no answer, no reading")
        health = await _asgi(app_model, "GET", "/health")
        released.set()
        return health[0], await task

    health, (status, text) = asyncio.run(go())
    assert status == 200, text
    assert health == 200 and waited == [True]


async def _asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request through the ASGI app, in-process: (status, body)."""
    out: dict = {"body": b""}
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("t", 1), "root_path": ""}
    sent, done = False, asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays until the answer is whole
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")
            if not msg.get("more_body"):
                done.set()

    await app(scope, receive, send)
    done.set()
    return out["status"], out["body"]

