"""llama-server's own API, for the scripts and tools written against it (llama.cpp's ``tools/server/README.md``).

- ``POST /completion``: its native completion. ``prompt`` is a string, token ids, a mixed list of both (``[12, 34,
  "text", 56]``, one prompt) or a list of prompts (strings, id lists, mixed lists, ``{"prompt_string"}``); BOS is
  added when the prompt begins with text and the model's rule says so. Its fields: ``n_predict`` (-1: until the
  end; also ``max_tokens``), ``stream``, ``cache_prompt``, ``n_probs``, ``stop``, ``return_tokens``,
  ``return_progress``, ``n_cmpl``, the sampling fields and ``grammar``/``json_schema``. The answer has its field
  names (``content``, ``tokens``, ``id_slot``, ``stop``, ``model``, ``tokens_predicted``, ``tokens_evaluated``,
  ``tokens_cached``, ``generation_settings``, ``prompt``, ``has_new_line``, ``truncated``, ``stop_type``,
  ``stopping_word``, ``timings``, ``completion_probabilities``); several prompts give an array. Streamed, each
  ``data:`` chunk carries the new text (and ``prompt_progress`` chunks with ``return_progress``), the last one the
  whole answer less its text, and no ``[DONE]`` (llama-server's own stream has none).
- ``POST /apply-template``: ``{"messages": [...]}`` (a chat request's fields) -> ``{"prompt": text}``, the model's
  chat template applied, nothing generated.
- ``POST /completions``, ``POST /chat/completions``, ``GET /models``: the ``/v1`` routes without the prefix.

A generation here is the same engine request as ``/v1/completions``' (:meth:`.routes.Routes.submit`). Sampler
fields this server does not have (``mirostat``, ``typical_p``, ``dry_multiplier``, ``xtc_probability``, ...) are
taken at their off values (what llama.cpp's own web UI sends) and refused otherwise, naming the field; a
``samplers`` order is taken when it is this server's order (:data:`SAMPLERS`). Errors are the OpenAI-shaped object
every route here answers with.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import GgmlHybridError
from ..runtime.engine import Request
from ..runtime.logprobs import MAX_TOP_LOGPROBS
from .logprobs import llama_probs
from .models import ServedModel
from .protocol import (
    MAX_CHOICES,
    Generation,
    bad,
    chat_request,
    context_overflow,
    prompt_progress,
    read_generation,
    read_stops,
    timings,
)
from .routes import Routes, chat_text
from .structured import compile_structure, failure, grammar_field, read_structure
from .tools import read_tools

# the sampling chain here, in its order (llama.cpp's names); a request's ``samplers`` must keep it
SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature")
# llama.cpp's sampler names (and their one-letter forms) whose settings here are their off values
_OFF_SAMPLERS = {"dry": "d", "top_n_sigma": "s", "typ_p": "y", "typical_p": "y", "xtc": "x"}
_LETTERS = {"e": "penalties", "k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "d": "dry",
            "s": "top_n_sigma", "y": "typ_p", "x": "xtc"}
# llama-server fields of features this server does not have: the values that ask for nothing (off)
_OFF: dict[str, tuple[Any, ...]] = {
    "typical_p": (1,), "mirostat": (0,), "dynatemp_range": (0,), "xtc_probability": (0,), "dry_multiplier": (0,),
    "top_n_sigma": (-1,), "n_discard": (0,), "min_keep": (0,), "t_max_predict_ms": (0,), "n_indent": (0,),
    "post_sampling_probs": (False,), "timings_per_token": (False,), "id_slot": (-1,), "n_cache_reuse": (0,),
    "n_keep": (0, -1), "lora": ((),), "response_fields": ((),),
}


class LlamaRoutes:
    """The routes of this module over the models of ``routes`` (its lookup, submit, body reader and counting)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def table(self) -> list[Route]:
        c, r = self.routes.counted, self.routes
        return [
            Route("/completion", c("/completion", self.completion), methods=["POST"]),
            Route("/apply-template", c("/apply-template", self.apply_template), methods=["POST"]),
            Route("/completions", c("/completions", r.completions), methods=["POST"]),
            Route("/chat/completions", c("/chat/completions", r.chat), methods=["POST"]),
            Route("/models", c("/models", r.list_models), methods=["GET"]),
        ]

    async def apply_template(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "chat")
        g = chat_request(body, self.routes.defaults)
        g.tools = await anyio.to_thread.run_sync(read_tools, body, limiter=self.routes.text_limiter)
        sm = self.routes.resolve(g)
        text = await anyio.to_thread.run_sync(chat_text, sm, g, limiter=self.routes.text_limiter)
        return JSONResponse({"prompt": text})

    async def completion(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "completion")
        g, return_tokens = completion_request(body, self.routes)
        pieces = prompts(body.get("prompt"))
        if len(pieces) * g.n > MAX_CHOICES:
            raise bad(f"{len(pieces)} prompts x n_cmpl={g.n} is {len(pieces) * g.n} completions; at most "
                      f"{MAX_CHOICES} per request.", "n_cmpl")
        sm = self.routes.resolve(g)
        ids = await anyio.to_thread.run_sync(tokenize, sm, pieces, limiter=self.routes.text_limiter)
        g.prompts = list(ids)
        grammar = None
        if g.structure is not None:
            assert sm.model is not None
            grammar = await anyio.to_thread.run_sync(compile_structure, sm.model.tokenizer, g.structure,
                                                     limiter=self.routes.grammar_limiter)
        reqs, wake = self.routes.submit(sm, g, ids, "completion", grammar)
        answer = Answer(sm, g, return_tokens)
        if g.stream:
            return self.routes.event_stream(self.stream(reqs, wake, answer))
        self.routes.models.begin()
        try:
            left = await self.routes.finish(request, reqs, wake, grammar_field(g))
        finally:
            self.routes.models.end()
        if left is not None:
            return left
        out = [answer.final(i, r, r.text, r.take_logprobs()) for i, r in enumerate(reqs)]
        return JSONResponse(out[0] if len(out) == 1 else out)

    async def stream(self, reqs: list[Request], wake: asyncio.Event, answer: Answer) -> AsyncIterator[dict[str, str]]:
        """Each request's chunks (interleaved, by ``index``): progress, text as it becomes final, then its whole
        answer less the text; an error ends the stream with ``{"error": {...}}``."""
        try:
            ended: set[int] = set()
            shown = [0] * len(reqs)  # prompt positions whose progress went out
            sent = [0] * len(reqs)  # tokens sent
            while len(ended) < len(reqs):
                wake.clear()
                for i, r in enumerate(reqs):
                    if i in ended:
                        continue
                    done = r.done.is_set()  # before take(): every piece of a finished request is posted
                    text = "".join(r.take())  # before the progress: a token taken means its prompt was done
                    if answer.g.return_progress and r.started_at is not None and r.prompt_done > shown[i]:
                        shown[i] = r.prompt_done
                        yield _data({**answer.partial(i, r, "", []), "prompt_progress": prompt_progress(r)})
                    if text:
                        toks = r.tokens[sent[i]:]
                        sent[i] += len(toks)
                        chunk = answer.partial(i, r, text, toks)
                        if answer.g.logprobs is not None:
                            chunk["completion_probabilities"] = answer.probs(r.take_logprobs())
                        yield _data(chunk)
                    if not done:
                        continue
                    ended.add(i)
                    if r.finish_reason not in ("stop", "length"):
                        yield _data(failure(r, grammar_field(answer.g)).body())
                        return
                    yield _data(answer.final(i, r, "", r.take_logprobs(), stream=True))
                if len(ended) < len(reqs):
                    await wake.wait()
        finally:
            for r in reqs:
                if not r.done.is_set():
                    r.cancel()  # the client went away (or the stream ended): free the slots


