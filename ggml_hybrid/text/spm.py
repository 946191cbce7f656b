"""SentencePiece-style tokenization (``tokenizer.ggml.model = "llama"``) as llama.cpp does it.

llama.cpp does not run SentencePiece: it greedily merges adjacent symbols,
always the pair whose merged text is the vocabulary token with the highest score
(the leftmost pair among equal scores), starting from one symbol per UTF-8
character; a symbol that ends up outside the vocabulary is spelled with byte
tokens (``<0xXX>``). Before that, user-defined tokens are cut out of the text
(with ``parse_special=false`` only those), and every remaining piece of text gets
a leading space (``add_space_prefix``) and its spaces written as "▁".

That is implemented here rather than through a library, because none gives
llama.cpp's ids in every case: ``sentencepiece`` itself merges only
normal/user-defined pieces and adds the leading space once per text (so it differs
as soon as a text holds a user-defined token), and a ``tokenizers`` BPE built from
the scores falls back to bytes for a character that is not a token even when it
could merge with its neighbour into one, and orders equal-score merges by rank
rather than by position. The tests compare this encoder with llama.cpp's ids and,
on vocabularies where they agree, with such a ``tokenizers`` BPE.
"""

from __future__ import annotations

import codecs
import heapq
from collections.abc import Iterable, Sequence
from typing import SupportsInt

from ..errors import ModelFileError
from ..gguf.store import GGUFStore
from .vocab import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    TextStream,
    check_add_bos,
    check_ids,
    check_text,
    check_token,
    special_ids,
    token_attributes,
    token_list,
    token_types,
)

_SPACE = "\u2581".encode()  # how SentencePiece writes a space
# bytes of a UTF-8 sequence from its first byte's high nibble (llama.cpp's unicode_len_utf8; invalid: 1)
_SEQ_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


