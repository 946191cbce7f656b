"""``qwen3moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): per-head q/k RMS norm, NEOX rope, normalised top-k.

llama.cpp: ``src/models/qwen3moe.cpp``. The expert width is ``expert_feed_forward_length``
(else ``feed_forward_length / expert_used_count``); ``expert_weights_scale`` is not read.
"""

from __future__ import annotations

from ...gguf.store import GGUFStore
from ..hparams import Common, HParams, Routing
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
    return base_hparams(store, c, rope_mode="neox", n_ff_exp=expert_width(store, c, required=False),
                        routing=Routing("softmax", True, 0.0, c.n_group, c.n_group_used), qk_norm="head",
                        attn_biases=attn_biases(store))


FAMILY = Family("qwen3moe", read, standard_tensors)
