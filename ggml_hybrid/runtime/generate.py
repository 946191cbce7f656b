"""Generation: prompt processing, then one token at a time until EOS or ``n_predict``, streamed.

``n_predict=-1`` generates until an end-of-generation token or a full context (llama.cpp's ``-n -1``).

A model loaded with speculative decoding (``spec_type``) generates with a :class:`~.speculative.Speculator`: each
step drafts tokens and verifies them in one target step; the tokens (and, greedy, every evaluated position's
logits) are those of plain decoding.

``generate`` yields text pieces as they become complete UTF-8 and fills a
:class:`GenerationStats` with timings and (optionally) every evaluated
position's logits, which is what the CLI prints and writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Generator, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..checks import check_callable, check_int
from ..errors import ArgumentError, NonFiniteError
from ..text.vocab import check_ids
from .sampling import Sampler
from .session import Session
from .speculative import SpecCounters, SpecItem, Speculator


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0                             # tokens evaluated after the prompt
    tokens: list[int] = field(default_factory=list)  # generated ids
    # "eos" (any end-of-generation token), "length", "context", or "interrupted" (KeyboardInterrupt)
    stop_reason: str = ""
    logits: list[np.ndarray] = field(default_factory=list)
    spec: SpecCounters | None = None  # speculative decoding's counters (None: plain decoding)
    benchmark_only: bool = False      # the drafts were replayed (spec_type=replay): a benchmark's run

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prompt's logits; each token evaluated after it is a step
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def all_logits(self) -> np.ndarray:
        return np.concatenate(self.logits, axis=0).astype(np.float32) if self.logits else np.zeros((0, 0), np.float32)


def check_finite(model: Session, logits: np.ndarray) -> np.ndarray:
    """``logits`` (the rows of the positions just evaluated) if all are finite; else a :class:`NonFiniteError`
    naming the first bad position. NaN logits come from broken weights, and sampling would hide them."""
    ok = np.isfinite(logits).all(axis=-1)
    if not ok.all():
        pos = model.n_past - len(logits) + int(np.argmin(ok))
        raise NonFiniteError(f"the model computed non-finite logits (NaN or infinity) at position {pos}: its weights "
                             "hold NaN or infinite values or overflow (session option check_tensors=true checks the "
                             "weights at load)")
    return logits


def generate(model: Session, prompt_tokens: Iterable[int], n_predict: int, sampler: Sampler | None = None,
             stats: GenerationStats | None = None, keep_logits: bool = False,
             stop_at_eos: bool = True, speculator: Speculator | None = None) -> Generator[str, None, None]:
    """Yield the generated text piece by piece; ``stats`` (if given) is filled as it goes.

    ``n_predict=-1``: until end of generation or a full context. A ``sampler`` with ``accept``
    and ``reset`` (a :class:`Sampler`) is shown the prompt and every kept token, for its penalties.
    On a ``KeyboardInterrupt`` the stats describe what ran (``stop_reason`` "interrupted") and
    the interrupt propagates. ``speculator``: speculative decoding's drafts and limits (default, for a model
    loaded with ``spec_type=draft-mtp``: its head's, with the model's options; speculation needs a
    :class:`Sampler`).
    """
    check_int(n_predict, "generate: n_predict (-1 = until the end)", -1)
    sampler = Sampler() if sampler is None else check_callable(sampler, "generate: sampler")
    st = stats if stats is not None else GenerationStats()
    prompt = check_ids(prompt_tokens, model.tokenizer.n_vocab, "generate: prompt_tokens")
    if not prompt:
        raise ArgumentError("generate: the prompt has no tokens")
    accept = getattr(sampler, "accept", None)
    if hasattr(sampler, "reset"):
        sampler.reset()
    model.reset()
    steps = _Steps(model, sampler, speculator, st, keep_logits, model.tokenizer.eog_ids if stop_at_eos else ())
    text = model.tokenizer.stream()
    eog = model.tokenizer.eog_ids
    t0 = time.perf_counter()
    phase = "prompt"
    try:
        logits = check_finite(model, model.eval(prompt, "all" if keep_logits else "last"))
        st.prompt_seconds = time.perf_counter() - t0
        st.prompt_tokens = len(prompt)  # counted once evaluated: an interrupted prompt reports none
        if keep_logits:
            st.logits.append(logits)
        if accept is not None:
            for t in prompt:
                accept(t)
        st.stop_reason = "length"
        phase = "decode"
        t0 = time.perf_counter()
        i = 0
        queue = [sampler(logits[-1])]  # tokens emitted and not yet shown: one, or a speculative step's several
        tok = -1
        while n_predict < 0 or i < n_predict:
            if not queue:  # the last one shown is evaluated
                if model.n_past >= model.n_ctx:
                    st.stop_reason = "context"
                    break
                queue = steps.next(tok, n_predict - i if n_predict >= 0 else model.n_ctx)
            tok = queue.pop(0)
            if stop_at_eos and tok in eog:
                st.stop_reason = "eos"
                break
            if accept is not None and not queue:  # a kept draft (not the step's last token) is accepted already
                accept(tok)
            st.tokens.append(tok)
            st.generated_tokens += 1
            piece = text.push(tok)
            if piece:
                yield piece
            i += 1
    except KeyboardInterrupt:
        st.stop_reason = "interrupted"
        raise
    finally:
        steps.finish()
        if phase == "prompt":
            st.prompt_seconds = time.perf_counter() - t0
        else:
            st.decode_seconds = time.perf_counter() - t0
    rest = text.flush()
    if rest:
        yield rest


class _Steps:
    """:func:`generate`'s decode steps: one token each, or (``speculator``, the default for a model loaded with
    ``spec_type=draft-mtp``) a speculative step's several, whose counters go to ``st.spec``."""

    def __init__(self, model: Session, sampler: Callable[[np.ndarray], int], speculator: Speculator | None,
                 st: GenerationStats, keep_logits: bool, stop_at: Collection[int]):
        if speculator is None and model.options.spec_type == "draft-mtp":
            speculator = Speculator(model)
        if speculator is not None and not isinstance(sampler, Sampler):
            raise ArgumentError("generate: speculative decoding judges drafts by the sampler's distribution; give a "
                                "Sampler")
        self.model, self.sampler, self.speculator, self.st = model, sampler, speculator, st
        self.keep_logits, self.stop_at = keep_logits, stop_at
        if speculator is not None:
            speculator.forget(0)
            st.spec = SpecCounters()
            st.benchmark_only = speculator.benchmark_only
            self.before = speculator.counters.copy()

    def next(self, tok: int, budget: int) -> list[int]:
        """Evaluate ``tok`` (and any drafts, at most ``budget`` tokens kept): the tokens that follow it."""
        model, st = self.model, self.st
        start = model.n_past
        if self.speculator is None:
            rows = model.eval([tok], "last")
            out = None
        else:
            assert isinstance(self.sampler, Sampler)
            out = self.speculator.step([SpecItem(0, tok, self.sampler, budget, self.stop_at)])[0]
            error = self.speculator.last_errors[0]
            if error is not None:
                raise error
            rows = self.speculator.last_rows[0][:model.n_past - start]
        check_finite(model, rows)
        st.decode_steps += model.n_past - start
        if self.keep_logits:
            st.logits.append(rows)
        return [self.sampler(rows[-1])] if out is None else out

    def finish(self) -> None:
        if self.speculator is not None:
            self.st.spec = self.speculator.counters.since(self.before)


def complete(model: Session, prompt_tokens: Iterable[int], n_predict: int, sampler: Sampler | None = None,
             keep_logits: bool = False, stop_at_eos: bool = True,
             speculator: Speculator | None = None) -> tuple[str, GenerationStats]:
    """:func:`generate` run to the end: the whole text and its stats."""
    st = GenerationStats()
    text = "".join(generate(model, prompt_tokens, n_predict, sampler, st, keep_logits, stop_at_eos, speculator))
    return text, st


__all__ = ["GenerationStats", "check_finite", "complete", "generate"]
