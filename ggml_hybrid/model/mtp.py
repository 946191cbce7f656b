"""The next-token-prediction head (MTP, "nextn"): the block a model carries after its layers, run as a draft model.

Qwen3.5/3.6 MoE, Qwen3-Next, GLM-4.5/4.6 and the deepseek2-architecture GLM-4.7-Flash carry one block past
``n_layer`` (``nextn_predict_layers = 1``) that predicts the token after next. The pinned llama.cpp runs it in a
context of its own (``LLAMA_CONTEXT_TYPE_MTP``, ``graph_mtp`` in ``src/models/qwen35moe.cpp``, ``qwen3next.cpp``,
``glm4-moe.cpp``, ``deepseek2.cpp``); op for op as there:

- its input at position p is the token x_p and the target's hidden state h_{p-1}: the output-normed state of the
  last layer at the previous position (llama.cpp's ``t_h_nextn``; :func:`~ggml_hybrid.model.decoder.build_decoder`
  with ``hidden=True`` computes it for every row);
- ``eh_proj(concat(enorm(embed(x_p)), hnorm(h_{p-1})))`` (``nextn.embed_tokens`` when the file has it, else the
  token embeddings), then a decoder layer of the family (its attention over a KV cache of the head's own, the
  routed experts through the expert cache like any layer's, the shared expert), then ``shared_head_norm`` (else
  the output norm) and ``shared_head_head`` (else the output head) give the logits; the normed state is the head's
  own hidden state, which the next draft step reads in place of the target's;
- the head's KV cache holds one layer (the head's); recurrent families have no recurrent state in it (the block
  is an attention layer).

A *fill* graph writes the head's KV cells of positions whose tokens the target has verified (llama.cpp's
``process`` step, whose logits nobody reads): only the head's attention inputs are computed, up to the cache
store; a *draft* graph computes the logits of every row.
"""

from __future__ import annotations

from ..errors import ModelFileError
from ..ggml.context import Arena, Context
from ..ggml.tensor import Tensor
from ..gguf.store import GGUFStore
from ..moe.ffn import ExpertWeights
from .decoder import DecoderGraph, graph_size, new_inputs
from .families import FAMILIES
from .hparams import HParams, check_shapes
from .kv_cache import KVCache, SeqRows
from .layers import Builder, decoder_layer

# the block's own tensors (besides a layer's), required; and those llama.cpp takes when present
NEXTN_REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")
NEXTN_OPTIONAL = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight", "nextn.shared_head_norm.weight")
HEAD_EXTRA_NODES = 32  # the head's graph beyond one decoder layer: embeddings, norms, the projection, the LM head


def head_layer(hp: HParams, path: str = "") -> int:
    """The head's block index (``n_layer``); refuses a model without one, or with a kind llama.cpp does not run."""
    fam = FAMILIES[hp.arch]
    n_nextn = (hp.n_layer_all or hp.n_layer) - hp.n_layer
    where = f"{path!r}: " if path else ""
    if fam.head_attention is None:
        raise ModelFileError(f"{where}{hp.arch} has no next-token-prediction (MTP) head in llama.cpp; draft-mtp "
                             "needs one of " + ", ".join(sorted(a for a, f in FAMILIES.items()
                                                               if f.head_attention is not None)))
    if n_nextn == 0:
        raise ModelFileError(f"{where}the model has no next-token-prediction (MTP) head "
                             f"({hp.arch}.nextn_predict_layers is 0 or absent: converted without it, e.g. with "
                             "--no-mtp)")
    if n_nextn != 1:
        raise ModelFileError(f"{where}{hp.arch}.nextn_predict_layers = {n_nextn}: llama.cpp's {hp.arch} MTP graph runs "
                             "a single head block")
    return hp.n_layer


