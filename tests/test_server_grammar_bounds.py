"""Bounded grammar compiles through ``ggml-hybrid serve`` (issue 40: E1, E5, E9, E10, E11, E16).

From every route that compiles one (chat's ``response_format``, ``json_schema`` and ``grammar``, completions, forced
tool calls, Anthropic's forced ``tool_choice``): a schema or grammar that took the server down (SIGSEGV) is a 400
naming the bound, and the server goes on; compiles wait in their own pool, never on the threads that tokenize and
render; bounds llguidance cannot hold exactly and ``x-guidance`` are refused; a grammar that fails mid-generation is a
typed 400 (a typed error event in a stream), never an untyped 500; ``stop`` strings cannot cut a structured text."""

from __future__ import annotations

import json
import threading
import urllib.request

import gguf
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("jinja2.sandbox")

from helpers import rewrite_gguf  # noqa: E402
from test_grammar_bounds import WIDE, gbnf_chain, ref_chain, slow_gbnf  # noqa: E402
from test_server import Server, get, post, scrape  # noqa: E402
from test_structured import FAMILY_TEMPLATES, TEMPLATES  # noqa: E402

from ggml_hybrid.synthetic import write_model  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# 1,200 hops through 'properties' (2,402 levels; past an 8 MiB stack on main), small enough for the prompt the
# template renders the tools into
DEEP_PARAMETERS = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}},
                   "$defs": ref_chain(1200, "properties")["$defs"]}
FORCED_TOOL = [{"type": "function", "function": {"name": "deep", "parameters": DEEP_PARAMETERS}}]
# a plain $ref chain of 2,500 in a tool's parameters (the forced call's Lark grammar: server/tool_grammar.py)
CHAIN_TOOL = [{"type": "function", "function": {"name": "chain", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": ref_chain(2500)["$defs"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("gbs")
    write_model(d / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    # a format whose forced call embeds the tool's parameters as they are (their $refs resolve: hermes' wrapper
    # leaves them dangling, issue 40's E8)
    rewrite_gguf(d / "m.gguf", d / "mistral.gguf", set_keys={"tokenizer.chat_template": (
        (TEMPLATES / FAMILY_TEMPLATES["mistral"]).read_text(), gguf.GGUFValueType.STRING)})
    cfg = d / "server.toml"
    cfg.write_text("".join(f'[models.{n}]\npath = "{n}.gguf"\n[models.{n}.session_options]\nn_ctx = {ctx}\n'
                           f'n_threads = 1\nn_parallel = {par}\n' for n, ctx, par in (("m", 1024, 2),
                                                                                     ("mistral", 32768, 1))))
    with Server(["--config", str(cfg)]) as s:
        yield s


def _chat(**kw) -> str:
    return json.dumps({"model": kw.pop("model", "m"), "messages": USER, "max_tokens": 4, **kw})


def _completion(**kw) -> str:
    return json.dumps({"model": "m", "prompt": "Answer:", "max_tokens": 4, **kw})


E1 = [
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(2500)}}), "response_format.json_schema.schema"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object", "schema": ref_chain(1800, "properties")}),
     "response_format.schema"),
    ("/v1/chat/completions", _chat(json_schema=ref_chain(2000, "items")), "json_schema"),
    ("/v1/chat/completions", _chat(grammar=gbnf_chain(4000)), "grammar"),
    ("/v1/completions", _completion(json_schema=ref_chain(2500)), "json_schema"),
    ("/v1/completions", _completion(grammar=gbnf_chain(4000)), "grammar"),
    ("/v1/chat/completions", _chat(model="mistral", tools=FORCED_TOOL, tool_choice="required"), "tools"),
    ("/v1/chat/completions", _chat(model="mistral", tools=CHAIN_TOOL, tool_choice={
        "type": "function", "function": {"name": "chain"}}), "tools"),
]


@pytest.mark.parametrize("path, body, param", E1, ids=[p for _, _, p in E1])
def test_what_crashed_the_server_is_a_400_naming_the_bound(server, path, body, param):
    status, doc = post(server.url + path, body)
    assert status == 400, doc
    assert doc["error"]["param"] == param and "levels deep" in doc["error"]["message"], doc
    assert doc["error"]["code"] in ("invalid_grammar", "invalid_tool_schema"), doc
    assert server.proc.poll() is None and get(server.url + "/health")[0] == 200


