"""What the draft head holds per sequence: its own KV cache, and the target's hidden rows it has not read yet.

The head's input at position p is the token x_p and the target's hidden state h_{p-1} (:mod:`ggml_hybrid.model.mtp`).
The target computes h for every token it evaluates; the head writes its KV cell of position p from them (a *fill*,
llama.cpp's ``common_speculative_impl_draft_mtp::process``). Fills are deferred: the pairs (x_p, h_{p-1}) wait here
until the head drafts next, and then all of them run as one batch. While drafting is paused (the backoff of
``draft_backoff``), the head therefore costs nothing but these rows, and a backoff's probe drafts without filling them
(the cells of the waiting positions hidden from its attention: :meth:`Session.draft_step`'s ``holes``).

Per sequence slot: ``kv.used[seq]`` positions of the head's cache are written (``filled``), the pairs of the
positions after them wait in order, and ``last_h`` is the target's hidden state at its last position (zeros before
the first token, as llama.cpp's ``pending_h`` starts). :meth:`record` follows the target; :meth:`truncate` follows a
truncation (a hidden row the head has already consumed cannot come back: the next pair then gets zeros, which
changes drafts, never the target's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model.kv_cache import KVCache


class DraftHead:
    def __init__(self, kv: KVCache, n_embd: int) -> None:
        self.kv = kv
        self.n_embd = n_embd
        n = kv.n_seq
        self.tokens: list[list[int]] = [[] for _ in range(n)]          # x_p of the positions waiting, in order
        self.hidden: list[list[np.ndarray]] = [[] for _ in range(n)]   # and h_{p-1} of each
        self.last_h = [np.zeros(n_embd, np.float32) for _ in range(n)]
        self.n = [0] * n  # positions of the target the head knows of (= the target's, kept in step)

    def filled(self, seq: int) -> int:
        return self.kv.used[seq]

    def waiting(self, seq: int) -> int:
        """Positions whose pairs wait for a fill."""
        return len(self.tokens[seq])

    def record(self, seq: int, tokens: Sequence[int] | np.ndarray, hidden: np.ndarray) -> None:
        """The target appended ``tokens`` to sequence ``seq``; ``hidden`` [len(tokens), n_embd] are its states."""
        prev = self.last_h[seq]
        for t, h in zip(tokens, hidden):
            self.tokens[seq].append(int(t))
            self.hidden[seq].append(prev)
            prev = h
        self.last_h[seq] = np.array(prev, np.float32, copy=True)
        self.n[seq] += len(tokens)

    def target_hidden(self, seq: int) -> np.ndarray:
        """The target's hidden states [waiting, n_embd] of the positions waiting for a fill, in order."""
        rows = self.hidden[seq][1:] + [self.last_h[seq]] if self.tokens[seq] else []
        return np.stack(rows).astype(np.float32, copy=False) if rows else np.zeros((0, self.n_embd), np.float32)

    def take(self, seq: int) -> tuple[list[int], np.ndarray]:
        """The waiting pairs of ``seq`` (tokens, hidden rows [n, n_embd]), removed: the caller fills them now."""
        toks, rows = self.tokens[seq], self.hidden[seq]
        self.tokens[seq], self.hidden[seq] = [], []
        return toks, (np.stack(rows).astype(np.float32, copy=False) if rows
                      else np.zeros((0, self.n_embd), np.float32))

    def put_back(self, seq: int, tokens: list[int], rows: np.ndarray) -> None:
        """A fill of :meth:`take`'s pairs failed: they wait again, in front."""
        self.tokens[seq][:0] = tokens
        self.hidden[seq][:0] = list(rows)

    def truncate(self, seq: int, n_keep: int) -> None:
        """The target kept only its first ``n_keep`` positions of ``seq``."""
        if n_keep >= self.n[seq]:
            return
        filled = self.kv.used[seq]
        if n_keep >= filled:
            keep = n_keep - filled
            # the pair of position n_keep held h_{n_keep - 1}: the state the next token pairs with
            self.last_h[seq] = self.hidden[seq][keep] if keep < len(self.hidden[seq]) else self.last_h[seq]
            del self.tokens[seq][keep:], self.hidden[seq][keep:]
        else:
            self.kv.used[seq] = n_keep
            self.tokens[seq], self.hidden[seq] = [], []
            self.last_h[seq] = np.zeros(self.n_embd, np.float32)  # consumed: not kept
        self.n[seq] = n_keep

    def clear(self, seq: int | None = None) -> None:
        for s in range(len(self.n)) if seq is None else (seq,):
            self.tokens[s], self.hidden[s] = [], []
            self.last_h[s] = np.zeros(self.n_embd, np.float32)
            self.n[s] = 0
        self.kv.clear(seq)

    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s state into the empty slot ``dst`` (its cells copied), then ``src`` cleared."""
        self.kv.move(src, dst)
        self.tokens[dst], self.hidden[dst] = self.tokens[src], self.hidden[src]
        self.last_h[dst], self.n[dst] = self.last_h[src], self.n[src]
        self.tokens[src], self.hidden[src] = [], []
        self.last_h[src] = np.zeros(self.n_embd, np.float32)
        self.n[src] = 0

    def close(self) -> None:
        self.kv.close()


__all__ = ["DraftHead"]
