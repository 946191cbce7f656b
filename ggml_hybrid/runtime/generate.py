"""Generation: prompt processing, then one token at a time until EOS or ``n_predict``, streamed.

``n_predict=-1`` generates until an end-of-generation token or a full context (llama.cpp's ``-n -1``).

``generate`` yields text pieces as they become complete UTF-8 and fills a
:class:`GenerationStats` with timings and (optionally) every evaluated
position's logits, which is what the CLI prints and writes.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..checks import check_callable, check_int
from ..errors import ArgumentError, NonFiniteError
from ..text.vocab import check_ids
from .sampling import Sampler
from .session import Session


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
             stop_at_eos: bool = True) -> Generator[str, None, None]:
    """Yield the generated text piece by piece; ``stats`` (if given) is filled as it goes.

    ``n_predict=-1``: until end of generation or a full context. A ``sampler`` with ``accept``
    and ``reset`` (a :class:`Sampler`) is shown the prompt and every kept token, for its penalties.
    On a ``KeyboardInterrupt`` the stats describe what ran (``stop_reason`` "interrupted") and
    the interrupt propagates.
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
        while n_predict < 0 or i < n_predict:
            tok = sampler(logits[-1])
            if stop_at_eos and tok in eog:
                st.stop_reason = "eos"
                break
            if accept is not None:
                accept(tok)
            st.tokens.append(tok)
            st.generated_tokens += 1
            piece = text.push(tok)
            if piece:
                yield piece
            i += 1
            if i == n_predict:
                break
            if model.n_past >= model.n_ctx:
                st.stop_reason = "context"
                break
            logits = check_finite(model, model.eval([tok], "last"))
            st.decode_steps += 1
            if keep_logits:
                st.logits.append(logits)
    except KeyboardInterrupt:
        st.stop_reason = "interrupted"
        raise
    finally:
        if phase == "prompt":
            st.prompt_seconds = time.perf_counter() - t0
        else:
            st.decode_seconds = time.perf_counter() - t0
    rest = text.flush()
    if rest:
        yield rest


def complete(model: Session, prompt_tokens: Iterable[int], n_predict: int, sampler: Sampler | None = None,
             keep_logits: bool = False, stop_at_eos: bool = True) -> tuple[str, GenerationStats]:
    """:func:`generate` run to the end: the whole text and its stats."""
    st = GenerationStats()
    text = "".join(generate(model, prompt_tokens, n_predict, sampler, st, keep_logits, stop_at_eos))
    return text, st


__all__ = ["GenerationStats", "check_finite", "complete", "generate"]
