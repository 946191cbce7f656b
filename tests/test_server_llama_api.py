"""llama-server's own API on a live ``ggml-hybrid serve``, for the scripts written against it: ``POST /completion``
(text, token and mixed prompts, several prompts, ``n_predict``, ``n_probs``, ``cache_prompt``/``tokens_cached``,
``return_progress``, streamed), the routes without ``/v1``, ``POST /apply-template``, ``model`` optional on a
one-model server, CORS for browser pages, llama-server's error types, ``/slots``' ``is_processing`` and its
server-wide flags. The oracles: a fresh resident model's greedy steps and float64 log-softmax, the model's tokenizer,
ChatML written out, the fixed-cut rule of prompt reuse, the official ``openai`` client."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
from test_server import Server, free_port  # noqa: E402

from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.runtime.moe_model import MoEModel  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402

N_CTX = 2048  # long enough that a generation to the end of it is still running when /slots is asked (1,000+ steps)
UB = 8
KEY = "sk-llama-test"
ORIGIN = "http://app.example:5173"
OPTS = SessionOptions(n_threads=1, n_ctx=N_CTX, ubatch_size=UB)  # the server's: the oracle runs as it does
PROMPT = [5, 77, 120, 9, 300, 41, 17, 250, 3, 88, 200]


def call(server, path: str, body: object = None, method: str | None = None, key: str | None = KEY,
         headers: dict | None = None) -> tuple[int, object, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text, got = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, text, got = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(text), got
    except ValueError:
        return status, text, got


def events(server, path: str, body: dict) -> list[str]:
    """A stream's ``data:`` payloads, in order, read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    out = [line[len(b"data: "):].decode() for line in r.read().splitlines() if line.startswith(b"data: ")]
    conn.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    return {"m": write_model(d / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4),
            "glm": write_model(d / "glm.gguf", arch="glm4moe", weight_type="q8_0", seed=4)}


