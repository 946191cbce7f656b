"""The server's API beyond generation, driven over HTTP (the official ``openai`` client where it applies): logprobs
against a float64 log-softmax of the model's own logits, prompt reuse in /metrics and usage, API keys, /tokenize,
/detokenize, /props, /slots, /v1/embeddings, and bad input that leaves the server up."""

from __future__ import annotations

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
from ggml_hybrid.text.chat import ChatTemplate  # noqa: E402

N_CTX = 128
KEY, FILE_KEY = "sk-test-one", "sk-test-two"
OPTS = SessionOptions(n_threads=1, n_ctx=N_CTX, ubatch_size=8)  # the server's, one slot: the oracle


def call(url: str, method: str = "GET", body: object = None, key: str | None = KEY,
         raw: bytes | None = None) -> tuple[int, object]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read(), e.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    keys = d / "keys.txt"
    keys.write_text(f"# the team's key\n\n{FILE_KEY}\n")
    return {"m": write_model(d / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4), "keys": str(keys)}


@pytest.fixture(scope="module")
def server(files):
    with Server([files["m"], "-c", str(N_CTX), "-t", "1", "-np", "2", "-ub", "8", "--api-key", KEY,
                 "--api-key-file", files["keys"]]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def log_softmax(row: np.ndarray) -> np.ndarray:
    """The oracle's log-softmax: float64, through numpy's logaddexp (not the server's max-shift formula)."""
    x = row.astype(np.float64)
    return x - np.logaddexp.reduce(x)


def greedy_oracle(path: str, prompt: list[int], n: int) -> list[np.ndarray]:
    """The log-probabilities of each of ``n`` greedy steps after ``prompt``, from a fresh resident model."""
    out = []
    with MoEModel(path, OPTS) as m:
        row = m.eval(prompt)[-1]
        for _ in range(n):
            out.append(log_softmax(row))
            row = m.eval([int(np.argmax(row))])[-1]
    return out


def token_bytes(path: str) -> list[bytes]:
    with MoEModel(path, OPTS) as m:
        return [m.tokenizer.token_bytes(i) for i in range(m.hp.n_vocab)]


def top_ids(lp: np.ndarray, k: int) -> list[int]:
    return sorted(range(lp.size), key=lambda i: (-lp[i], i))[:k]


# -- logprobs --------------------------------------------------------------------------------------------------

def test_completion_logprobs_are_the_log_softmax_of_the_models_logits(server, files):
    prompt = [5, 77, 120, 9, 300, 41, 17, 250, 3, 88, 200]
    r = client(server).completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    oracle = greedy_oracle(files["m"], prompt, len(lp.tokens))
    vocab = token_bytes(files["m"])
    assert len(lp.tokens) == r.usage.completion_tokens == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i, want in enumerate(oracle):
        tid = int(np.argmax(want))
        assert lp.tokens[i] == vocab[tid].decode("utf-8", "replace")
        assert lp.token_logprobs[i] == pytest.approx(want[tid], rel=1e-12, abs=1e-12)
        top = lp.top_logprobs[i]
        assert len(top) <= 3 and max(top.values()) == pytest.approx(want[tid], rel=1e-12)
        for t in top_ids(want, 3):
            s = vocab[t].decode("utf-8", "replace")
            assert s in top and top[s] >= want[t] - 1e-12  # (two tokens of one text share a key: the likelier)


def test_chat_logprobs_streamed_and_not_equal_the_oracle(server, files):
    msgs = [{"role": "user", "content": "Once upon a time"}]
    c = client(server)
    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=4)
    content = r.choices[0].logprobs.content
    with MoEModel(files["m"], OPTS) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        ids = tok.encode(t.render(msgs), special=True)
    oracle = greedy_oracle(files["m"], ids, len(content))
    vocab = token_bytes(files["m"])
    assert len(content) == r.usage.completion_tokens and r.usage.prompt_tokens == len(ids)
    for e, want in zip(content, oracle, strict=True):
        tid = int(np.argmax(want))
        assert bytes(e.bytes) == vocab[tid] and e.logprob == pytest.approx(want[tid], rel=1e-12, abs=1e-12)
        assert [bytes(x.bytes) for x in e.top_logprobs] == [vocab[i] for i in top_ids(want, 4)]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx([want[i] for i in top_ids(want, 4)], rel=1e-12)
    chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=4, stream=True))
    streamed = [e for x in chunks if x.choices and x.choices[0].logprobs for e in x.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [(e.token, e.logprob, e.bytes) for e in content]
    plain = c.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"cache_prompt": "yes"}, "cache_prompt"),
])
def test_bad_logprobs_are_400s_naming_the_parameter(server, path, body, param):
    base = {"model": "m", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    status, doc = call(server.url + path, "POST", {**base, **body})
    assert status == 400 and doc["error"]["param"] == param, doc


# -- prompt reuse ----------------------------------------------------------------------------------------------

def test_a_shared_prefix_is_reused_counted_and_changes_no_logprob(server):
    c = client(server)
    rng = np.random.default_rng(7)
    system = [int(t) for t in rng.integers(0, 384, 40)]
    first = system + [1, 2, 3]
    second = system + [4, 5, 6, 7]
    before = scrape_keyed(server)
    r1 = c.completions.create(model="m", prompt=first, max_tokens=3, temperature=0, logprobs=1)
    r2 = c.completions.create(model="m", prompt=second, max_tokens=3, temperature=0, logprobs=1)
    after = scrape_keyed(server)
    # the last cut below the 40 shared tokens that every longer prompt makes (ubatch 8): 40
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == 40
    reused = after["ggml_hybrid_prompt_tokens_reused_total"] - before["ggml_hybrid_prompt_tokens_reused_total"]
    evaluated = after["ggml_hybrid_prompt_tokens_evaluated_total"] - before["ggml_hybrid_prompt_tokens_evaluated_total"]
    assert reused == 40 and evaluated == len(first) + len(second) - 40
    cold = c.completions.create(model="m", prompt=second, max_tokens=3, temperature=0, logprobs=1,
                                extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].logprobs.token_logprobs == r2.choices[0].logprobs.token_logprobs  # exact floats
    assert cold.choices[0].text == r2.choices[0].text


def scrape_keyed(server) -> dict[str, float]:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples
            if s.labels.get("model") == "m" and not s.labels.get("finish_reason")}


