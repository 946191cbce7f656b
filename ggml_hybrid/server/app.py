"""The OpenAI-compatible HTTP API over the served models (Starlette; streams as server-sent events).

Routes (:mod:`.routes`): ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed with ``stream: true``), ``POST /v1/messages`` and ``GET /metrics``;
:mod:`.responses_routes`: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``; :mod:`.info`:
``POST /tokenize``, ``POST /detokenize``, ``GET /props``, ``GET /slots``, ``POST /v1/embeddings``. With API keys
(:mod:`.auth`) every route but ``/health`` needs one. Every error is OpenAI's error object with a 4xx/5xx status;
nothing a client sends takes the server down. A generation is one engine request per choice; the handler waits on
them without blocking the event loop (the engine thread wakes it), and a client that goes away cancels them, which
frees their slots before the engine's next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from .auth import APIKeyMiddleware
from .info import InfoRoutes
from .models import ModelSet
from .response_store import ResponseStore
from .responses_routes import ResponsesRoutes
from .routes import Routes


def create_app(models: ModelSet, drain_seconds: float = 30.0, lifespan: Any = None,
               api_keys: Sequence[str] = (), response_store: ResponseStore | None = None) -> Starlette:
    """The app over ``models``; ``lifespan`` (an async context manager factory) runs around serving; with
    ``api_keys``, every route but ``/health`` needs one of them; ``response_store``: where the Responses API keeps
    its responses (a default-sized store when None)."""
    routes = Routes(models, drain_seconds)
    middleware = [Middleware(APIKeyMiddleware, keys=list(api_keys), count=models.count)] if api_keys else []
    return Starlette(routes=routes.table() + InfoRoutes(routes).table() +
                     ResponsesRoutes(routes, response_store).table(),
                     exception_handlers={HTTPException: routes.not_found, Exception: routes.server_error},
                     middleware=middleware, lifespan=lifespan)


__all__ = ["create_app"]
