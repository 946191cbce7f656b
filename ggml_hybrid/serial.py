"""One call at a time per session: other threads wait their turn, a call from inside the call is refused.

GGML's scheduler, a KV cache and an expert cache are single-threaded state: two threads evaluating one
model at once abort inside GGML. Sessions therefore serialize their calls; the server's request threads
take turns through this. A call made from inside the running one (a region executor or eval callback
evaluating its own model) would deadlock on a plain lock, so it is refused with a clear error instead.
"""

from __future__ import annotations

import threading

from .errors import BackendError


class Serial:
    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._owner: int | None = None

    def turn(self, op: str) -> _Turn:
        """``with serial.turn("eval"): ...``: the body runs alone among this session's calls."""
        return _Turn(self, op)


class _Turn:
    """One call's turn (a plain context manager: a decode step takes one, and a generator-based one costs
    that step several microseconds more, run cold after each compute)."""

    __slots__ = ("_serial", "_op")

    def __init__(self, serial: Serial, op: str) -> None:
        self._serial, self._op = serial, op

    def __enter__(self) -> None:
        s = self._serial
        me = threading.get_ident()
        if s._owner == me:
            raise BackendError(f"{s._what}.{self._op}: called from inside its own {self._op} (a region executor "
                               "or eval callback using the session it runs in)")
        s._lock.acquire()
        s._owner = me

    def __exit__(self, *exc: object) -> None:
        s = self._serial
        s._owner = None
        s._lock.release()


__all__ = ["Serial"]
