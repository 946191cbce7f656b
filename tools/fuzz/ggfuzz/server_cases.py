"""Hostile requests against one real ``ggml-hybrid serve`` (issue 28): bodies, values, framing, timing.

One server (a config of three models: a resident one, one in disk-experts mode with a CPU share, and one
whose chat template overruns its bounds) on a free loopback port; request i is drawn from ``(seed, i)``
alone. A request is one of: a generation body built from valid fields with up to three fields replaced
by odd values (wrong JSON types, NaN/huge/tiny numbers, lone surrogates, deep nesting, long strings,
unknown options), malformed JSON, raw HTTP (bad framing, a body cut short and the socket closed, a
half-close), streamed or not, one of the other endpoints and methods, or a tool-call case against a model of
each family's call format (:mod:`.tool_cases`: calls cut by ``max_tokens``, whitespace runs in forced text, names and
keys a format cannot carry); since issue 40 also ``/tokenize`` and ``/detokenize`` far past their bounds, and
``pull`` against a hostile hub (``guard_cases.py``). Requests run ``--jobs`` at a time, so they batch in the engine.

Each answer is classed: ``fine`` (any status below 500, or a documented 5xx: 500 ``chat_template_limit`` /
``chat_template_unusable``, 503 ``model_loading`` / ``shutting_down``), ``5xx`` (any other), ``bad_call`` (a tool
call invalid under its schema, or calls with ``finish_reason`` ``length``), ``bad_shape``
(an error that is not OpenAI's error object), ``hang`` (no answer within the time limit) or ``crash`` (the
server died); a hub case is ``fine``, ``escape``, ``hang``, ``traceback`` or ``wrong`` (``guard_cases.py``). A
stream's error event is fine when it is a typed client error (``invalid_request_error``, e.g. a
grammar llguidance could not continue) or a documented 5xx. Throughout, ``/health`` is asked every 0.25 s and must
answer 200 within :data:`HEALTH_SECONDS` (``health_throughout`` in the summary: the slowest answer, and the cases
in flight while it was awaited). After the requests: 200 idle connections are opened and ``/health`` must
still answer 200, then SIGTERM must end the server with exit status 0 and no traceback in its log.

Structured output draws the shapes of issue 40 too (:func:`grammar_shape`): ``$ref`` chains (plain, through
``properties``, through ``items``), deep and wide schemas, GBNF grammars of many rules (chains, wide alternations,
right-recursive and mid-way failing ones), Lark text in ``grammar``, integer bounds beyond 2**53, ``x-guidance``,
``stop`` with a structure.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from . import guard_cases, tool_cases

DOCUMENTED_5XX = {(500, "chat_template_limit"), (500, "chat_template_unusable"), (503, "model_loading"),
                  (503, "shutting_down")}
N_CTX = 256
HEALTH_SECONDS = 1.0  # /health must answer within this throughout the run
TOOLS_N_CTX = 4096  # the tool-call models: the families' templates write the tools into the prompt
ODD = [None, True, False, 0, -1, 1, 2, 3.5, -0.0, 1e308, -1e308, 1e-320, 5e-324, 2**63, -(2**63), 2**64, 10**30,
       "", "a", "NaN", "Infinity", "\ud800", "x\udfff", "\x00", "é" * 3, "a" * 5000, [], [1], ["a"], [[1, 2]],
       [None], {}, {"a": 1}, [[[[[[]]]]]], [-1], [99999999], "<|im_start|>", [0] * 300,
       # structured output and tools (issue 33): schemas, grammars, tool lists, good and bad
       {"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
       {"type": "string", "pattern": "(("}, 'root ::= "a" | (', 'root ::= "yes" | "no"', "required", "auto",
       [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
       [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
       {"type": "function", "function": {"name": "f"}}]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n", "seed", "n", "stop",
          "stream", "stream_options", "ignore_eos", "logprobs", "top_logprobs", "cache_prompt", "echo", "suffix",
          "logit_bias", "tools", "response_format", "user", "best_of", "tool_choice", "json_schema", "grammar",
          "parallel_tool_calls"]
INFO = {"/tokenize": ["model", "content", "add_special", "with_pieces"], "/detokenize": ["model", "tokens"],
        "/v1/embeddings": ["model", "input"]}
_OUT = ["fuzz-out"]  # the run's folder (the hub cases' own folders go under it)


def write_models(folder: str) -> str:
    """The server's config (and its models) under ``folder``."""
    from ggml_hybrid.synthetic import ModelSpec, write_model

    os.makedirs(folder, exist_ok=True)
    q3 = write_model(os.path.join(folder, "q3.gguf"), ModelSpec(arch="qwen3moe", weight_type="q8_0", seed=4))
    glm = write_model(os.path.join(folder, "glm.gguf"), ModelSpec(arch="glm4moe", weight_type="q8_0", seed=4))
    bomb = os.path.join(folder, "bomb.gguf")
    _with_template(q3, bomb, "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
                             "{% endfor %}{% endfor %}{{ m.content * 10 ** 10 }}{% endfor %}")
    cfg = os.path.join(folder, "server.toml")
    with open(cfg, "w") as f:
        f.write(f'[models.q3]\npath = "{q3}"\naliases = ["m"]\n[models.q3.session_options]\nn_ctx = {N_CTX}\n'
                'n_threads = 1\nn_parallel = 4\nubatch_size = 8\n'
                f'[models.glm]\npath = "{glm}"\n[models.glm.session_options]\nn_ctx = {N_CTX}\nn_threads = 1\n'
                'n_parallel = 2\ndisk_experts = true\nexpert_cache_slots = 3\nmoe_cpu_share = 0.5\n'
                f'[models.bomb]\npath = "{bomb}"\n[models.bomb.session_options]\nn_ctx = {N_CTX}\nn_threads = 1\n')
        f.write(tool_cases.config(folder, q3, TOOLS_N_CTX))  # a model per tool-call format (issue 40)
    return cfg


