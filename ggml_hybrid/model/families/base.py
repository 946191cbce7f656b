"""What a family is, and the tensor lists and metadata rules several families share.

A family maps one ``general.architecture`` to what llama.cpp does for it: its own
metadata keys (``read``, on top of :func:`~ggml_hybrid.model.hparams.read_common`),
the exact set of tensors it needs (``tensors``: llama.cpp refuses a file with more or
fewer) and its layer graph (``layer``, built from :mod:`ggml_hybrid.model.layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...ggml.tensor import Tensor
from ...gguf.metadata import meta_bool, meta_float, meta_int
from ...gguf.store import GGUFStore
from ..hparams import GATINGS, Common, HParams, Routing, refuse
from ..layers import Attention, Builder, decoder_layer
from ..rope import kq_scale, read_rope

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Family:
    arch: str
    read: Callable[[GGUFStore, Common], HParams]
    tensors: Callable[[HParams], Shapes]
    layer: Callable[[Builder, int, Tensor], Tensor] = decoder_layer
    extra_nodes: int = 0  # graph nodes per layer beyond the common budget (decoder.NODES_PER_LAYER)
    # the next-token-prediction (MTP) block llama.cpp runs as a draft head (``graph_mtp``; model/mtp.py): its
    # attention (the rest of the block is decoder_layer's) and its tensors besides the ``nextn.*`` ones; None: the
    # family has no such block in the pinned llama.cpp
    head_attention: Attention | None = None
    head_tensors: Callable[[HParams, int], Shapes] | None = None


def rms_eps(store: GGUFStore, arch: str) -> float:
    """``attention.layer_norm_rms_epsilon``: required by every family here, as by llama.cpp."""
    return meta_float(store, f"{arch}.attention.layer_norm_rms_epsilon", None, 0.0, 0.5)


def expert_width(store: GGUFStore, c: Common, required: bool) -> int:
    """``expert_feed_forward_length``; when optional and absent, llama.cpp's ``n_ff / n_expert_used``."""
    key = f"{c.arch}.expert_feed_forward_length"
    if not required and not store.has(key):
        if not c.n_ff:
            raise refuse(store, c.arch, key, "a file with neither it nor feed_forward_length")
        return c.n_ff // c.n_used
    return meta_int(store, key, n=c.n_layer_all)


def gating(store: GGUFStore, arch: str, default: str) -> str:
    """``expert_gating_func``: 1 softmax, 2 sigmoid; absent (or 0) gives the family's default."""
    key = f"{arch}.expert_gating_func"
    v = meta_int(store, key, 0, lo=0)
    if v == 0:
        return default
    if v not in GATINGS:
        raise refuse(store, arch, key, f"gating function {v} (only 1 = softmax and 2 = sigmoid are implemented)")
    return GATINGS[v]


def attn_biases(store: GGUFStore) -> tuple[str, ...]:
    """Which of q, k, v carry a bias (each optional in llama.cpp's ``create_tensor_qkv``), from layer 0."""
    return tuple(n for n in "qkv" if f"blk.0.attn_{n}.bias" in store)


def refuse_fused_qkv(store: GGUFStore, arch: str) -> None:
    if "blk.0.attn_qkv.weight" in store:
        raise refuse(store, arch, "blk.0.attn_qkv.weight", "a fused q/k/v projection (converters write separate ones)")


def globals_(hp: HParams) -> Shapes:
    E, V = hp.n_embd, hp.n_vocab
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not hp.tied_output:
        shapes["output.weight"] = (V, E)
    return shapes


def attention_tensors(hp: HParams, il: int) -> Shapes:
    """A layer's attention in the q/k/v form: norm, projections (with their biases), q/k norms, sinks."""
    E, p = hp.n_embd, f"blk.{il}."
    q, kv, v = hp.n_embd_q, hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.head_dim_v
    shapes = {p + "attn_norm.weight": (E,), p + "attn_q.weight": (q, E), p + "attn_k.weight": (kv, E),
              p + "attn_v.weight": (v, E), p + "attn_output.weight": (E, hp.n_head * hp.head_dim_v)}
    sizes = {"q": q, "k": kv, "v": v, "o": E}
    for n in hp.attn_biases:
        shapes[p + ("attn_output" if n == "o" else f"attn_{n}") + ".bias"] = (sizes[n],)
    if hp.qk_norm == "head":
        shapes.update({p + "attn_q_norm.weight": (hp.head_dim,), p + "attn_k_norm.weight": (hp.head_dim,)})
    elif hp.qk_norm == "full":
        shapes.update({p + "attn_q_norm.weight": (q,), p + "attn_k_norm.weight": (kv,)})
    if hp.sinks:
        shapes[p + "attn_sinks.weight"] = (hp.n_head,)
    return shapes