def _data(doc: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(doc)}


class Answer:
    """The shapes of one ``/completion`` request's answers (llama-server's field names)."""

    def __init__(self, sm: ServedModel, g: Generation, return_tokens: bool) -> None:
        assert sm.model is not None
        self.sm, self.g, self.return_tokens = sm, g, return_tokens
        self.tok = sm.model.tokenizer

    def partial(self, i: int, r: Request, text: str, tokens: list[int]) -> dict[str, Any]:
        return {"index": i, "content": text, "tokens": list(tokens), "stop": False,
                "id_slot": -1 if r.seq is None else r.seq, "tokens_predicted": r.completion_tokens,
                "tokens_evaluated": r.prompt_tokens}

    def probs(self, entries: list[Any]) -> list[dict[str, Any]]:
        return llama_probs(entries, self.tok.token_bytes)

    def final(self, i: int, r: Request, text: str, entries: list[Any], stream: bool = False) -> dict[str, Any]:
        """The whole answer of request ``r`` (choice ``i``); streamed, without its text (the chunks had it)."""
        stopped_by = r.stop_string
        kind = "limit" if r.finish_reason == "length" else "word" if stopped_by is not None else "eos"
        out: dict[str, Any] = {
            "index": i, "content": text, "tokens": list(r.tokens) if self.return_tokens and not stream else [],
            "id_slot": -1 if r.seq is None else r.seq, "stop": True, "model": self.g.model,
            "tokens_predicted": r.completion_tokens, "tokens_evaluated": r.prompt_tokens,
            "generation_settings": self.settings(), "prompt": self.tok.decode(r.prompt),
            "has_new_line": "\n" in r.text, "truncated": False, "stop_type": kind,
            "stopping_word": stopped_by or "", "tokens_cached": r.n_reused, "timings": timings(r),
        }
        if self.g.logprobs is not None and (entries or not stream):
            out["completion_probabilities"] = self.probs(entries)
        return out

    def settings(self) -> dict[str, Any]:
        """``generation_settings``: what the request was generated with (llama-server's names)."""
        g, m = self.g, self.sm.model
        assert m is not None
        n = -1 if g.max_tokens is None else g.max_tokens
        st = g.structure
        return {"n_predict": n, "max_tokens": n, "seed": -1 if g.seed is None else g.seed, **g.sampling,
                "stop": list(g.stop), "ignore_eos": g.ignore_eos, "stream": g.stream,
                "n_probs": g.logprobs or 0, "cache_prompt": g.cache_prompt,
                "grammar": st.source if st is not None and st.kind == "gbnf" else "",
                "json_schema": st.source if st is not None and st.kind == "json_schema" else None,
                "samplers": list(SAMPLERS), "n_ctx": m.n_ctx, "model": g.model}


