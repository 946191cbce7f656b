"""The endpoints around generation, as llama.cpp's server has them: tokens, properties, slots, embeddings.

- ``POST /tokenize`` ``{"content": str, "add_special": bool, "with_pieces": bool}`` -> ``{"tokens": [...]}``
  (with pieces: ``[{"id", "piece"}]``); ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"content": str}``.
  Bounded as prompts are: a text longer than a sequence's context could hold whatever its tokens (the served model's
  ``max_prompt_chars``), or more ids than ``n_ctx``, is a 400 ``context_length_exceeded`` before any work; the work
  runs off the event loop, and the memory a long text needed is handed back once it is answered. Their bodies are
  bounded by the same rule before they are parsed (a 413): parsing holds the event loop for the whole body.
- ``GET /props``: the model, its context, slots, chat template, session options, sampling defaults.
- ``GET /slots``: what each slot holds (its state and llama-server's ``is_processing``, the positions its cells
  hold, the prompt tokens a next request may reuse); with ``serve --no-slots``, a 501 as llama-server's.
- ``POST /v1/embeddings``: a clear 400. Every family served is a generative model whose file declares no
  pooling (``{arch}.pooling_type`` absent or none), so no pooled embedding means anything for it; llama.cpp
  likewise refuses pooling ``none`` on this endpoint.

Each takes the model by name (``"model"`` in the body, ``?model=`` in the query); with one model served
it may be left out, and any name is that model (llama-server's rule, :meth:`.routes.Routes.lookup`).
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import GgmlHybridError
from ..machine import release_free_memory
from .models import ServedModel
from .protocol import APIError, bad, context_overflow
from .routes import Routes

MAX_TOKENIZE_CHARS = 1 << 22  # a text beyond this is refused before it is tokenized (the body limit is 16 MiB)
TRIM_AFTER = 1 << 16  # characters of text after which the freed memory is handed back to the system
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


class InfoRoutes:
    """The routes of this module over the models of ``routes`` (its lookup, body reader and counting)."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def table(self) -> list[Route]:
        c = self.routes.counted
        return [
            Route("/tokenize", c("/tokenize", self.tokenize), methods=["POST"]),
            Route("/detokenize", c("/detokenize", self.detokenize), methods=["POST"]),
            Route("/props", c("/props", self.props), methods=["GET"]),
            Route("/slots", c("/slots", self.slots), methods=["GET"]),
            Route("/v1/embeddings", c("/v1/embeddings", self.embeddings), methods=["POST"]),
        ]

    def model(self, name: object) -> ServedModel:
        """The served model named ``name`` (the only one when None)."""
        if name is None:
            if len(self.routes.models.models) != 1:
                raise bad(f"'model' is required: {len(self.routes.models.models)} models are served "
                          "(GET /v1/models lists them).", "model")
            name = next(iter(self.routes.models.models))
        if not isinstance(name, str) or not name:
            raise bad("'model' must be the name of a model from GET /v1/models.", "model")
        return self.routes.lookup(name)  # 404 for a name not served, 503 while it loads

    async def tokenize(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "tokenize")
        sm = self.model(body.get("model"))
        content = body.get("content")
        if not isinstance(content, str):
            raise bad("'content' must be a string (the text to tokenize).", "content")
        assert sm.model is not None
        if len(content) > sm.max_prompt_chars:  # the prompts' rule (server/routes.py): refused before tokenizing
            raise context_overflow(f"'content' has {len(content)} characters: more tokens than a sequence's context "
                                   f"holds ({sm.model.n_ctx}), whatever they are (at most {sm.max_prompt_chars} "
                                   "characters are tokenized, as for prompts).", "content", sm.model.n_ctx)
        if len(content) > MAX_TOKENIZE_CHARS:
            raise bad(f"'content' has {len(content)} characters; at most {MAX_TOKENIZE_CHARS} are tokenized.",
                      "content")
        add_special = _bool(body, "add_special", False)
        with_pieces = _bool(body, "with_pieces", False)
        tok = sm.model.tokenizer

        # the memory a long text needed (its encoding: a string and offsets per token, in the worker thread's heap;
        # the body and the answer) goes back to the system once the answer is sent, instead of staying with the heaps
        after = BackgroundTask(release_free_memory) if len(content) >= TRIM_AFTER else None

        def answer() -> Response:
            # off the event loop, the answer rendered too: a long text's ids and pieces take a while to build
            try:
                ids = tok.encode(content, add_bos=add_special, special=True)
            except GgmlHybridError as exc:  # text that is not valid Unicode (a lone surrogate)
                raise bad(f"'content': {exc}.", "content") from None
            if not with_pieces:
                return JSONResponse({"tokens": ids}, background=after)
            return JSONResponse({"tokens": [{"id": t, "piece": tok.token_bytes(t).decode("utf-8", "replace")}
                                            for t in ids]}, background=after)

        return await anyio.to_thread.run_sync(answer, limiter=self.routes.text_limiter)

    async def detokenize(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "detokenize")
        sm = self.model(body.get("model"))
        assert sm.model is not None
        tok = sm.model.tokenizer
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise bad("'tokens' must be an array of token ids (integers).", "tokens")
        if len(ids) > sm.model.n_ctx:  # no sequence holds more: refused before anything is decoded
            raise context_overflow(f"'tokens' has {len(ids)} token ids: more than a sequence's context holds "
                                   f"({sm.model.n_ctx}).", "tokens", sm.model.n_ctx, len(ids))

        def answer() -> Response:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise bad("'tokens' must be an array of token ids (integers).", "tokens")
            wrong = next((t for t in ids if not 0 <= t < tok.n_vocab), None)
            if wrong is not None:
                raise bad(f"'tokens': token id {wrong} is outside the vocabulary 0..{tok.n_vocab - 1}.", "tokens")
            return JSONResponse({"content": tok.decode(ids)})

        return await anyio.to_thread.run_sync(answer, limiter=self.routes.text_limiter)

    async def props(self, request: HTTPRequest) -> Response:
        sm = self.model(request.query_params.get("model"))
        m = sm.model
        assert m is not None and sm.engine is not None
        t = sm.template
        return JSONResponse({
            "model": sm.name, "aliases": list(sm.aliases), "model_path": sm.path, "arch": m.hp.arch,
            "n_ctx": m.n_ctx, "n_vocab": m.hp.n_vocab, "n_parallel": m.n_parallel, "total_slots": sm.engine.n_slots,
            "chat_template": t.source if t is not None else None,
            "chat_template_from_model": t.from_model if t is not None else False,
            "chat_template_error": sm.template_error,
            "bos_token": t.bos_token if t is not None else None, "eos_token": t.eos_token if t is not None else None,
            # prompt reuse keeps a prefix up to a cut every longer prompt makes (multiples of ubatch_size within each
            # batch_size); a recurrent model's slots keep state copies at the last max_checkpoints of them
            "recurrent": m.recurrent, "cache_prompt": {"ubatch_size": m.options.ubatch_size,
                                                       "batch_size": m.options.batch_size,
                                                       "max_checkpoints": sm.engine.cache.max_checkpoints},
            "session_options": m.options.to_dict(),
            "default_generation_settings": {**self.routes.defaults.sampling, "seed": self.routes.defaults.seed,
                                            "n_predict": self.routes.defaults.n_predict,
                                            "ignore_eos": self.routes.defaults.ignore_eos},
        })

    async def slots(self, request: HTTPRequest) -> Response:
        if not self.routes.settings.slots_endpoint:
            raise APIError(501, "This server does not support the slots endpoint (it runs with --no-slots).",
                           kind="not_supported_error")
        sm = self.model(request.query_params.get("model"))
        assert sm.engine is not None
        return JSONResponse([{**s, "is_processing": s["state"] != "idle"} for s in sm.engine.slots()])

    async def embeddings(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "completion")
        sm = self.model(body.get("model"))
        assert sm.model is not None
        arch = sm.model.hp.arch
        key = f"{arch}.pooling_type"
        try:
            pooling = sm.model.store.meta(key, kind="int") if sm.model.store.has(key) else 0
        except GgmlHybridError:  # declared as some other type: no pooling this server could know
            pooling = 0
        declared = POOLING.get(pooling, str(pooling))
        raise bad(f"The model '{sm.name}' ({arch}) is a generative model and its file declares pooling '{declared}' "
                  f"({arch}.pooling_type): it has no meaningful pooled embedding, and this server computes "
                  "embeddings for no model (llama.cpp likewise refuses pooling 'none' here).", "model",
                  "embeddings_not_supported")


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean.", name)
    return v


__all__ = ["InfoRoutes"]
