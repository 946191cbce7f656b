"""The server's log: one line per cause, rate-limited, never a traceback per request or per ``accept()``.

A client can make the same thing fail thousands of times a second (idle connections exhausting the
descriptors make every ``accept()`` fail; a bug hit by every request). Each cause (a logger, its message
pattern and the exception type) is written at most once per :data:`EVERY` seconds, as one line without
its traceback; the next line of that cause says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import shorten

EVERY = 30.0  # seconds between two lines of one cause
LOGGER = "ggml_hybrid.server"


class _Limiter:
    def __init__(self, every: float = EVERY) -> None:
        self.every = every
        self._last: dict[tuple[str, ...], tuple[float, int]] = {}  # cause -> (last written, left out since)
        self._lock = threading.Lock()

    def admit(self, cause: tuple[str, ...]) -> int | None:
        """None to drop this line, else how many of its cause were dropped since the last one written."""
        now = time.monotonic()
        with self._lock:
            last, dropped = self._last.get(cause, (-1e18, 0))
            if now - last < self.every:
                self._last[cause] = (last, dropped + 1)
                return None
            if len(self._last) > 1000:  # bounded: causes come from a fixed set of places, but be safe
                self._last.clear()
            self._last[cause] = (now, 0)
            return dropped


_limiter = _Limiter()


class OncePerCause(logging.Filter):
    """A logging filter: a record passes once per cause per :data:`EVERY` seconds, as one line (the traceback
    folded into its last line: the exception's type and message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        cause = (record.name, str(record.msg)[:200], type(exc).__name__ if exc is not None else "")
        dropped = _limiter.admit(cause)
        if dropped is None:
            return False
        msg = record.getMessage()
        if exc is not None:
            msg = f"{msg}: {type(exc).__name__}: {exc}"
        if dropped:
            msg += f" ({dropped} more like this since the last one)"
        record.msg, record.args = shorten(" ".join(msg.split()), 1000), None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def install() -> None:
    """Rate-limit the loggers a hostile client can flood: asyncio's (``accept()`` failures), uvicorn's, ours."""
    f = OncePerCause()
    for name in ("asyncio", "uvicorn.error", LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(x, OncePerCause) for x in logger.filters):
            logger.addFilter(f)


def log_once(message: str, exc: BaseException | None = None) -> None:
    """An error line of the server's own (one per cause per :data:`EVERY` seconds)."""
    logger = logging.getLogger(LOGGER)
    if exc is not None:
        logger.error(message, exc_info=(type(exc), exc, exc.__traceback__))
    else:
        logger.error(message)


__all__ = ["EVERY", "OncePerCause", "install", "log_once", "shorten"]
