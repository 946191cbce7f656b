"""Graphs kept by shape: built once, the least recently used dropped first, their memory reused.

A session builds one graph per shape it meets (a prompt length, a token count). Keeping them all would
grow memory with every new shape; freeing and rebuilding them would churn the allocator, which on a long
run fragments the heap until the process's memory creeps up. So a cache holds at most ``capacity``
graphs, and builds each in one of ``capacity`` arenas allocated once: a steady run allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

from ..checks import check_int
from .backend import Backend, Buffer
from .context import Arena, Context


class _Closable(Protocol):
    def close(self) -> None: ...


E = TypeVar("E", bound=_Closable)


class GraphCache(Generic[E]):
    """``get(key, build)``: the entry of ``key``, built by ``build(arena)`` on a miss.

    ``on_evict(key, entry)`` runs before an entry is closed to make room (e.g. to forget regions
    registered for its graph). ``arena_size`` bounds the context memory of one entry.
    """

    def __init__(self, capacity: int, arena_size: int,
                 on_evict: Callable[[Hashable, E], None] | None = None) -> None:
        self.capacity = check_int(capacity, "GraphCache: capacity", 1)
        self.arena_size = check_int(arena_size, "GraphCache: arena_size", 1)
        self._on_evict = on_evict
        self._entries: dict[Hashable, E] = {}
        self._arenas: list[Arena] = []
        self.builds = 0  # entries built so far (a warm, steady run stops counting)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def values(self) -> list[E]:
        return list(self._entries.values())

    def get(self, key: Hashable, build: Callable[[Arena], E]) -> E:
        entry = self._entries.pop(key, None)
        if entry is None:
            while len(self._entries) >= self.capacity:
                self._evict(next(iter(self._entries)))
            entry = build(self._free_arena())
            self.builds += 1
        self._entries[key] = entry  # most recently used last
        return entry

    def _free_arena(self) -> Arena:
        for a in self._arenas:
            if not a.in_use:
                return a
        # an entry's context may outlive its eviction (numpy views into it): then, and during warm-up,
        # one more arena
        arena = Arena(self.arena_size)
        self._arenas.append(arena)
        return arena

    def _evict(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        if self._on_evict is not None:
            self._on_evict(key, entry)
        entry.close()

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)


class SharedBuffer:
    """One compute buffer for graphs that never run at the same time (the entries of a GraphCache).

    Each graph's tensors are laid out from the buffer's start, overlapping the other graphs' tensors: a
    graph sets all its inputs before every compute, so nothing of another graph's run is ever read. The
    buffer grows (to a power of two) when a larger graph arrives; the graphs placed in the old one must
    then be dropped (:meth:`place` says so), and the old memory goes with their contexts.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.buffer: Buffer | None = None

    @property
    def size(self) -> int:
        return self.buffer.size if self.buffer is not None else 0

    def place(self, ctx: Context) -> bool:
        """Give ``ctx``'s tensors memory at the start of the buffer; True when the buffer had to grow."""
        need = ctx.bytes_needed(self.backend)
        grew = need > self.size
        if grew:
            self.buffer = self.backend.alloc_buffer(1 << max(need - 1, 1).bit_length())
            self.buffer.set_usage("compute")
        assert self.buffer is not None
        ctx.allocate_in(self.buffer)
        return grew

    def close(self) -> None:
        # contexts placed in the buffer keep it alive until they close (Buffer.place): dropping our
        # reference is enough, and safe while they still run
        self.buffer = None


__all__ = ["GraphCache", "SharedBuffer"]
