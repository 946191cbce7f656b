"""``qwen2moe`` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, a shared expert scaled by a sigmoid gate,
top-k weights not normalised.

llama.cpp: ``src/models/qwen2moe.cpp``. The queries are ``embedding_length`` wide; the shared expert
is ``expert_shared_feed_forward_length`` wide (else ``feed_forward_length``); the output head is required.
"""

from __future__ import annotations

from ...gguf.metadata import meta_int
from ...gguf.store import GGUFStore
from ..hparams import Common, HParams, Routing, refuse
from .base import (
    Family,
    attn_biases,
    base_hparams,
    expert_width,
    no_nextn,
    refuse_fused_qkv,
    require_full_rotary,
    standard_tensors,
)


def read(store: GGUFStore, c: Common) -> HParams:
    no_nextn(store, c)
    require_full_rotary(store, c)
    refuse_fused_qkv(store, c.arch)
    if c.n_head * c.key_length != c.n_embd:
        raise refuse(store, c.arch, f"{c.arch}.attention.key_length",
                     f"head_count*key_length = {c.n_head}*{c.key_length} != embedding_length {c.n_embd} (qwen2moe "
                     "needs head_count*key_length = embedding_length)")
    n_ff_shexp = meta_int(store, f"{c.arch}.expert_shared_feed_forward_length", c.n_ff or None)
    return base_hparams(store, c, rope_mode="neox", n_ff_exp=expert_width(store, c, required=False),
                        routing=Routing("softmax", False, 0.0, c.n_group, c.n_group_used),
                        attn_biases=attn_biases(store), n_ff_shexp=n_ff_shexp, shared_gate="silu_div",
                        tied_output=False)


FAMILY = Family("qwen2moe", read, standard_tensors)
