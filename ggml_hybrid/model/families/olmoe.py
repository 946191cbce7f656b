"""``olmoe`` (OLMoE-1B-7B): q/k RMS norms over the whole projection (before the split into heads), NEOX rope,
softmax gating without renormalisation.

llama.cpp: ``src/models/olmoe.cpp``. The experts are ``feed_forward_length`` wide; the k norm weight
is ``embedding_length`` long, so K must be as wide (as many KV heads as heads); the output head is required.
"""

from __future__ import annotations

from ...gguf.store import GGUFStore
from ..hparams import Common, HParams, Routing, refuse
from .base import Family, attn_biases, base_hparams, no_nextn, refuse_fused_qkv, require_full_rotary, standard_tensors


def read(store: GGUFStore, c: Common) -> HParams:
    no_nextn(store, c)
    require_full_rotary(store, c)
    refuse_fused_qkv(store, c.arch)
    if c.n_head * c.key_length != c.n_embd or c.n_head_kv != c.n_head:
        raise refuse(store, c.arch, f"{c.arch}.attention.head_count_kv",
                     f"{c.n_head_kv} KV heads of {c.key_length} for {c.n_head} heads and embedding_length "
                     f"{c.n_embd} (olmoe's q/k norms need head_count = head_count_kv and "
                     "head_count*key_length = embedding_length)")
    if not c.n_ff:
        raise refuse(store, c.arch, f"{c.arch}.feed_forward_length", "a file without it (the experts' width)")
    return base_hparams(store, c, rope_mode="neox", n_ff_exp=c.n_ff,
                        routing=Routing("softmax", False, 0.0, c.n_group, c.n_group_used), qk_norm="full",
                        attn_biases=attn_biases(store), tied_output=False)


FAMILY = Family("olmoe", read, standard_tensors)