def completion_request(body: dict[str, Any], routes: Routes) -> tuple[Generation, bool]:
    """``/completion``'s fields read into a generation (and ``return_tokens``), each checked (400 naming it)."""
    for name, off in _OFF.items():
        v = body.get(name)
        if v is not None and not any(_same(v, x) for x in off):
            shown = " or ".join(json.dumps(list(x) if isinstance(x, tuple) else x) for x in off)
            raise bad(f"'{name}' is not supported by this server (only {shown}, which asks for nothing, is taken).",
                      name, "unsupported_parameter")
    _samplers(body.get("samplers"))
    oa = {k: v for k, v in body.items() if k not in ("n_predict", "max_tokens", "max_completion_tokens", "stop",
                                                     "n", "n_cmpl", "logprobs", "n_probs")}
    n_param = "n_cmpl" if body.get("n_cmpl") is not None else "n"
    n = body.get(n_param)
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise bad(f"'{n_param}' must be an integer in 1..{MAX_CHOICES}, got {n!r}.", n_param)
        oa["n"] = n
    g = read_generation(oa, None, ("response_format",), routes.defaults)
    limit, param = next(((body[k], k) for k in ("n_predict", "max_completion_tokens", "max_tokens")
                         if body.get(k) is not None), (None, "n_predict"))
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < -1:
            raise bad(f"'{param}' must be an integer: -1 (until the end of generation) or >= 1, got {limit!r}.",
                      param)
        if limit == 0:
            raise bad(f"'{param}': 0 (evaluate the prompt into the cache, generate nothing) is not supported; give "
                      "-1 or a number >= 1.", param)
        g.max_tokens = None if limit == -1 else limit
    stop = body.get("stop")
    g.stop = read_stops([stop] if isinstance(stop, str) else stop, "stop")
    k = body.get("n_probs")
    if k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise bad(f"'n_probs' must be an integer in 0..{MAX_TOP_LOGPROBS}, got {k!r}.", "n_probs")
        g.logprobs = k if k > 0 else None
    rt = body.get("return_tokens", False)
    if not isinstance(rt, bool):
        raise bad("'return_tokens' must be a boolean.", "return_tokens")
    g.structure = read_structure(body)
    return g, rt


def _same(v: Any, off: Any) -> bool:
    if isinstance(off, tuple):
        return isinstance(v, list) and tuple(v) == off
    if isinstance(off, bool) or isinstance(v, bool):
        return v is off
    return isinstance(v, (int, float)) and v == off


