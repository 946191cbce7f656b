"""Speculative decoding: drafts, one verify step for them, and the tokens the target keeps.

A *step* of a sequence starts from its last token ``id_last`` (sampled, not yet evaluated). A draft source proposes
up to ``draft_max`` tokens after it; the target evaluates ``[id_last, d1, ..., dk]`` as one verify step
(:meth:`Session.verify`: each row bit-identical to a one-token decode step, every layer's experts one call); then
the rows' distributions decide, left to right, which drafts the target keeps (:func:`accept_drafts`) and the first
row not explained by a draft gives one more token. The step emits the kept drafts and that token;
:meth:`Session.accept` keeps ``id_last`` and the kept drafts in the sequence. With greedy sampling a draft is kept
exactly when it is the target's argmax, so the tokens are those of plain decoding, and so are the logits of every
evaluated position, bit for bit.

The draft sources:

- :class:`HeadDrafts` (``spec_type=draft-mtp``): the model's own next-token-prediction head, as llama.cpp's
  ``draft-mtp`` runs it (``common/speculative.cpp``): the head's cache is filled with the positions the target
  evaluated (in one batch, when it next drafts: :meth:`Session.draft_fill`), then each draft step runs the head on
  the token before with the hidden state before it (the target's, then the head's own) and takes the head's argmax;
  drafting stops at ``draft_max`` tokens or at a token whose probability among the head's top 10 is below
  ``draft_p_min`` (llama.cpp's draft sampler: top-k 10, greedy); a draft shorter than ``draft_min`` is dropped.
- :class:`ReplayDrafts` (``spec_type=replay``, benchmarks and tests only): the drafts are a given token sequence,
  each draft token replaced by a wrong one with probability ``1 - accept`` (seeded, by position), so accepted and
  rejected paths run at a chosen rate on a model whose own head would be noise (random weights). What it produces is
  marked benchmark-only wherever it is reported, and the server refuses it.

*Backoff* (``draft_backoff``, on by default): after two verify steps in a row that kept no draft (a draft step that
proposed none counts as one), a sequence pauses drafting for 2, then 4, ... up to 64 tokens, decoding plain steps (a
step in which no sequence drafts is :meth:`Session.eval` / :meth:`Session.decode`, as without speculation); the
head's rows wait unfilled in :class:`~ggml_hybrid.runtime.draft_head.DraftHead`. The step after a pause is a *probe*
(:attr:`DraftRequest.probe`): it drafts one token (``draft_min`` if larger) without filling the head (its draft step
hides the unfilled cells), and the draft is not verified but judged by the token its plain step emits (kept exactly
when a verify step would keep it). A probe that matches resets the pause (the next step fills the waiting rows and
drafts in full); one that fails pauses again. Speculation that does not pay thus costs one head step every 64 tokens.
The tokens never change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from ..checks import check_int, check_real
from ..errors import ArgumentError
from .sampling import Sampler
from .session import Session

DRAFT_TOP_K = 10  # llama.cpp's draft sampler: top-k 10, the probability of the best among them (common_speculative)
BACKOFF_MAX = 64  # the longest pause, in tokens


@dataclass
class SpecCounters:
    """What speculation did: the draft tokens proposed and kept, the verify steps (a target step with drafts), the
    head's steps (calls of its draft graph), the head's cache rows filled, the target steps without drafts."""

    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    draft_steps: int = 0
    filled: int = 0
    plain_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def copy(self) -> SpecCounters:
        return dataclasses.replace(self)

    def since(self, before: SpecCounters) -> SpecCounters:
        """What was counted after ``before`` (a :meth:`copy` of these counters then)."""
        return SpecCounters(*(getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)))

    def add(self, other: SpecCounters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_json(self) -> dict[str, float | int]:
        return {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": round(self.acceptance, 6),
                "verify_steps": self.verify_steps, "draft_steps": self.draft_steps, "head_rows_filled": self.filled,
                "plain_steps": self.plain_steps}


class SpecItem(NamedTuple):
    """One sequence of a speculative step: its last token (sampled, not evaluated), its sampler (``None``: no drafts,
    and the caller samples from the step's row itself: a request whose logits a grammar masks), the tokens it may
    still emit (at least 1) and its end-of-generation tokens."""

    seq: int
    id_last: int
    sampler: Sampler | None
    budget: int
    stop: Collection[int] = ()


@dataclass
class DraftRequest:
    """One sequence that drafts now: its last token, how many drafts it may take, and whether it is a probe of the
    backoff (its drafts are judged against the plain step's token, not verified: a source may spend less on it)."""

    seq: int
    id_last: int
    n_max: int
    probe: bool = False


class DraftSource(Protocol):
    #: whether what it produces is the model's own (False) or a benchmark's staging (True)
    benchmark_only: bool

    def propose(self, model: Session, requests: Sequence[DraftRequest], counters: SpecCounters) -> list[list[int]]:
        """The drafts of each request, in order (each at most its ``n_max`` tokens)."""
        ...


@dataclass
class HeadDrafts:
    """The model's own next-token-prediction head (``spec_type=draft-mtp``)."""

    p_min: float = 0.0
    benchmark_only: bool = False

    def propose(self, model: Session, requests: Sequence[DraftRequest], counters: SpecCounters) -> list[list[int]]:
        head = model.head
        if head is None:
            raise ArgumentError("HeadDrafts: the model was loaded without its draft head (spec_type=draft-mtp)")
        # a probe does not fill: the positions since the head's last fill stay holes its attention skips (filled
        # when the sequence drafts for real, after a probe whose draft the target kept); the others fill them now,
        # and so does a probe once an ubatch of them waits (what waits is a hidden row per position: bounded)
        ub = model.options.ubatch_size
        counters.filled += model.draft_fill([r.seq for r in requests if not r.probe or head.waiting(r.seq) >= ub])
        out: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.n_max > 0]
        toks = {i: requests[i].id_last for i in live}
        states = {i: head.last_h[requests[i].seq] for i in live}
        holes = {i: head.waiting(requests[i].seq) for i in live}  # 0 but for probes
        step = 0
        while live:
            logits, hidden = model.draft_step([(requests[i].seq, [toks[i]], states[i], holes[i] + step)
                                               for i in live], [holes[i] for i in live])
            counters.draft_steps += 1
            nxt = []
            for row, i in enumerate(live):
                tok, p = draft_choice(logits[row])
                if p < self.p_min:
                    continue
                out[i].append(tok)
                if len(out[i]) < requests[i].n_max:
                    toks[i], states[i] = tok, hidden[row]
                    nxt.append(i)
            live = nxt
            step += 1
        return out


def draft_choice(logits: np.ndarray) -> tuple[int, float]:
    """llama.cpp's draft sampler on one row: the best token, and its probability among the top ``DRAFT_TOP_K``."""
    z = np.asarray(logits, np.float64)
    k = min(DRAFT_TOP_K, z.size)
    top = np.argpartition(-z, k - 1)[:k]
    best = int(top[np.argmax(z[top])])
    e = np.exp(z[top] - z[best])
    return best, float(1.0 / e.sum())


@dataclass
class ReplayDrafts:
    """Benchmarks and tests only: the drafts are ``tokens`` (the sequence's tokens by position, e.g. the prompt and
    a plain greedy continuation), each draft token replaced by a wrong one (the next id) with probability
    ``1 - accept``, drawn once per position from ``seed``; ``pattern``, when given, decides instead: position p's
    draft is the replayed token when ``pattern[p % len(pattern)]`` is true."""

    tokens: Sequence[int]
    accept: float = 1.0
    seed: int = 0
    pattern: Sequence[bool] | None = None
    benchmark_only: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        check_real(self.accept, "ReplayDrafts: accept", 0.0, 1.0)
        check_int(self.seed, "ReplayDrafts: seed", 0)
        self.tokens = [int(t) for t in self.tokens]
        if self.pattern is not None:
            self.pattern = [bool(x) for x in self.pattern]
            if not self.pattern:
                raise ArgumentError("ReplayDrafts: pattern must hold at least one flag")
        self._right = np.random.default_rng(self.seed).random(max(len(self.tokens), 1)) < self.accept

    def right(self, pos: int) -> bool:
        if self.pattern is not None:
            return self.pattern[pos % len(self.pattern)]
        return bool(self._right[pos]) if pos < len(self._right) else False

    def propose(self, model: Session, requests: Sequence[DraftRequest], counters: SpecCounters) -> list[list[int]]:
        out = []
        for r in requests:
            pos = model.position(r.seq) + 1  # the first draft follows id_last
            drafts = []
            for p in range(pos, min(pos + r.n_max, len(self.tokens))):
                t = self.tokens[p]
                drafts.append(t if self.right(p) else (t + 1) % model.hp.n_vocab)
            out.append(drafts)
        return out


def accept_drafts(sampler: Sampler, rows: np.ndarray, drafts: Sequence[int],
                  q: Sequence[npt.ArrayLike] | None = None, stop: Collection[int] = ()) -> list[int]:
    """The tokens a verify step emits: the drafts the target keeps, then one more (the rejection rule).

    ``rows[i]``: the target's logits after the i-th token of the step (``rows[0]`` after ``id_last``), so draft i is
    judged by ``rows[i]``; ``len(rows) == len(drafts) + 1``. Draft i is kept with probability ``min(1, p(d)/q(d))``,
    p the sampler's distribution of row i (:meth:`Sampler.candidates`: penalties, top-k/p, min-p, temperature, with
    the kept drafts in its history) and q the distribution the draft was drawn from (``q[i]`` over the vocabulary;
    ``None``: each draft was chosen deterministically, q its point mass); at the first draft not kept, the emitted
    token is drawn from ``max(p - q, 0)`` normalized, and the step ends; if every draft is kept, the last row gives
    one more token. The emitted tokens are then distributed as the target's own (Leviathan et al., 2023). Greedy
    (temperature 0): a draft is kept exactly when it is the argmax, and the emitted token is the argmax: plain
    decoding's tokens.

    The kept drafts are ``accept``-ed into the sampler (its penalties' history) as they are judged; the last emitted
    token is not (the caller accepts it when it keeps it). An emitted draft in ``stop`` (end of generation) ends the
    step there, the draft itself last. The caller keeps ``len(result) - 1`` drafts in the sequence.
    """
    if len(rows) != len(drafts) + 1:
        raise ArgumentError(f"accept_drafts: {len(rows)} rows of logits for {len(drafts)} drafts (need one more)")
    out: list[int] = []
    for i, d in enumerate(drafts):
        d = int(d)
        ids, p = sampler.candidates(rows[i])
        if sampler.greedy or len(ids) == 1:
            best = int(ids[0])
            kept = best == d
            token = d if kept else best
        else:
            p_d = float(p[ids == d].sum())
            q_i = None if q is None else np.asarray(q[i], np.float64)
            q_d = 1.0 if q_i is None else float(q_i[d])
            kept = q_d > 0 and sampler.random() < min(1.0, p_d / q_d)
            token = d if kept else _residual(sampler, ids, p, d, q_i)
        out.append(token)
        if not kept or token in stop:
            return out
        sampler.accept(d)
    out.append(sampler(rows[len(drafts)]))
    return out


def _residual(sampler: Sampler, ids: np.ndarray, p: np.ndarray, d: int, q: np.ndarray | None) -> int:
    """A draw from ``max(p - q, 0)`` normalized (over ``ids``, where p lives): the rejected draft's correction."""
    r = p.copy()
    if q is None:
        r[ids == d] = 0.0
    else:
        r = np.maximum(r - q[ids], 0.0)
    total = r.sum()
    if not total > 0:  # p and q agree up to rounding: any draw from p is right
        r, total = p.copy(), p.sum()
    return sampler.choose(ids, r / total)


MISSES_TO_PAUSE = 2  # verify steps in a row that keep nothing before drafting pauses


@dataclass
class _SeqState:
    misses: int = 0       # verify steps in a row that kept nothing
    paused: int = 0       # plain steps left before the next probe
    probing: bool = False  # a pause ended: the next step drafts one token only (a probe is cheap when it fails)
    backoff: int = 2      # the next pause's length (doubles, up to BACKOFF_MAX)


class Speculator:
    """Speculative decoding for one model (every sequence slot of it): the draft source, the limits, the backoff.

    ``source``: the drafts (default: the model's head, ``spec_type=draft-mtp``; :class:`ReplayDrafts` for
    ``spec_type=replay``). ``draft_max``, ``draft_min``, ``p_min``, ``backoff``: the model's options unless given.
    """

    def __init__(self, model: Session, source: DraftSource | None = None, *, draft_max: int | None = None,
                 draft_min: int | None = None, p_min: float | None = None, backoff: bool | None = None) -> None:
        opts = model.options
        if opts.spec_type == "none":
            raise ArgumentError("Speculator: the model was loaded without speculative decoding (spec_type=none)")
        self.model = model
        self.draft_max = check_int(opts.draft_max if draft_max is None else draft_max, "Speculator: draft_max", 1,
                                   opts.draft_max)
        self.draft_min = check_int(opts.draft_min if draft_min is None else draft_min, "Speculator: draft_min", 0,
                                   self.draft_max)
        p = opts.draft_p_min if p_min is None else p_min
        check_real(p, "Speculator: p_min", 0.0, 1.0)
        self.backoff = opts.draft_backoff if backoff is None else bool(backoff)
        if source is None:
            if opts.spec_type != "draft-mtp":
                raise ArgumentError(f"Speculator: spec_type={opts.spec_type} needs a draft source (ReplayDrafts); "
                                    "only draft-mtp drafts with the model's own head")
            source = HeadDrafts(p_min=float(p))
        self.source = source
        self.counters = SpecCounters()
        self._seqs: dict[int, _SeqState] = {}
        #: the logits of the last step's verify rows, per item (row i: after the i-th token of its step)
        self.last_rows: list[np.ndarray] = []
        #: per item of the last step: the exception its sampler raised (it emitted nothing), or None
        self.last_errors: list[Exception | None] = []

    @property
    def benchmark_only(self) -> bool:
        return self.source.benchmark_only

    def forget(self, seq: int) -> None:
        """Sequence ``seq`` starts anew (its backoff too)."""
        self._seqs.pop(seq, None)

    def step(self, items: Sequence[SpecItem]) -> list[list[int]]:
        """One step of several sequences: each drafts up to ``min(draft_max, budget - 1)`` tokens, all verify
        together, and each keeps what its sampler's rejection rule keeps. Returns the emitted tokens of each item (at
        least one: the last is not evaluated yet, the sequence's next ``id_last``; a token of its ``stop`` is emitted
        last); none for an item without a sampler (its one row is :attr:`last_rows`' to sample from: the sequence
        keeps ``id_last`` only)."""
        requests = [r for r in (self._request(it) for it in items) if r is not None]
        proposed = self.source.propose(self.model, requests, self.counters) if requests else []
        drafts: dict[int, list[int]] = {}
        probes: dict[int, int] = {}  # a probe's first draft, judged by the token its plain step gives
        for r, d in zip(requests, proposed):
            if len(d) < max(self.draft_min, 1):
                self._missed(r.seq)  # nothing worth verifying: a plain step
            elif r.probe:
                probes[r.seq] = int(d[0])
            else:
                drafts[r.seq] = list(d)
        self.last_errors = [None] * len(items)
        if drafts:
            rows = self.model.verify([(it.seq, [it.id_last] + drafts.get(it.seq, [])) for it in items])
        else:  # nothing to verify (every sequence paused, probing or plain): a decode step as without speculation
            logits = self.model.eval([items[0].id_last], "last", items[0].seq) if len(items) == 1 else \
                self.model.decode([(it.seq, it.id_last) for it in items])
            rows = [logits[i:i + 1] for i in range(len(items))]
        self.last_rows = rows
        return [self._keep(i, it, drafts.get(it.seq, []), lg, bool(drafts), probes.get(it.seq))
                for i, (it, lg) in enumerate(zip(items, rows))]

    def _request(self, it: SpecItem) -> DraftRequest | None:
        """Whether ``it`` drafts this step, and how many tokens at most (the pause, the budget, the context)."""
        st = self._seqs.setdefault(it.seq, _SeqState())
        room = self.model.n_ctx - self.model.position(it.seq) - 1  # the verify step's rows must fit the context
        n_max = min(self.draft_max, it.budget - 1, room) if it.sampler is not None else 0
        if st.paused > 0 or n_max < max(self.draft_min, 1):
            if st.paused > 0:
                st.paused -= 1
                st.probing = st.paused == 0
            return None
        if st.probing:
            return DraftRequest(it.seq, it.id_last, min(n_max, max(self.draft_min, 1)), probe=True)
        return DraftRequest(it.seq, it.id_last, n_max)

    def _keep(self, i: int, it: SpecItem, drafts: list[int], rows: np.ndarray, verified: bool,
              probe: int | None) -> list[int]:
        """Item ``i``'s emitted tokens by its sampler's rule; the sequence keeps ``id_last`` and the kept drafts
        (``verified``: the step was a verify step, which keeps them now; else a decode step kept ``id_last``).
        ``probe``: the draft of a probe, which the emitted token judges."""
        if it.sampler is None:
            if verified:
                self.model.accept(it.seq, 1)
            self.counters.plain_steps += 1
            return []
        try:
            emitted = accept_drafts(it.sampler, rows, drafts, stop=it.stop)
        except Exception as exc:  # this sequence's sampler failed: it alone fails, it keeps id_last only
            if verified:
                self.model.accept(it.seq, 1)
            self.last_errors[i] = exc
            return []
        kept = len(emitted) - 1
        if verified:
            self.model.accept(it.seq, 1 + kept)
        if not drafts:
            self.counters.plain_steps += 1
            # a probe's draft is kept exactly when a verify step would have kept it: it is the target's token (not
            # counted as drafted: the counters count verified drafts, as each request's do)
            if probe is not None:
                if emitted[0] == probe:
                    self._seqs[it.seq] = _SeqState()
                else:
                    self._missed(it.seq)
            return emitted
        self.counters.drafted += len(drafts)
        self.counters.accepted += kept
        self.counters.verify_steps += 1
        if kept:
            self._seqs[it.seq] = _SeqState()
        else:
            self._missed(it.seq)
        return emitted

    def _missed(self, seq: int) -> None:
        st = self._seqs.setdefault(seq, _SeqState())
        st.misses += 1
        if self.backoff and st.misses >= MISSES_TO_PAUSE:
            st.paused = st.backoff
            st.backoff = min(2 * st.backoff, BACKOFF_MAX)


__all__ = ["BACKOFF_MAX", "DRAFT_TOP_K", "MISSES_TO_PAUSE", "DraftRequest", "DraftSource", "HeadDrafts", "ReplayDrafts",
           "SpecCounters", "SpecItem", "Speculator", "accept_drafts", "draft_choice"]
