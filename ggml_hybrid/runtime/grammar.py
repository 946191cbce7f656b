"""Constrained decoding: a grammar's token mask applied to the logits before the sampling chain.

A :class:`Grammar` is compiled once per request by llguidance (Microsoft's constrained-decoding engine: a
Rust library with PyPI wheels and no torch; JSON Schema, Lark and, through its converter, llama.cpp's
GBNF) against the model's vocabulary (:func:`vocabulary`, built once per tokenizer). Each request gets a
:class:`Constraint` of its own (the grammar's state as its tokens are accepted): before each draw,
:meth:`Constraint.mask` sets the logits of the tokens the grammar cannot take next to ``-inf``, so
penalties, top-k, top-p, min-p and temperature then work over the allowed tokens only and whatever is
drawn is allowed; :meth:`Constraint.accept` advances the grammar. The end-of-generation tokens are
allowed exactly when the grammar accepts what came so far, so a constrained text that ends at one is
whole.

Compilation is bounded (:data:`LIMITS`: grammar size, lexer states, the work of one mask), so a huge or
pathological grammar is refused with a :class:`~ggml_hybrid.errors.GrammarError` instead of holding the
engine thread or its memory.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import numpy as np

from ..errors import GrammarError, MissingDependencyError

MAX_GRAMMAR_CHARS = 256 << 10  # a grammar or schema text beyond this is refused before it is compiled
# llguidance's own bounds (its defaults are sized for one user's machine; these keep one request's compile
# under about a second and its lexer within tens of MiB)
LIMITS = {"max_grammar_size": 200_000, "max_lexer_states": 50_000, "initial_lexer_fuel": 1_000_000,
          "step_lexer_fuel": 200_000, "step_max_items": 50_000}
# JSON whitespace as llama.cpp's json-schema-to-grammar allows it: none, one space, or a newline and an indent
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"


class TokenBytes(Protocol):
    """What a vocabulary needs for a grammar: the token texts and ids, encoding, the special ids."""

    tokens: list[str]
    bos_id: int | None
    eos_id: int | None
    eog_ids: set[int]

    @property
    def n_vocab(self) -> int: ...

    def token_bytes(self, tid: int) -> bytes: ...

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]: ...


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependencyError("structured output needs llguidance (the server extra): pip install -e "
                                     "'.[server]' in the ggml-hybrid checkout, or pip install llguidance") from None
    return llguidance


class _Wrapped:
    """The tokenizer as llguidance's ``TokenizerWrapper`` reads one: token bytes (a control token's text
    marked by a leading 0xFF, llguidance's convention for special tokens), the special ids, an encoder."""

    def __init__(self, tok: TokenBytes) -> None:
        control = _control_ids(tok)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.tokens = [b"\xff" + tok.tokens[i].encode("utf-8") if i in control else tok.token_bytes(i)
                       for i in range(tok.n_vocab)]
        self.special_token_ids = sorted(control)
        self._tok = tok
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in control:
                self._by_bytes.setdefault(b, i)

    def __call__(self, text: bytes) -> list[int]:
        """Token ids whose bytes are exactly ``text`` (llguidance tokenizes pieces of the grammar's text with it)."""
        ids = self._tok.encode(text.decode("utf-8", "replace"), add_bos=False)
        got = b"".join(self.tokens[i] for i in ids)
        if got != text and got == b" " + text and ids:
            # SentencePiece's space prefix (add_space_prefix): the first token without its leading space
            rest = self.tokens[ids[0]][1:]
            head = [] if not rest else [self._by_bytes[rest]] if rest in self._by_bytes else \
                [self._by_bytes[bytes([c])] for c in rest if bytes([c]) in self._by_bytes]
            ids = head + ids[1:]
        return ids


def _control_ids(tok: TokenBytes) -> set[int]:
    control = getattr(tok, "control", None)
    if isinstance(control, set):
        return control
    types = getattr(tok, "types", None)  # SentencePiece: control (3) and unknown (2) render as nothing
    if types is not None:
        return {i for i, t in enumerate(types) if t in (2, 3)}
    return set(tok.eog_ids)


_VOCABS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocabulary(tok: TokenBytes) -> Any:
    """llguidance's tokenizer for ``tok`` (built once per tokenizer: it indexes every token's bytes)."""
    llg = _llguidance()
    with _VOCABS_LOCK:
        v = _VOCABS.get(tok)
        if v is None:
            v = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tok)), eos_token=sorted(tok.eog_ids) or None)
            _VOCABS[tok] = v
        return v


def _limits() -> Any:
    return _llguidance().LLParserLimits(**LIMITS, verbose_errors=False)


_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that lists ``properties`` and says
    nothing of others (llama.cpp's json-schema-to-grammar reads such schemas so: a model writes only the keys
    named). Whatever it allows is valid under ``schema`` too."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = closed_schema(out[k])
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed_schema(v) for n, v in out[k].items()}
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [closed_schema(v) for v in out[k]]
    return out


