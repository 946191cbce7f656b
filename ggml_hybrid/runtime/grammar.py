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

Compilation is bounded: a text is checked (its size, nesting, the levels llguidance's compiler recurses through, a
schema's numeric bounds) and validated by llguidance in a child process first, under a time and memory limit, then
compiled against the vocabulary on a thread with a known, large stack, on the compile threads' own limiter
(:mod:`.grammar_pool`, :mod:`.grammar_check`); llguidance's own limits (:data:`LIMITS`: grammar size, lexer states,
the work of one mask) bound the rest. A grammar refused, or one whose first token already passes llguidance's limits,
is a :class:`~ggml_hybrid.errors.GrammarError` naming the bound, never a crash or a held engine thread.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any, Protocol

import numpy as np

from ..errors import GrammarError, MissingDependencyError
from .grammar_check import (
    JSON_WHITESPACE,
    LIMITS,
    MAX_EXACT_INT,
    MAX_GRAMMAR_CHARS,
    MAX_LEVELS,
    MAX_SCHEMA_DEPTH,
    STEP_SECONDS,
    CheckError,
    check_shape,
    closed_schema,
    json_options,
)
from .grammar_pool import GrammarPool, grammar_pool

PROBE_TOKENS = 3  # first tokens tried at compile time (each on a copy): a grammar that cannot go on past one is refused


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


