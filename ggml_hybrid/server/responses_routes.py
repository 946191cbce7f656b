"""The Responses API's routes: ``POST /v1/responses`` (streamed with ``stream: true``), ``GET`` and ``DELETE
/v1/responses/{id}``.

A request is read into a chat generation (:func:`.responses.read_request`) and runs the chat endpoint's path: the
prompt rendered by the model's template and tokenized off the event loop, the grammar of its ``text.format`` or forced
call, the same engine request and wake-ups (:meth:`.routes.Routes.generate`); only the answer's shape is its own
(:class:`ResponsesShape`). Errors are OpenAI's error object naming the Responses field.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..runtime.engine import Request
from .models import ServedModel
from .protocol import APIError, bad
from .response_store import ResponseStore
from .responses import Answer, ResponseEvents, Turn, not_found, read_request, renamed, response_usage, with_ids
from .routes import Routes, _chat_prompt, _grammar, _too_long
from .shapes import prompt_use
from .tools import Reading


class ResponsesShape:
    """A generation answered as a response object, or streamed as its events (a :class:`.shapes.Shape`)."""

    def __init__(self, answer: Answer, sm: ServedModel) -> None:
        self.a, self.sm = answer, sm

    def usage(self, r: Request) -> dict[str, Any]:
        use = prompt_use(self.sm, r)
        return response_usage(use.total, r.completion_tokens, use.read, use.created)

    def answer(self, r: Request, read: Reading) -> dict[str, Any]:
        return self.a.finish(read.content, with_ids(read.calls), read.finish, self.usage(r))

    def events(self, r: Request) -> ResponseEvents:
        return ResponseEvents(self.a, self.usage)


class ResponsesRoutes:
    """The routes of this module over the models of ``routes`` (its lookup, body reader, counting and generation),
    with ``store`` holding the responses kept."""

    def __init__(self, routes: Routes, store: ResponseStore | None = None) -> None:
        self.routes = routes
        self.store = store if store is not None else ResponseStore()

    def table(self) -> list[Route]:
        c = self.routes.counted
        return [
            Route("/v1/responses", c("/v1/responses", self.create), methods=["POST"]),
            Route("/v1/responses/{rid}", c("/v1/responses/{id}", self.retrieve), methods=["GET"]),
            Route("/v1/responses/{rid}", c("/v1/responses/{id}", self.delete), methods=["DELETE"]),
        ]

    async def create(self, request: HTTPRequest) -> Response:
        body = await self.routes.route_body(request, "chat")
        try:
            turn = read_request(body, self.store)
            g = await self.routes.chat_generation(turn.chat)
            # what the generation runs with (the server's defaults where the request is silent), as OpenAI repeats it
            turn.echo.update(temperature=g.sampling["temperature"], top_p=g.sampling["top_p"],
                             max_output_tokens=g.max_tokens)
            sm = self.routes.resolve(g)
            _check_length(sm, turn)
            prompt = await anyio.to_thread.run_sync(_chat_prompt, sm, g, limiter=self.routes.text_limiter)
            grammar = await anyio.to_thread.run_sync(_grammar, sm, g, limiter=self.routes.grammar_limiter)
            shape = ResponsesShape(Answer(turn, g.model, self.store), sm)
            return await self.routes.generate(request, sm, g, [prompt], "chat", grammar, shape)
        except APIError as e:
            raise renamed(e) from None

    async def retrieve(self, request: HTTPRequest) -> Response:
        rid = request.path_params["rid"]
        if request.query_params.get("stream") not in (None, "false"):
            raise bad("'stream': a stored response is not streamed again by this server.", "stream",
                      "unsupported_parameter")
        found = self.store.get(rid)
        if found is None:
            raise not_found(rid)
        return JSONResponse(found.response)

    async def delete(self, request: HTTPRequest) -> Response:
        rid = request.path_params["rid"]
        if not self.store.delete(rid):
            raise not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})


def _check_length(sm: ServedModel, turn: Turn) -> None:
    """A text too long for the context whatever its tokens is refused before it is rendered, naming its field."""
    instructions = turn.echo["instructions"] or ""
    chars = sum(len(m["content"]) for m in turn.chat["messages"] if isinstance(m.get("content"), str))
    for what, n, param in (("'instructions'", len(instructions), "instructions"),
                           ("the conversation's text", chars, "input")):
        if n > sm.max_prompt_chars:
            raise _too_long(what, n, sm, param)


__all__ = ["ResponsesRoutes", "ResponsesShape"]