def json_options(schema: Any) -> Any:
    """``schema`` closed (:func:`closed_schema`) and carrying llguidance's JSON options (llama.cpp's whitespace), for
    a ``%json`` block of a Lark grammar or :meth:`Grammar.json_schema`."""
    out = closed_schema(schema)
    if isinstance(out, dict):
        out = {**out, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, **out.get("x-guidance", {})}}
    elif out is True:
        out = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return out


def _check_size(text: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")


class Grammar:
    """A grammar compiled for one vocabulary; :meth:`constraint` starts a request's state.

    Build one with :meth:`json_schema`, :meth:`gbnf` or :meth:`lark`; each raises
    :class:`~ggml_hybrid.errors.GrammarError` naming what is wrong (not valid JSON Schema, a syntax error, a
    bound passed)."""

    def __init__(self, tok: TokenBytes, spec: str, what: str) -> None:
        llg = _llguidance()
        self.tok, self.what = tok, what
        self.n_vocab = tok.n_vocab
        self._vocab = vocabulary(tok)
        try:
            m = llg.LLMatcher(self._vocab, spec, log_level=0, limits=_limits())
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{what}: {_first_line(str(exc))}") from None
        if m.is_error():
            raise GrammarError(f"{what}: {_first_line(m.get_error())}")
        # the first mask, on a copy: a grammar that cannot start (no text matches it) is refused here, not mid-request
        probe = m.deep_copy()
        bits = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if probe.is_error() or not bits.any():
            raise GrammarError(f"{what}: {_first_line(probe.get_error()) or 'no token can start it'}")
        self._spec = spec
        self._first = m  # the compiled start state; each constraint copies it

    @classmethod
    def json_schema(cls, tok: TokenBytes, schema: dict[str, Any] | bool, what: str = "the JSON schema") -> Grammar:
        """Text that is one JSON value valid under ``schema`` (``{}`` or ``True``: any JSON value)."""
        import json

        llg = _llguidance()
        text = json.dumps(schema)
        _check_size(text, what)
        try:
            spec = llg.LLMatcher.grammar_from_json_schema(json.dumps(json_options(schema)))
        except ValueError as exc:
            raise GrammarError(f"{what}: {_first_line(str(exc))}") from None
        return cls(tok, spec, what)

    @classmethod
    def gbnf(cls, tok: TokenBytes, text: str, what: str = "the grammar") -> Grammar:
        """llama.cpp's GBNF (``root ::= ...``), converted to Lark by llguidance."""
        llg = _llguidance()
        _check_size(text, what)
        try:
            spec = llg.grammar_from("gbnf", text)
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"{what} is not valid GBNF: {_first_line(str(exc))}") from None
        return cls(tok, spec, what)

    @classmethod
    def lark(cls, tok: TokenBytes, text: str, what: str = "the grammar") -> Grammar:
        """llguidance's Lark dialect (``start: ...``; ``%json {...}`` embeds a JSON schema)."""
        llg = _llguidance()
        _check_size(text, what)
        return cls(tok, llg.LLMatcher.grammar_from_lark(text), what)

    def constraint(self) -> Constraint:
        return Constraint(self)


def _first_line(msg: str) -> str:
    msg = " ".join(msg.split())
    if msg.startswith("NoExtensionBias"):  # llguidance's word for a grammar no text can match
        return "no text can match it (a rule that only refers to itself, or to rules that never end)"
    return msg[:500] + ("..." if len(msg) > 500 else "")


class Constraint:
    """One request's grammar state: :meth:`mask` the logits, :meth:`accept` the token drawn."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._m = grammar._first.deep_copy()
        self._bits = np.zeros((grammar.n_vocab + 31) // 32, dtype=np.int32)

    @property
    def done(self) -> bool:
        """The grammar takes no further token (not even an end-of-generation one)."""
        return bool(self._m.is_stopped())

    def allowed(self) -> np.ndarray:
        """A boolean array over the vocabulary: the tokens the grammar can take next."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise GrammarError(f"{self.grammar.what}: {_first_line(self._m.get_error())}")
        ok: np.ndarray = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.grammar.n_vocab)
        return ok.view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` as float64 with every token the grammar cannot take next at ``-inf`` (a new array)."""
        ok = self.allowed()
        z = np.asarray(logits).reshape(-1)
        if z.size > ok.size:  # a model's output rows beyond the vocabulary (padding): never text
            ok = np.concatenate([ok, np.zeros(z.size - ok.size, dtype=bool)])
        if not ok.any():
            raise GrammarError(f"{self.grammar.what}: no token can continue the text (the grammar is stuck)")
        out: np.ndarray = np.where(ok[:z.size], z.astype(np.float64, copy=False), -np.inf)
        return out

    def accept(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"{self.grammar.what}: token {token} is not allowed here: "
                               f"{_first_line(self._m.get_error())}")


__all__ = ["Constraint", "Grammar", "JSON_WHITESPACE", "LIMITS", "MAX_GRAMMAR_CHARS", "closed_schema", "json_options",
           "vocabulary"]
