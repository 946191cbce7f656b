"""``qwen3next`` (Qwen3-Next-80B-A3B): gated delta-net layers with one attention layer in four, NEOX rope over part
of each head, routed experts and a sigmoid-gated shared expert in every layer.

llama.cpp: ``src/models/qwen3next.cpp``. Value heads share the query/key heads in groups (value head h reads
key head h // (value heads / key heads), materialised with ``repeat_4d``); beta and alpha come from one
``ssm_ba`` projection, grouped per key head; the q, k, v and output-gate projections are ``attn_qkv`` and
``attn_gate``, or in files converted before llama.cpp split them, one ``ssm_in`` grouped per key head.
See :mod:`.recurrent` for the keys both recurrent families read.
"""

from __future__ import annotations

from ...gguf.store import GGUFStore
from ..delta_net import gated_attention, layer
from ..hparams import Common, HParams
from . import recurrent
from .base import Family


def read(store: GGUFStore, c: Common) -> HParams:
    return recurrent.read(store, c, rope_mode="neox", k_repeat="interleave", ba_fused=True)


FAMILY = Family("qwen3next", read, recurrent.tensors, layer, extra_nodes=40, head_attention=gated_attention,
                head_tensors=recurrent.head_tensors)
