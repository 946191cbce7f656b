"""What both tokenizers (byte-level BPE and SentencePiece) read from a GGUF vocabulary and check the same way:
token types and their llama.cpp fix-ups, the special ids, token-id arguments, and incremental detokenizing."""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from ..checks import check_int, check_type
from ..errors import ArgumentError, ArgumentTypeError, IndexRangeError, ModelFileError
from ..gguf.store import GGUFStore

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL = 1, 2, 3
TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE = 4, 5, 6
# texts of tokens that end a turn, which llama.cpp stops at (llama-vocab.cpp's end-of-generation list)
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}
# gpt-oss's harmony markers, which llama.cpp always renders (and matches in plain text)
_RENDERED = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}


def check_token(tid: object, n_vocab: int, what: str) -> int:
    """``tid`` as an int that names a token of an ``n_vocab`` vocabulary (negative ids never wrap around)."""
    return check_int(tid, what, 0, n_vocab - 1, error=IndexRangeError, type_error=ArgumentTypeError)


def check_text(text: object, what: str) -> str:
    """``text`` if it is a str that is valid Unicode text (no lone surrogate: UTF-8 cannot carry it)."""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"{what} must be str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ArgumentError(f"{what} holds a lone surrogate ({text[exc.start]!a}) at character {exc.start}: it is not "
                            "valid Unicode text") from None
    return text


def check_add_bos(add_bos: object, what: str) -> bool | None:
    """``add_bos`` if it is None (the file's choice) or a bool."""
    return None if add_bos is None else check_type(add_bos, what, bool)  # type: ignore[return-value]


def check_ids(ids: object, n_vocab: int, what: str) -> list[int]:
    """Token ids of an iterable, each checked."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ArgumentTypeError(f"{what} must be an iterable of token ids, got {ids!r} of type {type(ids).__name__}")
    return [check_token(t, n_vocab, what) for t in ids]


def token_attributes(tokens: Sequence[str], types: Sequence[int], special: Iterable[int | None]
                     ) -> tuple[list[int], set[int]]:
    """llama.cpp's fix-ups of the file's token types, and the end-of-generation ids.

    A token whose text is on llama.cpp's end-of-generation list becomes CONTROL and ends generation,
    as do the ``special`` ids (EOS, EOT, EOM); gpt-oss's markers become USER_DEFINED; with both
    ``<|return|>`` and ``<|call|>`` present, ``<|end|>`` is an ordinary (user-defined) token again.
    """
    types = list(types)
    eog = set()
    for i, t in enumerate(tokens):
        if t in _EOG_TEXTS:
            eog.add(i)
            types[i] = TOKEN_TYPE_CONTROL
    for i, t in enumerate(tokens):
        if t in _RENDERED:
            types[i] = TOKEN_TYPE_USER_DEFINED
    eog |= {i for i in special if i is not None}
    texts = {tokens[i]: i for i in eog}
    if {"<|return|>", "<|call|>", "<|end|>"} <= texts.keys() or {"<|calls|>", "<|flush|>", "<|end|>"} <= texts.keys():
        end = texts["<|end|>"]
        eog.discard(end)
        types[end] = TOKEN_TYPE_USER_DEFINED
    return types, eog


def special_ids(store: GGUFStore) -> dict[str, int | None]:
    """The file's bos/eos/eot/eom token ids (None when absent or negative)."""
    def opt_int(key: str) -> int | None:
        v = store.meta(key, -1, kind="int")
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    return {n: opt_int(f"tokenizer.ggml.{n}_token_id") for n in ("bos", "eos", "eot", "eom")}


def token_list(store: GGUFStore, key: str, default: list[str] | None = None) -> list[str]:
    v = store.meta(key, default, kind="strs")
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ModelFileError(f"{store.path!r}: {key} must be a list of strings, got {type(v).__name__}")
    return v


def token_types(store: GGUFStore) -> list[int] | None:
    types = store.meta("tokenizer.ggml.token_type", [], kind="ints")
    if not isinstance(types, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in types):
        raise ModelFileError(f"{store.path!r}: tokenizer.ggml.token_type must be a list of integers")
    return types or None



class _TokenBytes(Protocol):
    def token_bytes(self, tid: int) -> bytes: ...


class TextStream:
    """Incremental detokenizer: UTF-8 sequences split across tokens are held until complete.

    ``hide``: token ids that print nothing (a chat's control tokens such as ``<|im_end|>``, as llama.cpp's
    ``common_token_to_piece`` with ``special=false``)."""

    def __init__(self, tok: _TokenBytes, hide: Collection[int] = ()):
        self._tok = tok
        self._hide = hide
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        if tid in self._hide:
            return ""
        return self._dec.decode(self._tok.token_bytes(tid))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


__all__ = ["TOKEN_TYPE_BYTE", "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_UNKNOWN", "TOKEN_TYPE_UNUSED",
           "TOKEN_TYPE_USER_DEFINED", "TextStream", "check_add_bos", "check_ids", "check_text", "check_token",
           "special_ids", "token_attributes", "token_list", "token_types"]
