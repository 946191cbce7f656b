"""What a run holds over a loaded model (llama.cpp's ``llama_context``): the KV cache, sequences, a run's graphs.

    with LoadedModel("model.gguf", opts) as model:
        s = Session(model)
        logits = s.eval(s.tokenizer.encode("Hello"))   # [1, n_vocab]: the last position

A :class:`Session` over a :class:`~ggml_hybrid.runtime.loaded_model.LoadedModel` owns what evaluating changes:
the KV cache of its ``n_parallel`` sequences (one slot each), a recurrent model's states, its scheduler (and so
its compute buffers) and the decoder graphs of the ubatch shapes it met. ``eval`` appends tokens to a sequence's
KV slot (sequence 0 unless ``seq`` is given), ``reset`` starts over, ``decode`` computes one token of each of
several sequences in one ubatch; each sequence's logits are bit-identical to evaluating it alone on the CPU
(docs/serve.md, "Concurrent sequences").

Several sessions may run over one model (a draft or MTP context beside the main one): each allocates its own KV
cache and compute buffers, none copies a weight; they take the model's turn (``LoadedModel.serial``) call by call,
and share its expert cache (a hit for one is a hit for the other) and counters. A session chooses its own
context options (:data:`CONTEXT_OPTIONS`); every other option is the model's.
:class:`~ggml_hybrid.runtime.moe_model.MoEModel` is the session that loads its own model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ..checks import check_choice, check_int, check_type
from ..errors import ArgumentError, ClosedError, IndexRangeError, ShapeError
from ..ggml import rpc
from ..ggml.backend import Backend
from ..ggml.context import Arena
from ..ggml.graph_cache import GraphCache
from ..ggml.sched import Scheduler
from ..ggml.tensor import Tensor
from ..model.decoder import DecoderGraph, build_decoder, context_size, graph_size
from ..model.hparams import HParams
from ..model.kv_cache import KVCache, SeqRows, rotation_sizes, seq_input
from ..model.recurrent_state import RecurrentState
from ..model.rope import positions
from ..model.step_feed import StepFeed
from ..options import OptionError, SessionOptions
from .draft_head import DraftHead
from .loaded_model import LoadedModel, ModelView, check_context_options, decode_rows, lost_server, resolve_flash_attn
from .verify_steps import VerifySteps

DEFAULT_MAX_CTX = 4096
MAX_GRAPHS = 8  # decoder graphs kept per session (one per ubatch shape), least recently used dropped first
MAX_STEP_GRAPHS = 64  # at most this many graphs of decode steps of several sequences
# an ubatch's seq_rows, its number of outputs, and which graph: "" the model's, "fill" / "draft" the draft head's
GraphKey = tuple[tuple[SeqRows, ...], int, str]

#: the options a session chooses for itself (llama.cpp's context parameters); the others are its model's
CONTEXT_OPTIONS = ("n_ctx", "n_parallel", "batch_size", "ubatch_size", "cache_type_k", "cache_type_v", "flash_attn",
                   "n_threads", "n_threads_batch")


def context_warning(opts: SessionOptions, hp: HParams) -> str | None:
    """A context above the one the model was trained for is allowed, as in llama.cpp, with this warning."""
    if hp.n_ctx_train and opts.n_ctx > hp.n_ctx_train:
        return (f"n_ctx={opts.n_ctx} is above the {hp.n_ctx_train} tokens the model was trained for: positions past "
                "them may give poor text (llama.cpp allows it with the same warning)")
    return None


def session_options(model: LoadedModel, options: SessionOptions | None) -> SessionOptions:
    """A session's options over ``model``: the model's, but for the :data:`CONTEXT_OPTIONS` ``options`` gives."""
    if options is None:
        return model.options
    if not isinstance(options, SessionOptions):
        raise OptionError(f"options must be SessionOptions, got {type(options).__name__}")
    for f in dataclasses.fields(SessionOptions):
        mine, theirs = getattr(options, f.name), getattr(model.options, f.name)
        if f.name not in CONTEXT_OPTIONS and mine != theirs:
            raise OptionError(f"{f.name}={mine}: a session shares its model's {f.name}={theirs} (it shapes the "
                              f"load); a session chooses only {', '.join(CONTEXT_OPTIONS)}")
    return options


class Checkpoint(NamedTuple):
    """A sequence's position and, for a recurrent model, copies of its states there (:meth:`Session.checkpoint`)."""

    position: int
    states: list[bytes] | None

    @property
    def nbytes(self) -> int:
        return sum(len(r) for r in self.states) if self.states is not None else 0


