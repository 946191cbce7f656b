"""One generation answered in another API's shape (Anthropic's Messages API, OpenAI's Responses API): what such an
answer provides (:class:`Events` for a stream, :class:`Shape` for both kinds of answer) and the one loop that streams
a generation through its events (:func:`stream_events`).

The chat and completions endpoints stream choices (``Routes.stream``); these APIs stream one generation as typed
events: a start, the text as it comes (held where a tool call may begin, as chat's stream holds it), then the calls
and the end, or an error. The loop is the same for both; only the events differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio

from ..runtime.engine import Request
from . import anthropic
from .models import ServedModel
from .protocol import APIError, Generation
from .structured import failure
from .tools import Call, Reading, ToolFormat, ToolStream


class Events(Protocol):
    """One generation's events in another API's shape (:func:`stream_events` drives them)."""

    after_slot: bool  # start() once the request holds a slot (its prompt's reuse is known then)

    def start(self, r: Request) -> list[dict[str, str]]: ...
    def text(self, piece: str) -> list[dict[str, str]]: ...
    def end(self, calls: list[Call], finish: str | None, r: Request) -> list[dict[str, str]]: ...
    def error(self, e: APIError) -> list[dict[str, str]]: ...


class Shape(Protocol):
    """One generation answered in another API's shape: the object of a plain answer (``read``: its content, calls and
    finish reason), the events of a stream."""

    def answer(self, r: Request, read: Reading) -> dict[str, Any]: ...
    def events(self, r: Request) -> Events: ...


def prompt_use(sm: ServedModel, r: Request) -> anthropic.PromptUse:
    """How ``r``'s prompt used the slot's cells (Anthropic's cache figures; the Responses API's ``cached_tokens``
    and ``cache_write_tokens``): reused, and newly left for later requests (up to the last fixed cut:
    :class:`~ggml_hybrid.runtime.prompt_cache.PromptCache`)."""
    assert sm.engine is not None
    kept = sm.engine.cache.last_fixed_cut(r.prompt_tokens) if r.cache_prompt else 0
    return anthropic.PromptUse(r.prompt_tokens, r.n_reused, max(0, kept - r.n_reused))


class MessagesEvents:
    """Anthropic's MessageEvents as :class:`Events` (with the prompt's reuse in Anthropic's terms)."""

    after_slot = True

    def __init__(self, ev: anthropic.MessageEvents, sm: ServedModel) -> None:
        self.ev, self.sm = ev, sm

    def start(self, r: Request) -> list[dict[str, str]]:
        return self.ev.start(prompt_use(self.sm, r))

    def text(self, piece: str) -> list[dict[str, str]]:
        return self.ev.text(piece)

    def end(self, calls: list[Call], finish: str | None, r: Request) -> list[dict[str, str]]:
        return self.ev.end(calls, finish, r.stop_string, prompt_use(self.sm, r), r.completion_tokens)

    def error(self, e: APIError) -> list[dict[str, str]]:
        return [anthropic.event("error", error=anthropic.error_body(e)["error"])]


def tool_stream(fmt: ToolFormat, g: Generation) -> ToolStream | None:
    """A stream's tool-call parser in ``fmt`` (None without tools)."""
    return ToolStream(fmt, g.tools.tools) if g.tools is not None and g.tools.choice != "none" else None


async def _slot_taken(r: Request, wake: asyncio.Event) -> None:
    while r.started_at is None and not r.done.is_set():
        wake.clear()
        if r.started_at is None and not r.done.is_set():
            await wake.wait()  # the engine notifies after each prompt step, and at the end


async def _pieces(r: Request, wake: asyncio.Event) -> AsyncIterator[str]:
    """``r``'s text pieces as they become final, to its end."""
    while True:
        wake.clear()
        done = r.done.is_set()  # before take(): every piece of a finished request is posted
        for piece in r.take():
            yield piece
        if done:
            return
        await wake.wait()


async def stream_events(r: Request, wake: asyncio.Event, ev: Events, calls: ToolStream | None,
                        grammar_param: str | None, limiter: anyio.CapacityLimiter) -> AsyncIterator[dict[str, str]]:
    """The events of one generation (``calls``: its tool-call parser, None without tools, whose last reading runs off
    the event loop under ``limiter``): ``ev.start()`` (once the request holds a slot when ``ev.after_slot``), its text
    as it comes, then the calls and the end, or an error (its grammar's fault: a 400 naming ``grammar_param``). The
    request is cancelled when the stream ends early (the client went away)."""
    try:
        if ev.after_slot:
            await _slot_taken(r, wake)
        for e in ev.start(r):
            yield e
        async for piece in _pieces(r, wake):
            for e in ev.text(piece if calls is None else calls.push(piece)):
                yield e
        if r.finish_reason not in ("stop", "length"):
            for e in ev.error(failure(r, grammar_param)):
                yield e
            return
        tail, found, finish = ("", [], r.finish_reason) if calls is None else \
            await anyio.to_thread.run_sync(calls.end, r.finish_reason, limiter=limiter)  # the text may be long
        for e in [*ev.text(tail), *ev.end(found, finish, r)]:
            yield e
    finally:
        if not r.done.is_set():
            r.cancel()


__all__ = ["Events", "MessagesEvents", "Shape", "prompt_use", "stream_events", "tool_stream"]
