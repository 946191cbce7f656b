"""Connections a client cannot pin: a time limit on request headers, a bound on open connections.

uvicorn closes a keep-alive connection 5 s after its last response, but a connection that never sends
(or drip-feeds) its request headers stays open for good: a few hundred of them exhaust the process's
descriptors, every ``accept()`` fails (each failure a traceback in the log) and ``/health`` is
unreachable. :func:`protocol_class` gives uvicorn's h11 protocol with:

- a deadline for each request's headers (:data:`HEADER_SECONDS` from the connection, or from the end of
  the previous response): past it the connection is closed;
- a bound on open connections (:func:`connection_limit`, below the descriptor limit): a new connection
  over it closes the oldest connection still waiting for its headers (idle ones go first, so a health
  check always gets in), or, when every connection is busy with a request, the new one.

- a reply for a client that half-closes its socket after a whole request (``shutdown(SHUT_WR)``, as
  ``nc -N`` does): asyncio's default closes the connection on end of input, so such a client got nothing.
  The write side now stays open until the response is sent, then the connection closes. A client that
  closed both ways looks the same until something is written to it; while its response has not started,
  a ``100 Continue`` line goes out every :data:`PROBE_SECONDS` (HTTP/1.1 clients must skip 1xx replies)
  and the write after the reset a gone client answers with fails, which ends its generation as for any
  client that leaves (a counted 499). A streamed response's own events do the same.

Request bodies have their own deadline in the app (``body.BODY_SECONDS``, a 408).
"""

from __future__ import annotations

import asyncio
import resource
import time
from typing import Any

from .logs import log_once

HEADER_SECONDS = 10.0  # a request's headers must be complete this long after the connection (or last response)
PROBE_SECONDS = 0.5    # after a half-close, how often a reply not yet started checks that the client is still there
FD_RESERVE = 64        # descriptors kept for what is not a connection (model files, pipes, renderers, logs)


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (at most 65536); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else 65536


def connection_limit(fd_limit: int) -> int:
    """Connections held open at most: what the descriptor limit leaves after :data:`FD_RESERVE`."""
    return max(8, min(fd_limit - FD_RESERVE, 10_000))


def protocol_class(max_connections: int, header_seconds: float = HEADER_SECONDS,
                   probe_seconds: float = PROBE_SECONDS) -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a header deadline and a connection bound (module docs)."""

        def connection_made(self, transport: Any) -> None:
            self._header_timer: asyncio.TimerHandle | None = None
            self._probe_timer: asyncio.TimerHandle | None = None
            self._waiting_since = time.monotonic()
            super().connection_made(transport)
            self._arm_header_timer()
            if len(self.connections) > max_connections:
                self._make_room()

        def _make_room(self) -> None:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                    and c._header_timer is not None and not c.transport.is_closing()]
            victim = min(idle, key=lambda c: c._waiting_since) if idle else self
            log_once(f"more than {max_connections} connections: the oldest one still waiting for its request "
                     "headers is closed" if idle else
                     f"more than {max_connections} connections, all busy: a new one is closed")
            victim._close_now()

        def _close_now(self) -> None:
            self._cancel_header_timer()
            if not self.transport.is_closing():
                self.transport.close()

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._waiting_since = time.monotonic()
                self._header_timer = self.loop.call_later(header_seconds, self._headers_too_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log_once(f"a connection sent no complete request headers within {header_seconds:g} s: closed")
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # uvicorn's keep-alive timer closes an idle connection; one that starts a request and stalls
            # in its headers is this deadline's
            if not self.transport.is_closing():
                self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self._header_timer is None:
                self._arm_header_timer()
            super().data_received(data)

        def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio: True keeps the transport open
            cycle = self.cycle
            if cycle is None or cycle.response_complete or self.conn.their_state is not h11.DONE:
                return None  # idle, or a request cut short (a counted 499): the connection ends here
            # a half-close after a whole request: the reply still goes out, then the connection closes
            cycle.keep_alive = False
            if self._probe_timer is None:
                self._probe_timer = self.loop.call_later(probe_seconds, self._probe_client)
            return True

        def _probe_client(self) -> None:
            self._probe_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_started or cycle.disconnected or self.transport.is_closing():
                return  # a started response's own writes find a client that has gone
            if self.scope.get("http_version") == "1.1":  # HTTP/1.0 clients know no 1xx replies
                self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                             reason=b"Continue")))
            self._probe_timer = self.loop.call_later(probe_seconds, self._probe_client)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._probe_timer is not None:
                self._probe_timer.cancel()
                self._probe_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


__all__ = ["FD_RESERVE", "HEADER_SECONDS", "PROBE_SECONDS", "connection_limit", "protocol_class", "raise_fd_limit"]
