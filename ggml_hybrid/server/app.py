"""The OpenAI-compatible HTTP API over the served models (Starlette; streams as server-sent events).

Routes (:mod:`.routes`): ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed with ``stream: true``), Anthropic's ``POST /v1/messages`` and
``/v1/messages/count_tokens``, and ``GET /metrics``; :mod:`.info`: ``POST /tokenize``, ``POST /detokenize``,
``GET /props``, ``GET /slots``, ``POST /v1/embeddings``; :mod:`.llama_api`: llama-server's own ``POST /completion``,
``POST /apply-template`` and the routes without ``/v1``; :mod:`.expert_view`: ``GET /experts``; :mod:`.web`: the
chat page at ``/``. With API keys (:mod:`.auth`) every route but ``/health``
needs one; with ``cors_origins`` (:mod:`.settings`) browsers may call it from those pages. Every error is OpenAI's
error object (Anthropic's on its paths) with a 4xx/5xx status; nothing a client sends takes the server down. A
generation is one engine request per choice; the handler waits on them without blocking the event loop (the engine
thread wakes it), and a client that goes away cancels them, which frees their slots before the engine's next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from .auth import APIKeyMiddleware
from .expert_view import ExpertViewRoutes
from .info import InfoRoutes
from .llama_api import LlamaRoutes
from .models import ModelSet
from .routes import Routes
from .settings import LOCAL_ORIGIN_RE, LOCALHOST, ServerSettings
from .web import PageRoutes

CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")  # llama-server's --cors-methods default


def create_app(models: ModelSet, drain_seconds: float = 30.0, lifespan: Any = None,
               api_keys: Sequence[str] = (), settings: ServerSettings | None = None) -> Starlette:
    """The app over ``models``; ``lifespan`` (an async context manager factory) runs around serving; with
    ``api_keys``, every route but ``/health`` needs one of them; ``settings``: request defaults, CORS origins,
    optional endpoints."""
    settings = settings if settings is not None else ServerSettings()
    routes = Routes(models, drain_seconds, settings)
    # the first is the outermost: CORS answers a preflight before the key check, and labels the 401s too
    middleware = [_cors(settings.cors_origins)] if settings.cors_origins else []
    if api_keys:
        middleware.append(Middleware(APIKeyMiddleware, keys=list(api_keys), count=models.count))
    table = routes.table() + InfoRoutes(routes).table() + LlamaRoutes(routes).table()
    table += ExpertViewRoutes(routes).table() + PageRoutes().table()  # /experts; the chat page at /
    return Starlette(routes=table,
                     exception_handlers={HTTPException: routes.not_found, Exception: routes.server_error},
                     middleware=middleware, lifespan=lifespan)


def _cors(origins: tuple[str, ...]) -> Middleware:
    """Starlette's CORS middleware for ``origins`` (``*``, ``localhost`` or a list): any request header (an API key
    in ``Authorization``/``X-Api-Key`` included), llama-server's methods, no cookies (this API uses none)."""
    if origins == (LOCALHOST,):
        return Middleware(CORSMiddleware, allow_origin_regex=LOCAL_ORIGIN_RE, allow_methods=CORS_METHODS,
                          allow_headers=["*"])
    return Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=CORS_METHODS, allow_headers=["*"])


__all__ = ["create_app"]
