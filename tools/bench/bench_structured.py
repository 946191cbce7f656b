#!/usr/bin/env python3
"""Decode speed with a JSON schema enforced (llguidance's mask before the sampler) against free sampling.

One model, one engine (one slot, ``-t THREADS``), requests alternating free / schema, then schema / free, after a
warm-up pair. Every request decodes exactly ``--n`` tokens at temperature 1 from the same prompt: the free ones with
``ignore_eos``, the constrained ones under a schema whose shortest text is longer (``--schema``: an array of many
records, or of long strings), so both run their whole length. Two figures per request, from its first token to its
last: the decode tok/s (wall clock, as ``timings.predicted_per_second``), and the engine thread's CPU time per token
(decode, sampling and, with the schema, the mask: on a shared machine this one does not count the time other
processes took the core). Medians of each side and their ratios are printed, with the mean CPU time of the mask
and accept alone.

    python tools/bench/bench_structured.py [--model small|large|PATH] [--rounds 30] [--n 64] [--threads 1]
        [--schema records|long-strings] [--ab bounds]

``--ab bounds`` (issue 40) compares instead the schema compiled through the bounded path (``Grammar.json_schema``:
checked and validated in the checker process, compiled on a pool thread, its first tokens probed) with the same
schema compiled the old way (``Grammar`` over llguidance's grammar text, on the caller's thread): both decode
alternately (bounded, direct, then direct, bounded), each round compiling its grammars afresh; the medians of each
side's decode tok/s and CPU per token, their ratios (bounded / direct), and the medians of the compile times.

``small`` and ``large`` are ``bench_serve.py``'s generated models (vocabularies of 2,048 and 8,192 tokens).
"""

from __future__ import annotations

import statistics
import time

import click
from bench_serve import model_path

# JSON that cannot end before ``--n`` tokens, so both sides decode their whole length: ``records`` (an array of at
# least 64 records with plain strings: the common case, whose string tokens llguidance's precomputed slices cover) and
# ``long-strings`` (strings of at least 400 characters: a counted lexeme, each mask a walk of the whole token trie)
SCHEMAS = {
    "records": {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "id", "ok"]}},
    "long-strings": {"type": "array", "minItems": 2, "items": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 400}, "n": {"type": "integer"}}, "required": ["name", "n"]}},
}


@click.command()
@click.option("--model", default="small", show_default=True)
@click.option("--rounds", default=6, show_default=True)
@click.option("--n", "n_tokens", default=128, show_default=True)
@click.option("--threads", default=1, show_default=True)
@click.option("--schema", "schema_name", type=click.Choice(sorted(SCHEMAS)), default="records", show_default=True)
@click.option("--ab", type=click.Choice(["bounds"]), default=None, help="Compare the bounded compile with the direct "
              "one (both constrained) instead of free with constrained.")
