"""The handlers of the OpenAI-compatible HTTP API: one method of :class:`Routes` per endpoint (``Routes.table``).

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, Anthropic's ``POST /v1/messages`` (all streamed with ``stream: true``) and
``POST /v1/messages/count_tokens``, and ``GET /metrics``; the Responses API (:mod:`.responses_routes`) generates
through :meth:`Routes.generate` in a :class:`~.shapes.Shape` of its own. Every error is OpenAI's error object
(Anthropic's on its paths: :func:`.anthropic.owns`) with a 4xx/5xx status; nothing a client sends takes the server
down. With one model served, a request may leave ``model`` out or name any model (llama-server's rule); with several,
it names one of them. A generation is one engine request per choice; the handler waits on them without blocking the
event loop (the engine thread wakes it), and a client that goes away cancels them, which frees their slots before
the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ChatTemplateError, ChatTemplateLimitError, ClosedError, ContextFullError, GgmlHybridError
from ..runtime.engine import Request
from ..runtime.grammar import Grammar
from ..runtime.logprobs import TokenLogprob
from . import anthropic, body, metrics
from .body_bounds import body_bound, body_why
from .logprobs import CompletionLogprobs, chat_logprobs
from .logs import log_once, shorten
from .models import ModelSet, ServedModel
from .protocol import (
    MAX_BODY_BYTES,
    APIError,
    Generation,
    bad,
    chat_request,
    choice,
    completion_request,
    context_overflow,
    envelope,
    model_object,
    new_id,
    now,
    null_usage,
    prompt_progress,
    timings,
    usage,
)
from .settings import ServerSettings
from .shapes import MessagesEvents, Shape, prompt_use, stream_events, tool_stream
from .structured import compile_structure, failure, grammar_field, read_structure, refuse_stops
from .tools import (
    Reading,
    ToolFormat,
    ToolStream,
    chat_message,
    check_tools,
    read_calls,
    read_tools,
    stream_calls,
    template_messages,
    template_tools,
    tool_format,
    tools_grammar,
)

WAIT_POLL = 0.25  # seconds between disconnect checks of a non-streamed request
TEXT_THREADS = 4  # prompts tokenized and templates rendered at once (the others wait their turn)
GRAMMAR_WAITERS = 16  # requests waiting on the grammar compile pool at once (its own threads do the work)


def _error(e: APIError, anthropic_shape: bool = False) -> JSONResponse:
    return JSONResponse(anthropic.error_body(e) if anthropic_shape else e.body(), status_code=e.status)


def _not_loaded(sm: ServedModel) -> APIError:
    if sm.unavailable is not None:  # loaded, then its RPC worker was lost (models.py)
        return APIError(503, f"The model '{sm.name}' is unavailable: {sm.unavailable}; the server reconnects when "
                        "the worker is back (GET /health lists the unavailable models).", code="model_unavailable")
    return APIError(503, f"The model '{sm.name}' is still loading; retry when GET /health answers 200.",
                    code="model_loading")


class Routes:
    """The endpoints over ``models``: each a method, counted in ``/metrics`` by :meth:`counted`; generations end by
    ``drain_seconds`` after a drain begins."""

    def __init__(self, models: ModelSet, drain_seconds: float, settings: ServerSettings | None = None) -> None:
        self.models = models
        self.drain_seconds = drain_seconds
        self.settings = settings if settings is not None else ServerSettings()
        self.defaults = self.settings.defaults
        self.registry = metrics.registry(models)
        self.text_limiter = anyio.CapacityLimiter(TEXT_THREADS)
        self.grammar_limiter = anyio.CapacityLimiter(GRAMMAR_WAITERS)
        self.parse_limiter = anyio.CapacityLimiter(1)  # large bodies parsed one at a time (server/body.py)

    def table(self) -> list[Route]:
        """The routes, each handler counted under its path."""
        return [
            Route("/health", self.counted("/health", self.health), methods=["GET"]),
            Route("/v1/models", self.counted("/v1/models", self.list_models), methods=["GET"]),
            Route("/v1/models/{model:path}", self.counted("/v1/models/{id}", self.get_model), methods=["GET"]),
            Route("/metrics", self.counted("/metrics", self.metrics), methods=["GET"]),
            Route("/v1/completions", self.counted("/v1/completions", self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self.counted("/v1/chat/completions", self.chat), methods=["POST"]),
            Route("/v1/messages", self.counted("/v1/messages", self.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", self.counted("/v1/messages/count_tokens", self.count_tokens),
                  methods=["POST"]),
        ]

    def counted(self, endpoint: str, fn: Callable[[HTTPRequest], Awaitable[Response]]
                ) -> Callable[[HTTPRequest], Awaitable[Response]]:
        async def handler(request: HTTPRequest) -> Response:
            shape = anthropic.owns(endpoint, request.headers)  # Anthropic's error shape on its paths
            try:
                resp = await fn(request)
            except APIError as e:
                resp = _error(e, shape)
            except ClientDisconnect:  # the client left before its body was whole: nobody to answer
                resp = Response(status_code=499)
            except Exception as exc:  # a bug: still the API's error shape, still counted, one log line per cause
                log_once(f"internal error on {endpoint}: {type(exc).__name__}", exc)
                resp = _error(APIError(500, f"Internal error: {type(exc).__name__}: {shorten(str(exc))}"), shape)
            self.models.count(endpoint, resp.status_code)
            return resp
        return handler

    async def health(self, request: HTTPRequest) -> Response:
        status, body = self.models.health()
        return JSONResponse(body, status_code=status)

    async def list_models(self, request: HTTPRequest) -> Response:
        if anthropic.owns(request.url.path, request.headers):  # asked by Anthropic's client: its list
            data = [anthropic.model_info(n, sm.created) for n, sm in self.models.names.items()]
            return JSONResponse({"data": data, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None, "has_more": False})
        return JSONResponse({"object": "list",
                             "data": [model_object(n, sm.created) for n, sm in self.models.names.items()]})

    async def get_model(self, request: HTTPRequest) -> Response:
        """``GET /v1/models/{id}``: one model by name or alias (OpenAI's model object; Anthropic's when asked by its
        client); a name not served is a 404, however many models (only generation takes any name)."""
        name = request.path_params["model"]
        sm = self.models.names.get(name)
        if sm is None:
            raise APIError(404, f"The model '{name}' does not exist; GET /v1/models lists the models served.",
                           "model", "model_not_found")
        return JSONResponse(anthropic.model_info(name, sm.created) if anthropic.owns(request.url.path, request.headers)
                            else model_object(name, sm.created))

    async def metrics(self, request: HTTPRequest) -> Response:
        body, ctype = metrics.render(self.registry)
        return Response(body, media_type=ctype)

    async def read_body(self, request: HTTPRequest, limit: int = MAX_BODY_BYTES, why: str = "") -> dict[str, Any]:
        return await body.read_json(request, self.parse_limiter, limit, why)

    async def route_body(self, request: HTTPRequest, kind: str) -> dict[str, Any]:
        """The body of a ``kind`` route (:data:`.body_bounds.KINDS`), refused unparsed (413) beyond the largest one
        its fields could accept on the models served."""
        limit = body_bound(self.models.models.values(), kind)
        return await self.read_body(request, limit, body_why(request.url.path, kind))

    def lookup(self, name: str) -> ServedModel:
        """The model named ``name``; with one model served, that model whatever the name ("": none given), as
        llama-server answers; with several, an unknown name is a 404 and none a 400."""
        sm = self.models.names.get(name)
        if sm is None and len(self.models.models) == 1:
            sm = next(iter(self.models.models.values()))
        if sm is None:
            if not name:
                raise bad(f"'model' is required: {len(self.models.models)} models are served (GET /v1/models lists "
                          "them).", "model")
            raise APIError(404, f"The model '{name}' does not exist; GET /v1/models lists the models served.",
                           "model", "model_not_found")
        if not sm.ready:
            raise _not_loaded(sm)
        return sm

    def resolve(self, g: Generation) -> ServedModel:
        """The model ``g`` asks for (:meth:`lookup`); ``g.model`` becomes the name its answer carries: the one asked
        for when the server knows it, else the model's own."""
        sm = self.lookup(g.model)
        if g.model not in self.models.names:
            g.model = sm.name
        return sm

    async def completions(self, request: HTTPRequest) -> Response:
        body = await self.route_body(request, "completion")
        g = completion_request(body, self.defaults)
        g.structure = read_structure(body)
        sm = self.resolve(g)
        prompts = await anyio.to_thread.run_sync(_tokenize_prompts, sm, g, limiter=self.text_limiter)
        grammar = await anyio.to_thread.run_sync(_grammar, sm, g, limiter=self.grammar_limiter)
        return await self.generate(request, sm, g, prompts, "completion", grammar)

    async def chat(self, request: HTTPRequest) -> Response:
        g = await self.chat_generation(await self.route_body(request, "chat"))
        sm = self.resolve(g)
        prompt = await anyio.to_thread.run_sync(_chat_prompt, sm, g, limiter=self.text_limiter)
        grammar = await anyio.to_thread.run_sync(_grammar, sm, g, limiter=self.grammar_limiter)
        return await self.generate(request, sm, g, [prompt], "chat", grammar)

    async def chat_generation(self, body: dict[str, Any]) -> Generation:
        """A chat request body read (the server's defaults applied): the generation, its structured output and its
        tools (400 naming the field; the tools read off the event loop). The Responses API's requests are read into
        one too."""
        g = chat_request(body, self.defaults)
        g.structure = read_structure(body)
        g.tools = await anyio.to_thread.run_sync(read_tools, body, limiter=self.text_limiter)
        return g

    async def messages(self, request: HTTPRequest) -> Response:
        """Anthropic's Messages API: read into a chat request (server/anthropic.py), answered in Anthropic's shapes."""
        body = await self.route_body(request, "chat")
        g, sm = await anyio.to_thread.run_sync(self._messages_request, body, limiter=self.text_limiter)
        prompt = await anyio.to_thread.run_sync(_chat_prompt, sm, g, limiter=self.text_limiter)
        grammar = await anyio.to_thread.run_sync(_grammar, sm, g, limiter=self.grammar_limiter)
        return await self.generate(request, sm, g, [prompt], "messages", grammar)

    async def count_tokens(self, request: HTTPRequest) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the tokens of the prompt the request renders to (tools
        included), as ``/v1/messages`` would evaluate it."""
        body = await self.route_body(request, "chat")
        g, sm = await anyio.to_thread.run_sync(self._messages_request, body, True, limiter=self.text_limiter)
        prompt = await anyio.to_thread.run_sync(_chat_prompt, sm, g, limiter=self.text_limiter)
        return JSONResponse({"input_tokens": len(prompt)})

    def _messages_request(self, body: dict[str, Any], count_only: bool = False) -> tuple[Generation, ServedModel]:
        m = anthropic.read_request(body, count_only)
        g = chat_request(m.chat, self.defaults)
        g.stop = m.stop
        g.tools = read_tools(m.chat)
        g.structure = m.structure
        if g.structure is not None:
            refuse_stops(g.structure, g.stop, "stop_sequences")
        return g, self.resolve(g)

    async def generate(self, request: HTTPRequest, sm: ServedModel, g: Generation, prompts: list[list[int]],
                       kind: str, grammar: Grammar | None = None, shape: Shape | None = None) -> Response:
        """Run ``g`` on ``prompts`` and answer in ``kind``'s shape, or ``shape``'s (one generation answered in
        another API's shape: the Responses API's)."""
        reqs, wake = self.submit(sm, g, prompts, kind, grammar)
        rid, created = anthropic.new_id() if kind == "messages" else new_id(kind), now()
        n_prompt = sum(len(p) for p in prompts)
        if g.stream:
            if shape is not None:
                return self.event_stream(stream_events(reqs[0], wake, shape.events(reqs[0]), tool_stream(
                    _tool_format(sm), g), grammar_field(g), self.text_limiter))
            return self.event_stream(self.stream_messages(reqs[0], wake, rid, g, sm) if kind == "messages" else
                                     self.stream(reqs, wake, kind, rid, created, g, n_prompt, sm))
        self.models.begin()  # the server stops once every generation begun has answered (or the drain ran out)
        try:
            if shape is not None:
                left = await self.finish(request, reqs, wake, grammar_field(g))
                return left or JSONResponse(shape.answer(reqs[0], await self.read(sm, g, reqs[0])))
            return await self.wait(request, reqs, wake, kind, rid, created, g, n_prompt, sm)
        finally:
            self.models.end()

    async def read(self, sm: ServedModel, g: Generation, r: Request) -> Reading:
        """A finished generation's content, calls and finish reason (read off the event loop: the text may be long)."""
        if g.tools is None or g.tools.choice == "none":
            return Reading(r.text, [], r.finish_reason)
        return await anyio.to_thread.run_sync(read_calls, _tool_format(sm), r.text, g.tools.tools, r.finish_reason,
                                              limiter=self.text_limiter)

    def submit(self, sm: ServedModel, g: Generation, prompts: list[list[int]], kind: str,
               grammar: Grammar | None = None) -> tuple[list[Request], asyncio.Event]:
        """One engine request per prompt and choice, and the event the engine sets when a stream has news (a plain
        answer: when every request is done). Every route that generates submits here."""
        if self.models.draining:
            raise APIError(503, "The server is shutting down and takes no new requests.", code="shutting_down")
        engine = sm.engine
        assert engine is not None
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def listener() -> None:
            # a stream wakes for every piece; a plain answer only once its requests are done (a wake-up per
            # token would cost the event loop, which shares the interpreter with the engine, every step)
            if not g.stream and not all(r.done.is_set() for r in reqs):
                return
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                loop.call_soon_threadsafe(wake.set)

        reqs: list[Request] = []
        try:
            for tokens in prompts:
                for _ in range(g.n):
                    reqs.append(engine.submit(Request(tokens, g.sampler(len(reqs)), g.max_tokens, g.stop,
                                                      g.ignore_eos, listener, cache_prompt=g.cache_prompt,
                                                      logprobs=g.logprobs, constraint=None if grammar is None
                                                      else grammar.constraint())))
        except ContextFullError:
            _cancel(reqs)
            assert sm.model is not None
            n = max(len(p) for p in prompts)
            param = "messages" if kind in ("chat", "messages") else "prompt"
            raise context_overflow(f"The request ({n} tokens) exceeds the available context size ({sm.model.n_ctx} "
                                   "tokens): the prompt and at least one generated token must fit.",
                                   param, sm.model.n_ctx, n) from None
        except ClosedError:
            _cancel(reqs)
            raise APIError(503, "The server is shutting down and takes no new requests.",
                           code="shutting_down") from None
        except GgmlHybridError as exc:
            _cancel(reqs)
            raise bad(str(exc), "prompt") from None
        return reqs, wake

    async def finish(self, request: HTTPRequest, reqs: list[Request], wake: asyncio.Event,
                     grammar_param: str | None = None) -> Response | None:
        """Wait for ``reqs`` (a plain answer's): None once every one ended well; a 499 when the client went away
        (they are cancelled); a 400 (its grammar's fault: ``grammar_param`` names the field), 500 or 503 (raised)
        when one failed or the server shut down first."""
        try:
            while not all(r.done.is_set() for r in reqs):
                wake.clear()
                if all(r.done.is_set() for r in reqs):
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), WAIT_POLL)
                if await request.is_disconnected():
                    _cancel(reqs)
                    return Response(status_code=499)
                if self.models.drain_expired(self.drain_seconds):
                    _cancel(reqs)  # SIGTERM came --drain-timeout seconds ago: it ends now, with a 503
        finally:
            _cancel(reqs)  # a handler cancelled (shutdown) leaves no request running
        failed = [r for r in reqs if r.finish_reason in ("error", "cancelled")]
        if failed:
            raise failure(failed[0], grammar_param)
        return None

    def event_stream(self, events: AsyncIterator[dict[str, str]]) -> Response:
        """``events`` sent as server-sent events; the server's drain waits for the stream to end."""
        self.models.begin()
        return EventSourceResponse(self._counted_stream(events), ping=600, sep="\n",
                                   shutdown_grace_period=self.drain_seconds)

    async def _counted_stream(self, events: AsyncIterator[dict[str, str]]) -> AsyncIterator[dict[str, str]]:
        try:
            async for e in events:
                yield e
        finally:
            self.models.end()

    async def wait(self, request: HTTPRequest, reqs: list[Request], wake: asyncio.Event, kind: str, rid: str,
                    created: int, g: Generation, n_prompt: int, sm: ServedModel) -> Response:
        left = await self.finish(request, reqs, wake, grammar_field(g))
        if left is not None:
            return left
        if kind == "messages":
            r = reqs[0]
            read = await self.read(sm, g, r)
            return JSONResponse(anthropic.message(rid, g.model, read.content, read.calls, read.finish, r.stop_string,
                                                  prompt_use(sm, r), r.completion_tokens))
        lps = _logprobs_of(sm, kind, g)
        choices = [choice(kind, i, r.text, r.finish_reason, False,
                          logprobs=lps[i](r.take_logprobs()) if lps else None) for i, r in enumerate(reqs)]
        if g.tools is not None and g.tools.choice != "none":
            fmt, tools = _tool_format(sm), g.tools.tools
            choices = await anyio.to_thread.run_sync(
                lambda: [chat_message(c, fmt, r.text, tools) for c, r in zip(choices, reqs)],
                limiter=self.text_limiter)
        use = usage(n_prompt, sum(r.completion_tokens for r in reqs), sum(r.n_reused for r in reqs))
        out = envelope(kind, rid, created, g.model, choices, False, use, sm.fingerprint)
        if len(reqs) == 1:
            out["timings"] = timings(reqs[0])
        return JSONResponse(out)

    async def stream(self, reqs: list[Request], wake: asyncio.Event, kind: str, rid: str, created: int, g: Generation,
                      n_prompt: int, sm: ServedModel) -> AsyncIterator[dict[str, str]]:
        def event(choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> dict[str, str]:
            return {"data": json.dumps(null_usage(envelope(kind, rid, created, g.model, choices, True, use,
                                                           sm.fingerprint), g.include_usage))}

        lps = _logprobs_of(sm, kind, g, stream=True)
        calls = None
        if g.tools is not None and g.tools.choice != "none":
            fmt = _tool_format(sm)
            calls = [ToolStream(fmt, g.tools.tools) for _ in reqs]
        try:
            if kind == "chat":
                yield event([choice(kind, i, "", None, True, first=True) for i in range(len(reqs))])
            ended: set[int] = set()
            shown = [0] * len(reqs)  # prompt positions whose progress went out (return_progress)
            while len(ended) < len(reqs):
                wake.clear()
                for i, r in enumerate(reqs):
                    if i in ended:
                        continue
                    done = r.done.is_set()  # before take(): every piece of a finished request is posted
                    pieces = r.take()  # before the progress: a token taken means its prompt was done when read
                    if g.return_progress and r.started_at is not None and r.prompt_done > shown[i]:
                        shown[i] = r.prompt_done
                        empty = choice(kind, i, "", None, True) if kind == "completion" else \
                            {"index": i, "delta": {}, "logprobs": None, "finish_reason": None}
                        doc = null_usage(envelope(kind, rid, created, g.model, [empty], True, None, sm.fingerprint),
                                         g.include_usage)
                        doc["prompt_progress"] = prompt_progress(r)
                        yield {"data": json.dumps(doc)}
                    # a piece's chunk carries the tokens' logprobs that came with it (the last: any still held);
                    # text a tool call parser holds back goes out later, as content or as the call
                    for k, piece in enumerate(pieces):
                        text = piece if calls is None else calls[i].push(piece)
                        lp = lps[i](r.take_logprobs()) if lps and k == len(pieces) - 1 else None
                        if text or lp is not None:
                            yield event([choice(kind, i, text, None, True, logprobs=lp)])
                    if done:
                        ended.add(i)
                        if r.finish_reason in ("stop", "length"):
                            finish: str | None = r.finish_reason
                            if calls is not None:  # read off the event loop: the text may be long
                                tail, found, finish = await anyio.to_thread.run_sync(
                                    calls[i].end, finish, limiter=self.text_limiter)
                                if tail:
                                    yield event([choice(kind, i, tail, None, True)])
                                for delta in stream_calls(found):
                                    yield event([{"index": i, "delta": {"tool_calls": [delta]}, "logprobs": None,
                                                  "finish_reason": None}])
                            lp = lps[i](r.take_logprobs()) if lps else None
                            last = event([choice(kind, i, "", finish, True, logprobs=lp)])
                            if len(reqs) == 1:
                                doc = json.loads(last["data"])
                                doc["timings"] = timings(r)
                                last = {"data": json.dumps(doc)}
                            yield last
                        else:
                            yield {"data": json.dumps(failure(r, grammar_field(g)).body())}
                if len(ended) < len(reqs):
                    await wake.wait()
            if g.include_usage:
                yield event([], usage(n_prompt, sum(r.completion_tokens for r in reqs), sum(r.n_reused for r in reqs)))
            yield {"data": "[DONE]"}
        finally:
            _cancel(reqs)  # the client went away (or the stream ended): free the slots

    def stream_messages(self, r: Request, wake: asyncio.Event, rid: str, g: Generation, sm: ServedModel
                        ) -> AsyncIterator[dict[str, str]]:
        """Anthropic's events of one generation (server/anthropic.py's MessageEvents). ``message_start`` waits for the
        request to take a slot: its ``usage`` says how much of the prompt was reused."""
        ev = MessagesEvents(anthropic.MessageEvents(rid, g.model), sm)
        return stream_events(r, wake, ev, tool_stream(_tool_format(sm), g), grammar_field(g), self.text_limiter)

    async def not_found(self, request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        self.models.count("other", exc.status_code)
        msg = "Not found." if exc.status_code == 404 else str(exc.detail)
        return _error(APIError(exc.status_code, f"{msg} ({request.method} {request.url.path})"),
                      anthropic.owns(request.url.path, request.headers))

    async def server_error(self, request: HTTPRequest, exc: Exception) -> Response:
        self.models.count("other", 500)  # outside the routes (every route answers its own errors): still counted
        log_once(f"internal error: {type(exc).__name__}", exc)
        return _error(APIError(500, f"Internal error: {type(exc).__name__}: {shorten(str(exc))}"),
                      anthropic.owns(request.url.path, request.headers))


def _logprobs_of(sm: ServedModel, kind: str, g: Generation, stream: bool = False
                 ) -> list[Callable[[list[TokenLogprob]], dict[str, Any]]]:
    """Per choice, what turns its tokens' log-probabilities into OpenAI's shape (none without ``logprobs``)."""
    if g.logprobs is None:
        return []
    assert sm.model is not None
    token_bytes = sm.model.tokenizer.token_bytes
    if kind == "chat":
        return [lambda e: chat_logprobs(e, token_bytes, stream)] * g.n_choices
    return [CompletionLogprobs(token_bytes) for _ in range(g.n_choices)]


def _cancel(reqs: list[Request]) -> None:
    for r in reqs:
        if not r.done.is_set():
            r.cancel()


def _too_long(what: str, chars: int, sm: ServedModel, param: str) -> APIError:
    """A text refused before it is tokenized (it cannot fit, whatever its tokens): no ``n_prompt_tokens``."""
    assert sm.model is not None
    return context_overflow(f"{what} has {chars} characters: more tokens than a sequence's context holds "
                            f"({sm.model.n_ctx}), whatever they are; the request exceeds the available context size.",
                            param, sm.model.n_ctx)


def _tokenize_prompts(sm: ServedModel, g: Generation) -> list[list[int]]:
    assert sm.model is not None
    tok = sm.model.tokenizer
    out = []
    for i, p in enumerate(g.prompts):
        # a text too long for the context whatever its tokens is refused before the (costly) tokenization
        if isinstance(p, str) and len(p) > sm.max_prompt_chars:
            raise _too_long(f"prompt {i}", len(p), sm, "prompt")
        try:
            ids = tok.encode(p, special=True) if isinstance(p, str) else list(p)
        except GgmlHybridError as exc:  # text that is not valid Unicode (a lone surrogate)
            raise bad(f"prompt {i}: {exc}.", "prompt") from None
        bad_ids = [t for t in ids if not 0 <= t < tok.n_vocab]
        if bad_ids:
            raise bad(f"prompt {i}: token id {bad_ids[0]} is outside the vocabulary 0..{tok.n_vocab - 1}.", "prompt")
        if not ids:
            raise bad(f"prompt {i} is empty (it has no tokens).", "prompt")
        out.append(ids)
    return out


def _tool_format(sm: ServedModel) -> ToolFormat:
    return tool_format(sm.template.source if sm.template is not None else "")


def _grammar(sm: ServedModel, g: Generation) -> Grammar | None:
    """The request's grammar compiled for the model's vocabulary: its structure, its forced tool call, or (tools with
    ``auto`` and a JSON schema) a call or the answer under the schema. A forced call with a ``response_format`` is
    forced: the format shapes a later answer, after the tool results (compiled all the same: a 400 now if it cannot).
    In the compile pool: this thread only waits for it."""
    assert sm.model is not None
    tok = sm.model.tokenizer
    tools = g.tools if g.tools is not None and g.tools.choice != "none" else None
    grammar = None if g.structure is None else compile_structure(tok, g.structure)
    if tools is None:
        return grammar
    fmt = _tool_format(sm)
    check_tools(fmt, tools)
    if tools.forced:
        return tools_grammar(tok, fmt, tools)
    if g.structure is not None and g.structure.kind == "json_schema":
        return tools_grammar(tok, fmt, tools, answer=g.structure.source)
    return grammar


def chat_text(sm: ServedModel, g: Generation) -> str:
    """The prompt text ``g``'s messages (and tools) render to with ``sm``'s chat template."""
    if sm.template is None:
        raise APIError(500, f"The model's chat template cannot be used: {shorten(sm.template_error or '')}",
                       code="chat_template_unusable")
    assert sm.model is not None
    if not sm.jinja and g.tools is not None:
        raise bad("'tools' need the model's own (Jinja) chat template, and this server runs with --no-jinja "
                  "(as llama-server, which refuses tools without --jinja).", "tools")
    chars = sum(len(c) for m in g.messages if isinstance(m, dict) for c in (m.get("content"),) if isinstance(c, str))
    if chars > sm.max_prompt_chars:
        raise _too_long("the messages' content", chars, sm, "messages")
    extra = {}
    if g.tools is not None and g.tools.choice != "none":
        extra["tools"] = template_tools(g.tools)
    try:
        text = sm.template.render(template_messages(g.messages), add_generation_prompt=True,
                                  max_chars=sm.max_prompt_chars, **extra)
    except ChatTemplateLimitError as exc:
        if exc.kind == "output":
            raise context_overflow(f"the messages render to a prompt longer than a sequence's context holds "
                                   f"({sm.model.n_ctx} tokens): {exc}", "messages", sm.model.n_ctx) from None
        if exc.kind == "stopped":
            raise APIError(503, "The server is shutting down and takes no new requests.",
                           code="shutting_down") from None
        raise APIError(500, f"The model's chat template failed at a limit: {exc}", code="chat_template_limit") \
            from None
    except ChatTemplateError as exc:
        raise bad(shorten(str(exc)), "messages") from None
    return text


def _chat_prompt(sm: ServedModel, g: Generation) -> list[int]:
    text = chat_text(sm, g)
    assert sm.model is not None and sm.template is not None
    tok = sm.model.tokenizer
    # the template writes BOS itself when it wants one (most do); otherwise the model's rule adds it
    add_bos = tok.add_bos and not (sm.template.bos_token and text.startswith(sm.template.bos_token))
    try:
        ids = tok.encode(text, add_bos=add_bos, special=True)
    except GgmlHybridError as exc:  # text that is not valid Unicode (a lone surrogate in a message)
        raise bad(f"the messages: {exc}.", "messages") from None
    if not ids:
        raise bad("the messages render to an empty prompt.", "messages")
    return ids


__all__ = ["Routes", "chat_text"]