def _with_template(src: str, dst: str, template: str) -> None:
    import gguf

    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for key, fld in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, fld.contents(), vtype, sub_type=sub)
    w.add_chat_template(template)
    import numpy as np

    for t in r.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:  # quantized: the bytes as they are
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ref_chain(n: int, via: str) -> dict[str, Any]:
    def hop(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {"properties": {"a": ref}} if via == "properties" else {"items": ref} if via == "items" else ref
    defs = {f"d{i}": hop(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _nested(n: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def _gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f"r{i} ::= r{i + 1}" for i in range(n)] + [f'r{n} ::= "x"'])


_WIDE = "big ::= " + " | ".join(f'"w{i}" r' for i in range(3000)) + '\nr ::= "x" r | "x"'


def grammar_shape(rng: random.Random) -> dict[str, Any]:
    """Fields of a body that ask for one of issue 40's shapes of schema or grammar."""
    kind = rng.choice(["ref", "ref-properties", "ref-items", "deep", "wide", "gbnf-chain", "gbnf-wide",
                       "gbnf-right-recursive", "gbnf-fails-later", "lark", "bounds", "x-guidance", "stop", "tools",
                       "slow"])
    n = rng.choice([10, 400, 990, 1200, 2500])
    if kind in ("ref", "ref-properties", "ref-items"):
        schema = _ref_chain(n, kind[4:])
    elif kind == "deep":
        schema = _nested(rng.choice([20, 31, 33, 40]))
    elif kind == "wide":
        schema = {"type": "object", "properties": {f"p{i}": {"type": rng.choice(["string", "integer"])}
                                                   for i in range(rng.choice([10, 1000, 9000]))}}
    elif kind == "bounds":
        schema = {"type": "integer", rng.choice(["minimum", "maximum", "exclusiveMinimum", "multipleOf"]):
                  rng.choice([1e30, 2 ** 63, -(2 ** 63) + 2, 2 ** 53 + 1, 2 ** 53, 1e15])}
    elif kind == "x-guidance":
        schema = {"type": "object", "x-guidance": rng.choice([5, "x", {"whitespace_pattern": "[a-z]+"},
                                                               {"lenient": True}])}
    elif kind == "tools":
        params = _ref_chain(n, rng.choice(["", "properties"]))
        return {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                "tool_choice": rng.choice(["required", "auto"])}
    else:
        grammar = {"gbnf-chain": lambda: _gbnf_chain(n),
                   "gbnf-wide": lambda: "root ::= (" + " | ".join(f'"w{i}"' for i in range(n)) + ")",
                   "gbnf-right-recursive": lambda: 'root ::= "a" root | "a"',
                   "gbnf-fails-later": lambda: 'root ::= "q" [0-9]+ "z" big\n' + _WIDE,
                   "lark": lambda: "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"',
                   "stop": lambda: 'root ::= "yes" | "no"',
                   "slow": lambda: "\n".join(["root ::= big a0", "big ::= " + " ".join(['"x"'] * 60_000) + " big"]
                                              + [f"a{i} ::= a{i + 1}" for i in range(900)] + ['a900 ::= "x"'])}[kind]()
        out: dict[str, Any] = {"grammar": grammar, "max_tokens": rng.choice([4, 64, 300])}
        if kind == "stop":
            out["stop"] = ["\n"]
        return out
    field = rng.choice(["json_schema", "response_format"])
    if field == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return {"json_schema": schema}


def _body(rng: random.Random, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": rng.choice(["q3", "m", "glm", "bomb", "q3", "m"]),
                            "max_tokens": rng.choice([1, 2, 4, 8])}
    if chat:
        body["messages"] = [{"role": rng.choice(["system", "user", "assistant"]), "content": rng.choice(
            ["hi", "the cache", "", "a b c", "<|im_end|>"])} for _ in range(rng.randint(1, 3))]
    else:
        body["prompt"] = rng.choice(["the cache runs", "a", ["x", "y"], [1, 2, 3], [[5, 6], [7]], "hello there"])
    for name in rng.sample(["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                            "repeat_penalty", "seed", "n", "stop", "stream", "ignore_eos"], rng.randint(0, 4)):
        body[name] = {"temperature": rng.choice([0, 0.7, 1.5]), "top_p": rng.choice([0.5, 1]), "top_k": 5,
                      "min_p": 0.1, "presence_penalty": rng.choice([-2, 1.5]), "frequency_penalty": 0.5,
                      "repeat_penalty": 1.1, "seed": rng.randint(0, 100), "n": rng.randint(1, 3), "stop": ["e"],
                      "stream": rng.random() < 0.5, "ignore_eos": True}[name]
    for _ in range(rng.choices([0, 1, 2, 3], [40, 35, 15, 10])[0]):  # 0: a valid request (it generates)
        name = rng.choice(FIELDS)
        v = rng.choice(ODD)
        if name == "messages" and rng.random() < 0.5 and isinstance(body.get("messages"), list):
            body["messages"][0][rng.choice(["role", "content", "name"])] = v
        else:
            body[name] = v
    if rng.random() < 0.12:  # issue 40's shapes of schemas and grammars
        for k in ("grammar", "json_schema", "response_format", "tools", "tool_choice", "stop"):
            body.pop(k, None)
        body.update(grammar_shape(rng))
    return body


def _raw(port: int, data: bytes, timeout: float, close_early: bool = False, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if close_early:
            return b""
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        s.settimeout(timeout)
        while chunk := s.recv(65536):
            out += chunk
            reply = _past_informational(out)  # a half-closed client gets 100 lines until its reply starts
            if b"\r\n\r\n" in reply and not reply.startswith(b"HTTP/1.1 200"):
                break
        return out


def _past_informational(out: bytes) -> bytes:
    """What follows the complete 1xx replies at the start of `out`."""
    while out.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in out:
        out = out.split(b"\r\n\r\n", 1)[1]
    return out


def _classify_json(status: int, raw: bytes) -> str:
    if status < 400:
        return "fine"
    try:
        err = json.loads(raw)["error"]
        code = err.get("code")
        assert isinstance(err["message"], str) and "type" in err
    except Exception:
        return "bad_shape" if status != 499 else "fine"
    if status >= 500 and (status, code) not in DOCUMENTED_5XX:
        return "5xx"
    return "fine"


def one(seed: int, i: int, port: int, timeout: float) -> tuple[str, str]:
    """(class, what) of request i."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(["completion", "chat", "raw", "other", "info", "tools", "huge", "hub"],
                       [42, 28, 12, 12, 6, 8, 2, 2])[0]
    try:
        if kind == "hub":  # issue 40: `pull` against a hostile hub (guard_cases.py)
            return guard_cases.hub_case(seed, i, _OUT[0], timeout)
        if kind == "huge":  # issue 40: /tokenize and /detokenize far past their bounds
            status, raw, what = guard_cases.huge_info(rng, port, timeout)
            return _classify_json(status, raw), f"{what} {status}"
        if kind in ("completion", "chat", "tools"):
            body = _body(rng, kind == "chat") if kind != "tools" else tool_cases.body(rng)[0]
            data = json.dumps(body).encode("utf-8", "surrogatepass")
            if rng.random() < 0.05:
                data = data[: rng.randint(0, len(data))]  # malformed JSON
            path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            try:
                c.request("POST", path, data, {"Content-Type": "application/json"})
                r = c.getresponse()
                raw = r.read()
            finally:
                c.close()
            if r.status == 200 and r.getheader("content-type", "").startswith("text/event-stream"):
                events = [ln[6:] for ln in raw.decode("utf-8", "replace").splitlines() if ln.startswith("data: ")]
                if not events or events[-1] != "[DONE]":
                    return "bad_shape", f"{kind}: a stream without [DONE]"
                for e in events[:-1]:
                    doc = json.loads(e)
                    err = doc.get("error")
                    code = None if err is None else err.get("code")
                    if err is not None and err.get("type") != "invalid_request_error" and \
                            (500, code) not in DOCUMENTED_5XX and (503, code) not in DOCUMENTED_5XX:
                        return "5xx", f"{kind}: error event {e[:200]}"
                wrong = tool_cases.check(body, None, [json.loads(e) for e in events[:-1]]) if kind == "tools" else None
                return ("bad_call", f"{kind} stream: {wrong}") if wrong else ("fine", f"{kind} stream")
            if kind == "tools" and r.status == 200:
                wrong = tool_cases.check(body, json.loads(raw), None)
                if wrong:
                    return "bad_call", f"{kind}: {wrong}"
            return _classify_json(r.status, raw), f"{kind} {r.status}"
        if kind == "raw":
            what = rng.choice(["cut", "half", "junk", "huge-header", "bad-length", "chunked"])
            body = b'{"model": "q3", "prompt": "a", "max_tokens": 2}'
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            if what == "cut":
                _raw(port, head + b"Content-Length: 100\r\n\r\n" + body[:10], timeout, close_early=True)
                return "fine", "raw cut"
            if what == "half":
                out = _raw(port, head + b"Content-Length: %d\r\n\r\n" % len(body) + body, timeout, half_close=True)
            elif what == "junk":
                out = _raw(port, bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) + b"\r\n\r\n", timeout)
            elif what == "huge-header":
                out = _raw(port, b"GET /health HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", timeout)
            elif what == "bad-length":
                out = _raw(port, head + b"Content-Length: -5\r\n\r\n" + body, timeout)
            else:
                out = _raw(port, head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n0\r\n\r\n", timeout)
            out = _past_informational(out)  # 1xx lines (the half-close probe)
            status = int(out[9:12]) if out.startswith(b"HTTP/1.1 ") else 0
            if what == "half" and status != 200:  # a whole request, then a half-close: the reply still comes
                return "bad_shape", f"raw half: {out[:200]!r}"
            if status >= 500:
                return "5xx", f"raw {what} {out[:200]!r}"
            return "fine", f"raw {what} {status}"
        if kind == "info":  # the endpoints around generation, with odd values in their fields
            path = rng.choice(sorted(INFO))
            body = {"model": "q3", "content": "Hello", "tokens": [1, 2], "input": "x"}
            for name in rng.sample(INFO[path], rng.randint(1, len(INFO[path]))):
                body[name] = rng.choice(ODD)
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            try:
                c.request("POST", path, json.dumps(body).encode("utf-8", "surrogatepass"),
                          {"Content-Type": "application/json"})
                r = c.getresponse()
                raw = r.read()
            finally:
                c.close()
            return _classify_json(r.status, raw), f"{path} {r.status}"
        method, path = rng.choice([("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                   ("GET", "/props?model=q3"), ("GET", "/slots?model=glm"), ("GET", "/props"),
                                   ("GET", "/slots?model=%ff"),
                                   ("DELETE", "/v1/completions"), ("GET", "/v1/nothing"), ("POST", "/health"),
                                   ("GET", "/v1/chat/completions"), ("GET", "/%ff%fe"), ("OPTIONS", "/")])
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            c.request(method, path)
            r = c.getresponse()
            raw = r.read()
        finally:
            c.close()
        if path in ("/health", "/v1/models", "/metrics", "/props?model=q3", "/slots?model=glm") and method == "GET":
            return ("fine" if r.status == 200 else "5xx" if r.status >= 500 else "bad_shape"), f"{path} {r.status}"
        return _classify_json(r.status, raw), f"{method} {path} {r.status}"
    except TimeoutError:
        return "hang", kind
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        # raw framing may be answered by closing; a well-formed request never is
        return ("closed" if kind == "raw" else "dropped"), f"{kind}: {type(exc).__name__}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int, timeout: float = 10.0) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", "/health")
        return c.getresponse().status
    except OSError:
        return 0
    finally:
        c.close()


class HealthWatch:
    """``/health`` asked every 0.25 s from a thread of its own while the cases run: its slowest answer, and the
    answers other than 200 (the server must stay answerable whatever a request does)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.slowest = 0.0
        self.slowest_window = (0.0, 0.0)  # monotonic start and end of the slowest answer
        self.checks = 0
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            t0 = time.monotonic()
            status = _health(self.port, timeout=30.0)
            took = time.monotonic() - t0
            self.checks += 1
            if took > self.slowest:
                self.slowest, self.slowest_window = took, (t0, t0 + took)
            if status != 200 or took > HEALTH_SECONDS:
                self.bad.append(f"/health {status} in {took:.2f} s")

    def summary(self, spans: Sequence[tuple[float, float, str]] = ()) -> dict[str, Any]:
        """The counts, and the cases whose (start, end, what) ``spans`` overlap the slowest answer."""
        a, b = self.slowest_window
        during = sorted(w for t0, t1, w in spans if t0 < b and t1 > a)
        return {"checks": self.checks, "slowest_seconds": round(self.slowest, 3), "slowest_during": during,
                "bad": self.bad[:20]}


def run(cases: int, seed: int, out: str, jobs: int = 4, timeout: float = 60.0, idle: int = 200) -> dict[str, Any]:
    """Run the cases against a fresh server; the summary (also written to OUT/summary-server.json)."""
    out = os.path.abspath(out)  # the config names the models relative to itself
    cfg = write_models(os.path.join(out, "server-models"))
    _OUT[0] = out
    port = _free_port()
    log = open(os.path.join(out, "server.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ggml_hybrid.cli", "serve", "--config", cfg, "--port", str(port)],
                            stderr=log)
    results: list[tuple[int, str, str]] = []
    spans: list[tuple[float, float, str]] = []  # each case's start, end and what: the slowest /health's company
    lock = threading.Lock()
    t_start = time.monotonic()
    idle_ok = None
    rc = None
    watch: HealthWatch | None = None
    try:
        end = time.monotonic() + 120
        while _health(port) != 200:
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("the server did not start")
            time.sleep(0.1)
        todo = iter(range(cases))

        def worker() -> None:
            for i in todo:
                t0 = time.monotonic()
                cls, what = one(seed, i, port, timeout)
                if cls != "fine" and proc.poll() is not None:
                    cls = "crash"
                with lock:
                    results.append((i, cls, what))
                    spans.append((t0, time.monotonic(), f"{i}: {what[:80]}"))

        threads = [threading.Thread(target=worker) for _ in range(jobs)]
        with HealthWatch(port) as watch:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        socks = []
        try:
            for _ in range(idle):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            t0 = time.monotonic()
            idle_ok = (_health(port), round(time.monotonic() - t0, 3))
        finally:
            for s in socks:
                s.close()
    finally:
        guard_cases.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "hang at exit"
        else:
            rc = f"died: {proc.returncode}"
        log.seek(0)
        text = log.read()
        log.close()
    classes = Counter(c for _, c, _ in results)
    failures = [(i, c, w) for i, c, w in sorted(results) if c not in ("fine", "closed")]
    summary = {"cases": cases, "seed": seed, "jobs": jobs, "seconds": round(time.monotonic() - t_start, 1),
               "classes": dict(classes), "what": dict(Counter(w.split(" ")[0] + " " + w.split(" ")[-1]
                                                           for _, _, w in results)),
               "failures": failures[:200], "idle": {"connections": idle, "health": idle_ok}, "exit_status": rc,
               "health_throughout": watch.summary(spans) if watch is not None else None,
               "log_bytes": len(text), "log_tracebacks": text.count("Traceback")}
    with open(os.path.join(out, "summary-server.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def passed(summary: dict[str, Any]) -> bool:
    """No crash, hang, undocumented 5xx or malformed error; /health under the idle connections; a clean exit."""
    bad = {k: v for k, v in summary["classes"].items() if k not in ("fine", "closed")}
    health = summary.get("health_throughout")
    return (not bad and summary["idle"]["health"] is not None and summary["idle"]["health"][0] == 200
            and summary["exit_status"] == 0 and summary["log_tracebacks"] == 0
            and health is not None and not health["bad"])


__all__ = ["DOCUMENTED_5XX", "HEALTH_SECONDS", "HealthWatch", "grammar_shape", "one", "passed", "run", "write_models"]