# -- API keys --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/metrics", "GET"), ("/props", "GET"),
                                         ("/slots", "GET"), ("/tokenize", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/models/m", "GET"), ("/v1/responses", "POST"),
                                         ("/v1/responses/resp_x", "GET"), ("/v1/responses/resp_x", "DELETE"),
                                         ("/no/such/path", "GET")])
def test_every_endpoint_but_health_needs_a_key(server, path, method):
    for key in (None, "sk-wrong", KEY[:-1], KEY + "x", ""):
        status, doc = call(server.url + path, method, {} if method == "POST" else None, key=key)
        assert status == 401, (path, key)
        # OpenAI's code, llama-server's type (scripts written against either read one of them)
        assert doc["error"]["code"] == "invalid_api_key" and doc["error"]["type"] == "authentication_error"
    status, _ = call(server.url + "/health", key=None)
    assert status == 200


def test_the_openai_client_with_and_without_the_key(server):
    with pytest.raises(openai.AuthenticationError) as exc:
        client(server, "sk-wrong").models.list()
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    for key in (KEY, FILE_KEY):  # --api-key and --api-key-file
        assert [m.id for m in client(server, key).models.list()] == ["m"]
    req = urllib.request.Request(server.url + "/v1/models", headers={"X-Api-Key": FILE_KEY})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    assert scrape_http(server).get(("unauthorized", "401"), 0) >= 1


def scrape_http(server) -> dict[tuple[str, str], float]:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["endpoint"], s.labels["status"]): s.value for fam in text_string_to_metric_families(body)
            for s in fam.samples if s.name == "ggml_hybrid_http_requests_total"}


def test_no_key_is_the_old_open_server(files):
    with Server([files["m"], "-c", str(N_CTX), "-t", "1"]) as s:
        assert call(s.url + "/v1/models", key=None)[0] == 200
        rc, err = s.stop()
    assert rc == 0