@pytest.fixture(scope="module")
def server(files):
    with Server([files["m"], "-c", str(N_CTX), "-t", "1", "-np", "2", "-ub", str(UB), "--api-key", KEY,
                 "--cors-origins", ORIGIN]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def oracle(files):
    """The model and its tokenizer as a fresh resident run sees them."""
    with MoEModel(files["m"], OPTS) as m:
        yield m


def greedy(m: MoEModel, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens after ``prompt`` from an empty cache, and each step's float64 log-softmax."""
    toks, lps = [], []
    row = m.eval(prompt)[-1]
    for _ in range(n):
        x = row.astype(np.float64)
        lps.append(x - np.logaddexp.reduce(x))
        toks.append(int(np.argmax(row)))
        row = m.eval([toks[-1]])[-1]
    return toks, lps


def fresh_greedy(path: str, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    with MoEModel(path, OPTS) as m:
        return greedy(m, prompt, n)


# -- POST /completion -------------------------------------------------------------------------------------------

def test_completion_of_token_ids_is_the_greedy_continuation(server, files, oracle):
    status, doc, _ = call(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                  "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
    assert status == 200, doc
    want, _ = fresh_greedy(files["m"], PROMPT, 6)
    assert doc["tokens"] == want and doc["content"] == oracle.tokenizer.decode(want)
    assert (doc["tokens_predicted"], doc["tokens_evaluated"], doc["tokens_cached"]) == (6, len(PROMPT), 0)
    assert doc["stop"] is True and doc["stop_type"] == "limit" and doc["stopping_word"] == "" and not doc["truncated"]
    assert doc["model"] == "m" and doc["prompt"] == oracle.tokenizer.decode(PROMPT) and doc["index"] == 0
    gs = doc["generation_settings"]
    assert (gs["n_predict"], gs["temperature"], gs["n_ctx"], gs["ignore_eos"]) == (6, 0, N_CTX, True)
    t = doc["timings"]
    assert t["predicted_n"] == 6 and t["prompt_n"] == len(PROMPT) and t["cache_n"] == 0
    assert {"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
            "predicted_per_second"} <= set(t)


def test_text_mixed_and_several_prompts_tokenize_as_llama_server(server, files, oracle):
    tok = oracle.tokenizer
    text = "Once upon a time"
    cases = [(text, tok.encode(text, special=True)),  # text: BOS by the file's rule
             ([12, 34, " and then", 56], [12, 34] + tok.encode(" and then", add_bos=False, special=True) + [56]),
             ([" so", 7], tok.encode(" so", special=True) + [7])]
    for prompt, ids in cases:
        status, doc, _ = call(server, "/completion", {"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                      "ignore_eos": True, "return_tokens": True})
        assert status == 200, doc
        assert doc["tokens_evaluated"] == len(ids)
        assert doc["tokens"] == fresh_greedy(files["m"], ids, 3)[0]
    status, doc, _ = call(server, "/completion", {"prompt": ["a b", [5, 6, 7], {"prompt_string": "c"}],
                                                  "n_predict": 2, "temperature": 0, "ignore_eos": True,
                                                  "return_tokens": True})
    assert status == 200 and isinstance(doc, list) and [d["index"] for d in doc] == [0, 1, 2]
    for d, ids in zip(doc, (tok.encode("a b", special=True), [5, 6, 7], tok.encode("c", special=True))):
        assert d["tokens"] == fresh_greedy(files["m"], ids, 2)[0]


def test_n_probs_are_the_log_softmax_of_the_models_logits(server, files, oracle):
    status, doc, _ = call(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "n_probs": 3,
                                                  "ignore_eos": True, "cache_prompt": False})
    assert status == 200, doc
    toks, lps = fresh_greedy(files["m"], PROMPT, 4)
    probs = doc["completion_probabilities"]
    assert [p["id"] for p in probs] == toks
    for p, lp in zip(probs, lps):
        assert p["logprob"] == pytest.approx(lp[p["id"]], rel=1e-12, abs=1e-12)
        assert bytes(p["bytes"]) == oracle.tokenizer.token_bytes(p["id"])
        want = sorted(range(lp.size), key=lambda i: (-lp[i], i))[:3]
        assert [t["id"] for t in p["top_logprobs"]] == want
        assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx([lp[i] for i in want], rel=1e-12)


def test_a_streamed_completion_is_the_whole_one_in_pieces(server):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    _, whole, _ = call(server, "/completion", body)
    chunks = [json.loads(e) for e in events(server, "/completion", {**body, "stream": True})]
    assert all(e != "[DONE]" for e in chunks)  # llama-server's own stream ends without it
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert [t for c in chunks[:-1] for t in c["tokens"]] == whole["tokens"]
    last = chunks[-1]
    assert (last["tokens_predicted"], last["stop_type"], last["content"]) == (8, "limit", "")


def test_cache_prompt_reuses_up_to_the_last_fixed_cut(server, files):
    prompt = [(7 * i + 3) % 400 for i in range(40)]
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    cold = call(server, "/completion", {**body, "cache_prompt": False})[1]
    assert cold["tokens_cached"] == 0
    call(server, "/completion", body)  # leaves its cells in a slot
    warm = call(server, "/completion", body)[1]
    # the same prompt again: everything up to the last multiple of -ub below its length (one token is evaluated)
    assert warm["tokens_cached"] == warm["timings"]["cache_n"] == (len(prompt) - 1) // UB * UB
    assert warm["tokens"] == cold["tokens"] == fresh_greedy(files["m"], prompt, 3)[0]


def test_return_progress_reports_the_prompt_steps(server):
    prompt = [(5 * i + 1) % 400 for i in range(40)]
    for path, body in (("/completion", {"prompt": prompt, "n_predict": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 30}],
                                                 "max_tokens": 2})):
        docs = [json.loads(e) for e in events(server, path, {**body, "stream": True, "return_progress": True,
                                                              "cache_prompt": False}) if e != "[DONE]"]
        progress = [d["prompt_progress"] for d in docs if "prompt_progress" in d]
        total = progress[0]["total"]
        assert total > 2 * UB and all(p["total"] == total and p["cache"] == 0 for p in progress)
        done = [p["processed"] for p in progress]
        # after prompt steps (each ubatch of -ub tokens; a chunk may cover several steps): the prompt's cuts, rising
        assert done == sorted(set(done)) and done[-1] == total and all(k % UB == 0 for k in done[:-1])
        assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)
        first_text = next(i for i, d in enumerate(docs) if (d.get("content") or (d.get("choices") or [{}])[0].get(
            "delta", {}).get("content")))
        assert max(i for i, d in enumerate(docs) if "prompt_progress" in d) < first_text


# -- the other llama-server routes ----------------------------------------------------------------------------------

def test_routes_without_v1_are_the_v1_routes(server):
    bare = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    v1 = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Hello"}]
    a = bare.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    b = v1.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content and a.object == "chat.completion"
    c = bare.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
    d = v1.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
    assert c.choices[0].text == d.choices[0].text
    assert [m.id for m in bare.models.list()] == [m.id for m in v1.models.list()] == ["m"]


def test_apply_template_is_the_chat_prompt(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, doc, _ = call(server, "/apply-template", {"messages": msgs})
    assert status == 200
    # the file has no template: ChatML, written out
    assert doc == {"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                             "<|im_start|>assistant\n"}


def test_one_model_answers_any_name_or_none(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    want = c.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text
    for name in ("gpt-4o-mini", "some/other-model"):
        r = c.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.choices[0].text == want and r.model == "m"
    status, doc, _ = call(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 2})
    assert status == 200 and doc["model"] == "m"
    assert call(server, "/completion", {"prompt": "x", "n_predict": 1, "model": "anything"})[0] == 200


# -- CORS -------------------------------------------------------------------------------------------------------

def test_a_preflight_is_answered_without_a_key(server):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, h = call(server, "/v1/chat/completions", method="OPTIONS", key=None, headers=pre)
    assert status == 200
    assert h["access-control-allow-origin"] == ORIGIN
    assert "authorization" in h["access-control-allow-headers"].lower()
    assert "POST" in h["access-control-allow-methods"]
    # the request itself, and a refusal, carry the header the browser needs to read them
    status, _, h = call(server, "/completion", {"prompt": "x", "n_predict": 1}, headers={"Origin": ORIGIN})
    assert status == 200 and h["access-control-allow-origin"] == ORIGIN
    status, doc, h = call(server, "/completion", {"prompt": "x"}, key=None, headers={"Origin": ORIGIN})
    assert status == 401 and h["access-control-allow-origin"] == ORIGIN
    # another site's page gets no permission
    status, _, h = call(server, "/v1/chat/completions", method="OPTIONS", key=None,
                        headers={**pre, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in h}


# -- errors -----------------------------------------------------------------------------------------------------

def test_a_context_overflow_is_llama_servers_error(server):
    long = [5] * (N_CTX + 4)
    for path, body, param in (("/completion", {"prompt": long}, "prompt"),
                              ("/v1/completions", {"model": "m", "prompt": long}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 2 * N_CTX}]},
                               "messages")):
        status, doc, _ = call(server, path, body)
        assert status == 400, doc
        e = doc["error"]
        assert e["type"] == "exceed_context_size_error" and e["code"] == "context_length_exceeded", e
        assert e["n_ctx"] == N_CTX and e["n_prompt_tokens"] > N_CTX and e["param"] == param
        assert "exceeds the available context size" in e["message"]


def test_a_bad_key_is_an_authentication_error(server):
    for path in ("/completion", "/v1/chat/completions", "/apply-template"):
        for key in (None, "sk-wrong"):
            status, doc, _ = call(server, path, {"prompt": "x"}, key=key)
            assert status == 401 and doc["error"]["type"] == "authentication_error", doc
            assert doc["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="sk-wrong", max_retries=0).models.list()


@pytest.mark.parametrize("path, body, param", [
    ("/completion", {}, "prompt"),
    ("/completion", {"prompt": []}, "prompt"),
    ("/completion", {"prompt": [1, True]}, "prompt"),
    ("/completion", {"prompt": [[1], {"prompt_string": "x", "multimodal_data": ["AAAA"]}]},
     "prompt[1].multimodal_data"),
    ("/completion", {"prompt": [1, 10 ** 9]}, "prompt"),
    ("/completion", {"prompt": "x", "n_predict": 0}, "n_predict"),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": "x", "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": "x", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "x", "samplers": ["temperature", "top_k"]}, "samplers"),
    ("/completion", {"prompt": "x", "stop": ["y" * 300]}, "stop[0]"),
    ("/completion", {"prompt": "x", "return_tokens": "yes"}, "return_tokens"),
    ("/completion", {"prompt": "x", "grammar": 5}, "grammar"),
    ("/completion", {"prompt": ["a"] * 5, "n_cmpl": 4}, "n_cmpl"),
    ("/completion", {"prompt": "a", "n_cmpl": 17}, "n_cmpl"),
    ("/apply-template", {"messages": "hi"}, "messages"),
    ("/apply-template", {"messages": [{"role": "user", "content": 5}]}, "messages"),
])
def test_bad_input_on_the_new_routes_is_a_400_naming_the_field(server, path, body, param):
    status, doc, _ = call(server, path, body)
    assert status == 400, doc
    assert set(doc["error"]) >= {"message", "type", "param", "code"} and doc["error"]["param"] == param, doc
    assert call(server, "/health", key=None)[0] == 200
    assert call(server, "/completion", {"prompt": "x", "n_predict": 1})[0] == 200


def test_llama_uis_sampler_fields_at_their_off_values_are_taken(server):
    body = {"prompt": PROMPT, "n_predict": 3, "temperature": 0, "ignore_eos": True, "return_tokens": True,
            "mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0, "dynatemp_range": 0,
            "top_n_sigma": -1, "n_keep": 0, "id_slot": -1, "post_sampling_probs": False, "lora": [],
            "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
            "mirostat_tau": 5.0, "dry_base": 1.75}
    status, doc, _ = call(server, "/completion", body)
    assert status == 200, doc
    plain = {k: body[k] for k in ("prompt", "n_predict", "temperature", "ignore_eos", "return_tokens")}
    assert doc["tokens"] == call(server, "/completion", plain)[1]["tokens"]


def test_slots_say_is_processing(server):
    status, slots, _ = call(server, "/slots")
    assert status == 200 and len(slots) == 2
    assert all(s["is_processing"] is False and s["state"] == "idle" for s in slots)
    # a generation to the end of the context (2,000 decode steps) in flight: poll /slots after each chunk, bounded by
    # the stream's end, until its slot is seen busy
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/completion", json.dumps({"prompt": [1, 2, 3], "n_predict": -1, "ignore_eos": True,
                                                    "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    seen = False
    while not seen:
        line = r.readline()
        if not line or b'"stop": true' in line:
            break
        for s in call(server, "/slots")[1]:
            assert s["is_processing"] == (s["state"] != "idle")
            seen |= s["is_processing"]
    conn.close()
    assert seen


# -- server-wide flags ---------------------------------------------------------------------------------------------

def test_server_wide_flags(files, oracle):
    args = [files["glm"], "-c", "128", "-t", "1", "--temp", "0.9", "--top-k", "20", "--seed", "11", "-n", "5",
            "--ignore-eos", "--no-slots", "--metrics", "--chat-template", "chatml", "--no-jinja", "-b", "16", "-ub",
            "32"]
    with Server(args) as s:
        plain = {"prompt": PROMPT, "return_tokens": True}
        status, doc, _ = call(s, "/completion", plain, key=None)
        gs = doc["generation_settings"]
        assert (gs["temperature"], gs["top_k"], gs["seed"], gs["n_predict"], gs["ignore_eos"]) == (0.9, 20, 11, 5, True)
        explicit = call(s, "/completion", {**plain, "temperature": 0.9, "top_k": 20, "seed": 11, "n_predict": 5,
                                           "ignore_eos": True}, key=None)[1]
        assert doc["tokens"] == explicit["tokens"] and len(doc["tokens"]) == 5
        assert call(s, "/completion", {**plain, "ignore_eos": False}, key=None)[1]["generation_settings"][
            "ignore_eos"] is False  # a request's own field wins
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model="glm", prompt=PROMPT)
        assert r.usage.completion_tokens == 5  # -n, not OpenAI's 16
        assert call(s, "/slots", key=None)[1]["error"]["type"] == "not_supported_error"
        assert call(s, "/slots", key=None)[0] == 501 and call(s, "/metrics", key=None)[0] == 200
        props = call(s, "/props", key=None)[1]
        assert props["cache_prompt"]["ubatch_size"] == 16 and props["default_generation_settings"]["seed"] == 11
        assert props["default_generation_settings"]["ignore_eos"] is True
        # --chat-template chatml replaces the file's (glm4moe's) template; --no-jinja refuses tools
        msgs = [{"role": "user", "content": "Hi"}]
        assert call(s, "/apply-template", {"messages": msgs}, key=None)[1]["prompt"] == \
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        status, doc, _ = call(s, "/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]}, key=None)
        assert status == 400 and doc["error"]["param"] == "tools" and "--no-jinja" in doc["error"]["message"]
        # no --cors-origins: a preflight is not a 401, and grants nothing
        status, _, h = call(s, "/v1/chat/completions", method="OPTIONS", key=None, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert status == 405 and "access-control-allow-origin" not in {k.lower() for k in h}
        rc, err = s.stop()
    assert rc == 0 and "-ub 32 is larger than -b 16: using -ub 16" in err, err


@pytest.mark.parametrize("args, message", [
    (["--chat-template", "llama3"], "'chatml'"),
    (["--no-jinja"], "--no-jinja needs --chat-template chatml"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"], "not valid Jinja2"),
    (["--cors-origins", "app.example"], "not an origin"),
    (["--cors-origins", "*,http://a.example"], "stand alone"),
    (["-n", "0"], "-n 0"),
    (["--temp", "0.5", "--top-p", "0"], "top-p"),
])
def test_bad_server_flags_are_one_error_line(files, args, message):
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", files["m"], "-c", str(N_CTX), "-t", "1",
                        "--port", str(free_port()), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
