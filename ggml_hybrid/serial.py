"""One call at a time per session: other threads wait their turn, a call from inside the call is refused.

GGML's scheduler, a KV cache and an expert cache are single-threaded state: two threads evaluating one
model at once abort inside GGML. Sessions therefore serialize their calls; the server's request threads
take turns through this. A call made from inside the running one (a region executor or eval callback
evaluating its own model) would deadlock on a plain lock, so it is refused with a clear error instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import BackendError


class Serial:
    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._owner: int | None = None

    @contextmanager
    def turn(self, op: str) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:
            raise BackendError(f"{self._what}.{op}: called from inside its own {op} (a region executor or eval "
                               "callback using the session it runs in)")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


__all__ = ["Serial"]