def ffn_tensors(hp: HParams, il: int) -> Shapes:
    """A layer's FFN: its pre-FFN norm, then a dense FFN (leading dense layers) or the routed experts and the
    shared expert."""
    E, p, X, F = hp.n_embd, f"blk.{il}.", hp.n_expert, hp.n_ff_exp
    shapes: Shapes = {p + hp.ffn_norm + ".weight": (E,)}
    if il < hp.n_dense_lead:
        shapes.update({p + "ffn_gate.weight": (hp.n_ff, E), p + "ffn_up.weight": (hp.n_ff, E),
                       p + "ffn_down.weight": (E, hp.n_ff)})
        return shapes
    shapes.update({p + "ffn_gate_inp.weight": (X, E), p + "ffn_down_exps.weight": (X, E, F)})
    if hp.fused_gate_up:
        shapes[p + "ffn_gate_up_exps.weight"] = (X, 2 * F, E)
    else:
        shapes.update({p + "ffn_gate_exps.weight": (X, F, E), p + "ffn_up_exps.weight": (X, F, E)})
    if hp.expert_biases:
        shapes.update({p + "ffn_gate_inp.bias": (X,), p + "ffn_gate_exps.bias": (X, F),
                       p + "ffn_up_exps.bias": (X, F), p + "ffn_down_exps.bias": (X, E)})
    if hp.selection_bias:
        shapes[p + "exp_probs_b.bias"] = (X,)
    if hp.n_ff_shexp:
        S = hp.n_ff_shexp
        shapes.update({p + "ffn_gate_shexp.weight": (S, E), p + "ffn_up_shexp.weight": (S, E),
                       p + "ffn_down_shexp.weight": (E, S)})
        if hp.shared_gate:
            shapes[p + "ffn_gate_inp_shexp.weight"] = (E,)
    return shapes


def standard_layer_tensors(hp: HParams, il: int) -> Shapes:
    """One layer of the q/k/v families: its attention and its FFN."""
    return {**attention_tensors(hp, il), **ffn_tensors(hp, il)}


def standard_tensors(hp: HParams) -> Shapes:
    shapes = globals_(hp)
    for il in range(hp.n_layer):
        shapes.update(standard_layer_tensors(hp, il))
    return shapes


def dense_lead(store: GGUFStore, c: Common) -> int:
    """``leading_dense_block_count``: the first layers have a dense FFN of ``feed_forward_length``."""
    key = f"{c.arch}.leading_dense_block_count"
    n = meta_int(store, key, 0, lo=0)
    if n >= c.n_layer:
        raise refuse(store, c.arch, key, f"{n} dense layers of {c.n_layer} (no MoE layer)")
    if n and not c.n_ff:
        raise refuse(store, c.arch, f"{c.arch}.feed_forward_length", "dense layers without it")
    return n


def no_nextn(store: GGUFStore, c: Common) -> None:
    """Families whose llama.cpp graph has no next-token-prediction layers (it would refuse their tensors)."""
    if c.n_layer != c.n_layer_all:
        raise refuse(store, c.arch, f"{c.arch}.nextn_predict_layers", "next-token-prediction layers")


def require_full_rotary(store: GGUFStore, c: Common) -> None:
    """The families whose graph asserts ``n_embd_head == n_rot`` (llama.cpp aborts otherwise)."""
    if c.n_rot != c.key_length or c.key_length != c.value_length:
        raise refuse(store, c.arch, f"{c.arch}.rope.dimension_count",
                     f"rotary dimensions {c.n_rot} with key/value head sizes {c.key_length}/{c.value_length} "
                     "(this architecture's graph needs all three equal)")


__all__ = ["Family", "Shapes", "attention_tensors", "attn_biases", "base_hparams", "dense_lead", "expert_width",
           "ffn_tensors", "gating", "globals_", "no_nextn", "refuse_fused_qkv", "require_full_rotary", "rms_eps",
           "routing_keys", "standard_layer_tensors", "standard_tensors"]


def routing_keys(store: GGUFStore, c: Common, default_gating: str) -> Routing:
    """The routing keys glm4moe and deepseek2 read: gating function, normalisation, scale (and the groups)."""
    a = c.arch
    return Routing(gating(store, a, default_gating), meta_bool(store, f"{a}.expert_weights_norm", False),
                   meta_float(store, f"{a}.expert_weights_scale", 0.0, 0.0, 1e6), c.n_group, c.n_group_used)


def base_hparams(store: GGUFStore, c: Common, *, rope_mode: str, n_ff_exp: int, routing: Routing,
                 **fields: Any) -> HParams:
    """HParams from the common keys: head sizes from key/value_length, llama.cpp's float32 attention scale,
    the rope of ``rope_mode`` over ``rope.dimension_count`` dims; ``fields`` set the family's own."""
    values: dict[str, Any] = dict(
        arch=c.arch, n_layer=c.n_layer, n_layer_all=c.n_layer_all, n_embd=c.n_embd, n_head=c.n_head,
        n_head_kv=c.n_head_kv, head_dim=c.key_length, head_dim_v=c.value_length, n_vocab=c.n_vocab,
        n_ctx_train=c.n_ctx_train, n_expert=c.n_expert, n_used=c.n_used, n_ff_exp=n_ff_exp,
        rms_eps=rms_eps(store, c.arch), routing=routing, kq_scale=kq_scale(c.value_length),
        tied_output=c.tied_output, n_ff=c.n_ff)
    values.update(fields)
    if "rope" not in values:
        values["rope"] = read_rope(store, c.arch, rope_mode, c.n_rot, c.n_ctx_train)
    return HParams(**values)
