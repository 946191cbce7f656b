"""The session's side of speculative decoding: verify steps, keeping their tokens, and the draft head's graphs.

:class:`VerifySteps` is a part of :class:`~ggml_hybrid.runtime.session.Session` (a mixin: what a session holds is
the session's; this module holds what a session does for speculative decoding, docs/speculative.md):

- :meth:`verify` evaluates several tokens of several sequences as one step, each token as a decode step of its own
  would compute it, and :meth:`accept` keeps the first of them;
- :meth:`draft_fill` and :meth:`draft_step` run the model's next-token-prediction head
  (:mod:`ggml_hybrid.model.mtp`) over its own cache (:class:`~ggml_hybrid.runtime.draft_head.DraftHead`), on
  schedulers of their own (a step alternates the model's, the fill's and the draft's graphs; one scheduler would
  allocate anew at every switch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..checks import check_int
from ..errors import ArgumentError, ShapeError
from ..ggml.backend import Backend
from ..ggml.context import Arena
from ..ggml.graph_cache import GraphCache
from ..ggml.sched import Scheduler
from ..model.decoder import DecoderGraph
from ..model.kv_cache import KVCache, SeqRows, seq_input
from ..model.mtp import build_head, head_context_size, head_graph_size
from ..model.recurrent_state import RecurrentState
from ..options import SessionOptions
from ..serial import Serial
from .draft_head import DraftHead
from .loaded_model import LoadedModel

if TYPE_CHECKING:
    GraphKey = tuple[tuple[SeqRows, ...], int, str]


class VerifySteps:
    """Verify steps and the draft head, for a :class:`~ggml_hybrid.runtime.session.Session`."""

    # the session's (set by it)
    model: LoadedModel
    options: SessionOptions
    kv: KVCache
    rs: RecurrentState | None
    head: DraftHead | None
    sched: Scheduler
    decode_rows: int
    flash_attn: bool
    _serial: Serial
    _threads: dict[bool, int]
    # per sequence with a verify step waiting for accept(): (start, tokens, hidden rows, recurrent rows)
    _verifying: dict[int, tuple[int, list[int], np.ndarray | None, list[tuple[int, int]]]]
    _head_graphs: GraphCache[DecoderGraph]
    _head_scheds: dict[str, Scheduler]
    _head_active: dict[str, tuple[GraphKey, DecoderGraph]]

    if TYPE_CHECKING:
        def _graph(self, seq_rows: tuple[SeqRows, ...], n_out: int, kind: str = "") -> DecoderGraph: ...
        def _check_open(self, op: str) -> None: ...
        def _check_seq(self, seq: int, op: str) -> int: ...
        def _check_tokens(self, tokens: npt.ArrayLike) -> np.ndarray: ...
        def _inputs(self, parts: list[tuple[int, np.ndarray]], seq_rows: tuple[SeqRows, ...], n_out: int,
                    out_ids: bool, kv: KVCache | None = None, offsets: Sequence[int] | None = None,
                    rs_rows: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]: ...

    def _init_speculation(self, n_graphs: int) -> None:
        """The session's state for verify steps and the draft head, before anything is allocated."""
        self._verifying = {}
        self._head_graphs = GraphCache(n_graphs, head_context_size(self.model.hp, self.options.n_parallel),
                                       self._forget_head_graph)
        self._head_scheds = {}
        self._head_active = {}

    def _close_speculation(self) -> None:
        if hasattr(self, "_head_graphs"):
            self._head_graphs.clear()
        for sched in getattr(self, "_head_scheds", {}).values():
            sched.close()
        if self.head is not None:
            self.head.close()

    def _rewound(self, seq: int, position: int) -> None:
        """Sequence ``seq`` went back to ``position`` (a truncation, a restore, a failed eval, a reset: 0): a verify
        step waiting for it is dropped, and the draft head follows."""
        self._verifying.pop(seq, None)
        if self.head is not None:
            if position == 0:
                self.head.clear(seq)
            else:
                self.head.truncate(seq, position)

    def _record_hidden(self, g: DecoderGraph, parts: list[tuple[int, np.ndarray]]) -> None:
        """The model's hidden state of every row of an ubatch, for the draft head's fills."""
        assert self.head is not None
        hidden, r0 = g.read_hidden().reshape(-1, self.model.hp.n_embd), 0
        for seq, toks in parts:
            self.head.record(seq, toks, hidden[r0:r0 + len(toks)])
            r0 += len(toks)

    def _allocate_head(self, n_ctx: int, kv_backends: list[Backend], rot: tuple[int, int]) -> None:
        """The head's own cache (its one layer, on that layer's KV device) and its two schedulers."""
        model, opts, hp = self.model, self.options, self.model.hp
        assert model.head_layer is not None
        self.head = DraftHead(KVCache(hp.n_layer + 1, n_ctx, hp.kv_k, hp.kv_v, opts.cache_type_k, opts.cache_type_v,
                                      kv_backends, v_trans=not self.flash_attn, clear=not model.dry_run, rot=rot,
                                      layers=[model.head_layer], n_seq=opts.n_parallel), hp.n_embd)
        for kind in ("fill", "draft"):
            self._head_scheds[kind] = Scheduler(list(model.devices.values()) + [model.host],
                                                graph_size=2 * head_graph_size(hp, opts.n_parallel))

    def _reserve_head(self, n_ctx: int, ub: int, n_step: int) -> None:
        """The head's compute buffers at load: a prompt's fill, a draft step of every sequence."""
        self._head_scheds["fill"].reserve(self._graph((SeqRows(0, ub, n_ctx),), ub, "fill").graph)
        self._head_scheds["draft"].reserve(self._graph(tuple(SeqRows(s, 1, n_ctx) for s in range(n_step)), n_step,
                                                       "draft").graph)

    def _head_graph(self, key: GraphKey) -> DecoderGraph:
        """A draft head graph (``key``: seq_rows, n_out, ``"fill"`` or ``"draft"``), its regions registered with the
        scheduler of its kind."""
        seq_rows, _, kind = key
        active = self._head_active.get(kind)
        if active is not None and active[0] == key:
            return active[1]
        sched = self._head_scheds[kind]

        def build(arena: Arena) -> DecoderGraph:
            assert self.head is not None
            model = self.model
            entry = build_head(model.hp, model.weights, model.experts.weights, self.head.kv, seq_rows,
                               self.flash_attn, kind == "fill", arena)
            if len(seq_rows) > 1 and kind == "draft":
                entry.graph.set_rowwise()  # a sequence's drafts do not depend on the others drafting with it
            sched.set_pins(entry.graph, model.pins(entry))
            return entry

        entry = self._head_graphs.get(key, build)
        sched.clear_regions()
        self.model.experts.register(sched, entry.regions)
        self._head_active[kind] = (key, entry)
        return entry

    def verify(self, batch: Sequence[tuple[int, Sequence[int]]]) -> list[np.ndarray]:
        """Several tokens of each of several sequences, ``(seq, tokens)`` pairs, computed as one step (a verify
        step of speculative decoding: the last accepted token and the drafts after it).

        Each token is computed as a decode step of its own would compute it, bit for bit: one row of its own
        (its own attention over the cells before it, one-row products: ``Graph.set_rowwise``), its recurrent state
        written to a row of its own. Every layer's routed experts are one call over all the step's rows (the
        expert cache loads each distinct expert once). Returns the logits [len(tokens), n_vocab] of each
        sequence, in batch order. The sequences stay where they were until :meth:`accept` keeps the tokens the
        drafts earned. All or nothing, as :meth:`decode`.
        """
        self._check_open("verify")
        if self.options.spec_type == "none":
            raise ArgumentError("verify: the model was loaded without speculative decoding (spec_type=none); its "
                                "recurrent state keeps no row per verified token")
        try:
            items = [(s, list(t)) for s, t in batch]
        except (TypeError, ValueError):
            raise ShapeError("verify: batch must be a non-empty sequence of (seq, tokens) pairs") from None
        if not items:
            raise ShapeError("verify: batch must be a non-empty sequence of (seq, tokens) pairs")
        most = self.options.draft_max + 1
        checked: list[tuple[int, np.ndarray]] = []
        for seq, toks in items:
            self._check_seq(seq, "verify")
            if not 1 <= len(toks) <= most:
                raise ArgumentError(f"verify: sequence {seq} has {len(toks)} tokens; a verify step takes 1.."
                                    f"{most} (draft_max={self.options.draft_max} drafts after the last token)")
            checked.append((seq, self._check_tokens(toks)))
        seqs = [s for s, _ in checked]
        if len(set(seqs)) != len(seqs):
            raise ArgumentError(f"verify: a sequence appears more than once in the batch {seqs}")
        with self._serial.turn("verify"):
            for seq, arr in checked:
                self._check_idle(seq, "verify")
                self.kv.n_kv_for(len(arr), seq)  # every sequence has room, or nothing is evaluated
            rows: list[tuple[int, int, int, tuple[int, int]]] = []  # (seq, token, offset, recurrent rows)
            chains: dict[int, list[tuple[int, int]]] = {}
            for seq, arr in checked:
                chain = self.rs.chain(seq, len(arr)) if self.rs is not None else [(0, 0)] * len(arr)
                chains[seq] = chain
                rows += [(seq, int(t), i, chain[i]) for i, t in enumerate(arr)]
            logits, hidden = [], []
            for u0 in range(0, len(rows), self.decode_rows):
                lg, hd = self._verify_ubatch(rows[u0:u0 + self.decode_rows])
                logits.append(lg)
                hidden.append(hd)
            all_logits = np.concatenate(logits, axis=0)
            all_hidden = np.concatenate(hidden, axis=0) if self.head is not None else None
            out, r0 = [], 0
            for seq, arr in checked:
                n = len(arr)
                out.append(all_logits[r0:r0 + n])
                h = all_hidden[r0:r0 + n] if all_hidden is not None else None
                self._verifying[seq] = (self.kv.used[seq], [int(t) for t in arr], h, chains[seq])
                r0 += n
            return out

    def _verify_ubatch(self, rows: list[tuple[int, int, int, tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
        """One ubatch of a verify step: each row one token of a sequence at ``offset`` past its position."""
        if self._threads[False] != self.model.threads_now:
            self.model.use_threads(self._threads[False])  # rows of one-token steps, with a one-token step's threads
        kv = self.kv
        seq_rows = tuple([SeqRows(seq, 1, kv.n_kv_for(1, seq, off)) for seq, _, off, _ in rows])
        g = self._graph(seq_rows, len(rows))
        if g.feed is not None:
            g.feed.write([t for _, t, _, _ in rows], [off for _, _, off, _ in rows], [r for *_, r in rows])
            logits = self.sched.step(g.graph, g.feed.io)
        else:
            self.sched.prepare(g.graph)
            parts = [(seq, np.array([t], np.int32)) for seq, t, _, _ in rows]
            feed = self._inputs(parts, seq_rows, len(rows), "out_ids" in g.inputs,
                                offsets=[off for _, _, off, _ in rows], rs_rows=[r for *_, r in rows])
            for name, t in g.inputs.items():
                t._set_trusted(feed[name])
            logits = self.sched.compute_read(g.graph, g.read_logits)  # over RPC the read is the one round trip
        self.model.store.check_reads()
        self.model.experts.flush_traces()
        n_embd = self.model.hp.n_embd
        hidden = g.read_hidden().reshape(-1, n_embd) if self.head is not None else np.zeros((0, 0), np.float32)
        return logits.reshape(len(rows), self.model.hp.n_vocab), hidden

    def accept(self, seq: int, n_keep: int) -> None:
        """Keep the first ``n_keep`` tokens of sequence ``seq``'s last :meth:`verify` step (0: none): the sequence
        goes on exactly as if those tokens had been evaluated one at a time, the rest never were."""
        self._check_seq(seq, "accept")
        pending = self._verifying.get(seq)
        if pending is None:
            raise ArgumentError(f"accept: sequence {seq} has no verify step waiting")
        start, toks, hidden, chain = pending
        check_int(n_keep, "accept: n_keep", 0, len(toks))
        with self._serial.turn("accept"):
            del self._verifying[seq]
            if self.rs is not None:
                self.rs.commit_row(seq, chain[n_keep - 1][1] if n_keep else None)
            if self.head is not None and hidden is not None and n_keep:
                self.head.record(seq, toks[:n_keep], hidden[:n_keep])
            self.kv.used[seq] = start + n_keep

    def _forget_head_graph(self, key: object, entry: DecoderGraph) -> None:
        for kind, (k, _) in list(self._head_active.items()):
            if k == key:  # its regions are registered with its scheduler
                self._head_scheds[kind].clear_regions()
                del self._head_active[kind]

    def _check_idle(self, seq: int, op: str) -> None:
        """Refuse ``op`` on a sequence whose verify step waits for :meth:`accept`."""
        if seq in self._verifying:
            raise ArgumentError(f"{op}: sequence {seq} has a verify step waiting for accept()")

    def draft_fill(self, seqs: Sequence[int]) -> int:
        """Write the draft head's cache cells of every position of ``seqs`` the target has evaluated since the head's
        last fill (llama.cpp's MTP ``process``), in batches of up to ``ubatch_size`` rows; returns the rows."""
        head = self.head
        if head is None:
            raise ArgumentError("draft_fill: the model was loaded without its draft head (spec_type=draft-mtp)")
        parts: list[tuple[int, np.ndarray, np.ndarray, int]] = []  # (seq, tokens, hidden rows, offset)
        taken = []
        with self._serial.turn("draft_fill"):
            try:
                for seq in seqs:
                    toks, rows = head.take(seq)
                    taken.append((seq, toks, rows))
                    for r0 in range(0, len(toks), self.options.ubatch_size):
                        r1 = r0 + self.options.ubatch_size
                        parts.append((seq, np.array(toks[r0:r1], np.int32), rows[r0:r1], r0))
                done = 0
                while done < len(parts):  # as many parts per ubatch as fit in ubatch_size rows
                    n, k = 0, done
                    while k < len(parts) and (k == done or n + len(parts[k][1]) <= self.options.ubatch_size):
                        n += len(parts[k][1])
                        k += 1
                    self._head_ubatch(parts[done:k], fill=True)
                    done = k
            except BaseException:
                for seq, toks, rows in reversed(taken):  # nothing was written for good: all wait again
                    head.put_back(seq, toks, rows)
                raise
            for seq, toks, _ in taken:
                head.kv.used[seq] += len(toks)
            return sum(len(t) for _, t, _ in taken)

    def draft_step(self, parts: Sequence[tuple[int, Sequence[int], npt.ArrayLike, int]],
                   holes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The draft head over ``(seq, tokens, hidden, offset)`` parts in one ubatch (rows in that order): each
        part's tokens at ``offset`` past its sequence's filled head cells, ``hidden`` [len(tokens), n_embd] the
        hidden state before each (the target's, or the head's own of the step before). Returns the head's logits
        [rows, n_vocab] and its hidden states [rows, n_embd]. A draft step is one token of each drafting sequence;
        the cells written past the filled ones are scratch (the next fill overwrites them).

        ``holes[i]``: part i's first that many cells past the filled ones are hidden from its attention (a probe of
        the backoff drafts at its sequence's position without filling the positions before it: those cells hold
        scratch, not the head's KV of them; 0 or ``None``: none hidden)."""
        if self.head is None:
            raise ArgumentError("draft_step: the model was loaded without its draft head (spec_type=draft-mtp)")
        checked = []
        hidden_cells = [0] * len(parts) if holes is None else list(holes)
        if len(hidden_cells) != len(parts):
            raise ShapeError(f"draft_step: {len(hidden_cells)} holes for {len(parts)} parts (one per part)")
        for (seq, toks, h, off), n_hole in zip(parts, hidden_cells):
            self._check_seq(seq, "draft_step")
            arr = self._check_tokens(list(toks))
            rows = np.ascontiguousarray(h, np.float32).reshape(-1, self.model.hp.n_embd) \
                if np.size(h) == len(arr) * self.model.hp.n_embd else None
            if rows is None:
                raise ShapeError(f"draft_step: sequence {seq}: hidden must be [{len(arr)}, {self.model.hp.n_embd}], "
                                 f"got {np.shape(h)}")
            check_int(off, "draft_step: offset", 0)
            check_int(n_hole, "draft_step: holes", 0, off)  # only cells before the part's own rows
            self.head.kv.n_kv_for(len(arr), seq, off)  # room, or nothing is computed
            checked.append((seq, arr, rows, off))
        if not checked:
            raise ShapeError("draft_step: parts must be a non-empty sequence of (seq, tokens, hidden, offset)")
        with self._serial.turn("draft_step"):
            out = self._head_ubatch(checked, fill=False, holes=hidden_cells)
            assert out is not None
            return out

    def _head_ubatch(self, parts: list[tuple[int, np.ndarray, np.ndarray, int]], fill: bool,
                     holes: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray] | None:
        """One ubatch of the draft head: ``(seq, tokens, hidden rows, offset)`` parts, rows in that order, each
        ``offset`` past the head's filled cells of its sequence; ``holes[i]``: cells after part i's filled ones
        that its rows do not see (:meth:`draft_step`)."""
        head = self.head
        assert head is not None
        n = sum(len(t) for _, t, _, _ in parts)
        if self._threads[n > 1] != self.model.threads_now:
            self.model.use_threads(self._threads[n > 1])
        seq_rows = tuple([SeqRows(seq, len(toks), head.kv.n_kv_for(len(toks), seq, off))
                          for seq, toks, _, off in parts])
        kind = "fill" if fill else "draft"
        g = self._graph(seq_rows, n, kind)
        sched = self._head_scheds[kind]
        sched.prepare(g.graph)
        feed = self._inputs([(seq, toks) for seq, toks, _, _ in parts], seq_rows, n, False, kv=head.kv,
                            offsets=[off for *_, off in parts])
        feed["h"] = np.ascontiguousarray(np.concatenate([h for _, _, h, _ in parts], axis=0), np.float32)
        for i, n_hole in enumerate(holes):
            if n_hole:
                used = head.kv.used[parts[i][0]]
                for name in ("mask", "mask_swa"):
                    if seq_input(name, i) in feed:
                        feed[seq_input(name, i)][:, used:used + n_hole] = -np.inf
        for name, t in g.inputs.items():  # a fill graph has no masks: what it lacks is not set
            t._set_trusted(feed[name])
        sched.compute(g.graph)
        self.model.store.check_reads()
        self.model.experts.flush_traces()
        if fill:
            return None
        return g.read_logits().reshape(n, self.model.hp.n_vocab), g.read_hidden().reshape(n, self.model.hp.n_embd)



__all__ = ["VerifySteps"]
