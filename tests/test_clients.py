"""The client libraries people point at a local server, unmodified, against a live ``ggml-hybrid serve`` on loopback:
openai, openai-agents, pydantic-ai, langchain-openai, instructor and litellm (the ``clients`` extra; each test is
skipped when its library is not installed).

The model is a generated one with Qwen3's published template (its text is noise), so what a test needs to be valid
comes from the server's guarantees, not from the model: schemas are finite (enums, bounded integers, ``maxLength``) and
calls a test needs are forced (``tool_choice``). The oracles are the libraries' own parsing and validation (a
pydantic model they build from the answer, the items they assemble from the events), a tool function actually
called with arguments its signature accepts, and the chat endpoint's answer to the same request.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import gguf
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("jinja2")
from helpers import rewrite_gguf  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from test_server import Server  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.synthetic import write_model  # noqa: E402

MODEL = "qwen3"
MAX = 1500  # output tokens: the random model ends its free text long before (median ~80 tokens), a grammar sooner


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    sky: Literal["sun", "rain", "snow"]
    celsius: int = Field(ge=-30, le=45)


class Sky(BaseModel):
    kind: Literal["sun", "rain"]
    wind: int = Field(ge=0, le=9)


class NestedForecast(BaseModel):  # pydantic writes the nested model as a $defs entry and a $ref
    city: Literal["Paris", "Rome"]
    sky: Sky


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("clients")
    base = write_model(d / "base.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    rewrite_gguf(base, d / f"{MODEL}.gguf", set_keys={
        "tokenizer.chat_template": ((TEMPLATES / FAMILY_TEMPLATES["hermes"]).read_text(), gguf.GGUFValueType.STRING)})
    os.remove(base)
    with Server([str(d / f"{MODEL}.gguf"), "-a", MODEL, "-c", "8192", "-np", "2", "-t", "1"]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0, err


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.url + "/v1"


def weather_calls() -> tuple[list[str], object]:
    """A tool function that records its calls (the oracle that a library ran the call it parsed)."""
    calls: list[str] = []

    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        assert city in ("Paris", "Rome", "Oslo")
        calls.append(city)
        return f"sunny in {city}"

    return calls, get_weather


# -- openai ------------------------------------------------------------------------------------------------

def test_openai_chat_and_responses(url):
    c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                     seed=3, temperature=1.0)
    r = c.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=1.0, extra_body={"seed": 3})
    assert r.output_text == chat.choices[0].message.content
    # streamed: the SDK's helper assembles the events (a finished answer: the schema's grammar ends it)
    with c.responses.stream(model=MODEL, input="Forecast?", text_format=Forecast, max_output_tokens=MAX) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert isinstance(final.output_parsed, Forecast)
    # parse: text.format from a pydantic model, read back into it
    parsed = c.responses.parse(model=MODEL, input="Forecast?", text_format=Forecast, max_output_tokens=MAX)
    assert isinstance(parsed.output_parsed, Forecast)
    # tools: a forced call, its output back with previous_response_id
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}, "strict": True}
    first = c.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
                               parallel_tool_calls=False, max_output_tokens=MAX)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    second = c.responses.create(model=MODEL, previous_response_id=first.id, tools=[tool], max_output_tokens=MAX,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens


# -- openai-agents -----------------------------------------------------------------------------------------

def _agent(url: str, **kw):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls, fn = weather_calls()
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    # the default model class of an Agent: the Responses API
    agent = agents.Agent(name="forecaster", instructions="Answer with the weather.", tools=[agents.function_tool(fn)],
                         model=agents.OpenAIResponsesModel(MODEL, client), **kw)
    return agents, agent, calls


def test_openai_agents_runner_run_calls_the_tool_and_answers(url):
    agents, agent, calls = _agent(url, model_settings=_agent_settings("required"))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    assert calls, "the tool was never called"
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert result.new_items[1].output == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, str)
    assert all(r.usage.input_tokens > 0 for r in result.raw_responses)


def test_openai_agents_runner_run_streamed(url):
    agents, agent, calls = _agent(url, model_settings=_agent_settings("required"))

    async def go():
        run = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=6)
        seen = []
        async for e in run.stream_events():
            seen.append(e.data.type if e.type == "raw_response_event" else e.name if e.type == "run_item_stream_event"
                        else e.type)
        return run, seen

    run, seen = asyncio.run(go())
    assert calls and "tool_called" in seen and "tool_output" in seen, seen
    assert "response.function_call_arguments.delta" in seen
    # the call's turn completed, then the tool ran, then the answer's turn completed
    assert seen.index("response.completed") < seen.index("tool_output") < len(seen) - 1 - seen[::-1].index(
        "response.completed")
    assert isinstance(run.final_output, str)


def _agent_settings(choice: str):
    from agents import ModelSettings

    return ModelSettings(tool_choice=choice, parallel_tool_calls=False, max_tokens=MAX, temperature=1.0)


def test_openai_agents_with_an_output_type(url):
    agents, agent, calls = _agent(url, model_settings=_agent_settings("required"), output_type=Forecast)
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=16))
    assert calls and isinstance(result.final_output, Forecast)


# -- pydantic-ai -------------------------------------------------------------------------------------------

def _pydantic_agent(url: str, kind: str, output_type):
    pai = pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls, fn = weather_calls()
    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                                               timeout=300))
    model = (OpenAIResponsesModel if kind == "responses" else OpenAIChatModel)(MODEL, provider=provider)
    agent = pai.Agent(model, output_type=output_type, model_settings={"max_tokens": MAX, "temperature": 1.0})
    agent.tool_plain(fn)
    return agent, calls


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_pydantic_ai_a_tool_and_an_output_model(url, kind):
    """pydantic-ai forces a call among the tool and its output tool (``final_result``) until the output comes: the tool
    may or may not be picked first, so runs go on until one called it (each pick is a fair draw of the model)."""
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.usage import UsageLimits

    for _ in range(16):
        agent, calls = _pydantic_agent(url, kind, Forecast)
        result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=24))
        assert isinstance(result.output, Forecast)
        if calls:
            break
    assert calls, "in 16 runs the model never picked the tool"
    returns = [p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)
               and p.tool_name == "get_weather"]
    # (parallel calls run concurrently: the same calls, in any order)
    assert sorted(r.content for r in returns) == sorted(f"sunny in {c}" for c in calls)


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_pydantic_ai_a_nested_output_model(url, kind):
    agent, _ = _pydantic_agent(url, kind, NestedForecast)
    assert isinstance(agent.run_sync("What is the weather in Rome?").output, NestedForecast)


# -- langchain-openai --------------------------------------------------------------------------------------

@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_bind_tools_and_structured_output(url, responses_api):
    lc = pytest.importorskip("langchain_openai")
    _, fn = weather_calls()
    llm = lc.ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_retries=0, max_tokens=MAX, temperature=1.0,
                        use_responses_api=responses_api, timeout=300)
    msg = llm.bind_tools([fn], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert fn(**msg.tool_calls[0]["args"]) == f"sunny in {msg.tool_calls[0]['args']['city']}"
    out = llm.with_structured_output(Forecast).invoke("Forecast for Rome?")
    assert isinstance(out, Forecast)
    plain = llm.invoke("Hi")
    assert isinstance(plain.text, str) and plain.response_metadata.get("model_name", MODEL).startswith(MODEL)


# -- instructor --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_chat_modes(url, mode):
    instructor = pytest.importorskip("instructor")
    c = instructor.from_openai(openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300),
                               mode=getattr(instructor.Mode, mode))
    out = c.create(model=MODEL, messages=[{"role": "user", "content": "Forecast?"}], response_model=Forecast,
                   max_retries=0, max_tokens=MAX)
    assert isinstance(out, Forecast)


def test_instructor_responses_tools(url):
    instructor = pytest.importorskip("instructor")
    c = instructor.from_openai(openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300),
                               mode=instructor.Mode.RESPONSES_TOOLS)
    out = c.create(model=MODEL, messages=[{"role": "user", "content": "Forecast?"}], response_model=Forecast,
                   max_retries=0, max_output_tokens=MAX)
    assert isinstance(out, Forecast)


# -- litellm -----------------------------------------------------------------------------------------------

def test_litellm_completion_and_responses(url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list from the package, not the network
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"openai/{MODEL}", api_base=url, api_key="unused")
    # (litellm raises max_output_tokens to OpenAI's least, 16)
    chat = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=1.0, seed=5,
                              **kw)
    assert chat.choices[0].message.content is not None
    r = litellm.responses(input="Hi", max_output_tokens=16, temperature=1.0, extra_body={"seed": 5}, **kw)
    text = "".join(p.text for item in r.output if item.type == "message" for p in item.content)
    assert text == chat.choices[0].message.content
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}
    called = litellm.responses(input="Weather?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
                               max_output_tokens=MAX, **kw)
    assert called.parallel_tool_calls is False  # passed on: one call
    (call,) = [i for i in called.output if i.type == "function_call"]
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    streamed = litellm.responses(input="Hi", max_output_tokens=16, temperature=1.0, extra_body={"seed": 5},
                                 stream=True, **kw)
    deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text
