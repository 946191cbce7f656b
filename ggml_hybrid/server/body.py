"""A request's body, read whole within a deadline and bounded before it is parsed (parsing holds the event loop)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request as HTTPRequest

from .protocol import MAX_BODY_BYTES, APIError, parse_json

BODY_SECONDS = 30.0  # a request body not received whole within this is refused (408): no drip-fed bodies


def _too_big(limit: int, why: str = "") -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes{why}.")


async def read_json(request: HTTPRequest, limit: int = MAX_BODY_BYTES, why: str = "") -> dict[str, Any]:
    """The body as a JSON object. One of more than ``limit`` bytes (``why``: the route's reason) is a 413, never
    parsed: parsing holds the interpreter, and with it the event loop, for the whole body. Up to
    :data:`MAX_BODY_BYTES` such a body is still read to its end (a client that sends it whole before reading the
    answer would see its connection reset); one announced beyond that is refused at once."""
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
    return parse_json(b"".join(chunks))


__all__ = ["BODY_SECONDS", "read_json"]
