#!/usr/bin/env python3
"""Streamed decode through ``POST /v1/responses`` against ``POST /v1/chat/completions`` on one server and one model.

One ``ggml-hybrid serve`` (``-np 1 -t THREADS``, the ``small`` model of bench_serve.py by default: 4 layers, embd 256,
16 experts top-4, Q8_0; its per-token cost is small, so what an API adds per event shows) gets the same request
through both APIs: the same user message, greedy (``temperature: 0``), at most ``--n`` tokens. Greedy over one prompt
makes both generate the same tokens, and the benchmark checks that they do (the same text, the same token count). Per
request, measured at the client as a user sees it:

- TTFT: from sending the request to the first text delta (``response.output_text.delta``, a chunk with
  ``delta.content``);
- decode tok/s: (tokens - 1) / (first text delta to the last);
- the server's CPU time per generated token: the server process's user + system time (``/proc/PID/stat``, every
  thread's, ended ones included) over the request, divided by its tokens. The server runs one request at a time and
  nothing else, so this is what the request cost it, prompt, decode, HTTP and events together; unlike the wall clock
  it is not stretched by other processes' load on the machine (its resolution is one clock tick, 10 ms: use ``--n``
  of a few hundred).

Each round runs A B B A (A: chat, B: responses) with a new prompt (every prompt is shorter than the 512-token cut
below which nothing is reused from a slot: no request reuses another's prompt); one warm-up round is dropped; medians
over the rounds are printed, with the ratio responses / chat.

    python tools/bench/bench_responses.py [--model small|large|PATH] [--rounds 12] [--n 128] [--threads 1]
    python tools/bench/bench_responses.py --part events [--rounds 20]

``--part events``: what each API's shape costs per streamed text piece, in this process, without HTTP or a model:
a chat chunk as ``Routes.stream`` makes it (``protocol.envelope`` of ``protocol.choice``, JSON) against a
``response.output_text.delta`` event (``ResponseEvents.text``); blocks of 5,000 pieces alternate (A B B A), one
warm-up round dropped, the median microseconds per piece of each.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request

import click
import numpy as np
from bench_serve import Server, model_path

WORDS = ("the cache runs the hits first then the misses on the CPU share of experts in rounds with slots and a "
         "host tier below the device where the router picks experts for each token").split()


def stream(url: str, path: str, body: dict) -> tuple[float, float, int, str]:
    """One streamed request: (TTFT s, decode tok/s, tokens, text)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    text, n = [], None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode()
            if not line.startswith("data:") or line.startswith("data: [DONE]"):
                continue
            doc = json.loads(line[5:])
            piece = None
            if path == "/v1/responses":
                if doc["type"] == "response.output_text.delta":
                    piece = doc["delta"]
                elif doc["type"] in ("response.completed", "response.incomplete"):
                    n = doc["response"]["usage"]["output_tokens"]
            else:
                if doc.get("choices"):
                    piece = doc["choices"][0]["delta"].get("content") or None
                if doc.get("usage"):
                    n = doc["usage"]["completion_tokens"]
            if piece:
                last = time.perf_counter()
                first = first or last
                text.append(piece)
    assert first is not None and last is not None and n is not None and n > 1, (path, n)
    return first - t0, (n - 1) / (last - first), n, "".join(text)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, its ended threads included (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bodies(prompt: str, n: int) -> dict[str, tuple[str, dict]]:
    msg = [{"role": "user", "content": prompt}]
    return {"chat": ("/v1/chat/completions", {"model": "m", "messages": msg, "max_tokens": n, "temperature": 0,
                                              "stream": True, "stream_options": {"include_usage": True}}),
            "responses": ("/v1/responses", {"model": "m", "input": prompt, "max_output_tokens": n, "temperature": 0,
                                            "stream": True, "store": False})}


def events(rounds: int, block: int = 5000) -> None:
    from ggml_hybrid.server.protocol import choice, envelope
    from ggml_hybrid.server.response_store import ResponseStore
    from ggml_hybrid.server.responses import Answer, ResponseEvents, Turn

    ev = ResponseEvents(Answer(Turn({}, [], {}, False), "m", ResponseStore()), lambda r: {})
    ev.start()
    ev.text(" ")  # the message item is open: every later piece is one delta event

    def chat() -> None:
        for _ in range(block):
            json.dumps(envelope("chat", "chatcmpl-0123456789abcdef0123456789abcdef", 1796580000, "m",
                                [choice("chat", 0, " piece", None, True)], True, None, "fp_0123456789abcdef"))

    def responses() -> None:
        for _ in range(block):
            ev.text(" piece")

    arms = {"chat": chat, "responses": responses}
    us: dict[str, list[float]] = {k: [] for k in arms}
    for rnd in range(rounds + 1):
        for k in ("chat", "responses", "responses", "chat"):
            t0 = time.perf_counter()
            arms[k]()
            if rnd:
                us[k].append((time.perf_counter() - t0) / block * 1e6)
    med = {k: statistics.median(v) for k, v in us.items()}
    print(f"\n{rounds} rounds of {block} pieces per arm (A B B A), load average {os.getloadavg()[0]:.1f}")
    print(f"chat chunk {med['chat']:.2f} us, responses delta event {med['responses']:.2f} us per piece "
          f"(responses / chat {med['responses'] / med['chat']:.3f})")


@click.command()
@click.option("--part", type=click.Choice(["http", "events"]), default="http", show_default=True)
@click.option("--model", default="small", show_default=True, help="small, large (bench_serve.py's) or a GGUF path")
@click.option("--rounds", default=12, show_default=True)
@click.option("--n", default=128, show_default=True, help="tokens per request at most")
@click.option("--threads", default=1, show_default=True)
@click.option("--words", default=24, show_default=True, help="words per prompt")
def main(part: str, model: str, rounds: int, n: int, threads: int, words: int) -> None:
    if part == "events":
        events(rounds)
        return
    path, _ = model_path(model)
    rng = np.random.default_rng(7)
    srv = Server(path, ["-np", "1", "-t", str(threads), "-c", "2048"])
    ttft: dict[str, list[float]] = {"chat": [], "responses": []}
    rate: dict[str, list[float]] = {"chat": [], "responses": []}
    cpu: dict[str, list[float]] = {"chat": [], "responses": []}
    loads = [os.getloadavg()[0]]
    try:
        for rnd in range(rounds + 1):
            prompt = " ".join(rng.choice(WORDS, words))
            b = bodies(prompt, n)
            seen: dict[str, tuple[int, str]] = {}
            for arm in ("chat", "responses", "responses", "chat"):
                c0 = cpu_seconds(srv.proc.pid)
                t, r, k, text = stream(srv.url, *b[arm])
                c = (cpu_seconds(srv.proc.pid) - c0) / k
                if arm in seen:
                    assert seen[arm] == (k, text), f"{arm}: greedy gave another answer the second time"
                seen[arm] = (k, text)
                if rnd:
                    ttft[arm].append(t)
                    rate[arm].append(r)
                    cpu[arm].append(c)
            assert seen["chat"] == seen["responses"], "the two APIs generated different tokens"
            loads.append(os.getloadavg()[0])
    finally:
        srv.close()
    med = {k: (statistics.median(ttft[k]) * 1e3, statistics.median(rate[k]), statistics.median(cpu[k]) * 1e3)
           for k in ttft}
    print(f"\n{rounds} rounds (A B B A, 1 warm-up dropped), {n} tokens at most, threads {threads}, model {model}, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("| API | TTFT ms (median) | decode tok/s (median) | server CPU ms per token (median) |")
    print("| --- | --- | --- | --- |")
    for k, (t, r, c) in med.items():
        print(f"| {k} | {t:.1f} | {r:.1f} | {c:.3f} |")
    # per round: the sum of each API's two requests, then their ratio
    def quartiles(d: dict[str, list[float]]) -> str:
        q = sorted(sum(d["responses"][i:i + 2]) / sum(d["chat"][i:i + 2]) for i in range(0, len(d["chat"]), 2))
        return f"{q[len(q) // 4]:.3f}..{q[3 * len(q) // 4]:.3f}"

    print(f"\nresponses / chat: tok/s {med['responses'][1] / med['chat'][1]:.3f} (per-round q1..q3 {quartiles(rate)}), "
          f"TTFT {med['responses'][0] / med['chat'][0]:.3f}, server CPU per token "
          f"{med['responses'][2] / med['chat'][2]:.3f} (per-round q1..q3 {quartiles(cpu)})")


if __name__ == "__main__":
    main()
