"""Tokenizers from GGUF metadata, as llama.cpp tokenizes: byte-level BPE through ``tokenizers``, SentencePiece
(``tokenizer.ggml.model = "llama"``) in :mod:`ggml_hybrid.text.spm`.

llama.cpp's ``gpt2`` tokenizer model is byte-level BPE: pre-tokenizer regexes
that depend on ``tokenizer.ggml.pre`` (applied in turn, each splitting the pieces
of the previous one), GPT-2's byte-to-unicode alphabet, and the merges list in
rank order. The ``tokenizers`` package implements exactly that (``Split`` with
the same regexes, then ``ByteLevel`` without its own regex), so it is used rather
than a BPE of our own; its Oniguruma regex and llama.cpp's matcher agree on the
pre-tokenizer patterns below (the tests compare the ids with llama.cpp's).
Control tokens are never produced from plain text, as in llama.cpp with
``parse_special=false``; :func:`token_attributes` applies llama.cpp's fix-ups of
the token types (end-of-generation texts, gpt-oss's rendered markers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import SupportsInt

from ..errors import ModelFileError
from ..gguf.store import GGUFStore
from .spm import SPMTokenizer
from .vocab import (
    TOKEN_TYPE_CONTROL,
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

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe), by tokenizer.ggml.pre
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# qwen35: letter runs also take the combining marks (\p{M}) that follow or join them
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's adaptation of o200k's case classes: any letter that is not ASCII counts as both cases
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn
    ignore_merges: bool       # a whole piece that is a token is taken as is
    add_bos: bool = False     # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


PRE_TOKENIZERS = {
    "qwen2": PreTokenizer((_QWEN2,), False),
    "qwen35": PreTokenizer((_QWEN35,), False),
    "llama-bpe": PreTokenizer((_LLAMA3,), True, add_bos=True),
    "olmo": PreTokenizer((_GPT2,), False),
    "glm4": PreTokenizer((_LLAMA3,), True),       # LLAMA_VOCAB_PRE_TYPE_CHATGLM4
    "gpt-4o": PreTokenizer((_GPT4O,), False),
    "deepseek-v3": PreTokenizer(_DEEPSEEK3, False),
}

class Tokenizer:
    """Text to token ids and back, as llama.cpp does for the same GGUF vocabulary."""

    def __init__(self, tokens: list[str], merges: list[str], pre: str, token_types: list[int] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False, source: str = "vocab",
                 eot_id: int | None = None, eom_id: int | None = None, add_eos: bool = False):
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
        types, self.eog_ids = token_attributes(tokens, types, (eos_id, eot_id, eom_id))
        self.tokens, self.pre, self.types = list(tokens), pre, types
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = bos_id, eos_id, add_bos, add_eos
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
        spec = PRE_TOKENIZERS[pre]
        try:
            model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
        except Exception as exc:  # tokenizers raises its own exception type
            raise ModelFileError(f"{source}: the vocabulary is not a valid BPE model ({exc})") from None
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        # user-defined tokens (Qwen3's <think>, <tool_call>, ...) are matched in plain text before BPE,
        # as llama.cpp does even without special-token parsing
        user = [tokens[i] for i in sorted(self._raw - self.control) if tokens[i]]
        if user:
            hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._hf = hf
        self._special_re: re.Pattern[str] | None = None  # control-token matcher, built on first use
        self._special_ids: dict[str, int] = {}

    @classmethod
    def from_gguf(cls, store: GGUFStore) -> Tokenizer | SPMTokenizer:
        """The file's tokenizer: byte-level BPE (``gpt2``) or SentencePiece (``llama``)."""
        model = store.meta("tokenizer.ggml.model", "", kind="str")
        if model == "llama":
            return SPMTokenizer.from_gguf(store)
        if model != "gpt2":
            raise ModelFileError(f"{store.path!r}: tokenizer.ggml.model = {model!r} is not supported; supported: "
                                 "'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
        pre = store.meta("tokenizer.ggml.pre", "default", kind="str")
        spec = PRE_TOKENIZERS.get(pre) if isinstance(pre, str) else None
        add_bos = store.meta("tokenizer.ggml.add_bos_token", spec.add_bos if spec is not None else False, kind="bool")
        add_eos = store.meta("tokenizer.ggml.add_eos_token", False, kind="bool")
        ids = special_ids(store)
        return cls(token_list(store, "tokenizer.ggml.tokens"), token_list(store, "tokenizer.ggml.merges", []), pre,
                   token_types(store), ids["bos"], ids["eos"], bool(add_bos), store.path, ids["eot"], ids["eom"],
                   bool(add_eos))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of ``text`` (llama.cpp's ``llama_tokenize``); add_bos: the file's rule by default.

        ``special``: control tokens written in the text (a chat template's ``<|im_start|>``) are those
        tokens, not their characters (llama.cpp's ``parse_special``, what its server does with prompts);
        the text between them is encoded as usual.
        """
        check_text(text, "encode: text")
        add_bos = check_add_bos(add_bos, "encode: add_bos")
        ids: list[int] = []
        for part in self._split_special(text) if special else [text]:
            if isinstance(part, int):
                ids.append(part)
            elif part:
                # encode_batch lets other threads run while it works (encode holds the interpreter for the whole
                # text: a server's event loop stood still for as long as a long text took); the same ids
                ids += self._hf.encode_batch([part], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        # llama.cpp appends EOS after the text when the file says so (tokenizer.ggml.add_eos_token) and special
        # tokens are added at all (add_bos=False here adds none)
        if add_bos is not False and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _split_special(self, text: str) -> list[str | int]:
        """``text`` cut at the control tokens written in it, the longest first: text pieces and ids."""
        if self._special_re is None:
            texts = sorted((self.tokens[i] for i in self.control if self.tokens[i]), key=len, reverse=True)
            self._special_ids = {self.tokens[i]: i for i in sorted(self.control, reverse=True) if self.tokens[i]}
            self._special_re = re.compile("|".join(re.escape(t) for t in texts)) if texts else re.compile(r"(?!)")
        out: list[str | int] = []
        at = 0
        for m in self._special_re.finditer(text):
            out += [text[at:m.start()], self._special_ids[m.group()]]
            at = m.end()
        out.append(text[at:])
        return out

    def token_bytes(self, tid: int) -> bytes:
        """The bytes a token stands for (control tokens: their text)."""
        tid = check_token(tid, len(self.tokens), "token_bytes: token id")
        tok = self.tokens[tid]
        if tid in self._raw:
            return tok.encode()
        return bytes(self._bytes_of[ch] for ch in tok)

    def decode(self, ids: Iterable[SupportsInt]) -> str:
        return b"".join(self.token_bytes(i) for i in check_ids(ids, len(self.tokens), "decode: ids")).decode(
            "utf-8", errors="replace")

    def stream(self) -> TextStream:
        return TextStream(self)


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


__all__ = ["PRE_TOKENIZERS", "PreTokenizer", "Tokenizer"]