def _pairs(batch: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``decode``'s batch as checked (seq, token) integer pairs."""
    def integer(x: object) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    try:
        items = [tuple(p) for p in batch]
    except TypeError:
        items = []
    if not items or not all(len(p) == 2 and integer(p[0]) and integer(p[1]) for p in items):
        raise ShapeError("decode: batch must be a non-empty sequence of (seq, token) integer pairs")
    return [(int(p[0]), int(p[1])) for p in items]


class Session(VerifySteps, ModelView):
    """A run over ``model`` with ``options`` (default: the model's; see :func:`session_options`)."""

    CONTEXT_OPTIONS = CONTEXT_OPTIONS
    # set by _allocate; close() releases whichever of them a failed start got to
    sched: Scheduler
    kv: KVCache
    rs: RecurrentState | None = None  # the delta-net layers' states (recurrent models)
    # the draft head's cache and per-sequence state (spec_type=draft-mtp): llama.cpp's MTP context, held by the session
    # whose positions it follows
    head: DraftHead | None = None

    def __init__(self, model: LoadedModel, options: SessionOptions | None = None) -> None:
        self._closed = False
        check_type(model, "Session: model", LoadedModel)
        model.check_open("Session")
        self.model = model
        self.options = opts = session_options(model, options)
        if options is not None:
            check_context_options(opts, model.hp)
        warning = context_warning(opts, model.hp)
        #: what the session allows but a user should know (printed by the command line)
        self.warnings: list[str] = [warning] if warning else []
        n_threads = opts.n_threads or model.n_threads
        # llama.cpp's -t / -tb: one thread count for single-token steps, one for batches (the prompt)
        self._threads = {False: n_threads, True: opts.n_threads_batch or n_threads}
        self.n_threads = n_threads
        self._serial = model.serial
        hp = model.hp
        # one decoder graph per ubatch shape, the least recently used dropped first: ubatches of one sequence
        # (prompts of many lengths, in any slot) and decode steps of several (one set of slots each; the
        # engine keeps its sequences in the lowest slots, so about one graph per number of sequences)
        self._graphs: GraphCache[DecoderGraph] = GraphCache(MAX_GRAPHS + opts.n_parallel - 1, context_size(hp),
                                                            self._forget_graph)
        # verify steps (speculative decoding) meet more shapes: every draft length of every set of sequences
        n_verify = 2 * (opts.draft_max + 1) if opts.spec_type != "none" else 0
        self._step_graphs: GraphCache[DecoderGraph] = GraphCache(
            min(2 * opts.n_parallel, MAX_STEP_GRAPHS) + n_verify,
            context_size(hp, opts.n_parallel * (opts.draft_max + 1 if n_verify else 1)), self._forget_graph)
        self._active: GraphKey | None = None  # key of the graph whose regions are registered
        self._active_entry: DecoderGraph | None = None  # and that graph
        self._init_speculation(MAX_GRAPHS)
        model.add_session(self)
        try:
            self._allocate(opts, hp)
            rpc.raise_if_lost(model.devices.values())  # a server lost meanwhile: the cache is not there
        except BaseException as exc:
            lost = lost_server(exc, model.devices)
            self.close()
            if lost is not None:
                raise lost from exc
            raise

    def _allocate(self, opts: SessionOptions, hp: HParams) -> None:
        model = self.model
        lay = model.layout
        self.sched = Scheduler(list(model.devices.values()) + [model.host],
                               graph_size=2 * graph_size(hp, opts.n_parallel))
        n_ctx = opts.n_ctx or min(hp.n_ctx_train, DEFAULT_MAX_CTX)
        self.flash_attn = resolve_flash_attn(model, opts)
        self._mask_dtype = np.float16 if self.flash_attn else np.float32  # flash attention takes an F16 mask
        # latent attention has no Hadamard rotation (llama.cpp's K-only cache input has none)
        rot = (0, 0) if hp.mla is not None else rotation_sizes(opts.cache_type_k, opts.cache_type_v, hp.head_dim,
                                                               hp.head_dim_v)
        kv_backends = [model.backend(d) for d in lay.kv_device]
        self.kv = KVCache(hp.n_layer, n_ctx, hp.kv_k, hp.kv_v, opts.cache_type_k, opts.cache_type_v, kv_backends,
                          v_trans=not self.flash_attn, clear=not model.dry_run, rot=rot,
                          n_swa=hp.swa.n_swa if hp.swa is not None else 0, layers=hp.kv_layers,
                          n_seq=opts.n_parallel)
        if model.head_layer is not None:
            self._allocate_head(n_ctx, kv_backends, rot)
        dn = hp.delta_net
        # a recurrent model's delta-net layers keep recurrent states where their KV cache would be (llama.cpp's rule);
        # a verify step of draft_max + 1 tokens writes each token's state to a row of its own
        depth = opts.draft_max + 2 if opts.spec_type != "none" else 2
        self.rs = None if dn is None else RecurrentState(hp.n_layer, dn.layers, dn.conv_state, dn.ssm_state,
                                                         kv_backends, n_seq=opts.n_parallel,
                                                         clear=not model.dry_run, depth=depth)
        # like llama.cpp: size the compute buffers for the largest ubatch once, at load; the expert caches'
        # own graphs too, so that a run never allocates more than the load (and the planner's dry run) did;
        # with several sequences also for a decode step of as many of them as one ubatch takes, each at a
        # full context
        ub = min(opts.ubatch_size, n_ctx)
        self.sched.reserve(self._graph((SeqRows(0, ub, n_ctx),), ub).graph)
        model.experts.reserve(ub)
        self._reserve_step()
        self.decode_rows = decode_rows(model, opts.ubatch_size)
        n_step = min(opts.n_parallel, self.decode_rows)
        if n_step > 1:
            self.sched.reserve(self._graph(tuple(SeqRows(s, 1, n_ctx) for s in range(n_step)), n_step).graph)
        if self.head is not None:
            self._reserve_head(n_ctx, ub, n_step)

    def _reserve_step(self) -> None:
        """Build and reserve the graph of a session's first decode steps too (one token over the first cells), after
        the largest ubatch's, so that no buffer grows. GGML asks a backend the size of each product of a new shape,
        a round trip to each RPC server, and caches it by shape: reserved here, the first decode step asks none and
        builds no graph; before, it asked one per product at the first token (9 + 5 round trips for
        bench_hosts.py's split over two workers; llama.cpp's client, which reserves its one-token graph over the
        whole context, asks 1 + 1: its attention's over the cells in use). A planning dry run skips it (it sizes
        nothing the largest ubatch's graph does not)."""
        if self.options.ubatch_size > 1 and not self.model.dry_run:
            self.sched.reserve(self._graph((SeqRows(0, 1, self.kv.n_kv_for(1)),), 1).graph)

    # -- state ----------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Cells of one sequence's context (every sequence slot has as many)."""
        return self.kv.n_ctx

    @property
    def n_parallel(self) -> int:
        return self.kv.n_seq

    @property
    def n_past(self) -> int:
        """Positions held by sequence 0 (see :meth:`position` for the others)."""
        return self.kv.used[0]

    def position(self, seq: int = 0) -> int:
        """Positions held by sequence ``seq``: where its next token goes."""
        return self.kv.used[self._check_seq(seq, "position")]

    def reset(self, seq: int | None = None) -> None:
        """Forget one sequence (``seq``), or all of them: its next eval starts at position 0."""
        if seq is not None:
            self._check_seq(seq, "reset")
        with self._serial.turn("reset"):
            self.kv.clear(seq)
            if self.rs is not None:
                for s in range(self.rs.n_seq) if seq is None else (seq,):
                    self.rs.clear(s)
            for s in range(self.kv.n_seq) if seq is None else (seq,):
                self._rewound(s, 0)

    @property
    def recurrent(self) -> bool:
        """Whether the model keeps recurrent states (delta-net layers): a sequence can be reset, not truncated."""
        return self.rs is not None

    def truncate(self, n_keep: int, seq: int = 0) -> None:
        """Keep the first ``n_keep`` positions of sequence ``seq`` and drop the rest (a conversation that
        re-renders its history evaluates only what changed). The dropped cells are masked from here on
        and overwritten by the next eval. A recurrent model (:attr:`recurrent`) holds no state of earlier
        positions to go back to: it keeps everything or nothing (``reset``)."""
        self._check_seq(seq, "truncate")
        check_int(n_keep, "truncate: n_keep", 0)
        if self.rs is not None and n_keep < self.kv.used[seq]:
            raise ArgumentError(f"truncate: n_keep={n_keep} < the {self.kv.used[seq]} positions of sequence {seq}: "
                                f"{self.hp.arch}'s recurrent state cannot go back to an earlier position "
                                "(reset the sequence instead)")
        with self._serial.turn("truncate"):
            self.kv.used[seq] = min(n_keep, self.kv.used[seq])
            self._rewound(seq, self.kv.used[seq])

    def checkpoint(self, seq: int = 0) -> Checkpoint:
        """Where sequence ``seq`` stands now, to go back to later with :meth:`restore`: its position, and a
        recurrent model's states (copies; a KV cache's cells stay in place, so the sequence must not be truncated
        below that position and re-evaluated in between for the restore to mean anything)."""
        self._check_open("checkpoint")
        self._check_seq(seq, "checkpoint")
        with self._serial.turn("checkpoint"):
            self._check_idle(seq, "checkpoint")
            return Checkpoint(self.kv.used[seq], self.rs.save(seq) if self.rs is not None else None)

    def restore(self, cp: Checkpoint, seq: int = 0) -> None:
        """Take sequence ``seq`` back to checkpoint ``cp`` of it (:meth:`checkpoint`): positions past it are
        dropped (as :meth:`truncate`), a recurrent model's states are put back, and the next eval goes on
        exactly as it would have from the checkpoint."""
        self._check_open("restore")
        self._check_seq(seq, "restore")
        check_type(cp, "restore: cp", Checkpoint)
        if cp.position > self.kv.used[seq]:
            raise ArgumentError(f"restore: the checkpoint is at position {cp.position}, past the "
                                f"{self.kv.used[seq]} positions sequence {seq} holds")
        if (cp.states is None) != (self.rs is None):
            raise ArgumentError("restore: the checkpoint is not of this model (recurrent states "
                                f"{'missing' if cp.states is None else 'given to a model without them'})")
        with self._serial.turn("restore"):
            if self.rs is not None and cp.states is not None:
                self.rs.load(seq, cp.states)
            self.kv.used[seq] = cp.position
            self._rewound(seq, cp.position)

    def move(self, src: int, dst: int) -> None:
        """Move sequence ``src`` into the empty slot ``dst`` (its cells copied, ``src`` emptied): it goes on
        from ``dst`` exactly as it would have from ``src``. A server packs its sequences into the lowest
        slots this way, so decode steps keep meeting the same few graphs."""
        self._check_seq(src, "move")
        self._check_seq(dst, "move")
        if src == dst or self.kv.used[dst]:
            raise ArgumentError(f"move: slot {dst} must be empty and other than {src} (it holds "
                                f"{self.kv.used[dst]} positions)")
        with self._serial.turn("move"):
            self._check_idle(src, "move")
            self.kv.move(src, dst)
            if self.rs is not None:
                self.rs.move(src, dst)
            if self.head is not None:  # its draft head's cells go with it
                self.head.move(src, dst)

    def _check_seq(self, seq: int, op: str) -> int:
        check_int(seq, f"{op}: seq", 0, self.kv.n_seq - 1)
        return seq

    # -- evaluation -----------------------------------------------------------

    def _graph(self, seq_rows: tuple[SeqRows, ...], n_out: int, kind: str = "") -> DecoderGraph:
        """The graph of an ubatch of ``seq_rows`` with ``n_out`` outputs: the model's (``kind`` ""), or the draft
        head's (``"fill"``, ``"draft"``: :meth:`VerifySteps._head_graph`)."""
        if kind:
            return self._head_graph((seq_rows, n_out, kind))
        key: GraphKey = (seq_rows, n_out, kind)

        def build(arena: Arena) -> DecoderGraph:
            model = self.model
            entry = build_decoder(model.hp, model.weights, model.experts.weights, self.kv, seq_rows, n_out,
                                  self.flash_attn, arena, self.rs)
            if len(seq_rows) > 1:
                # a decode step of several sequences (or a verify step: several tokens of one): each row as the
                # one-row product of its sequence alone
                entry.graph.set_rowwise()
            self.sched.set_pins(entry.graph, self._pins(entry))
            assert entry.logits is not None
            entry.feed = StepFeed.of(self.kv, self.rs, model.hp.rope, seq_rows, n_out, entry.inputs, entry.logits,
                                     self._mask_dtype)
            return entry

        if key == self._active and self._active_entry is not None:
            return self._active_entry  # the graph of the last call (a decode step's), most recently used already
        entry = (self._graphs if len(seq_rows) == 1 else self._step_graphs).get(key, build)
        if self._active != key:
            self.sched.clear_regions()
            self.model.experts.register(self.sched, entry.regions)
            self._active = key
        self._active_entry = entry
        return entry

    def _forget_graph(self, key: Hashable, entry: DecoderGraph) -> None:
        if self._active == key:  # its regions are registered with the scheduler
            self.sched.clear_regions()
            self._active = None
            self._active_entry = None

    def _pins(self, entry: DecoderGraph) -> list[tuple[Tensor, Backend]]:
        """Each node's backend (:meth:`LoadedModel.pins`)."""
        return self.model.pins(entry)

    def _check_tokens(self, tokens: npt.ArrayLike) -> np.ndarray:
        n_vocab = self.model.hp.n_vocab
        if isinstance(tokens, list) and len(tokens) == 1 and type(tokens[0]) is int and 0 <= tokens[0] < n_vocab:
            return np.array(tokens, np.int32)  # a decode step's one token, as the checks below would pass it
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ShapeError(f"eval: tokens must be a non-empty 1-D sequence of integers, got {arr.dtype} "
                             f"{arr.shape}")
        bad = (arr < 0) | (arr >= n_vocab)
        if bad.any():
            raise IndexRangeError(f"eval: token id {int(arr[bad][0])} is outside the vocabulary 0..{n_vocab - 1}")
        return arr.astype(np.int32)

    def _ubatch(self, parts: list[tuple[int, np.ndarray]], n_out: int) -> np.ndarray:
        """Compute one ubatch of ``(seq, tokens)`` parts (rows in that order); the last ``n_out`` rows' logits."""
        kv, model = self.kv, self.model
        batch = (len(parts[0][1]) if len(parts) == 1 else sum(len(toks) for _, toks in parts)) > 1
        if self._threads[batch] != model.threads_now:
            model.use_threads(self._threads[batch])
        seq_rows = tuple([SeqRows(seq, len(toks), kv.n_kv_for(len(toks), seq)) for seq, toks in parts])
        g = self._graph(seq_rows, n_out)
        if g.feed is not None:
            g.feed.write([toks[0] for _, toks in parts])
            logits = self.sched.step(g.graph, g.feed.io)
        else:
            self.sched.prepare(g.graph)
            # every input was built here from checked tokens and the cache's own positions
            feed = self._inputs(parts, seq_rows, n_out, "out_ids" in g.inputs)
            for name, t in g.inputs.items():
                t._set_trusted(feed[name])
            logits = self.sched.compute_read(g.graph, g.read_logits)  # over RPC the read is the one round trip
        # weights are read in place from the mapping: a read past the end of a file truncated meanwhile gave
        # zeros (the mapping's guard), and these logits must not be used; the sequence stays as it was
        model.store.check_reads()
        model.experts.flush_traces()
        if self.head is not None:  # the draft head reads the model's hidden state of every position
            self._record_hidden(g, parts)
        for seq, toks in parts:
            kv.used[seq] += len(toks)
            if self.rs is not None:
                self.rs.advance(seq)
        return logits.reshape(n_out, model.hp.n_vocab)

    def _inputs(self, parts: list[tuple[int, np.ndarray]], seq_rows: tuple[SeqRows, ...], n_out: int,
                out_ids: bool, kv: KVCache | None = None, offsets: Sequence[int] | None = None,
                rs_rows: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
        """The inputs of any ubatch, built anew (prompts); decode steps write theirs in place (:class:`StepFeed`).

        ``kv``: the cache the graph attends over (default the session's); ``offsets[i]``: part i's first position
        past its sequence's (a verify step's, the draft head's); ``rs_rows[i]``: its recurrent state rows."""
        kv = self.kv if kv is None else kv
        mask_dtype = self._mask_dtype
        feed: dict[str, np.ndarray] = {}
        pos = []
        for i, seg in enumerate(seq_rows):
            one = kv.inputs(seg.n_tokens, seg.n_kv, mask_dtype, seg.seq, offsets[i] if offsets is not None else 0)
            pos.append(one.pop("pos"))
            for name in ("k_rot", "v_rot"):
                if name in one:
                    feed[name] = one.pop(name)
            feed.update({seq_input(name, i): arr for name, arr in one.items()})
        feed["tokens"] = np.concatenate([toks for _, toks in parts])
        # M-RoPE lays its four rows out over the whole ubatch: built from every sequence's positions at once
        feed["pos"] = positions(self.model.hp.rope, np.concatenate(pos))
        if self.rs is not None and kv is self.kv:
            for i, (seq, _) in enumerate(parts):
                if rs_rows is not None:
                    read, write = rs_rows[i]
                    one = {"rs_read": np.array([read], np.int32), "rs_write": np.array([write], np.int32)}
                else:
                    one = self.rs.inputs(seq)
                feed.update({seq_input(name, i): arr for name, arr in one.items()})
        n = len(feed["tokens"])
        if out_ids:
            feed["out_ids"] = np.arange(n - n_out, n, dtype=np.int32)
        return feed

    def _check_open(self, op: str) -> None:
        if self.model.dry_run:
            raise ClosedError(f"{op}: this model was opened for planning (dry run) and holds no weights")
        if self._closed:
            raise ClosedError(f"{op}: the model is closed")

    def eval(self, tokens: npt.ArrayLike, logits: Literal["last", "all"] = "last", seq: int = 0) -> np.ndarray:
        """Append ``tokens`` to sequence ``seq``; the logits of the last (``"last"``) or every (``"all"``) one."""
        if logits != "last":
            check_choice(logits, "eval: logits", ("last", "all"))
        if self._closed or self.model.dry_run:
            self._check_open("eval")
        if type(seq) is not int or not 0 <= seq < self.kv.n_seq:
            self._check_seq(seq, "eval")
        arr = self._check_tokens(tokens)
        with self._serial.turn("eval"):
            self._check_idle(seq, "eval")
            self.kv.n_kv_for(len(arr), seq)  # the whole call fits, or nothing is evaluated
            start = self.kv.used[seq]
            if self.rs is not None:
                self.rs.begin(seq)
            try:
                out = self._eval(arr, logits, seq)
            except BaseException:
                # all or nothing: a failed ubatch leaves the sequence as it was (the cells written past
                # its position are masked out and overwritten by the next eval; the recurrent states were
                # written to rows the sequence does not read)
                self.kv.used[seq] = start
                if self.rs is not None:
                    self.rs.abandon(seq)
                self._rewound(seq, start)
                raise
            if self.rs is not None:
                self.rs.commit(seq)
            return out

    def ubatch_ends(self, n_tokens: int) -> list[int]:
        """Where ``eval`` of ``n_tokens`` tokens cuts them into ubatches: the end of each, in order.

        The logical batch (``batch_size``) first, then the physical one (``ubatch_size``), as llama.cpp.
        A caller that feeds a prompt in pieces cut here computes exactly the ubatches of one ``eval``.
        """
        bs, ub = self.options.batch_size, self.options.ubatch_size
        return [min(b0 + u0 + ub, b0 + bs, n_tokens) for b0 in range(0, n_tokens, bs)
                for u0 in range(0, min(bs, n_tokens - b0), ub)]

    def _eval(self, arr: np.ndarray, logits: str, seq: int) -> np.ndarray:
        if len(arr) <= min(self.options.batch_size, self.options.ubatch_size):  # one ubatch: a decode step
            return self._ubatch([(seq, arr)], len(arr) if logits == "all" else 1)
        out = []
        start = 0
        for end in self.ubatch_ends(len(arr)):
            part = arr[start:end]
            if logits == "all":
                out.append(self._ubatch([(seq, part)], len(part)))
            elif end == len(arr):
                out.append(self._ubatch([(seq, part)], 1))
            else:
                self._ubatch([(seq, part)], 1)  # the logits of a prompt's inner positions are not needed
            start = end
        return np.concatenate(out, axis=0)

    def decode(self, batch: Sequence[tuple[int, int]]) -> np.ndarray:
        """One token for each of several sequences, ``(seq, token)`` pairs, computed together.

        Returns the logits [len(batch), n_vocab] in batch order; row i is bit-identical to
        ``eval([token_i], seq=seq_i)`` on its own (the products of a step of several sequences
        compute each row as a one-row product: ``Graph.set_rowwise``). A batch larger than
        :attr:`decode_rows` runs as several ubatches. All or nothing: if any sequence has no room
        left, or a step fails, no sequence moves.
        """
        self._check_open("decode")
        pairs = _pairs(batch)
        seqs = [s for s, _ in pairs]
        for s in seqs:
            self._check_seq(s, "decode")
        if len(set(seqs)) != len(seqs):
            raise ArgumentError(f"decode: a sequence appears more than once in the batch {seqs}; "
                                "give each sequence one token per step")
        toks = self._check_tokens([t for _, t in pairs])
        # seq_rows in sequence order: the same set of sequences always meets the same cached graph
        order = sorted(range(len(pairs)), key=lambda i: seqs[i])
        with self._serial.turn("decode"):
            for s in seqs:
                self._check_idle(s, "decode")
                self.kv.n_kv_for(1, s)  # every sequence has room, or nothing is evaluated
            start = list(self.kv.used)
            rs = self.rs
            if rs is not None:
                for s in seqs:
                    rs.begin(s)
            try:
                rows = []
                step = self.decode_rows
                for u0 in range(0, len(order), step):
                    part = order[u0:u0 + step]
                    rows.append(self._ubatch([(seqs[i], toks[i:i + 1]) for i in part], len(part)))
                out = np.concatenate(rows, axis=0)
            except BaseException:
                self.kv.used[:] = start
                for s in seqs:
                    if rs is not None:
                        rs.abandon(s)
                    self._rewound(s, start[s])
                raise
            if rs is not None:
                for s in seqs:
                    rs.commit(s)
        res = np.empty_like(out)
        res[order] = out
        return res

    # -- reporting ------------------------------------------------------------

    def device_memory(self, device: str | None = None) -> dict[str, int]:
        """Bytes held on the devices (one device, if named) by purpose, what GPUs would hold: the model's weights
        and experts (:meth:`LoadedModel.device_memory`) and this session's KV cache, states and compute buffers."""
        model = self.model
        out = model.device_memory(device)
        names = [device] if device is not None else list(model.devices)
        out = {"weights": out["weights"], "experts": out["experts"], "kv_cache": 0, "recurrent": 0,
               "compute": out["compute"]}
        for name in names:
            b = model.devices[name]
            out["kv_cache"] += self.kv.nbytes(b) + (self.head.kv.nbytes(b) if self.head is not None else 0)
            out["recurrent"] += self.rs.nbytes(b) if self.rs is not None else 0
            out["compute"] += self.sched.buffer_size(b) + sum(h.buffer_size(b) for h in self._head_scheds.values())
        return out

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Release what this session holds (not its model); safe twice, and on a session whose start failed."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if hasattr(self, "_graphs"):
            self._graphs.clear()
            self._step_graphs.clear()
        self._close_speculation()
        if hasattr(self, "sched"):
            self.sched.close()
        if hasattr(self, "kv"):
            self.kv.close()
        rs = getattr(self, "rs", None)
        if rs is not None:
            rs.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CONTEXT_OPTIONS", "Checkpoint", "Session", "context_warning", "session_options"]