def test_anthropic_forced_tool_with_a_deep_schema_is_anthropics_400(server):
    body = json.dumps({"model": "mistral", "max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"},
                       "tools": [{"name": "deep", "input_schema": DEEP_PARAMETERS}]})
    status, doc = post(server.url + "/v1/messages", body)
    assert status == 400 and doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert "levels deep" in doc["error"]["message"]
    assert server.proc.poll() is None and get(server.url + "/health")[0] == 200


def _compiles(server) -> dict[str, float]:
    m = scrape(server.url)
    return {labels[0][1]: v for (name, labels), v in m.items() if name == "ggml_hybrid_grammar_compiles"}


def test_compiles_do_not_starve_tokenizing_or_rendering(server):
    """Four clients compile grammars that outrun the compile's time (E5: they held the four text threads, and
    another client's chat waited 16.8 s); while they are in the compile pool, a plain chat is answered."""
    slow = _chat(grammar=slow_gbnf())
    answers: list[tuple[int, dict]] = []

    def send() -> None:
        answers.append(post(server.url + "/v1/chat/completions", slow))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(600):  # until all four are in the pool (a bounded poll of its gauge)
            c = _compiles(server)
            if c.get("running", 0) + c.get("waiting", 0) >= 4:
                break
            threading.Event().wait(0.05)
        else:
            pytest.fail(f"the four compiles never showed in the pool: {c}")
        status, doc = post(server.url + "/v1/chat/completions", _chat())
        assert status == 200, doc
        assert not answers, "the chat waited for the compiles"  # none of the four had its answer yet
        assert get(server.url + "/health")[0] == 200
    finally:
        for t in threads:
            t.join()
    assert [s for s, _ in answers] == [400] * 4
    assert all("did not compile within" in d["error"]["message"] for _, d in answers), answers


BOUNDS = [
    (_chat(json_schema={"type": "integer", "minimum": 1e30, "maximum": 1e31}), "json_schema", "2**53"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 2 ** 63}}}}}),
     "response_format.json_schema.schema", "2**53"),
    (_chat(json_schema={"type": "object", "x-guidance": {"whitespace_pattern": "[a-z]+"}}), "json_schema",
     "x-guidance"),
    (_chat(response_format={"type": "json_object", "schema": {"x-guidance": 5}}), "response_format.schema",
     "x-guidance"),
    (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "x-guidance": {"lenient": True}}}}]), "tools[0].function.parameters", "x-guidance"),
    (_chat(grammar="root ::= (" + " | ".join(f'"w{i}"' for i in range(3000)) + ")"), "grammar",
     "past its first token"),
    (_completion(grammar='root ::= "q" "z" big\n' + WIDE), "grammar", "past its first token"),
    (_chat(json_schema={"type": "string"}, stop=["}"]), "stop", "'stop' cannot be combined"),
    (_completion(grammar='root ::= "yes" | "no"', stop="\n"), "stop", "'stop' cannot be combined"),
]


@pytest.mark.parametrize("body, param, words", BOUNDS, ids=[f"{p}:{w}" for _, p, w in BOUNDS])
def test_what_llguidance_would_answer_falsely_is_a_400(server, body, param, words):
    path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
    status, doc = post(server.url + path, body)
    assert status == 400 and doc["error"]["param"] == param and words in doc["error"]["message"], doc


def test_an_empty_stop_list_is_no_stop(server):
    status, doc = post(server.url + "/v1/chat/completions", _chat(json_schema={"enum": ["yes", "no"]}, stop=[]))
    assert status == 200 and json.loads(doc["choices"][0]["message"]["content"]) in ("yes", "no")
    assert doc["choices"][0]["finish_reason"] == "stop"


FAILS_LATER = 'root ::= "q" [0-9]+ "z" big\n' + WIDE