def _samplers(v: Any) -> None:
    """A ``samplers`` order (names, or llama.cpp's letters) is taken when it keeps this server's chain: top-k, top-p,
    min-p, temperature, in that order (penalties first, if named), and names no other sampler but ones that are off
    here."""
    if v is None:
        return
    if isinstance(v, str):
        names = [_LETTERS.get(c, c) for c in v]
    elif isinstance(v, list) and all(isinstance(x, str) for x in v):
        names = list(v)
    else:
        raise bad("'samplers' must be an array of sampler names (or a string of their letters).", "samplers")
    unknown = [x for x in names if x not in SAMPLERS and x not in _OFF_SAMPLERS]
    ours = [x for x in names if x in SAMPLERS and x != "penalties"]
    if unknown or ours != [x for x in SAMPLERS if x != "penalties"] or ("penalties" in names and names.index(
            "penalties") > names.index("top_k")):
        raise bad(f"'samplers': this server's chain is {', '.join(SAMPLERS)} in that order (got {', '.join(names)}); "
                  "another order or sampler is not supported.", "samplers", "unsupported_parameter")


def prompts(p: Any) -> list[list[str | int]]:
    """``prompt`` as llama-server reads it: a list of prompts, each a list of pieces (text or token ids)."""
    rule = ("'prompt' must be a string, token ids, a list mixing both, or a list of such prompts (strings, id "
            "lists, mixed lists, {\"prompt_string\"}).")

    def one(x: Any, where: str) -> list[str | int]:
        if isinstance(x, str):
            return [x]
        if isinstance(x, dict):
            if x.get("multimodal_data"):
                raise bad(f"'{where}.multimodal_data': this server takes text only.", f"{where}.multimodal_data")
            if not isinstance(x.get("prompt_string"), str):
                raise bad(f"'{where}.prompt_string' must be a string.", f"{where}.prompt_string")
            return [x["prompt_string"]]
        if isinstance(x, list) and x and all(_piece(y) for y in x):
            return list(x)
        raise bad(rule, "prompt")

    if isinstance(p, list) and p and all(_piece(y) for y in p):
        if all(isinstance(y, str) for y in p):
            return [[y] for y in p]  # only strings: one prompt each
        return [list(p)]  # ids, or ids and text mixed: one prompt
    if isinstance(p, list) and p:
        return [one(x, f"prompt[{i}]") for i, x in enumerate(p)]
    return [one(p, "prompt")]


def _piece(y: Any) -> bool:
    return isinstance(y, str) or (isinstance(y, int) and not isinstance(y, bool))


def tokenize(sm: ServedModel, pieces: list[list[str | int]]) -> list[list[int]]:
    """Each prompt's token ids: its text pieces tokenized (control tokens parsed; BOS by the model's rule before a
    prompt that begins with text), its ids checked against the vocabulary."""
    assert sm.model is not None
    tok = sm.model.tokenizer
    out = []
    for i, prompt in enumerate(pieces):
        chars = sum(len(x) for x in prompt if isinstance(x, str))
        if chars > sm.max_prompt_chars:
            raise context_overflow(f"prompt {i} has {chars} characters: more tokens than a sequence's context "
                                   f"holds ({sm.model.n_ctx}), whatever they are; the request exceeds the available "
                                   "context size.", "prompt", sm.model.n_ctx)
        ids: list[int] = []
        for j, x in enumerate(prompt):
            if isinstance(x, int):
                ids.append(x)
                continue
            try:
                ids += tok.encode(x, add_bos=None if j == 0 else False, special=True)
            except GgmlHybridError as exc:  # text that is not valid Unicode (a lone surrogate)
                raise bad(f"prompt {i}: {exc}.", "prompt") from None
        wrong = [t for t in ids if not 0 <= t < tok.n_vocab]
        if wrong:
            raise bad(f"prompt {i}: token id {wrong[0]} is outside the vocabulary 0..{tok.n_vocab - 1}.", "prompt")
        if not ids:
            raise bad(f"prompt {i} is empty (it has no tokens).", "prompt")
        out.append(ids)
    return out


__all__ = ["Answer", "LlamaRoutes", "SAMPLERS", "completion_request", "prompts", "tokenize"]