class Grammar:
    """A grammar compiled for one vocabulary; :meth:`constraint` starts a request's state.

    Build one with :meth:`json_schema`, :meth:`gbnf` or :meth:`lark` (each checked and compiled in the compile pool:
    :mod:`.grammar_pool`); each raises :class:`~ggml_hybrid.errors.GrammarError` naming what is wrong (not valid JSON
    Schema, a syntax error, a bound passed, a compile over its time). ``kind`` is the form it came in
    (``json_schema``, ``gbnf`` or ``lark``)."""

    def __init__(self, tok: TokenBytes, spec: str, what: str, kind: str = "lark") -> None:
        # llguidance's grammar text, already checked (grammar_check): the compile recurses as the check did, so
        # this runs on a compile thread of the pool, whose stack is the checker's several times over
        llg = _llguidance()
        self.tok, self.what, self.kind = tok, what, kind
        self.step_seconds = STEP_SECONDS  # the CPU time one token's mask (or taking it) may take in a constraint
        self.n_vocab = tok.n_vocab
        self._vocab = vocabulary(tok)
        try:
            m = llg.LLMatcher(self._vocab, spec, log_level=0, limits=_limits())
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{what}: {_first_line(str(exc))}") from None
        if m.is_error():
            raise GrammarError(f"{what}: {_first_line(m.get_error())}")
        self._probe(m)
        self._spec = spec
        self._first = m  # the compiled start state; each constraint copies it

    def _probe(self, m: Any) -> None:
        """Refuse here what would fail at the first steps of every request: no token can start the text, or
        llguidance's limits stop it at its first token (a start rule of thousands of alternatives), each tried on
        a copy of the start state."""
        what = self.what
        probe = m.deep_copy()
        bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if probe.is_error() or not bits.any():
            raise GrammarError(f"{what}: {_first_line(probe.get_error()) or 'no token can start it'}")
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little", count=self.n_vocab))
        eog = set(getattr(self.tok, "eog_ids", ()))
        allowed = np.array([t for t in allowed if int(t) not in eog], dtype=np.int64)
        if not allowed.size:
            return
        for t in sorted({int(allowed[0]), int(allowed[allowed.size // 2]), int(allowed[-1])})[:PROBE_TOKENS]:
            step = probe.deep_copy()  # as a request goes: the mask computed, then the token taken
            ok = bool(step.consume_token(t)) and not step.is_error()
            if ok:
                step.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                ok = not step.is_error()
            if not ok:
                raise GrammarError(f"{what}: llguidance cannot go on past its first token (token {t}): "
                                   f"{_first_line(step.get_error())}")

    @classmethod
    def compile(cls, tok: TokenBytes, kind: str, source: Any, what: str, pool: GrammarPool | None = None
                ) -> Grammar:
        """``source`` (a JSON schema for ``json_schema``, GBNF or Lark text) checked and compiled in ``pool`` (the
        process's: :func:`~.grammar_pool.grammar_pool`)."""
        _llguidance()
        if kind == "json_schema" and not isinstance(source, (dict, bool)):
            raise GrammarError(f"{what} must be a JSON Schema (an object or a boolean), got {type(source).__name__}")
        if kind != "json_schema" and not isinstance(source, str):
            raise GrammarError(f"{what} must be text, got {type(source).__name__}")
        try:
            if not isinstance(source, str):
                check_shape(source, what)  # before serializing it (one call that holds the interpreter)
            text = source if isinstance(source, str) else json.dumps(source)
        except CheckError as exc:
            raise GrammarError(str(exc)) from None
        except (TypeError, ValueError, RecursionError) as exc:
            raise GrammarError(f"{what} is not JSON: {exc}") from None
        if len(text) > MAX_GRAMMAR_CHARS:  # the checker says so too; this spares sending it there
            raise GrammarError(f"{what} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are compiled")
        request = {"kind": kind, "source": source, "what": what}
        return (pool or grammar_pool()).run(request, lambda spec: cls(tok, spec, what, kind))

    @classmethod
    def json_schema(cls, tok: TokenBytes, schema: dict[str, Any] | bool, what: str = "the JSON schema",
                    pool: GrammarPool | None = None) -> Grammar:
        """Text that is one JSON value valid under ``schema`` (``{}`` or ``True``: any JSON value)."""
        return cls.compile(tok, "json_schema", schema, what, pool)

    @classmethod
    def gbnf(cls, tok: TokenBytes, text: str, what: str = "the grammar", pool: GrammarPool | None = None) -> Grammar:
        """llama.cpp's GBNF (``root ::= ...``), converted to Lark by llguidance."""
        return cls.compile(tok, "gbnf", text, what, pool)

    @classmethod
    def lark(cls, tok: TokenBytes, text: str, what: str = "the grammar", pool: GrammarPool | None = None) -> Grammar:
        """llguidance's Lark dialect (``start: ...``; ``%json {...}`` embeds a JSON schema)."""
        return cls.compile(tok, "lark", text, what, pool)

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
        start = time.thread_time()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise GrammarError(f"{self.grammar.what}: {_first_line(self._m.get_error())}")
        self._check_time("the mask of the next token", time.thread_time() - start)
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
        start = time.thread_time()
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"{self.grammar.what}: token {token} is not allowed here: "
                               f"{_first_line(self._m.get_error())}")
        self._check_time(f"taking token {token}", time.thread_time() - start)

    def _check_time(self, work: str, spent: float) -> None:
        """A GrammarError when one token's grammar work took more CPU time (this thread's: other threads' load does
        not count) than the grammar's bound (:data:`STEP_SECONDS`): it runs on the engine thread, where every other
        sequence of the model waits for it, and an ambiguous grammar's grows with every token."""
        bound = self.grammar.step_seconds
        if spent > bound:
            raise GrammarError(f"{self.grammar.what}: {work} took {spent * 1000:.1f} ms of CPU time, over the bound "
                               f"of {bound * 1000:.1f} ms a token (llguidance's step limits at its documented speeds, "
                               "twice over): an ambiguous grammar (a rule such as 'root ::= root root', where a text "
                               "parses more than one way) costs more with every token; write it so that each text "
                               "parses one way")

    def whole(self, text: str) -> bool:
        """Whether ``text``, which the grammar took to its end, is what the grammar promises: for a JSON schema, JSON
        (a last check before a request answers "stop": llguidance's end alone is not taken on trust)."""
        if self.grammar.kind != "json_schema":
            return True
        try:
            json.loads(text)
        except ValueError:
            return False
        return True


__all__ = ["Constraint", "Grammar", "JSON_WHITESPACE", "LIMITS", "MAX_EXACT_INT", "MAX_GRAMMAR_CHARS", "MAX_LEVELS",
           "MAX_SCHEMA_DEPTH", "PROBE_TOKENS", "STEP_SECONDS", "closed_schema", "json_options", "vocabulary"]
