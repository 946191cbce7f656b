"""Continuous batching: requests share a model's sequence slots and generate together.

One thread, the engine's, runs *steps* on the model (it alone calls it while the engine is open):

- a **decode step** computes the next token of every sequence that is generating, all in one
  ubatch (:meth:`Session.decode`);
- a **prompt step** evaluates the next piece of one waiting prompt, cut where a lone ``eval`` of
  the whole prompt cuts its ubatches (:meth:`Session.ubatch_ends`), so the prompt's logits and KV
  cells are the lone run's.

With speculative decoding (the model's ``spec_type=draft-mtp``), a decode step is a speculative step of every
generating sequence (:class:`~.speculative.Speculator`): each drafts with the model's head, all verify in one step,
and each keeps the drafts its own sampler's rejection rule keeps, so a step emits one or more tokens per sequence
(a request under a grammar drafts nothing: its token is drawn from the masked row, as without speculation).

When prompts wait while sequences generate, prompt and decode steps alternate, so a long prompt
delays the others' tokens by one prompt step at a time, not by the whole prompt. Between steps,
queued requests take free slots (first come, first served) and finished or cancelled ones give
theirs back, their cells cleared. Since every sequence's logits are bit-identical to running it
alone, so is its text for the same sampler seed: batching changes when a request's tokens come,
never which.

A :class:`Request` is filled from the engine thread: text pieces as they become final (a piece
that may be the start of a stop string is held back until it is not), then the finish reason. A request
with a ``constraint`` (a grammar's state, :mod:`.grammar`) has its logits masked by it before its sampler
draws, and ends ("stop") when the grammar takes nothing more.
``listener`` (if given) is called, from the engine thread, after each change (and after each prompt step).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from ..errors import ArgumentError, ClosedError, ContextFullError, GgmlHybridError
from ..text.vocab import TextStream
from .grammar import Constraint
from .logprobs import TokenLogprob, token_logprob
from .prompt_cache import MAX_CHECKPOINTS, PromptCache
from .sampling import Sampler
from .session import Session
from .speculative import SpecCounters, SpecItem, Speculator

QUEUED, PROMPT, DECODE, DONE = "queued", "prompt", "decode", "done"
RATE_WINDOW = 10.0  # seconds of decode steps the tokens-per-second figure covers


class StepRate:
    """Tokens per second of the decode steps that ended in the last ``window`` seconds.

    Kept as running sums of integer nanoseconds and tokens, so each step costs O(1) whatever the rate (a sum
    over the window every step cost a quarter of a small model's engine thread at 1,500 steps a second) and
    the figure is exactly the one a fresh sum over the window gives."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window_ns = int(window * 1e9)
        self._steps: deque[tuple[int, int, int]] = deque()  # (end, duration, tokens), nanoseconds
        self._busy_ns = 0
        self._tokens = 0

    def add(self, end_ns: int, duration_ns: int, tokens: int) -> None:
        self._steps.append((end_ns, duration_ns, tokens))
        self._busy_ns += duration_ns
        self._tokens += tokens

    def rate(self, now_ns: int) -> float:
        steps = self._steps
        while steps and steps[0][0] < now_ns - self.window_ns:
            _, d, n = steps.popleft()
            self._busy_ns -= d
            self._tokens -= n
        return self._tokens / (self._busy_ns / 1e9) if self._busy_ns else 0.0


class StopText:
    """Text after the stop strings: what may be the start of one is held back until it is not.

    ``push`` returns the text that is final and whether a stop string ended it (the stop string and
    anything after it are dropped, as OpenAI's ``stop`` does).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> tuple[str, bool]:
        text = self.held + piece
        found = [(i, -len(s), s) for s in self.stops for i in (text.find(s),) if i >= 0]
        if found:
            cut, _, self.matched = min(found)  # the first one found (the longest of those that start there)
            self.held = ""
            return text[:cut], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation: a prompt, its sampler and limits; filled in by the engine as it runs."""

    prompt: list[int]
    sampler: Sampler
    max_tokens: int | None = None      # None: until an end-of-generation token or a full context
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    listener: Callable[[], object] | None = None
    cache_prompt: bool = True          # reuse what a slot holds of the prompt, leave it for later (prompt_cache.py)
    logprobs: int | None = None        # None: none; k: each token's log-probability and the k likeliest
    constraint: Constraint | None = None  # a grammar: its mask applied to the logits before the sampler
    id: int = field(default_factory=lambda: next(_ids))
    # -- filled in by the engine (read them after ``done`` is set, or under ``lock``) --
    state: str = QUEUED
    seq: int | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop", "length", "cancelled" or "error"
    n_reused: int = 0                  # prompt positions kept from what the slot held (not evaluated)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # with ``logprobs``: one per token
    error: str | None = None
    exception: BaseException | None = None  # what failed it ("error"): a GrammarError is the grammar's fault
    n_drafted: int = 0                 # speculative decoding: draft tokens verified for this request
    n_accepted: int = 0                # and kept
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None    # took a slot
    first_token_at: float | None = None
    finished_at: float | None = None

    lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    done: threading.Event = field(init=False, repr=False, default_factory=threading.Event)
    _pieces: list[str] = field(init=False, repr=False, default_factory=list)  # final, not yet taken
    _n_logprobs_taken: int = field(init=False, repr=False, default=0)
    _text: list[str] = field(init=False, repr=False, default_factory=list)    # all final text
    _cancelled: bool = field(init=False, repr=False, default=False)
    _n_prompt_done: int = field(init=False, repr=False, default=0)
    _pending: int = field(init=False, repr=False, default=-1)  # sampled, not yet evaluated
    _stops: StopText = field(init=False, repr=False)
    _stream: TextStream | None = field(init=False, repr=False, default=None)
    _engine: Engine | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            check_int(self.max_tokens, "Request: max_tokens", 1)
        if self.logprobs is not None:
            check_int(self.logprobs, "Request: logprobs", 0)
        if not self.prompt:
            raise ArgumentError("Request: the prompt has no tokens")
        self._stops = StopText(self.stop)

    # -- the caller's side ----------------------------------------------------

    def cancel(self) -> None:
        """Stop generating: the engine frees the slot before its next step (``finish_reason`` "cancelled")."""
        self._cancelled = True
        if self._engine is not None:
            self._engine._wake()

    def take(self) -> list[str]:
        """The text pieces that became final since the last call."""
        with self.lock:
            out, self._pieces = self._pieces, []
        return out

    def take_logprobs(self) -> list[TokenLogprob]:
        """The tokens' log-probabilities added since the last call (with ``logprobs``)."""
        with self.lock:
            out = self.token_logprobs[self._n_logprobs_taken:]
            self._n_logprobs_taken = len(self.token_logprobs)
        return out

    @property
    def text(self) -> str:
        with self.lock:
            return "".join(self._text)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (None: another reason)."""
        return self._stops.matched

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prompt_done(self) -> int:
        """The prompt positions the slot holds so far: those reused, then those evaluated by prompt steps."""
        return self._n_prompt_done

    # -- the engine's side ----------------------------------------------------

    def _post(self, text: str) -> None:
        if text:
            with self.lock:
                self._pieces.append(text)
                self._text.append(text)

    def _notify(self) -> None:
        if self.listener is not None:
            self.listener()


@dataclass
class EngineStats:
    """What the engine has done, for metrics: totals since start and the state now."""

    requests: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0     # kept from what a slot held (runtime/prompt_cache.py)
    prompt_tokens_evaluated: int = 0  # computed by prompt steps
    generated_tokens: int = 0
    decode_steps: int = 0
    prompt_steps: int = 0
    decode_ns: int = 0  # time in decode steps (the model's decode), nanoseconds
    prompt_ns: int = 0  # time in prompt steps (the model's eval)
    moves: int = 0  # sequences moved to a lower slot (:meth:`Engine._pack`)
    queued: int = 0
    busy_slots: int = 0
    tokens_per_second: float = 0.0  # generated tokens per second of decode steps, over the last RATE_WINDOW s
    spec: SpecCounters | None = None  # speculative decoding's counters (None: plain decoding)


class Engine:
    """Runs requests on ``model``'s sequence slots (``n_parallel``) from a thread of its own.

    A finished request's cells stay in its slot for a later prompt that begins alike (:class:`PromptCache`;
    ``max_checkpoints``: recurrent state copies kept per slot)."""

    def __init__(self, model: Session, name: str = "model",
                 after_step: Callable[[Engine], object] | None = None,
                 max_checkpoints: int = MAX_CHECKPOINTS) -> None:
        self.model = model
        self.cache = PromptCache(model, max_checkpoints)
        self.name = name
        self.n_slots = model.n_parallel
        self._slots: list[Request | None] = [None] * self.n_slots
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._accepting = True
        self._stop = False
        self._last = DECODE
        self._eog = model.tokenizer.eog_ids
        self._rate = StepRate()
        self.stats = EngineStats()
        self._after_step = after_step
        self._calls: list[Callable[[], object]] = []  # run by the engine thread between two steps (between_steps)
        self.spec = Speculator(model) if model.options.spec_type == "draft-mtp" else None
        if model.options.spec_type == "replay":
            raise ArgumentError("spec_type=replay: replayed drafts are for benchmarks and tests; a server drafts with "
                                "the model's own head (spec_type=draft-mtp) or not at all")
        self.stats.spec = self.spec.counters if self.spec is not None else None
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()

    # -- the callers' side ----------------------------------------------------

    def submit(self, req: Request) -> Request:
        """Queue ``req``; it starts when a slot is free. Refused once the engine stops accepting."""
        n_ctx = self.model.n_ctx
        if len(req.prompt) >= n_ctx:
            raise ContextFullError(f"the prompt has {len(req.prompt)} tokens; a sequence's context holds {n_ctx} "
                                   "(the prompt and at least one generated token must fit)")
        bad = [t for t in req.prompt if not 0 <= t < self.model.hp.n_vocab]
        if bad:
            raise ArgumentError(f"token id {bad[0]} is outside the vocabulary 0..{self.model.hp.n_vocab - 1}")
        with self._cond:
            if not self._accepting:
                raise ClosedError(f"{self.name}: the server is shutting down and takes no new requests")
            req._engine = self
            self._queue.append(req)
            self.stats.queued = len(self._queue)
            self._cond.notify()
        return req

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def cancel_all(self) -> None:
        """Cancel every request queued or running (a drain that ran out of time); the engine goes on."""
        with self._cond:
            for r in list(self._queue) + [r for r in self._slots if r is not None]:
                r._cancelled = True
            self._cond.notify()

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not any(self._slots)

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, cancel what is queued or running, and wait for the engine thread to end."""
        with self._cond:
            self._accepting = False
            self._stop = True
            for r in list(self._queue) + [r for r in self._slots if r is not None]:
                r._cancelled = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def slots(self) -> list[dict[str, Any]]:
        """What each slot holds now: its state (``idle``, ``prompt``, ``decode``), the request in it, the positions
        its cells hold and what a next prompt may reuse of them (:meth:`PromptCache.report`)."""
        with self._cond:
            out = []
            for s, r in enumerate(self._slots):
                out.append({"id": s, "state": "idle" if r is None else r.state,
                            "request": None if r is None else r.id, "n_ctx": self.model.n_ctx,
                            "positions": self.model.kv.used[s], **self.cache.report(s)})
            return out

    def between_steps(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread before its next step (at once when it is idle): it sees the model as no
        step is computing with it. An exception of ``fn`` is its own (``fn`` must catch it). Once :meth:`close` has
        begun, a :class:`ClosedError` (what was given before still runs)."""
        with self._cond:
            if self._stop:
                raise ClosedError(f"{self.name}: the engine is closed")
            self._calls.append(fn)
            self._cond.notify()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    gone = self._take_cancelled_queued()
                    self._admit()
                    active = [r for r in self._slots if r is not None]
                    calls, self._calls = self._calls, []
                    if active or gone or calls:
                        break
                    if self._stop:
                        return
                    self._cond.wait()
            for fn in calls:
                fn()
            for r in gone:
                self._finish(r, "cancelled")
            for r in active:
                if r._cancelled:
                    self._finish(r, "cancelled")  # its slot is free before the next step
            self._pack()
            active = [r for r in self._slots if r is not None]
            if active:
                self._step(active)
            self._publish()

    def _take_cancelled_queued(self) -> list[Request]:
        gone = [r for r in self._queue if r._cancelled]
        for r in gone:
            self._queue.remove(r)
        return gone

    def _admit(self) -> None:
        while self._queue:
            free = [s for s in range(self.n_slots) if self._slots[s] is None]
            if not free:
                break
            r = self._queue.popleft()
            seq, n = self.cache.choose(free, r.prompt, r.cache_prompt)
            try:
                self.cache.prepare(seq, r.prompt, n)
            except Exception as exc:  # (a device lost): this request fails, the slot starts empty next time
                self.cache.held[seq] = None
                r.error = " ".join(str(exc).split()) or type(exc).__name__
                self._finish(r, "error")
                continue
            r._n_prompt_done = r.n_reused = n
            self.stats.prompt_tokens_reused += n
            r.seq, r.state, r.started_at = seq, PROMPT, time.perf_counter()
            r.sampler.reset()
            for t in r.prompt:
                r.sampler.accept(t)
            r._stream = self.model.tokenizer.stream()
            self._slots[seq] = r
        self.stats.queued = len(self._queue)

    def _pack(self) -> None:
        """Move the sequences of the highest slots into free lower ones (when no request waits for those).

        A decoder graph is built per set of slots a step decodes; with holes left by finished requests
        every mix of slots would be a graph of its own (a build costs tens of ms). Packed, the busy
        slots are 0..k-1 and decode steps meet about one graph per k. A moved sequence computes
        exactly as before (:meth:`Session.move` copies its cells)."""
        with self._cond:
            if self._queue:
                return  # the free slots are about to be taken
        while True:
            # a free slot that holds a prompt keeps it for a later request (the prompt cache): only empty ones
            free = [s for s, r in enumerate(self._slots) if r is None and self.cache.held[s] is None]
            busy = [s for s, r in enumerate(self._slots) if r is not None]
            if not free or not busy or free[0] > busy[-1]:
                return
            src, dst = busy[-1], free[0]
            r = self._slots[src]
            assert r is not None
            try:
                self.model.move(src, dst)
            except Exception as exc:  # (a device lost mid-copy): this request fails, the others go on
                r.error = " ".join(str(exc).split()) or type(exc).__name__
                self._finish(r, "error")
                return
            self.cache.moved(src, dst)
            with self._cond:
                self._slots[dst], self._slots[src], r.seq = r, None, dst
            self.stats.moves += 1

    def _step(self, active: list[Request]) -> None:
        prompts = [r for r in active if r.state == PROMPT]
        decoding = [r for r in active if r.state == DECODE]
        if prompts and (not decoding or self._last == DECODE):
            self._last = PROMPT
            step = [min(prompts, key=lambda r: r.queued_at)]
        else:
            self._last = DECODE
            step = decoding
        try:
            if self._last == PROMPT:
                self._prompt_step(step[0])
            else:
                self._decode_step(step)
        except Exception as exc:  # the step's requests fail (those not finished yet); the others go on
            for r in step:
                self._fail(r, exc)

    def _fail(self, r: Request, exc: BaseException) -> None:
        if r.state != DONE:  # a request finished earlier in the step keeps its reason (and is counted once)
            r.error = " ".join(str(exc).split()) or type(exc).__name__
            r.exception = exc
            self._finish(r, "error")

    def _prompt_step(self, r: Request) -> None:
        start = r._n_prompt_done
        end = next(e for e in self.model.ubatch_ends(len(r.prompt)) if e > start)
        assert r.seq is not None
        t0 = time.perf_counter_ns()
        logits = self.model.eval(r.prompt[start:end], "last", seq=r.seq)
        self.stats.prompt_ns += time.perf_counter_ns() - t0
        r._n_prompt_done = end
        self.stats.prompt_steps += 1
        self.stats.prompt_tokens_evaluated += end - start
        self.cache.evaluated(r.seq, end)
        if end == len(r.prompt):
            self.stats.prompt_tokens += len(r.prompt)
            r.state = DECODE
            self._next(r, logits[-1])
        else:
            r._notify()  # a stream may report the prompt's progress (llama-server's return_progress)

    def _decode_step(self, rs: list[Request]) -> None:
        if self.spec is not None:
            self._spec_step(rs, self.spec)
            return
        t0 = time.perf_counter_ns()
        logits = self.model.decode([(r.seq, r._pending) for r in rs if r.seq is not None])
        t1 = time.perf_counter_ns()
        self.stats.decode_steps += 1
        self.stats.decode_ns += t1 - t0
        self._rate.add(t1, t1 - t0, len(rs))
        for r, row in zip(rs, logits):
            try:
                self._next(r, row)
            except Exception as exc:  # this sequence's choice failed (its sampler, its text): it alone fails
                self._fail(r, exc)

    def _spec_step(self, rs: list[Request], spec: Speculator) -> None:
        """A speculative step of every generating sequence (the engine's decode step with ``spec_type``)."""
        items = []
        for r in rs:
            assert r.seq is not None
            budget = r.max_tokens - len(r.tokens) if r.max_tokens is not None else self.model.n_ctx
            # a grammar masks the logits before its sampler: no drafts, the row sampled as without speculation
            sampler = r.sampler if r.constraint is None else None
            items.append(SpecItem(r.seq, r._pending, sampler, max(budget, 1), () if r.ignore_eos else self._eog))
        t0 = time.perf_counter_ns()
        emitted = spec.step(items)
        t1 = time.perf_counter_ns()
        self.stats.decode_steps += 1
        self.stats.decode_ns += t1 - t0
        self._rate.add(t1, t1 - t0, sum(max(len(e), 1) for e in emitted))
        for r, toks, rows, err in zip(rs, emitted, spec.last_rows, spec.last_errors):
            try:
                if err is not None:
                    raise err
                if not toks:  # no sampler given: the masked row, as a plain decode step
                    self._next(r, rows[0])
                    continue
                r.n_drafted += len(rows) - 1
                r.n_accepted += len(toks) - 1
                for i, tok in enumerate(toks):
                    last = i == len(toks) - 1
                    self._take(r, tok, rows[i], accepted=not last)  # a kept draft is in the sampler's history
                    if r.state == DONE:
                        break
            except Exception as exc:  # this sequence's choice failed (its sampler, its text): it alone fails
                self._fail(r, exc)

    def _next(self, r: Request, logits: np.ndarray) -> None:
        """Sample r's next token from ``logits`` and decide whether it goes on."""
        c = r.constraint
        tok = r.sampler(logits if c is None else c.mask(logits))
        if c is not None:
            c.accept(tok)
        self._take(r, tok, logits)

    def _take(self, r: Request, tok: int, logits: np.ndarray, accepted: bool = False) -> None:
        """Token ``tok``, drawn from ``logits`` (``accepted``: already in the sampler's history), is r's next:
        decide whether it goes on."""
        c = r.constraint
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        if not r.ignore_eos and tok in self._eog:
            self._finish(r, "stop")
            return
        if not accepted:
            r.sampler.accept(tok)
        if r.logprobs is not None:  # of the very logits the sampler saw
            lp = token_logprob(logits, tok, r.logprobs)
            with r.lock:
                r.token_logprobs.append(lp)
        r.tokens.append(tok)
        self.stats.generated_tokens += 1
        assert r._stream is not None and r.seq is not None
        text, hit = r._stops.push(r._stream.push(tok))
        r._post(text)
        if hit:
            self._finish(r, "stop", flush=False)
        elif c is not None and c.done:
            self._finish(r, "stop")  # the grammar is complete and takes nothing more
        elif r.max_tokens is not None and len(r.tokens) >= r.max_tokens:
            self._finish(r, "length")
        elif self.model.position(r.seq) >= self.model.n_ctx:
            self._finish(r, "length")  # no cell left for this token
        else:
            r._pending = tok
            r._notify()

    def _finish(self, r: Request, reason: str, flush: bool = True) -> None:
        if r.state == DONE:
            return  # finished once: its reason and its count stand
        if flush and r._stream is not None and reason in ("stop", "length"):
            text, hit = r._stops.push(r._stream.flush())
            r._post(text if hit else text + r._stops.flush())
        if reason == "stop" and r.constraint is not None and r.stop_string is None and \
                not r.constraint.whole(r.text):  # llguidance's end is not taken on trust: "stop" is never a lie
            r.exception = GgmlHybridError(f"{r.constraint.grammar.what}: the grammar ended on text that does not "
                                          "parse (llguidance's fault, not the request's)")
            r.error, reason = str(r.exception), "error"
        if r.seq is not None and self._slots[r.seq] is r:
            self._slots[r.seq] = None
            # the cells stay for a later prompt that begins alike (kept only where a cold run's are: PromptCache);
            # otherwise zeroed cells: the next request in this slot starts as a lone run does
            self.cache.finished(r.seq, keep=reason != "error" and r.cache_prompt)
        r.state, r.finish_reason, r.finished_at = DONE, reason, time.perf_counter()
        self.stats.requests[reason] = self.stats.requests.get(reason, 0) + 1
        r.done.set()
        r._notify()

    def _publish(self) -> None:
        self.stats.tokens_per_second = self._rate.rate(time.perf_counter_ns())
        self.stats.busy_slots = sum(1 for r in self._slots if r is not None)
        if self._after_step is not None:
            self._after_step(self)


__all__ = ["Engine", "EngineStats", "Request", "StepRate", "StopText"]
