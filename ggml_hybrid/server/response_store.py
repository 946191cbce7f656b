"""The Responses API's stored responses (``store: true``): what ``GET /v1/responses/{id}`` answers and what
``previous_response_id`` continues, bounded in count and in bytes, the oldest first out.

Each entry holds the response object as answered and the conversation it ends (the messages the next turn starts
from, the instructions left out as OpenAI leaves them out). Its size is the length of both as JSON text; an entry larger
than the whole bound is not kept. An evicted id is as unknown as one never given.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024      # responses kept at most
MAX_BYTES = 64 << 20      # their JSON text at most (host memory: the experts' tier shares it)


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]        # the response object, as answered
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and the output
    size: int


class ResponseStore:
    """Responses by id, at most ``max_count`` of them and ``max_bytes`` of JSON text; the oldest leave first."""

    def __init__(self, max_count: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` under ``rid`` (evicting the oldest as the bounds require); False when it alone is over
        the byte bound (it is not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))  # ASCII-escaped: characters are bytes
        if size > self.max_bytes or self.max_count < 1:
            return False
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._bytes -= old.size
            while self._items and (len(self._items) >= self.max_count or self._bytes + size > self.max_bytes):
                _, gone = self._items.popitem(last=False)
                self._bytes -= gone.size
            self._items[rid] = Stored(response, conversation, size)
            self._bytes += size
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            gone = self._items.pop(rid, None)
            if gone is not None:
                self._bytes -= gone.size
        return gone is not None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes


__all__ = ["MAX_BYTES", "MAX_RESPONSES", "ResponseStore", "Stored"]