def test_a_grammar_that_fails_mid_generation_is_a_typed_400(server):
    status, doc = post(server.url + "/v1/chat/completions", _chat(grammar=FAILS_LATER, max_tokens=200, seed=3,
                                                                temperature=1.0))
    assert status == 400, doc
    err = doc["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_grammar" and err["param"] == "grammar"
    assert "mid-way" in err["message"] and "items" in err["message"]


def test_a_grammar_that_fails_mid_stream_ends_with_a_typed_error_event(server):
    req = urllib.request.Request(server.url + "/v1/completions", data=_completion(
        grammar=FAILS_LATER, max_tokens=200, seed=3, temperature=1.0, stream=True).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1, events
    assert errors[0]["type"] == "invalid_request_error" and errors[0]["code"] == "invalid_grammar", errors


# -- the other APIs' routes (Anthropic's output_config, llama-server's /completion) ---------------------------------

def test_anthropic_output_config_with_stop_sequences_is_refused(server):
    body = {"model": "m", "max_tokens": 8, "messages": USER,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "string"}}}}
    status, doc = post(server.url + "/v1/messages", json.dumps({**body, "stop_sequences": ["}"]}))
    assert status == 400 and doc["type"] == "error" and "cannot be combined" in doc["error"]["message"], doc
    status, doc = post(server.url + "/v1/messages", json.dumps({**body, "output_config": {"format": {
        "type": "json_schema", "schema": ref_chain(2500)}}}))
    assert status == 400 and "levels deep" in doc["error"]["message"], doc


def test_llama_server_completion_bounds_and_typed_failures(server):
    body = {"model": "m", "prompt": "Answer:", "n_predict": 200, "seed": 3, "temperature": 1.0}
    status, doc = post(server.url + "/completion", json.dumps({**body, "grammar": gbnf_chain(4000)}))
    assert status == 400 and "levels deep" in doc["error"]["message"], doc
    status, doc = post(server.url + "/completion", json.dumps({**body, "grammar": FAILS_LATER}))
    assert status == 400 and doc["error"]["code"] == "invalid_grammar", doc
    req = urllib.request.Request(server.url + "/completion", data=json.dumps(
        {**body, "grammar": FAILS_LATER, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.read().decode().splitlines() if ln.startswith("data: ")
                  and ln[6:] != "[DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "invalid_grammar", events


def test_a_heavy_tool_schema_is_read_off_the_event_loop(server):
    """A tool's parameters are checked against JSON Schema's meta-schema (jsonschema: seconds for thousands of
    $defs, found by the fuzzer's chains: /health stalled 1.9 s); that runs off the event loop, so /health answers
    meanwhile, time after time (on main three came before the check began or between its parts, none during it)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"type": "string"}}}
            for i in range(2500)}
    defs["d2500"] = {"type": "integer"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}}}]
    done = threading.Event()
    answer: list[tuple[int, dict]] = []

    def send() -> None:
        # a tool_choice naming no tool given: refused right after the tools are read (reading them is all it costs)
        answer.append(post(server.url + "/v1/chat/completions", _chat(tools=tools, tool_choice={
            "type": "function", "function": {"name": "nope"}})))
        done.set()

    t = threading.Thread(target=send)
    t.start()
    during = 0
    while not done.is_set():
        status, _ = get(server.url + "/health")
        assert status == 200
        during += not done.is_set()
    t.join()
    assert answer[0][0] == 400 and answer[0][1]["error"]["param"] == "tool_choice.function.name", answer
    assert during >= 10, f"/health answered {during} times while the tools were read"


def test_an_ambiguous_grammar_ends_at_the_cpu_bound_and_another_client_goes_on(server):
    """An ambiguous grammar's per-token work grows with every token, on the engine thread every client of the model
    shares: it ends at the bound of one token's CPU time (34 ms, some 650 tokens in: 19 s here at load 6.5; before,
    it ran on towards llguidance's row limit near 1,000 tokens, at up to 0.4 s a token, and outlived the client's
    30 s timeout) as a typed 400 naming the field and the bound. Another client's request, sent while it runs, gets
    the answer it gets alone."""
    other = _chat(max_tokens=8, temperature=0)
    status, alone = post(server.url + "/v1/chat/completions", other)
    assert status == 200, alone
    # a negative presence and frequency penalty keep drawing "a" (the grammar's only other choice is the end)
    amb = _completion(prompt="a", grammar='root ::= x\nx ::= x x | "a"', max_tokens=1000, temperature=0,
                      presence_penalty=-2, frequency_penalty=-2)
    out: list[tuple[int, dict]] = []
    job = threading.Thread(target=lambda: out.append(post(server.url + "/v1/completions", amb)))
    job.start()
    status, beside = post(server.url + "/v1/chat/completions", other)
    job.join()
    assert status == 200 and beside["choices"][0]["message"] == alone["choices"][0]["message"], (beside, alone)
    status, doc = out[0]
    assert status == 400, doc
    err = doc["error"]
    assert err["code"] == "invalid_grammar" and err["param"] == "grammar", err
    assert "ms of CPU time, over the bound of 33.6 ms a token" in err["message"] and "ambiguous" in err["message"]
