"""``qwen35moe`` (Qwen3.5 / Qwen3.6 MoE, e.g. Qwen3.5-35B-A3B): gated delta-net layers with one attention layer
in four, interleaved M-RoPE over part of each head, routed experts and a sigmoid-gated shared expert.

llama.cpp: ``src/models/qwen35moe.cpp``. The required ``rope.dimension_sections`` (four counts) say which
position axis each rotated pair uses; text gives every axis but the fourth the token's position, so with
sections that cover the rotated pairs the rope equals NEOX's. Value head h reads key head h % (key heads),
inside the fused delta-net op; beta and alpha are two projections (``ssm_beta``, ``ssm_alpha``).
See :mod:`.recurrent` for the keys both recurrent families read.
"""

from __future__ import annotations

from ...gguf.metadata import meta_int
from ...gguf.store import GGUFStore
from ..delta_net import gated_attention, layer
from ..hparams import Common, HParams
from . import recurrent
from .base import Family


def sections(store: GGUFStore, c: Common) -> tuple[int, ...]:
    """``rope.dimension_sections``: four counts (one value: four times that), checked as GGML's rope asserts."""
    key = f"{c.arch}.rope.dimension_sections"
    v = store.meta(key, kind=("int", "ints"))
    vals = v if isinstance(v, list) else [meta_int(store, key, lo=0)] * 4
    if len(vals) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise recurrent.bad_value(store, key, v, "must be 4 non-negative integers (pairs per position axis t, h, w, e)")
    if not any(vals[:3]) or sum(vals) > c.key_length:
        raise recurrent.bad_value(store, key, v, f"the first three must not all be 0 and the sum must be at most the "
                               f"head size {c.key_length}")
    return tuple(vals)


def read(store: GGUFStore, c: Common) -> HParams:
    return recurrent.read(store, c, rope_mode="imrope", k_repeat="tile", ba_fused=False, sections=sections(store, c))


FAMILY = Family("qwen35moe", read, recurrent.tensors, layer, extra_nodes=40, head_attention=gated_attention,
                head_tensors=recurrent.head_tensors)
