"""The decoder graph for one ubatch shape, op for op as llama.cpp builds it.

Matching llama.cpp's op sequence (including its quirks: the shared-expert gate
as ``silu(x)/x``, the ``argsort`` expert order, the transposed V cache read by
``mul_mat``) is what makes the logits agree with llama.cpp's to rounding. Each
family (:mod:`ggml_hybrid.model.families`) builds its layers from the shared
pieces of :mod:`ggml_hybrid.model.layers`. A graph is built once per shape
(its :class:`SeqRows` and the number of outputs) and reused: only its inputs
change from one ubatch to the next.

An ubatch holds the tokens of one or more sequences, one :class:`SeqRows` each, in that
order. Everything but attention runs over all rows at once; each sequence attends to its
own KV slot with the very ops (and shapes) a one-sequence graph of its tokens has.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..ggml.context import Arena, Context
from ..ggml.graph import Graph
from ..ggml.tensor import Tensor
from ..moe.ffn import ExpertWeights, MoERegion
from .families import FAMILIES
from .hparams import HParams
from .kv_cache import KVCache, SeqRows, seq_input
from .layers import Builder
from .recurrent_state import RecurrentState
from .step_feed import StepFeed

# nodes and leafs per layer besides the weighted sum (two per expert used) and the family's own
NODES_PER_LAYER = 96
# and per layer for each further sequence of an ubatch: its row views, KV stores, attention, the join
NODES_PER_SEGMENT = 40
# and, for a model with delta-net layers, its state reads and writes, convolution and delta rule per sequence
NODES_PER_RECURRENT_SEGMENT = 64


@dataclass
class DecoderGraph:
    ctx: Context
    graph: Graph
    inputs: dict[str, Tensor]
    logits: Tensor | None  # None: a graph that only writes a cache (the draft head's fill graphs)
    regions: list[MoERegion | None] = field(default_factory=list)  # per layer; None for a dense layer
    # (first tensor-struct offset in ctx's pool, kind, layer): which part of the model built a node
    segments: list[tuple[int, str, int]] = field(default_factory=list)
    feed: StepFeed | None = None  # a decode step's inputs, written in place (MoEModel sets it)
    # the output-normed hidden state of every row (llama.cpp's ``t_h_nextn``): what a draft head reads
    hidden: Tensor | None = None
    read_logits: Callable[[], np.ndarray] = field(init=False)  # a copy of the logits after a compute
    read_hidden: Callable[[], np.ndarray] = field(init=False)  # and of the hidden rows (graphs that have them)

    def owner(self, t: Tensor) -> tuple[str, int]:
        """("embd" | "layer" | "attn" | "output", layer) of a node of this graph."""
        # segments are in creation order: the last one starting at or before t's struct is its part
        k = bisect.bisect_right(self._starts, self.ctx.offset_of(t)) - 1
        return self.segments[k][1:] if k >= 0 else ("embd", -1)

    def __post_init__(self) -> None:
        self._starts = [start for start, _, _ in self.segments]
        self.read_logits = self.logits.reader() if self.logits is not None else _nothing
        self.read_hidden = self.hidden.reader() if self.hidden is not None else _nothing

    def close(self) -> None:
        self.ctx.close()


def _nothing() -> np.ndarray:
    raise AssertionError("this graph has no such output")


def graph_size(hp: HParams, n_seq: int = 1, n_layer: int | None = None) -> int:
    """Nodes of the largest decoder graph of a model whose ubatches hold up to ``n_seq`` sequences (over
    ``n_layer`` layers: default the model's)."""
    per_segment = NODES_PER_SEGMENT + (NODES_PER_RECURRENT_SEGMENT if hp.delta_net is not None else 0)
    per_layer = NODES_PER_LAYER + FAMILIES[hp.arch].extra_nodes + 2 * hp.n_used + per_segment * (n_seq - 1)
    return per_layer * (hp.n_layer if n_layer is None else n_layer) + 64


def context_size(hp: HParams, n_seq: int = 1, n_layer: int | None = None) -> int:
    """Bytes of the context a decoder graph is built in."""
    size = graph_size(hp, n_seq, n_layer)
    return Context.size_for(2 * size, graph_size=size)  # views are tensors too


def new_inputs(c: Context, hp: HParams, kv: KVCache, seq_rows: tuple[SeqRows, ...], n_tokens: int, flash: bool,
               rs: RecurrentState | None) -> dict[str, Tensor]:
    """The inputs an ubatch's graph reads besides its tokens: positions, each sequence's KV write indices and
    masks (and recurrent state rows), the Hadamard rotations."""
    mask_type = "f16" if flash else "f32"
    n_pos = 4 * n_tokens if hp.rope.sections else n_tokens  # M-RoPE: four positions per token
    inp: dict[str, Tensor] = {}
    if kv.layers:
        inp["pos"] = c.new_tensor("i32", (n_pos,), "inp_pos")
        for i, s in enumerate(seq_rows):
            tag = f"_s{i}" if len(seq_rows) > 1 else ""
            inp[seq_input("k_idxs", i)] = c.new_tensor("i64", (s.n_tokens,), f"inp_k_idxs{tag}")
            inp[seq_input("mask", i)] = c.new_tensor(mask_type, (s.n_tokens, s.n_kv), f"inp_kq_mask{tag}")
            if kv.n_swa:
                inp[seq_input("mask_swa", i)] = c.new_tensor(mask_type, (s.n_tokens, s.n_kv),
                                                                 f"inp_kq_mask_swa{tag}")
            if kv.v_trans and kv.n_embd_v:
                inp[seq_input("v_idxs", i)] = c.new_tensor("i64", (s.n_tokens * kv.n_embd_v,), f"inp_v_idxs{tag}")
    if rs is not None:  # per sequence: the rows its delta-net layers read their states from and write them to
        for i in range(len(seq_rows)):
            tag = f"_s{i}" if len(seq_rows) > 1 else ""
            for name in ("rs_read", "rs_write"):
                inp[seq_input(name, i)] = c.new_tensor("i32", (1,), f"inp_{name}{tag}")
    for name, n in (("k_rot", kv.rot_k), ("v_rot", kv.rot_v)):
        if n and kv.layers:
            inp[name] = c.new_tensor("f32", (n, n), f"attn_inp_{name}")
    return inp


def build_decoder(hp: HParams, w: dict[str, Tensor], experts: list[ExpertWeights | None], kv: KVCache,
                  seq_rows: tuple[SeqRows, ...], n_out: int, flash: bool, arena: Arena | None = None,
                  rs: RecurrentState | None = None) -> DecoderGraph:
    """Logits [n_out, n_vocab] of the last ``n_out`` rows of an ubatch of ``seq_rows`` (rows in that order;
    ``rs``: the recurrent states of a recurrent model's delta-net layers).

    A model loaded with its draft head (``w`` holds the head's ``nextn`` weights) also gives the output-normed hidden
    state of every row (the head's input), as llama.cpp's target context computes it for an MTP draft context
    (``embeddings_nextn``): the last layer then runs over every row and the output rows are picked after the output
    norm."""
    family = FAMILIES[hp.arch]
    size = graph_size(hp, len(seq_rows))
    n_tokens = sum(s.n_tokens for s in seq_rows)
    c = Context(n_tensors=2 * size, graph_size=size, arena=arena)  # views are tensors too
    g = c.new_graph(size)
    inp = {"tokens": c.new_tensor("i32", (n_tokens,), "inp_tokens")}
    inp.update(new_inputs(c, hp, kv, seq_rows, n_tokens, flash, rs))
    if n_out < n_tokens:
        inp["out_ids"] = c.new_tensor("i32", (n_out,), "inp_out_ids")
    for t in inp.values():
        t.set_input()
    hidden = f"blk.{hp.n_layer}.nextn.eh_proj.weight" in w
    b = Builder(c, g, hp, w, experts, kv, inp, seq_rows, flash, rs)
    b.late_rows = hidden
    b.mark("embd", -1)
    cur = c.get_rows(w["token_embd.weight"], inp["tokens"])
    for il in range(hp.n_layer):
        b.mark("layer", il)
        cur = family.layer(b, il, cur)
    b.mark("output", -1)
    h = None
    if hidden:
        cur = h = b.norm(cur, "output_norm.weight")
        h.name = "result_norm"
        h.set_output()
        if "out_ids" in inp:
            cur = c.get_rows(cur, inp["out_ids"])
    else:
        if hp.out_rows_late and "out_ids" in inp:
            cur = c.get_rows(cur, inp["out_ids"])
        cur = b.norm(cur, "output_norm.weight")
    logits = c.mul_mat(w.get("output.weight", w["token_embd.weight"]), cur)
    logits.name = "result_output"
    logits.set_output()
    g.expand(logits)
    return DecoderGraph(c, g, inp, logits, b.regions, b.segments, hidden=h)


__all__ = ["DecoderGraph", "SeqRows", "build_decoder", "context_size", "graph_size", "new_inputs", "seq_input"]