def main(model: str, rounds: int, n_tokens: int, threads: int, schema_name: str, ab: str | None) -> None:
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
    grammar = Grammar.json_schema(tok, SCHEMAS[schema_name])
    compile_ms: dict[str, list[float]] = {"bounded": [], "direct": []}

    def compiled(side: str) -> Grammar:
        """The schema compiled afresh: through the pool (bounded) or on this thread from llguidance's text (direct)."""
        import json

        import llguidance

        from ggml_hybrid.runtime.grammar import json_options

        t0 = time.perf_counter()
        if side == "bounded":
            g = Grammar.json_schema(tok, SCHEMAS[schema_name])
        else:
            spec = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_options(SCHEMAS[schema_name])))
            g = Grammar(tok, spec, "the JSON schema", "json_schema")
        compile_ms[side].append((time.perf_counter() - t0) * 1e3)
        return g

    class Timed(Constraint):
        """The mask and the accept timed (what the schema adds to a token)."""
        spent = 0.0
        calls = 0

        def mask(self, logits):  # type: ignore[no-untyped-def]
            t0 = time.thread_time()  # CPU time of the engine thread (which calls it)
            out = super().mask(logits)
            Timed.spent += time.thread_time() - t0
            Timed.calls += 1
            return out

        def accept(self, token: int) -> None:
            t0 = time.thread_time()
            super().accept(token)
            Timed.spent += time.thread_time() - t0

    def run(constrained: bool, seed: int, g: Grammar | None = None) -> tuple[float, float]:
        cpu: list[float] = []  # the engine thread's CPU clock at each token (its listener runs on that thread)
        r = Request(list(prompt), Sampler(temperature=1.0, seed=seed), n_tokens, ignore_eos=not constrained,
                    listener=lambda: cpu.append(time.thread_time()),
                    constraint=Timed(g or grammar) if constrained else None)
        engine.submit(r)
        r.done.wait()
        assert r.finish_reason == "length" and r.completion_tokens == n_tokens, (r.finish_reason, r.error, r.text)
        assert r.first_token_at is not None and r.finished_at is not None
        return (n_tokens - 1) / (r.finished_at - r.first_token_at), (cpu[-1] - cpu[0]) / (len(cpu) - 1)

    if ab == "bounds":
        try:
            ab_bounds(run, compiled, compile_ms, rounds, model, tok.n_vocab, threads, n_tokens, schema_name)
        finally:
            engine.close()
            m.close()
        return
    rates: dict[str, list[float]] = {"free": [], "schema": []}
    cpus: dict[str, list[float]] = {"free": [], "schema": []}
    try:
        for i in range(rounds + 1):
            for k in ["free", "schema"] if i % 2 == 0 else ["schema", "free"]:
                if k == "schema" and i == 1:
                    Timed.spent, Timed.calls = 0.0, 0  # the warm-up round's masks are not counted
                rate, cpu = run(k == "schema", seed=i)
                if i > 0:  # round 0 warms up
                    rates[k].append(rate)
                    cpus[k].append(cpu)
    finally:
        engine.close()
        m.close()
    free, schema = statistics.median(rates["free"]), statistics.median(rates["schema"])
    cfree, cschema = statistics.median(cpus["free"]), statistics.median(cpus["schema"])
    print(f"model {model} (vocab {tok.n_vocab}), {threads} thread(s), {n_tokens} tokens x {rounds} rounds per side, "
          f"schema {schema_name}")
    print(f"free sampling     {free:8.1f} tok/s   {cfree * 1e3:6.3f} ms CPU per token (medians)")
    print(f"JSON schema       {schema:8.1f} tok/s   {cschema * 1e3:6.3f} ms CPU per token   tok/s ratio "
          f"{schema / free:.3f}, CPU ratio {cschema / cfree:.3f}")
    print(f"mask + accept     {Timed.spent / max(Timed.calls, 1) * 1e6:8.1f} us CPU per token (mean)")


def ab_bounds(run, compiled, compile_ms, rounds: int, model: str, n_vocab: int, threads: int,  # type: ignore[no-untyped-def]
              n_tokens: int, schema_name: str) -> None:
    """The bounded compile against the direct one, both decoding under the schema, alternated."""
    rates: dict[str, list[float]] = {"bounded": [], "direct": []}
    cpus: dict[str, list[float]] = {"bounded": [], "direct": []}
    for i in range(rounds + 1):
        for side in ["bounded", "direct"] if i % 2 == 0 else ["direct", "bounded"]:
            rate, cpu = run(True, seed=i, g=compiled(side))
            if i > 0:  # round 0 warms up (the checker process starts there)
                rates[side].append(rate)
                cpus[side].append(cpu)
    for side in compile_ms:
        del compile_ms[side][0]
    b, d = statistics.median(rates["bounded"]), statistics.median(rates["direct"])
    cb, cd = statistics.median(cpus["bounded"]), statistics.median(cpus["direct"])
    print(f"model {model} (vocab {n_vocab}), {threads} thread(s), {n_tokens} tokens x {rounds} rounds per side, "
          f"schema {schema_name}, bounded vs direct compile")
    print(f"direct compile    {d:8.1f} tok/s   {cd * 1e3:6.3f} ms CPU per token   compile "
          f"{statistics.median(compile_ms['direct']):7.2f} ms (median)")
    print(f"bounded compile   {b:8.1f} tok/s   {cb * 1e3:6.3f} ms CPU per token   compile "
          f"{statistics.median(compile_ms['bounded']):7.2f} ms (median)")
    print(f"bounded / direct: tok/s ratio {b / d:.3f}, CPU ratio {cb / cd:.3f}")


if __name__ == "__main__":
    main()
