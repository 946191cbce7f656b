#!/usr/bin/env python3
"""Decode tokens per second with a JSON schema enforced (llguidance's mask before the sampler) against free sampling.

One model, one engine (one slot, ``-t THREADS``), requests alternating free / schema / schema / free after a
warm-up pair. Every request decodes exactly ``--n`` tokens at temperature 1 from the same prompt: the free ones with
``ignore_eos``, the constrained ones under a schema whose shortest text is longer (an array of objects with long strings),
so both run their whole length. Decode tok/s is the request's own (first token to last, as ``timings.predicted_per_
second``); the medians of each side and their ratio are printed, with the mean time per token of the mask itself.

    python tools/bench/bench_structured.py [--model small|large|PATH] [--rounds 6] [--n 128] [--threads 1]

``small`` and ``large`` are ``bench_serve.py``'s generated models (vocabularies of 2,048 and 8,192 tokens).
"""

from __future__ import annotations

import statistics
import time

import click

from bench_serve import model_path

# JSON that cannot end before ``--n`` tokens (800 characters at least), so both sides decode their whole length
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "minLength": 400},
                                                                      "n": {"type": "integer"}},
                                     "required": ["name", "n"]}, "minItems": 2}


@click.command()
@click.option("--model", default="small", show_default=True)
@click.option("--rounds", default=6, show_default=True)
@click.option("--n", "n_tokens", default=128, show_default=True)
@click.option("--threads", default=1, show_default=True)
def main(model: str, rounds: int, n_tokens: int, threads: int) -> None:
    from ggml_hybrid.options import SessionOptions
    from ggml_hybrid.runtime.engine import Engine, Request
    from ggml_hybrid.runtime.grammar import Constraint, Grammar
    from ggml_hybrid.runtime.moe_model import MoEModel
    from ggml_hybrid.runtime.sampling import Sampler

    path, _ = model_path(model)
    m = MoEModel(path, SessionOptions(n_threads=threads, n_ctx=n_tokens + 64, n_parallel=1))
    engine = Engine(m, "bench")
    tok = m.tokenizer
    prompt = tok.encode("The expert cache runs the hits first, then", add_bos=None)
    grammar = Grammar.json_schema(tok, SCHEMA)

    class Timed(Constraint):
        """The mask and the accept timed (what the schema adds to a token)."""
        spent = 0.0
        calls = 0

        def mask(self, logits):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = super().mask(logits)
            Timed.spent += time.perf_counter() - t0
            Timed.calls += 1
            return out

        def accept(self, token: int) -> None:
            t0 = time.perf_counter()
            super().accept(token)
            Timed.spent += time.perf_counter() - t0

    def run(constrained: bool, seed: int) -> float:
        r = Request(list(prompt), Sampler(temperature=1.0, seed=seed), n_tokens, ignore_eos=not constrained,
                    constraint=Timed(grammar) if constrained else None)
        engine.submit(r)
        r.done.wait()
        assert r.finish_reason == "length" and r.completion_tokens == n_tokens, (r.finish_reason, r.error, r.text)
        assert r.first_token_at is not None and r.finished_at is not None
        return (n_tokens - 1) / (r.finished_at - r.first_token_at)

    rates: dict[str, list[float]] = {"free": [], "schema": []}
    try:
        for i in range(rounds + 1):
            order = ["free", "schema"] if i % 2 == 0 else ["schema", "free"]
            for k in order:
                if k == "schema" and i == 1:
                    Timed.spent, Timed.calls = 0.0, 0  # the warm-up round's masks are not counted
                rate = run(k == "schema", seed=i)
                if i > 0:  # round 0 warms up
                    rates[k].append(rate)
    finally:
        engine.close()
        m.close()
    free, schema = statistics.median(rates["free"]), statistics.median(rates["schema"])
    print(f"model {model} (vocab {tok.n_vocab}), {threads} thread(s), {n_tokens} tokens x {rounds} rounds per side")
    print(f"free sampling     {free:8.1f} tok/s (median)")
    print(f"JSON schema       {schema:8.1f} tok/s (median)   ratio {schema / free:.3f}")
    print(f"mask + accept     {Timed.spent / max(Timed.calls, 1) * 1e6:8.1f} us per token (mean)")


if __name__ == "__main__":
    main()