class SPMTokenizer:
    """Text to token ids and back for a SentencePiece vocabulary, as llama.cpp does."""

    def __init__(self, tokens: list[str], scores: Sequence[float] | None = None,
                 token_types_: Sequence[int] | None = None, bos_id: int | None = 1, eos_id: int | None = 2,
                 add_bos: bool = True, add_eos: bool = False, add_space_prefix: bool = True, source: str = "vocab",
                 eot_id: int | None = None, eom_id: int | None = None):
        n = len(tokens)
        if not all(isinstance(t, str) for t in tokens):
            raise ModelFileError(f"{source}: every token must be a string")
        scores = [0.0] * n if scores is None else [float(x) for x in scores]
        types = [TOKEN_TYPE_NORMAL] * n if token_types_ is None else list(token_types_)
        if len(scores) < n or len(types) < n:
            raise ModelFileError(f"{source}: {len(scores)} scores and {len(types)} token types for {n} tokens")
        # llama.cpp ignores a special id outside the vocabulary (with a warning)
        bos_id, eos_id, eot_id, eom_id = (i if i is not None and 0 <= i < n else None
                                          for i in (bos_id, eos_id, eot_id, eom_id))
        self.tokens, self.scores = list(tokens), scores[:n]
        self.types, self.eog_ids = token_attributes(tokens, types[:n], (eos_id, eot_id, eom_id))
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = bos_id, eos_id, add_bos, add_eos
        self.add_space_prefix = add_space_prefix
        self._bytes = [t.encode() for t in tokens]
        self._id = {b: i for i, b in enumerate(self._bytes)}
        if len(self._id) != n:
            dup = next(t for i, t in enumerate(tokens) if self._id[self._bytes[i]] != i)
            raise ModelFileError(f"{source}: token {dup!r} appears twice in tokenizer.ggml.tokens (llama.cpp aborts "
                                 "on duplicate tokens)")
        self.control = {i for i, t in enumerate(self.types) if t == TOKEN_TYPE_CONTROL}
        # only user-defined tokens are cut out of plain text (parse_special=false); longest first
        self._user = sorted((i for i, t in enumerate(self.types) if t == TOKEN_TYPE_USER_DEFINED and self._bytes[i]),
                            key=lambda i: -len(self._bytes[i]))
        # with parse_special, control and unknown tokens too
        kinds = (TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        self._special = sorted((i for i, t in enumerate(self.types) if t in kinds and self._bytes[i]),
                               key=lambda i: -len(self._bytes[i]))

    @classmethod
    def from_gguf(cls, store: GGUFStore) -> SPMTokenizer:
        scores = store.meta("tokenizer.ggml.scores", [], kind="numbers")
        if not isinstance(scores, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                   for x in scores):
            raise ModelFileError(f"{store.path!r}: tokenizer.ggml.scores must be a list of numbers")
        ids = special_ids(store)

        def flag(key: str, default: bool) -> bool:
            v = store.meta(key, default, kind="bool")
            if not isinstance(v, bool):
                raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be a boolean")
            return v

        # llama.cpp's SPM defaults: BOS 1, EOS 2, a BOS added, a space prefix
        return cls(token_list(store, "tokenizer.ggml.tokens"), scores or None, token_types(store),
                   1 if ids["bos"] is None else ids["bos"], 2 if ids["eos"] is None else ids["eos"],
                   flag("tokenizer.ggml.add_bos_token", True), flag("tokenizer.ggml.add_eos_token", False),
                   flag("tokenizer.ggml.add_space_prefix", True), store.path, ids["eot"], ids["eom"])

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    # -- encoding -------------------------------------------------------------------

    def _byte_token(self, b: int) -> int:
        tid = self._id.get(b"<0x%02X>" % b)
        if tid is None:
            tid = self._id.get(bytes([b]))
        if tid is None:
            raise ModelFileError(f"byte 0x{b:02X} has neither a byte token (<0x{b:02X}>) nor a one-byte token in the "
                                 "vocabulary, so this text cannot be tokenized (llama.cpp throws here)")
        return tid

    def _merge(self, text: bytes, out: list[int]) -> None:
        """The symbols of ``text`` merged greedily by the merged token's score (llama_tokenizer_spm_session)."""
        start, size = [], []
        pos = 0
        while pos < len(text):
            start.append(pos)
            size.append(min(_SEQ_LEN[text[pos] >> 4], len(text) - pos))
            pos += size[-1]
        n = len(start)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)
        split_of: dict[bytes, tuple[int, int]] = {}

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = text[start[left]:start[left] + size[left] + size[right]]
            tid = self._id.get(piece)
            if tid is not None:
                heapq.heappush(queue, (-self.scores[tid], left, right, len(piece)))
                split_of[piece] = (left, right)

        for i in range(1, n):
            push(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # one side changed since this pair was queued
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        def emit(i: int) -> None:
            piece = text[start[i]:start[i] + size[i]]
            tid = self._id.get(piece)
            if tid is not None:
                out.append(tid)
            elif piece in split_of:  # only reachable for pathological vocabularies
                for j in split_of[piece]:
                    emit(j)
            else:
                out.extend(self._byte_token(b) for b in piece)

        i = 0 if n else -1
        while i >= 0:
            emit(i)
            i = nxt[i]

    def _fragments(self, raw: bytes, special: bool = False) -> list[bytes | int]:
        """``raw`` cut at every user-defined token (and control token, if ``special``): text pieces and
        token ids, in order; the longest tokens are matched first, as llama.cpp does."""
        parts: list[bytes | int] = [raw] if raw else []
        for tid in self._special if special else self._user:
            needle, cut = self._bytes[tid], list[bytes | int]()
            for part in parts:
                if isinstance(part, int):
                    cut.append(part)
                    continue
                at = 0
                while (hit := part.find(needle, at)) >= 0:
                    if hit > at:
                        cut.append(part[at:hit])
                    cut.append(tid)
                    at = hit + len(needle)
                if at < len(part):
                    cut.append(part[at:])
            parts = cut
        return parts

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """llama.cpp's ``llama_tokenize(text, add_special, parse_special)``; add_bos: the file's by default.

        ``special``: control tokens written in the text (``<s>``, a chat template's markers) are those
        tokens, not their characters (llama.cpp's ``parse_special``, what its server does with prompts).
        """
        check_text(text, "encode: text")
        add_bos = check_add_bos(add_bos, "encode: add_bos")
        bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = [self.bos_id] if bos and self.bos_id is not None else []
        after_token = True  # the start of the text counts as following a token
        for part in self._fragments(text.encode(), special):
            if isinstance(part, int):
                out.append(part)
                after_token = True
                continue
            if self.add_space_prefix and after_token:
                part = b" " + part
            self._merge(part.replace(b" ", _SPACE), out)
            after_token = False
        if bos and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    # -- decoding -------------------------------------------------------------------

    def token_bytes(self, tid: int) -> bytes:
        """llama.cpp's ``token_to_piece(special=false)``: what a token renders as in generated text."""
        tid = check_token(tid, len(self.tokens), "token_bytes: token id")
        t = self.types[tid]
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            return b""
        if t == TOKEN_TYPE_USER_DEFINED:
            return self._bytes[tid]
        if t == TOKEN_TYPE_NORMAL:
            return self._bytes[tid].replace(_SPACE, b" ")
        if t == TOKEN_TYPE_BYTE:
            return bytes([int(self.tokens[tid][3:5], 16)])
        return b""  # unused and undefined tokens render as nothing

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        """llama.cpp's ``llama_detokenize``: the pieces joined, the first one without its prefix space."""
        out = []
        for k, i in enumerate(check_ids(ids, len(self.tokens), "decode: ids")):
            piece = self.token_bytes(i)
            if k == 0 and self.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            out.append(piece)
        return codecs.decode(b"".join(out), "utf-8", errors="replace")

    def stream(self) -> TextStream:
        return TextStream(self)


__all__ = ["SPMTokenizer"]
