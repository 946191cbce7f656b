"""``gpt-oss`` (gpt-oss-20b, gpt-oss-120b): MXFP4 experts with per-expert biases, the clamped SwiGLU, attention
sinks, sliding-window attention on every other layer, YaRN, softmax over the k selected router logits.

llama.cpp: ``src/models/openai-moe.cpp`` (``LLM_ARCH_OPENAI_MOE``). The head size is the rope dimension
count (key/value lengths must equal it); the pre-FFN norm is ``post_attention_norm``; the router and the
experts have biases (``add_id`` per selected expert); the output rows are picked after the last layer.
``expert_weights_scale``, ``expert_weights_norm`` and ``expert_gating_func`` are not read (llama.cpp
ignores them for this architecture). The sliding-window layers keep full-size caches, as
llama-cpp-python does (``swa_full``); llama.cpp's command-line tools' ring cache is not implemented.
"""

from __future__ import annotations

from ...gguf.metadata import meta_float, meta_int
from ...gguf.store import GGUFStore
from ..hparams import SWA, Common, HParams, Routing, refuse
from ..rope import f32, read_rope
from .base import Family, attn_biases, base_hparams, expert_width, no_nextn, refuse_fused_qkv, standard_tensors


def _swa_layers(store: GGUFStore, c: Common) -> tuple[bool, ...]:
    key = f"{c.arch}.attention.sliding_window_pattern"
    v = store.meta(key, 2, kind=("int", "ints", "bools"))
    if isinstance(v, list):  # one flag per layer (missing ones: full attention)
        if len(v) > c.n_layer_all or not all(isinstance(x, (bool, int)) for x in v):
            raise refuse(store, c.arch, key, f"{v!r} (per-layer flags, at most one per layer)")
        flags = [bool(x) for x in v] + [False] * (c.n_layer_all - len(v))
        return tuple(flags[:c.n_layer])
    n = meta_int(store, key, 2, lo=0)
    return tuple(n == 0 or il % n < n - 1 for il in range(c.n_layer))  # llama.cpp's set_swa_pattern


def read(store: GGUFStore, c: Common) -> HParams:
    a = c.arch
    no_nextn(store, c)
    refuse_fused_qkv(store, a)
    swa_keys = (f"{a}.attention.key_length_swa", f"{a}.attention.value_length_swa", f"{a}.rope.dimension_count_swa")
    dims = {c.key_length, c.value_length, c.n_rot} | {meta_int(store, k, c.n_rot) for k in swa_keys}
    if len(dims) != 1:
        raise refuse(store, a, f"{a}.rope.dimension_count", f"head sizes {sorted(dims)} (gpt-oss's graph takes the "
                     "rope dimension count as the head size: key/value lengths must equal it)")
    rope = read_rope(store, a, "neox", c.n_rot, c.n_ctx_train)
    factor = f32(meta_float(store, f"{a}.rope.scaling.factor", meta_float(store, f"{a}.rope.scale_linear", 0.0, 0.0,
                                                                          1e6), 0.0, 1e6))
    swa = SWA(n_swa=meta_int(store, f"{a}.attention.sliding_window"), layers=_swa_layers(store, c),
              freq_base=float(f32(meta_float(store, f"{a}.rope.freq_base_swa", rope.freq_base, 1e-3, 1e12))),
              # the trained scale, even when rope.scaling.type is "none" (llama.cpp's rope_freq_scale_train_swa)
              freq_scale=float(f32(1) if factor == 0 else f32(f32(1) / factor)))
    return base_hparams(store, c, rope_mode="neox", n_ff_exp=expert_width(store, c, required=True),
                        routing=Routing("softmax_weight", False, 0.0, c.n_group, c.n_group_used, glu="swiglu_oai"),
                        attn_biases=attn_biases(store) + ("o",), ffn_norm="post_attention_norm", swa=swa, sinks=True,
                        expert_biases=True, out_rows_late=True, tied_output=False)


FAMILY = Family("gpt-oss", read, standard_tensors)