def head_shapes(store: GGUFStore, hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor of the head's block with its numpy-order shape: the layer's, the required ``nextn.*`` ones and
    the optional ones the file holds."""
    il = head_layer(hp, store.path)
    fam = FAMILIES[hp.arch]
    assert fam.head_tensors is not None
    E, V, p = hp.n_embd, hp.n_vocab, f"blk.{il}."
    shapes = dict(fam.head_tensors(hp, il))
    sizes = {"nextn.eh_proj.weight": (E, 2 * E), "nextn.enorm.weight": (E,), "nextn.hnorm.weight": (E,),
             "nextn.embed_tokens.weight": (V, E), "nextn.shared_head_head.weight": (V, E),
             "nextn.shared_head_norm.weight": (E,)}
    for name in NEXTN_REQUIRED:
        shapes[p + name] = sizes[name]
    for name in NEXTN_OPTIONAL:
        if p + name in store:
            shapes[p + name] = sizes[name]
    return shapes


def check_head(store: GGUFStore, hp: HParams) -> dict[str, tuple[int, ...]]:
    """The head's tensors as :func:`head_shapes` lists them, each present with its shape and a type GGML computes
    it in (else one error naming the tensor); returns them."""
    shapes = head_shapes(store, hp)
    try:
        check_shapes(store, hp, shapes)
    except ModelFileError as exc:
        raise ModelFileError(f"{exc} (in the next-token-prediction head blk.{hp.n_layer}, which draft-mtp runs)") \
            from None
    return shapes


def head_graph_size(hp: HParams, n_seq: int = 1) -> int:
    return graph_size(hp, n_seq, n_layer=1) + HEAD_EXTRA_NODES


def head_context_size(hp: HParams, n_seq: int = 1) -> int:
    size = head_graph_size(hp, n_seq)
    return Context.size_for(2 * size, graph_size=size)


def build_head(hp: HParams, w: dict[str, Tensor], experts: list[ExpertWeights | None], kv: KVCache,
               seq_rows: tuple[SeqRows, ...], flash: bool, fill: bool, arena: Arena | None = None) -> DecoderGraph:
    """The head over an ubatch of ``seq_rows`` (rows in that order; each row's inputs: a token, the hidden state
    ``h`` [T, n_embd] before it, its position). ``fill``: only the head's KV cache is written (no logits); else
    the logits [T, n_vocab] of every row and the head's own hidden state (``hidden``)."""
    fam = FAMILIES[hp.arch]
    attention = fam.head_attention
    assert attention is not None
    il = hp.n_layer
    p = f"blk.{il}."
    size = head_graph_size(hp, len(seq_rows))
    n_tokens = sum(s.n_tokens for s in seq_rows)
    c = Context(n_tensors=2 * size, graph_size=size, arena=arena)
    g = c.new_graph(size)
    inp = {"tokens": c.new_tensor("i32", (n_tokens,), "inp_tokens"),
           "h": c.new_tensor("f32", (n_tokens, hp.n_embd), "mtp_h_input")}
    inp.update(new_inputs(c, hp, kv, seq_rows, n_tokens, flash, None))
    for t in inp.values():
        t.set_input()
    b = Builder(c, g, hp, w, experts, kv, inp, seq_rows, flash, None)
    b.mark("embd", -1)
    embd = c.get_rows(w.get(p + "nextn.embed_tokens.weight", w["token_embd.weight"]), inp["tokens"])
    b.mark("layer", il)
    h_norm = b.norm(inp["h"], p + "nextn.hnorm.weight")
    e_norm = b.norm(embd, p + "nextn.enorm.weight")
    x = c.mul_mat(w[p + "nextn.eh_proj.weight"], c.concat(e_norm, h_norm, axis=-1))
    if fill:
        # the attention stores this ubatch's K and V; nothing after them is expanded into the graph (the masks are
        # inputs of no node of it)
        attention(b, il, b.norm(x, p + "attn_norm.weight"))
        return DecoderGraph(c, g, {k: t for k, t in inp.items() if "mask" not in k}, None, b.regions, b.segments)
    cur = decoder_layer(b, il, x, attention)
    b.mark("output", -1)
    hidden = b.norm(cur, p + "nextn.shared_head_norm.weight" if p + "nextn.shared_head_norm.weight" in w
                    else "output_norm.weight")
    hidden.name = "h_nextn"
    hidden.set_output()
    head = w.get(p + "nextn.shared_head_head.weight", w.get("output.weight", w["token_embd.weight"]))
    logits = c.mul_mat(head, hidden)
    logits.name = "result_output"
    logits.set_output()
    g.expand(logits)
    return DecoderGraph(c, g, inp, logits, b.regions, b.segments, hidden=hidden)


__all__ = ["NEXTN_OPTIONAL", "NEXTN_REQUIRED", "build_head", "check_head", "head_context_size", "head_graph_size",
           "head_layer", "head_shapes"]
