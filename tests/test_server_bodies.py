"""The generation routes' bodies are bounded before they are parsed (issue 40's leftover of E2).

Each route takes a body no longer than the largest one its fields could accept (server/body_bounds.py: the prompts
a sequence's context can hold, a schema or grammar, stop strings, 64 KiB for the rest); one byte more is a 413
naming the bound, never parsed. The bounds are computed here from the model file's vocabulary (the prompts' rule:
``n_ctx`` tokens of the longest token's text, twice over) and the documented per-field rules."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("openai")
from test_server import Server, get, post
from test_server_info import prompt_rule_chars

from ggml_hybrid.synthetic import write_model

N_CTX = 512

CHAT_ROUTES = ["/v1/chat/completions", "/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
               "/v1/responses", "/apply-template"]
COMPLETION_ROUTES = ["/v1/completions", "/completions", "/completion", "/v1/embeddings"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("bodies") / "m.gguf", arch="qwen3moe", weight_type="q8_0", seed=4)


@pytest.fixture(scope="module")
def prompt_chars(model) -> int:
    """The prompts' rule from the vocabulary: more characters than n_ctx of the longest token (twice over) cannot
    fit in a sequence's context."""
    return prompt_rule_chars(model, N_CTX)


@pytest.fixture(scope="module")
def server(model):
    with Server([model, "-c", str(N_CTX), "-t", "1", "-np", "1"]) as s:
        yield s
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


def bounds(prompt_chars: int) -> dict[str, int]:
    """Each route's bound, from the fields' rules: a chat takes one prompt's text (12 bytes of JSON a character at
    most), a completion 16 prompts of text and n_ctx ids (24 bytes each at most); both a schema or grammar of 256 Ki
    characters and 4,096 characters of stop strings; 64 KiB for the rest."""
    rest = 64 * 1024 + 12 * (256 * 1024 + 4096)
    chat = rest + 12 * prompt_chars
    completion = rest + 16 * (12 * prompt_chars + 24 * N_CTX)
    out = {r: chat for r in CHAT_ROUTES}
    out.update({r: completion for r in COMPLETION_ROUTES})
    return {r: min(b, 16 << 20) for r, b in out.items()}


@pytest.mark.parametrize("route", CHAT_ROUTES + COMPLETION_ROUTES)
def test_a_body_over_the_routes_bound_is_a_413_without_a_parse(server, prompt_chars, route):
    """A body one byte over the route's bound is refused unparsed: not JSON past the bound, it still gets the 413
    (a parse would answer 400). One of exactly the bound is parsed (its 400 says it is not JSON)."""
    limit = bounds(prompt_chars)[route]
    assert limit < 16 << 20  # a bound of the route's own, below the server-wide one
    code, doc = post(server.url + route, b"{" + b"x" * (limit - 1))
    assert code == 400 and "parse the JSON body" in doc["error"]["message"], (route, code, doc)
    code, doc = post(server.url + route, b"{" + b"x" * limit)
    assert code == 413, (route, code, doc)
    assert f"larger than {limit} bytes ({route}: " in doc["error"]["message"], doc


def test_a_body_at_the_bound_is_answered(server, prompt_chars):
    """A real request padded with whitespace to exactly the bound is answered as it would be without it."""
    limit = bounds(prompt_chars)["/v1/chat/completions"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    code, doc = post(server.url + "/v1/chat/completions", body + " " * (limit - len(body)))
    assert code == 200 and doc["choices"][0]["finish_reason"] in ("length", "stop"), doc
    code, doc = post(server.url + "/v1/chat/completions", body + " " * (limit - len(body) + 1))
    assert code == 413, doc


def test_health_answers_while_large_allowed_bodies_are_parsed(server, prompt_chars):
    """Six chat bodies within the route's bound (3.4 MB here), each a million small arrays (the costliest JSON to
    build), sent at once; /health is asked again and again until all six are answered (the event waited for), and
    stays under the 1 s rule. Parsed on the loop, the bodies completed in one turn of it ran back to back: /health
    waited 1.9 s here (load 5; the slowest body took 3.3 s). Parsed one at a time on a thread with the collector
    paused, the loop answers between two parses (0.14-0.27 s)."""
    limit = bounds(prompt_chars)["/v1/chat/completions"]
    head = b'{"n": 0, "messages": [{"role": "user", "content": "hi"}], "junk": ['
    body = head + b"[]," * ((limit - len(head)) // 3 - 2) + b"[]]}"
    assert len(body) <= limit
    took: list[float] = []
    codes: list[int] = []
    lock = threading.Lock()

    def big() -> None:
        t = time.monotonic()
        code, _ = post(server.url + "/v1/chat/completions", body)
        with lock:
            took.append(time.monotonic() - t)
            codes.append(code)

    jobs = [threading.Thread(target=big) for _ in range(6)]
    for j in jobs:
        j.start()
    health: list[float] = []
    while any(j.is_alive() for j in jobs):
        t = time.monotonic()
        assert get(server.url + "/health")[0] == 200
        health.append(time.monotonic() - t)
    for j in jobs:
        j.join()
    assert codes == [400] * 6  # parsed (n=0 is refused after the parse), not refused unparsed
    assert health and max(health) < 1.0, (max(health), sorted(took))
