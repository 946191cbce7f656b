"""API keys: every endpoint but ``/health`` and the chat page's static files (:mod:`.web`) answers only requests
that carry one (``serve --api-key``).

A request gives its key as OpenAI's clients send it, ``Authorization: Bearer KEY`` (or ``X-Api-Key: KEY``,
as Anthropic's clients and llama.cpp's server do). Each given key is compared with every configured one in
constant time (:func:`hmac.compare_digest`, no early exit: the time taken tells nothing of how much of a key
matched, nor which). Without a valid key the answer is a 401, sent before the body is read: in OpenAI's error
shape (type ``authentication_error``, as llama-server's, and code ``invalid_api_key``), or Anthropic's
(``authentication_error``) on Anthropic's paths and to Anthropic's clients. A browser's CORS preflight
(``OPTIONS``) carries no key by design: it passes (the CORS middleware, or a 405, answers it; it reaches no
endpoint).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import ConfigError
from . import anthropic
from .config import read_bounded
from .protocol import APIError
from .web import PAGE_PATHS

OPEN_PATHS = frozenset({"/health"}) | PAGE_PATHS  # a load balancer's probe carries no key, nor a browser's first visit
MAX_KEY_FILE_BYTES = 1 << 20

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


def check_keys(keys: Iterable[str], where: str) -> list[str]:
    """The keys as given, each a non-empty printable ASCII string without spaces (what an HTTP header carries)."""
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k or not k.isascii() or not k.isprintable() or any(c.isspace() for c in k):
            raise ConfigError(f"{where}: API key {i + 1} must be non-empty printable ASCII without spaces")
        out.append(k)
    return out


def read_key_file(path: str) -> list[str]:
    """The keys of ``path``: one a line; blank lines and lines starting with ``#`` are skipped."""
    try:
        text = read_bounded(path, "API key file", MAX_KEY_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"API key file {path!r} is not UTF-8 text") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError(f"API key file {path!r} holds no key (one a line; '#' starts a comment line)")
    return check_keys(keys, f"API key file {path!r}")


def key_matches(given: str, keys: list[bytes]) -> bool:
    """Whether ``given`` is one of ``keys``, every one compared in constant time."""
    g = given.encode("utf-8", "surrogateescape")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(g, k)
    return ok


def _given_key(scope: Scope) -> str | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for name, value in headers:
        if name == b"authorization":
            v = value.decode("latin-1").strip()
            if v[:7].lower() == "bearer ":
                return v[7:].strip()
        elif name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


class APIKeyMiddleware:
    """ASGI middleware in front of the app: a request to any path but :data:`OPEN_PATHS` needs one of ``keys``.
    ``count(path, status)`` records the refusals (``/metrics``' ``http_requests``)."""

    def __init__(self, app: Callable[..., Any], keys: list[str], count: Callable[[str, int], object]) -> None:
        self.app = app
        self.keys = [k.encode("utf-8") for k in keys]
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = _given_key(scope)
        if given is not None and key_matches(given, self.keys):
            await self.app(scope, receive, send)
            return
        msg = ("You didn't provide an API key: give it as 'Authorization: Bearer KEY'." if given is None else
               "Incorrect API key provided.")
        e = APIError(401, msg, code="invalid_api_key", kind="authentication_error")
        path = str(scope.get("path", ""))
        body = json.dumps(anthropic.error_body(e) if anthropic.owns(path, scope.get("headers", [])) else
                          e.body()).encode()
        self.count("unauthorized", 401)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="ggml-hybrid"')]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["APIKeyMiddleware", "OPEN_PATHS", "check_keys", "key_matches", "read_key_file"]
