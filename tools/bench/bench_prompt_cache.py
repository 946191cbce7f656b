#!/usr/bin/env python3
"""Prompt reuse in ``ggml-hybrid serve``: time to first token with a shared 2,000-token system prompt.

One server (``-np 2 -t THREADS -c 4096 -ub UBATCH``) on a synthetic model. Each round draws a fresh system
prompt of --system random tokens and sends, one at a time, ``/v1/completions`` with ``max_tokens: 1`` (so
the wall time of a request is its time to first token, over HTTP, the prompt given as token ids):

- ``first``: system + user turn 1, the first request with this system prompt (nothing to reuse);
- ``second``: system + user turn 2, reusing what ``first`` left in its slot (``cache_prompt``, the default);
- ``cold``: the same prompt as ``second`` with ``cache_prompt: false`` (evaluated whole, in another slot).

``second`` and ``cold`` alternate their order per round (after ``first``); one warm-up round is dropped;
medians over rounds are printed with the server's ``timings.prompt_ms`` and ``cache_n``, and the ratios
first / second and cold / second. Every ``second`` must give the very log-probability ``cold`` gives
(bit-identical prompt reuse), or the run stops.

    python tools/bench/bench_prompt_cache.py [--model small|large|PATH] [--rounds 5] [--ubatch 512] [--threads 1]
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

import click
import numpy as np
from bench_serve import Server, model_path


def complete(server: Server, prompt: list[int], cache: bool) -> tuple[float, dict]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                       "logprobs": 1, "cache_prompt": cache})
    req = urllib.request.Request(server.url + "/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        doc = json.loads(r.read())
    return time.perf_counter() - t0, doc


@click.command()
@click.option("--model", "which", default="small", show_default=True, help="small, large or a GGUF path")
@click.option("--rounds", default=5, show_default=True, type=click.IntRange(1))
@click.option("--system", default=2000, show_default=True, type=click.IntRange(1), help="system prompt tokens")
@click.option("--user", default=24, show_default=True, type=click.IntRange(1), help="tokens of each user turn")
@click.option("--ubatch", default=512, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1))
def main(which: str, rounds: int, system: int, user: int, ubatch: int, threads: int) -> None:
    """Time to first token of a second request sharing a --system-token prompt with the first (prompt reuse)."""
    path, vocab = model_path(which)
    rng = np.random.default_rng(0)
    server = Server(path, ["-np", "2", "-t", str(threads), "-c", "4096", "-ub", str(ubatch)])
    rows: dict[str, list[tuple[float, float, int]]] = {"first": [], "second": [], "cold": []}
    try:
        for i in range(rounds + 1):
            sys_prompt = [int(t) for t in rng.integers(0, vocab, system)]
            turn1 = sys_prompt + [int(t) for t in rng.integers(0, vocab, user)]
            turn2 = sys_prompt + [int(t) for t in rng.integers(0, vocab, user)]
            got = {"first": complete(server, turn1, True)}
            for name in (("second", "cold") if i % 2 == 0 else ("cold", "second")):
                got[name] = complete(server, turn2, name == "second")
            lp = {k: d["choices"][0]["logprobs"]["token_logprobs"] for k, (_, d) in got.items()}
            assert lp["second"] == lp["cold"], f"round {i}: prompt reuse changed the logits"
            assert got["second"][1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            if i == 0:
                continue  # warm-up
            for k, (wall, d) in got.items():
                rows[k].append((wall, d["timings"]["prompt_ms"], d["timings"]["cache_n"]))
    finally:
        server.close()
    med = {k: (statistics.median(w for w, _, _ in v), statistics.median(p for _, p, _ in v),
               statistics.median(c for _, _, c in v)) for k, v in rows.items()}
    print(f"model {which}, system {system} + user {user} tokens, ubatch {ubatch}, threads {threads}, "
          f"{rounds} rounds (medians)")
    print("| request | time to first token (ms) | server prompt_ms | tokens reused | vs second |")
    print("| --- | --- | --- | --- | --- |")
    for k in ("first", "second", "cold"):
        w, p, c = med[k]
        print(f"| {k} | {w * 1e3:.1f} | {p:.1f} | {c:.0f} | {w / med['second'][0]:.2f}x |")


if __name__ == "__main__":
    main()
