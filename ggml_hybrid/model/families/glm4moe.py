"""``glm4moe`` (GLM-4.5, GLM-4.5-Air, GLM-4.6): leading dense layers, a shared expert, sigmoid gating with a
selection bias, normalised and scaled top-k weights, partial rotary dimensions, next-token-prediction layers.

llama.cpp: ``src/models/glm4-moe.cpp``. The pre-FFN norm is ``post_attention_norm``; q/k/v biases
and the per-head q/k norms are each optional; the last ``nextn_predict_layers`` block is not part of
the graph: it is the draft head (``graph_mtp``, :mod:`ggml_hybrid.model.mtp`), a layer like the others on
the target's hidden state, loaded only for speculative decoding (as llama.cpp skips its tensors otherwise).
Refused: M-RoPE (``rope.dimension_sections``, the vision variant) and ``expert_shared_count = 0`` (llama.cpp then adds
``silu(x)`` in the shared expert's place).
"""

from __future__ import annotations

from ...gguf.metadata import meta_int
from ...gguf.store import GGUFStore
from ..hparams import Common, HParams, refuse
from ..layers import standard_attention
from .base import (
    Family,
    attn_biases,
    base_hparams,
    dense_lead,
    expert_width,
    refuse_fused_qkv,
    routing_keys,
    standard_layer_tensors,
    standard_tensors,
)


def read(store: GGUFStore, c: Common) -> HParams:
    a = c.arch
    refuse_fused_qkv(store, a)
    sections = store.meta(f"{a}.rope.dimension_sections", [0, 0, 0, 0], kind="ints")
    if isinstance(sections, list) and len(sections) >= 2 and sections[0] > 0 and sections[1] > 0:
        raise refuse(store, a, f"{a}.rope.dimension_sections", "multimodal rope (M-RoPE)")
    if c.key_length != c.value_length:
        raise refuse(store, a, f"{a}.attention.value_length", "key and value head sizes that differ")
    n_ff_exp = expert_width(store, c, required=True)
    shared = meta_int(store, f"{a}.expert_shared_count", lo=0)
    if shared == 0:
        raise refuse(store, a, f"{a}.expert_shared_count", "0 (no shared expert)")
    n_dense = dense_lead(store, c)
    norms = [f"blk.0.attn_{n}_norm.weight" in store for n in "qk"]
    if norms[0] != norms[1]:
        raise refuse(store, a, "blk.0.attn_q_norm.weight", "a q norm without a k norm (or the reverse)")
    routing = routing_keys(store, c, "sigmoid")
    return base_hparams(store, c, rope_mode="neox", n_ff_exp=n_ff_exp, routing=routing,
                        qk_norm="head" if norms[0] else "none", attn_biases=attn_biases(store),
                        n_dense_lead=n_dense, n_ff_shexp=n_ff_exp * shared, ffn_norm="post_attention_norm",
                        selection_bias=True, f32_acc=True)


FAMILY = Family("glm4moe", read, standard_tensors, head_attention=standard_attention,
                head_tensors=standard_layer_tensors)
