"""``logprobs`` in OpenAI's two shapes, from the engine's :class:`~ggml_hybrid.runtime.logprobs.TokenLogprob` list.

Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}], "refusal": null}``. Completions (``logprobs: k``): ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, offsets in characters of the
completion's text. A token's text is its bytes as UTF-8 (a token holding part of a character shows
U+FFFD; ``bytes`` has the exact bytes).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from ..runtime.logprobs import TokenLogprob

TokenBytes = Callable[[int], bytes]


def _one(token_bytes: TokenBytes, tid: int, lp: float) -> dict[str, Any]:
    b = token_bytes(tid)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}


def chat_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes, stream: bool = False) -> dict[str, Any]:
    """Chat's ``choices[i].logprobs`` (of a chunk's tokens when ``stream``)."""
    content = [{**_one(token_bytes, e.token, e.logprob),
                "top_logprobs": [_one(token_bytes, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content} if stream else {"content": content, "refusal": None}


class CompletionLogprobs:
    """Completions' ``choices[i].logprobs``, chunk after chunk: offsets count on from the previous chunk's."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def __call__(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for e in entries:
            b = self.token_bytes(e.token)
            tokens.append(b.decode("utf-8", "replace"))
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(b))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [self._top(e) for e in entries], "text_offset": offsets}

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        """``{text: logprob}``, likeliest first; tokens of one text (pieces of characters) keep the likeliest's."""
        out: dict[str, float] = {}
        for t, lp in e.top:
            out.setdefault(self.token_bytes(t).decode("utf-8", "replace"), lp)
        return out


def llama_probs(entries: list[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` (``n_probs``): per token ``{"id", "token", "bytes", "logprob",
    "top_logprobs": [{"id", "token", "bytes", "logprob"}]}``."""
    return [{"id": e.token, **_one(token_bytes, e.token, e.logprob),
             "top_logprobs": [{"id": t, **_one(token_bytes, t, lp)} for t, lp in e.top]} for e in entries]


__all__ = ["CompletionLogprobs", "chat_logprobs", "llama_probs"]
