"""``llama`` with routed experts (Mixtral 8x7B and 8x22B): normal (adjacent-pair) rope, experts sized by
``feed_forward_length``, normalised top-k weights.

llama.cpp: ``src/models/llama.cpp``. Optional there and refused here: ``rope_freqs`` (Llama-3 rope
factors, a dense-model feature) and a missing ``ffn_gate_exps``; the output projection's bias is supported.
"""

from __future__ import annotations

from ...gguf.store import GGUFStore
from ..hparams import Common, HParams, Routing, refuse
from .base import Family, attn_biases, base_hparams, no_nextn, refuse_fused_qkv, require_full_rotary, standard_tensors


def read(store: GGUFStore, c: Common) -> HParams:
    no_nextn(store, c)
    require_full_rotary(store, c)  # llama.cpp: "invalid n_rot"
    refuse_fused_qkv(store, c.arch)
    if not c.n_ff:
        raise refuse(store, c.arch, f"{c.arch}.feed_forward_length", "a file without it (the experts' width)")
    biases = attn_biases(store) + (("o",) if "blk.0.attn_output.bias" in store else ())
    return base_hparams(store, c, rope_mode="normal", n_ff_exp=c.n_ff,
                        routing=Routing("softmax", True, 0.0, c.n_group, c.n_group_used), attn_biases=biases)


FAMILY = Family("llama", read, standard_tensors)
