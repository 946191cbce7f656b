"""A request's body, read whole within a deadline and bounded before it is parsed (parsing holds the interpreter)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import anyio
from starlette.requests import Request as HTTPRequest

from .protocol import MAX_BODY_BYTES, APIError, parse_json

BODY_SECONDS = 30.0  # a request body not received whole within this is refused (408): no drip-fed bodies
INLINE_BYTES = 64 << 10  # a body up to this is parsed on the event loop (a few milliseconds at most); larger: a thread


def _too_big(limit: int, why: str = "") -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes{why}.")


async def read_json(request: HTTPRequest, parser: anyio.CapacityLimiter, limit: int = MAX_BODY_BYTES,
                    why: str = "") -> dict[str, Any]:
    """The body as a JSON object. One of more than ``limit`` bytes (``why``: the route's reason) is a 413, never
    parsed: parsing holds the interpreter, and with it the event loop, for the whole body. Up to
    :data:`MAX_BODY_BYTES` such a body is still read to its end (a client that sends it whole before reading the
    answer would see its connection reset); one announced beyond that is refused at once.

    A body over :data:`INLINE_BYTES` is parsed on a thread, one at a time (``parser``: the server's limiter), with
    the garbage collector paused (:func:`_parse_large`). The parse still holds the interpreter while it runs, but the
    loop answers between two parses, where bodies parsed on the loop ran back to back (all those completed in one turn
    of the loop) before it looked at its sockets again (docs/reliability.md has the figures)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise _too_big(MAX_BODY_BYTES)
    chunks: list[bytes] = []
    seen = 0

    async def receive() -> None:
        nonlocal seen
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > MAX_BODY_BYTES:
                raise _too_big(MAX_BODY_BYTES)
            if seen <= limit:
                chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {BODY_SECONDS:g} seconds.",
                       code="request_timeout") from None
    if seen > limit:
        raise _too_big(limit, why)
    raw = b"".join(chunks)
    if len(raw) <= INLINE_BYTES:
        return parse_json(raw)
    return await anyio.to_thread.run_sync(_parse_large, raw, limiter=parser)


def _parse_large(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed with the cyclic garbage collector paused: a body of millions of small arrays or objects
    otherwise sets off a collection every few hundred of them, each walking all those already built (the parse took
    three to four times as long, and held the event loop as long). Nothing a parse builds is garbage until it ends."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return parse_json(raw)
    finally:
        if paused:
            gc.enable()


__all__ = ["BODY_SECONDS", "INLINE_BYTES", "read_json"]
