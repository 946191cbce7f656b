"""Exceptions of Python callbacks that C calls (region executors, the eval callback), carried back to Python.

A callback catches its own exceptions and hands them to the scheduler, which re-raises them once the C
call returns. But an asynchronous exception (Ctrl-C's KeyboardInterrupt) can arrive at the callback's
first or last bytecode, outside its ``try``: cffi then returns the callback's declared error value
(failure, never "done") and calls :func:`escaped` with the exception, which keeps it here, per thread,
for the scheduler to re-raise. Without this, cffi would print "Exception ignored" and return 0, which
the scheduler reads as success: the layer output would never be written.
"""

from __future__ import annotations

import threading
from types import TracebackType

_local = threading.local()


def escaped(exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
    """cffi's ``onerror`` hook: keep the first exception that escaped a callback on this thread."""
    if exc is not None and getattr(_local, "error", None) is None:
        _local.error = exc


def take_escaped() -> BaseException | None:
    """The exception that escaped a callback on this thread since the last call, if any (and forget it)."""
    err = getattr(_local, "error", None)
    _local.error = None
    return err


__all__ = ["escaped", "take_escaped"]