@pytest.mark.parametrize("args,message", [
    (["--api-key", "two words"], "printable ASCII without spaces"),
    (["--api-key-file", "/nonexistent/keys"], "does not exist"),
    (["--api-key-file", "EMPTY"], "holds no key"),
])
def test_bad_keys_are_refused_at_start(files, tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", files["m"], "-c", str(N_CTX), "-t", "1",
                        "--port", str(free_port()), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_non_loopback_address_with_a_key_does_not_warn(files):
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", files["m"], "-c", str(N_CTX), "-t", "1",
                        "--host", "192.0.2.1", "--port", str(free_port()), "--api-key", KEY],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no authentication" not in r.stderr and "warning" not in r.stderr, r.stderr


# -- the other endpoints ---------------------------------------------------------------------------------------

def test_tokenize_and_detokenize_are_the_models_tokenizer(server, files):
    text = "Once upon a time, <|im_start|> héllo"
    with MoEModel(files["m"], OPTS) as m:
        want = m.tokenizer.encode(text, add_bos=False, special=True)
        pieces = [m.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in want]
        back = m.tokenizer.decode(want)
    status, doc = call(server.url + "/tokenize", "POST", {"content": text})
    assert status == 200 and doc == {"tokens": want}
    status, doc = call(server.url + "/tokenize", "POST", {"content": text, "with_pieces": True, "model": "m"})
    assert doc == {"tokens": [{"id": t, "piece": p} for t, p in zip(want, pieces)]}
    status, doc = call(server.url + "/detokenize", "POST", {"tokens": want})
    assert status == 200 and doc == {"content": back} and back == text


def test_props_and_slots_say_what_the_server_holds(server):
    status, props = call(server.url + "/props")
    assert status == 200
    assert props["model"] == "m" and props["n_ctx"] == N_CTX and props["total_slots"] == props["n_parallel"] == 2
    assert "<|im_start|>" in props["chat_template"] and props["session_options"]["ubatch_size"] == 8
    assert props["session_options"]["n_parallel"] == 2 and props["cache_prompt"]["ubatch_size"] == 8
    prompt = list(range(10, 30))
    client(server).completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    status, slots = call(server.url + "/slots?model=m")
    assert status == 200 and [s["id"] for s in slots] == [0, 1]
    assert all(s["state"] == "idle" and s["n_ctx"] == N_CTX for s in slots)
    held = [s for s in slots if s["prompt_tokens"] == len(prompt)]
    assert held and held[0]["reusable_tokens"] == 16 and held[0]["positions"] == len(prompt) + 1


def test_embeddings_are_a_clear_400_naming_the_pooling(server):
    status, doc = call(server.url + "/v1/embeddings", "POST", {"model": "m", "input": "hello"})
    assert status == 400 and doc["error"]["code"] == "embeddings_not_supported"
    assert "pooling 'none'" in doc["error"]["message"] and "qwen3moe.pooling_type" in doc["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client(server).embeddings.create(model="m", input="hello")


@pytest.mark.parametrize("path,method,body", [
    ("/tokenize", "POST", {"content": 5}),
    ("/tokenize", "POST", {"content": "x", "add_special": "yes"}),
    ("/tokenize", "POST", {"content": "x", "model": ""}),
    ("/tokenize", "POST", {"content": "\ud800"}),
    ("/detokenize", "POST", {"tokens": [1, 384]}),
    ("/detokenize", "POST", {"tokens": [-1]}),
    ("/detokenize", "POST", {"tokens": "12"}),
    ("/detokenize", "POST", {"tokens": [True]}),
    ("/props?model=", "GET", None),
    ("/slots?model=", "GET", None),
    ("/tokenize", "POST", b"{not json"),
    ("/v1/embeddings", "POST", [1, 2]),
])
def test_bad_input_is_a_4xx_and_the_server_stays_up(server, path, method, body):
    if isinstance(body, bytes):
        status, doc = call(server.url + path, method, raw=body)
    else:
        status, doc = call(server.url + path, method, body)
    assert status in (400, 404), (status, doc)
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert call(server.url + "/health", key=None)[0] == 200


def test_a_key_is_compared_with_every_key_in_constant_time(monkeypatch):
    """hmac.compare_digest against every configured key, whichever matches (no early exit)."""
    import hmac

    from ggml_hybrid.server import auth

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = [b"k-one", b"k-two", b"k-three"]
    for given, ok in (("k-one", True), ("k-three", True), ("k-on", False), ("", False), ("k-one\u00e9", False)):
        calls.clear()
        assert auth.key_matches(given, keys) is ok
        assert [b for _, b in calls] == keys
