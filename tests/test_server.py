"""``ggml-hybrid serve`` as a subprocess on a free loopback port, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.runtime.moe_model import MoEModel  # noqa: E402
from ggml_hybrid.synthetic import TEMPLATES, write_model  # noqa: E402
from ggml_hybrid.text.chat import ChatTemplate  # noqa: E402

N_CTX = 128
PROMPTS = ["The cache runs the hits first", "a", "Once upon a time in a land far away", "misses", "then the",
           "CPU share of", "experts, in rounds", "slots and"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``ggml-hybrid serve`` subprocess; ``url`` once /health answers 200."""

    def __init__(self, args: list[str], wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "ggml_hybrid.cli", "serve", *args, "--port",
                                      str(self.port)], stderr=subprocess.PIPE, text=True)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()  # a server that never became ready is still stopped
                raise

    def wait_ready(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            try:
                if get(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("the server did not become ready")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return rc, self.proc.stderr.read() if self.proc.stderr else ""

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a test that failed half-way: the server goes too
            self.stop()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url: str, body: bytes | str, method: str = "POST") -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    status, body = get(url + "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    q3 = write_model(d / "q3.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)
    glm = write_model(d / "glm.gguf", arch="glm4moe", weight_type="q8_0", seed=4)
    slow = write_model(d / "slow.gguf", arch="qwen3moe", weight_type="q8_0", seed=4, n_layer=4, n_embd=256,
                       n_ff_exp=256, head_dim=64, n_expert=16, n_used=4)
    cfg = d / "server.toml"
    cfg.write_text(f'''
[models.q3]
path = "{os.path.basename(q3)}"
aliases = ["gpt-test", "qwen"]
[models.q3.session_options]
n_parallel = 4
n_ctx = {N_CTX}
n_threads = 1
ubatch_size = 8

[models.glm]
path = "{os.path.basename(glm)}"
[models.glm.session_options]
n_ctx = {N_CTX}
n_threads = 1
disk_experts = true
expert_cache_slots = 3
moe_cpu_share = 0.5
''')
    return {"q3": q3, "glm": glm, "slow": slow, "config": str(cfg), "dir": d}


@pytest.fixture(scope="module")
def server(files):
    with Server(["--config", files["config"], "--parallel", "4"]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0, err


def test_models_lists_names_and_aliases(server):
    ids = sorted(m.id for m in server.client().models.list())
    assert ids == ["glm", "gpt-test", "q3", "qwen"]


@pytest.mark.parametrize("model", ["q3", "glm"])
def test_completions_streamed_and_not_agree(server, model):
    c = server.client()
    r = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    (ch,) = r.choices
    assert ch.finish_reason in ("length", "stop") and r.usage.completion_tokens <= 10
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    chunks = list(c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True))
    assert "".join(x.choices[0].text for x in chunks) == ch.text
    assert chunks[-1].choices[0].finish_reason == ch.finish_reason
    # an alias is the same model
    if model == "q3":
        assert c.completions.create(model="qwen", prompt=PROMPTS[0], max_tokens=10, temperature=0).choices[0].text \
            == ch.text


@pytest.mark.parametrize("model", ["q3", "glm"])
def test_chat_renders_the_models_template(server, files, model):
    """Chat equals a completion of the prompt the model's template (ChatML when the file has none) renders."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]
    c = server.client()
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    with MoEModel(files[model], SessionOptions(n_threads=1)) as m:
        tok = m.tokenizer
        t = ChatTemplate.from_gguf(m.store, tok.tokens, tok.bos_id, tok.eos_id)
        assert t.from_model == (model == "glm") and (model != "glm" or t.source == TEMPLATES["glm4moe"])
        ids = tok.encode(t.render(msgs), special=True)
    plain = c.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_eight_concurrent_streams_equal_one_at_a_time(server):
    c = server.client()

    def one(p: str) -> str:
        s = c.completions.create(model="q3", prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join(x.choices[0].text for x in s)

    alone = [one(p) for p in PROMPTS]
    before = scrape(server.url)
    got: list[str | None] = [None] * len(PROMPTS)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, one(PROMPTS[i]))) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == alone
    after = scrape(server.url)
    # 8 requests over 4 slots
    key = ("ggml_hybrid_requests_total", (("finish_reason", "length"), ("model", "q3")))
    stop = ("ggml_hybrid_requests_total", (("finish_reason", "stop"), ("model", "q3")))
    assert after.get(key, 0) + after.get(stop, 0) - before.get(key, 0) - before.get(stop, 0) == 8


def test_seeded_sampling_and_n_choices(server):
    c = server.client()
    kw = dict(model="q3", prompt=PROMPTS[2], max_tokens=10, temperature=0.9, seed=5)
    a = c.completions.create(**kw)
    b = c.completions.create(**kw, n=3)
    assert [x.index for x in b.choices] == [0, 1, 2]
    assert b.choices[0].text == a.choices[0].text  # choice i draws from seed + i
    assert c.completions.create(**{**kw, "seed": 6}).choices[0].text == b.choices[1].text


def test_metrics_count_what_was_served(server):
    before = scrape(server.url)
    r = server.client().completions.create(model="glm", prompt=PROMPTS[3], max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def delta(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return after.get(k, 0) - before.get(k, 0)

    assert delta("ggml_hybrid_generated_tokens_total", model="glm") == r.usage.completion_tokens == 7
    assert delta("ggml_hybrid_prompt_tokens_total", model="glm") == r.usage.prompt_tokens
    assert delta("ggml_hybrid_requests_total", model="glm", finish_reason="length") == 1
    assert delta("ggml_hybrid_http_requests_total", endpoint="/v1/completions", status="200") == 1
    # the expert cache of the disk-experts model was used, the CPU took a share of the misses
    assert delta("ggml_hybrid_expert_cache_hits_total", model="glm") + \
        delta("ggml_hybrid_expert_cache_misses_total", model="glm") > 0
    assert after[("ggml_hybrid_expert_cache_cpu_misses_total", (("model", "glm"),))] > 0
    assert after[("ggml_hybrid_hybrid_offload_active", (("model", "glm"),))] == 1
    assert after[("ggml_hybrid_hybrid_offload_active", (("model", "q3"),))] == 0
    assert 0 < after[("ggml_hybrid_moe_cpu_share_applied", (("model", "glm"),))] <= 1
    assert after[("ggml_hybrid_slots", (("model", "q3"),))] == 4
    for name in ("busy_slots", "queue_depth", "tokens_per_second", "model_loaded"):
        assert ("ggml_hybrid_" + name, (("model", "q3"),)) in after
    mem = {k[1]: v for k, v in after.items() if k[0] == "ggml_hybrid_device_memory_bytes"}
    assert {dict(lab)["purpose"] for lab in mem} == {"weights", "experts", "kv_cache", "recurrent", "compute"}
    assert all(v >= 0 for v in mem.values()) and any(v > 0 for v in mem.values())


def test_a_client_that_disconnects_frees_its_slot(server):
    c = server.client()
    before = scrape(server.url)
    stream = c.completions.create(model="q3", prompt=PROMPTS[0], max_tokens=100, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    key = ("ggml_hybrid_requests_total", (("finish_reason", "cancelled"), ("model", "q3")))
    end = time.monotonic() + 20
    while time.monotonic() < end:
        m = scrape(server.url)
        if m.get(key, 0) == before.get(key, 0) + 1 and m[("ggml_hybrid_busy_slots", (("model", "q3"),))] == 0:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the slot was not freed")
    gen = ("ggml_hybrid_generated_tokens_total", (("model", "q3"),))
    assert m[gen] - before[gen] < 100  # it stopped early
    # the server goes on serving
    assert c.completions.create(model="q3", prompt="a", max_tokens=2).usage.completion_tokens <= 2


@pytest.mark.parametrize("body, status, param, fragment", [
    ("{bad json", 400, None, "not valid JSON"),
    ("[1, 2]", 400, None, "JSON object"),
    ('{"model": "nope", "prompt": "a"}', 404, "model", "does not exist"),
    ('{"prompt": "a"}', 400, "model", "required"),
    ('{"model": "q3", "prompt": "' + "x " * 400 + '"}', 400, "prompt", "context"),
    ('{"model": "q3", "prompt": "a", "max_tokens": -1}', 400, "max_tokens", ">= 1"),
    ('{"model": "q3", "prompt": "a", "max_tokens": "ten"}', 400, "max_tokens", "integer"),
    ('{"model": "q3", "prompt": "a", "max_tokens": 2.5}', 400, "max_tokens", "integer"),
    ('{"model": "q3", "prompt": "a", "n": 100000}', 400, "n", "1..16"),
    ('{"model": "q3", "prompt": ["a", "b", "c", "d", "e"], "n": 4}', 400, "n", "at most 16"),
    ('{"model": "q3", "prompt": "a", "temperature": "hot"}', 400, "temperature", "number"),
    ('{"model": "q3", "prompt": "a", "temperature": -1}', 400, "temperature", "temperature"),
    ('{"model": "q3", "prompt": "a", "top_p": 0}', 400, "top_p", "top_p"),
    ('{"model": "q3", "prompt": "a", "stream": "yes"}', 400, "stream", "boolean"),
    ('{"model": "q3", "prompt": "a", "stop": [1]}', 400, "stop", "strings"),
    ('{"model": "q3", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', 400, "stop", "at most 4"),
    ('{"model": "q3", "prompt": "a", "logprobs": 30}', 400, "logprobs", "0..20"),
    ('{"model": "q3", "prompt": "a", "echo": true}', 400, "echo", "not supported"),
    ('{"model": "q3", "prompt": 5}', 400, "prompt", "'prompt' must be"),
    ('{"model": "q3", "prompt": [99999]}', 400, "prompt", "vocabulary"),
    ('{"model": "q3", "prompt": ""}', 400, "prompt", "empty"),
])
def test_bad_completion_requests(server, body, status, param, fragment):
    code, doc = post(server.url + "/v1/completions", body)
    assert code == status, doc
    err = doc["error"]
    # a context overflow has llama-server's type (and OpenAI's code); the rest OpenAI's type
    kind = "exceed_context_size_error" if err["code"] == "context_length_exceeded" else "invalid_request_error"
    assert fragment in err["message"] and err["param"] == param and err["type"] == kind


@pytest.mark.parametrize("body, fragment", [
    ('{"model": "q3", "messages": []}', "non-empty"),
    ('{"model": "q3", "messages": "hi"}', "non-empty"),
    ('{"model": "q3", "messages": [{"content": "x"}]}', "role"),
    ('{"model": "q3", "messages": [{"role": "user", "content": 3}]}', "content"),
    ('{"model": "q3", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "text part"),
    ('{"model": "q3", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     "'tools[0]' must be"),
    ('{"model": "q3", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}',
     "not supported"),
])
def test_bad_chat_requests(server, body, fragment):
    code, doc = post(server.url + "/v1/chat/completions", body)
    assert code == 400 and fragment in doc["error"]["message"], doc


def test_other_bad_requests_and_the_server_survives(server):
    code, doc = post(server.url + "/v1/nothing", "{}")
    assert code == 404 and doc["error"]["type"] == "invalid_request_error"
    code, doc = post(server.url + "/v1/completions", "{}", method="PUT")
    assert code == 405 and "error" in doc
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # a body announced too large
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (17 << 20))
        reply = b""
        while b"larger than" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"larger than" in reply
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="q3", prompt="a", max_tokens=-5)
    assert e.value.status_code == 400
    assert get(server.url + "/health") == (200, b'{"status":"ok"}')


def test_sigterm_finishes_requests_in_flight_and_exits_0(files):
    with Server([files["slow"], "-np", "2", "-c", str(N_CTX), "-t", "1", "-a", "m"]) as s:
        c = s.client()
        results: dict[str, object] = {}
        streaming = threading.Event()

        def stream() -> None:
            n, last = 0, None
            for x in c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=100, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}):
                streaming.set()
                n, last = n + 1, x.choices[0].finish_reason
            results["stream"] = (last, time.monotonic())

        def plain() -> None:
            r = c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=100, temperature=0,
                                     extra_body={"ignore_eos": True})
            results["plain"] = (r.usage.completion_tokens, r.choices[0].finish_reason, time.monotonic())

        threads = _sigterm_with_both_in_flight(s, stream, plain, streaming)
        sent = time.monotonic()
        for t in threads:
            t.join(60)
        rc, err = s.stop()
        assert rc == 0, err
        assert results["plain"][:2] == (100, "length") and results["stream"][0] == "length"
        assert results["stream"][1] > sent  # it was in flight when the signal came, and finished
        with pytest.raises(OSError):
            get(s.url + "/health")


def test_sigterm_cancels_what_outlives_the_drain_timeout_and_exits_0(files):
    """A stream far from its end when SIGTERM comes is cancelled after --drain-timeout (it ends early, with an
    error event or a closed connection); the server still exits 0."""
    with Server([files["slow"], "-np", "2", "-c", "2048", "-t", "1", "-a", "m", "--drain-timeout", "1"]) as s:
        c = s.client(timeout=60)
        got: dict[str, object] = {}
        streaming = threading.Event()

        def stream() -> None:
            n = 0
            try:
                for _ in c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=2000, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}):
                    streaming.set()
                    n += 1
            except Exception as exc:  # the connection closed under it, or the error event
                got["error"] = type(exc).__name__
            got["n"] = n

        def plain() -> None:
            try:
                c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=2000, temperature=0,
                                     extra_body={"ignore_eos": True})
            except openai.APIStatusError as exc:
                got["plain"] = (exc.status_code, exc.body)

        threads = _sigterm_with_both_in_flight(s, stream, plain, streaming)
        for t in threads:
            t.join(60)
        rc, err = s.stop()
    assert rc == 0, err
    assert not any(t.is_alive() for t in threads) and 0 < int(got["n"]) < 2000  # type: ignore[call-overload]
    status, body = got["plain"]  # type: ignore[misc]
    assert status == 503 and body["code"] == "shutting_down"


def test_binds_to_loopback_by_default(files):
    with Server([files["q3"], "-c", str(N_CTX), "-t", "1"]) as s:
        others = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
        others = {a for a in others if not a.startswith("127.")}
        for addr in others:
            with pytest.raises(OSError):
                socket.create_connection((addr, s.port), timeout=2).close()
        rc, err = s.stop()
    assert rc == 0 and f"http://127.0.0.1:{s.port}" in err


def test_a_busy_port_is_one_error_line_naming_port(files):
    """Nothing before it (no banner, no uvicorn line), no model loaded; exit status 2 as every user error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", files["q3"], "-c", str(N_CTX), "-t",
                            "1", "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.splitlines() == [f"error: Invalid value for --port: {port} is in use on 127.0.0.1 (another "
                                     "server listens there; give a free port)"], p.stderr


def _asgi_get(app, path: str) -> tuple[int, bytes]:
    """One GET through the ASGI app, in-process (no server, no HTTP client)."""
    async def go():
        out: dict = {"body": b""}
        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [], "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("t", 1),
                 "root_path": ""}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg):
            if msg["type"] == "http.response.start":
                out["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                out["body"] += msg.get("body", b"")

        await app(scope, receive, send)
        return out["status"], out["body"]

    return asyncio.run(go())


def test_health_is_503_while_loading_and_while_draining(files):
    from ggml_hybrid.server.app import create_app
    from ggml_hybrid.server.config import ModelEntry
    from ggml_hybrid.server.models import ModelSet

    ms = ModelSet([ModelEntry("q3", files["q3"], None, SessionOptions(n_threads=1, n_ctx=N_CTX))])
    app = create_app(ms)
    try:
        assert _asgi_get(app, "/health") == (503, b'{"status":"loading"}')
        code, body = _asgi_get(app, "/v1/models")
        assert code == 200 and json.loads(body)["data"][0]["id"] == "q3"
        loaded = threading.Event()
        ms.start_loading(lambda msg: None, lambda name, s: loaded.set())
        assert loaded.wait(60)
        assert _asgi_get(app, "/health") == (200, b'{"status":"ok"}')
        ms.drain()
        assert _asgi_get(app, "/health") == (503, b'{"status":"draining"}')
    finally:
        ms.close()


def test_bad_config_is_one_error_line_naming_file_model_and_key(files, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[models.q3]\npath = "{files["q3"]}"\n[models.q3.session_options]\nn_parallel = 0\n')
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", "--config", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(bad) in line and "[models.q3]" in line and "n_parallel" in line
    dup = tmp_path / "dup.toml"
    dup.write_text(f'[models.a]\npath = "{files["q3"]}"\naliases = ["b"]\n[models.b]\npath = "{files["q3"]}"\n')
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", "--config", str(dup)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "aliases" in r.stderr and "[models.a]" in r.stderr
    missing = tmp_path / "missing.toml"
    missing.write_text('[models.m]\npath = "nowhere.gguf"\n')
    r = subprocess.run([sys.executable, "-m", "ggml_hybrid.cli", "serve", "--config", str(missing)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "'m'" in r.stderr


def _sigterm_with_both_in_flight(s, stream, plain, streaming):
    """Start a streamed and a plain request, SIGTERM the server once both hold a slot; the threads."""
    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert streaming.wait(30)
    busy = ("ggml_hybrid_busy_slots", (("model", "slow"),))
    end = time.monotonic() + 30
    while scrape(s.url)[busy] < 2:  # both requests hold a slot
        assert time.monotonic() < end
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    return threads
