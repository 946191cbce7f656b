"""Ownership of native objects: explicit close, context managers, a finalizer as backstop."""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..errors import ClosedError
from . import CData

_M = TypeVar("_M", bound="Managed")

_live: collections.Counter[str] = collections.Counter()
_live_lock = threading.Lock()


def live_objects() -> dict[str, int]:
    """Native objects not yet freed, by kind (tests use it to find leaks)."""
    with _live_lock:
        return {k: v for k, v in _live.items() if v}


class _Computing(Protocol):
    def blocks_close(self, obj: Managed) -> str | None: ...


# schedulers inside a compute, on any thread: what they use must not be freed under them
_computing: list[_Computing] = []
_computing_lock = threading.Lock()


def enter_compute(who: _Computing) -> None:
    with _computing_lock:
        _computing.append(who)


def leave_compute(who: _Computing) -> None:
    with _computing_lock:
        _computing.remove(who)


def check_closable(obj: Managed) -> None:
    """Refuse to free ``obj`` while a scheduler computes with it (a region executor closing its own
    scheduler or weights would free memory GGML is about to read)."""
    if not _computing:
        return
    # checked under the lock: a scheduler that leaves its compute meanwhile could close the graph being read
    with _computing_lock:
        for s in _computing:
            reason = s.blocks_close(obj)
            if reason is not None:
                raise ClosedError(f"{type(obj).__name__}.close(): {reason}")


def _release(kind: str, free: Callable[[CData], object], ptr: CData) -> None:
    free(ptr)
    with _live_lock:
        _live[kind] -= 1


class Managed:
    """An owned native pointer.

    ``close()`` frees it and is safe to call twice; using the object afterwards
    raises :class:`ClosedError`. Subclasses keep strong references to the
    objects their pointer depends on (a tensor to its context, a buffer to its
    backend), so freeing order is always child before parent.
    """

    _kind = "object"

    def __init__(self, ptr: CData, free: Callable[[CData], object], owned: bool = True) -> None:
        self._ptr: CData | None = ptr
        self._finalizer: weakref.finalize[..., object] | None = None
        if owned:
            with _live_lock:
                _live[self._kind] += 1
            # the finalizer must not reference self, or self would never be collected
            self._finalizer = weakref.finalize(self, _release, self._kind, free, ptr)

    @property
    def ptr(self) -> CData:
        if self._ptr is None:
            raise ClosedError(f"{type(self).__name__} was used after close()")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def close(self) -> None:
        if self._ptr is None:
            return
        check_closable(self)
        self._ptr = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self: _M) -> _M:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
