"""Byte-level BPE tokenizer from GGUF metadata, through the ``tokenizers`` package.

llama.cpp's ``gpt2`` tokenizer model is byte-level BPE: a pre-tokenizer regex
that depends on ``tokenizer.ggml.pre``, GPT-2's byte-to-unicode alphabet, and
the merges list in rank order. The ``tokenizers`` package implements exactly
that (``Split`` with the same regex, then ``ByteLevel`` without its own regex),
so it is used rather than a BPE of our own; its Oniguruma regex and llama.cpp's
hand-written matcher agree on the pre-tokenizer patterns below.
Control tokens (token type 3) are never produced from plain text, as in
llama.cpp with ``parse_special=false``.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import SupportsInt

from ..errors import ArgumentTypeError, ModelFileError
from .gguf_store import GGUFStore

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by tokenizer.ggml.pre
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": (_QWEN2, False), "llama-bpe": (_LLAMA3, True)}  # name -> (regex, ignore_merges)

TOKEN_TYPE_CONTROL = 3
# control tokens that end a turn, which llama.cpp also stops at (llama-vocab.cpp's end-of-generation list)
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"}
TOKEN_TYPE_USER_DEFINED = 4


class Tokenizer:
    """Text to token ids and back, as llama.cpp does for the same GGUF vocabulary."""

    def __init__(self, tokens: list[str], merges: list[str], pre: str, token_types: list[int] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False, source: str = "vocab",
                 eot_id: int | None = None, eom_id: int | None = None):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in PRE_TOKENIZERS:
            raise ModelFileError(f"{source}: tokenizer.ggml.pre = {pre!r} is not supported; "
                                 f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
        n = len(tokens)
        types = list(token_types) if token_types is not None else [1] * n
        if len(types) != n:
            raise ModelFileError(f"{source}: {len(types)} token types for {n} tokens")
        for name, tid in (("bos", bos_id), ("eos", eos_id), ("eot", eot_id), ("eom", eom_id)):
            if tid is not None and not 0 <= tid < n:
                raise ModelFileError(f"{source}: {name} token id {tid} is outside the vocabulary of {n}")
        self.tokens, self.pre, self.types = list(tokens), pre, types
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.control = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
        # control and user-defined tokens are plain text (llama.cpp decodes them as written)
        self._raw = self.control | {i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED}
        self._bytes_of = _byte_decoder()
        for i, tok in enumerate(tokens):
            if not isinstance(tok, str):
                raise ModelFileError(f"{source}: token {i} is not a string")
        alphabet = set(self._bytes_of)
        if not set("".join(t for i, t in enumerate(tokens) if i not in self._raw)) <= alphabet:
            bad = next(i for i, t in enumerate(tokens) if i not in self._raw and not set(t) <= alphabet)
            raise ModelFileError(f"{source}: token {bad} ({tokens[bad]!r}) has characters outside byte-level BPE's "
                                 "256-character alphabet (and is not a control or user-defined token)")
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if i in self.control:
                continue  # never produced from text; decoded from self.tokens
            vocab.setdefault(tok, i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or a + b not in vocab:
                raise ModelFileError(f"{source}: merge {m!r} is not 'left right' with the result in the vocabulary")
            pairs.append((a, b))
        regex, ignore_merges = PRE_TOKENIZERS[pre]
        try:
            model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
        except Exception as exc:  # tokenizers raises its own exception type
            raise ModelFileError(f"{source}: the vocabulary is not a valid BPE model ({exc})") from None
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        # user-defined tokens (Qwen3's <think>, <tool_call>, ...) are matched in plain text before BPE,
        # as llama.cpp does even without special-token parsing
        user = [tokens[i] for i in sorted(self._raw - self.control) if tokens[i]]
        if user:
            hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._hf = hf
        # end-of-generation: EOS, EOT and EOM ids, and the control tokens llama.cpp treats as such
        self.eog_ids = {t for t in (eos_id, eot_id, eom_id) if t is not None}
        self.eog_ids |= {i for i in self.control if tokens[i] in _EOG_TEXTS}

    @classmethod
    def from_gguf(cls, store: GGUFStore) -> Tokenizer:
        model = store.meta("tokenizer.ggml.model", "")
        if model != "gpt2":
            raise ModelFileError(f"{store.path!r}: tokenizer.ggml.model = {model!r}; only byte-level BPE "
                                 "('gpt2') is supported")

        def opt_int(key: str) -> int | None:
            v = store.meta(key, -1)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

        def str_list(key: str, default: list[str] | None = None) -> list[str]:
            v = store.meta(key, default)
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ModelFileError(f"{store.path!r}: {key} must be a list of strings, got {type(v).__name__}")
            return v

        types = store.meta("tokenizer.ggml.token_type", [])
        if not isinstance(types, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in types):
            raise ModelFileError(f"{store.path!r}: tokenizer.ggml.token_type must be a list of integers")
        pre = store.meta("tokenizer.ggml.pre", "default")
        # llama.cpp adds BOS by default for the Llama-3 pre-tokenizer when the file does not say
        add_bos = store.meta("tokenizer.ggml.add_bos_token", pre == "llama-bpe")
        return cls(str_list("tokenizer.ggml.tokens"), str_list("tokenizer.ggml.merges", []), pre, types or None,
                   opt_int("tokenizer.ggml.bos_token_id"), opt_int("tokenizer.ggml.eos_token_id"), bool(add_bos),
                   store.path, opt_int("tokenizer.ggml.eot_token_id"), opt_int("tokenizer.ggml.eom_token_id"))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise ArgumentTypeError(f"encode: text must be str, got {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def token_bytes(self, tid: int) -> bytes:
        """The bytes a token stands for (control tokens: their text)."""
        tok = self.tokens[tid]
        if tid in self._raw:
            return tok.encode()
        return bytes(self._bytes_of[ch] for ch in tok)

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Incremental detokenizer: UTF-8 sequences split across tokens are held until complete."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        return self._dec.decode(self._tok.token_bytes(tid))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


__all__ = ["Tokenizer", "TextStream", "PRE_TOKENIZERS"]
