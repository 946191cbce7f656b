"""``deepseek2`` (DeepSeek-V2/V2.5/V2-Lite, DeepSeek-V3/R1, Kimi K2): multi-head latent attention in the
absorbed form, leading dense layers, shared experts, softmax (V2) or sigmoid + selection bias (V3) gating,
grouped routing, routed scaling, YaRN.

llama.cpp: ``src/models/deepseek2.cpp``. The KV cache holds, per token and layer, the normed compressed
KV and the shared rope key (``kv_lora_rank + qk_rope`` values, one KV head); the queries are absorbed
into that space through ``attn_k_b`` and the attention output is decompressed through ``attn_v_b``.
YaRN's magnitude goes into the attention scale (``yarn_log_multiplier``). Refused: the legacy layout
with ``attn_kv_b`` (files converted before the absorbed form: reconvert them) and Mistral-Large-3's
attention temperature.
"""

from __future__ import annotations

import numpy as np

from ...errors import ModelFileError
from ...ggml.tensor import Tensor
from ...gguf.metadata import meta_float, meta_int
from ...gguf.store import GGUFStore
from ..hparams import MLA, Common, HParams, refuse
from ..layers import Builder, decoder_layer, output_projection
from ..rope import f32, logf, read_rope
from .base import Family, Shapes, base_hparams, dense_lead, ffn_tensors, globals_, routing_keys


def read(store: GGUFStore, c: Common) -> HParams:
    a = c.arch
    vocab = meta_int(store, f"{a}.vocab_size", 0, lo=0) or len(store.meta("tokenizer.ggml.tokens", [], kind="strs"))
    # llama.cpp's "lite" heuristics (DeepSeek-V2-Lite and relatives): no q-LoRA, and the key is not even read
    is_lite = c.n_layer in (26, 27) or (c.n_layer == 48 and vocab == 128256)
    q_lora = 0 if is_lite else meta_int(store, f"{a}.attention.q_lora_rank", lo=0)
    kv_lora = meta_int(store, f"{a}.attention.kv_lora_rank")
    k_mla = meta_int(store, f"{a}.attention.key_length_mla", 0, lo=0)
    v_mla = meta_int(store, f"{a}.attention.value_length_mla", 0, lo=0)
    if not (k_mla and v_mla) or "blk.0.attn_kv_b.weight" in store:
        raise refuse(store, a, f"{a}.attention.key_length_mla", "the legacy attention layout (attn_kv_b, no "
                     "key_length_mla/value_length_mla): reconvert the model with a current llama.cpp converter")
    if meta_float(store, f"{a}.attention.temperature_scale", 0.0, -1e6, 1e6) != 0:
        raise refuse(store, a, f"{a}.attention.temperature_scale", "attention temperature tuning")
    r = c.n_rot
    if r % 2 or k_mla - r < 1:
        raise refuse(store, a, f"{a}.rope.dimension_count", f"{r} rope dims of key_length_mla {k_mla} (they must be "
                     "even and fewer)")
    if c.n_head_kv != 1 or c.key_length != kv_lora + r:
        raise refuse(store, a, f"{a}.attention.head_count_kv", f"{c.n_head_kv} KV heads of {c.key_length} (the "
                     f"absorbed layout has 1 KV head of kv_lora_rank + rope dims = {kv_lora + r})")
    n_dense = dense_lead(store, c)
    shared = meta_int(store, f"{a}.expert_shared_count")  # llama.cpp always creates the shared expert
    log_mul = 0.0
    if store.has(f"{a}.rope.scaling.yarn_log_multiplier"):
        log_mul = float(f32(meta_float(store, f"{a}.rope.scaling.yarn_log_multiplier", None, 0, 1e6)) / f32(0.1))
    rope = read_rope(store, a, "normal", r, c.n_ctx_train, yarn_log_mul=log_mul, deepseek2=True)
    scale = mla_kq_scale(rope.attn_factor, rope.freq_scale, log_mul, k_mla)
    default_gating = "sigmoid" if c.n_layer in (47, 48) and vocab == 154880 else "softmax"
    routing = routing_keys(store, c, default_gating)
    first = f"blk.{n_dense}."
    n_ff_exp = meta_int(store, f"{a}.expert_feed_forward_length", n=c.n_layer_all)
    return base_hparams(store, c, rope_mode="normal", n_ff_exp=n_ff_exp, routing=routing, rope=rope,
                        kq_scale=scale, head_dim=kv_lora + r, head_dim_v=kv_lora,
                        mla=MLA(q_lora, kv_lora, k_mla - r, r, v_mla), n_dense_lead=n_dense,
                        n_ff_shexp=n_ff_exp * shared, selection_bias=first + "exp_probs_b.bias" in store,
                        fused_gate_up=first + "ffn_gate_up_exps.weight" in store)


def mla_kq_scale(attn_factor: float, freq_scale: float, yarn_log_mul: float, key_length_mla: int) -> float:
    """The attention scale ``deepseek2.cpp`` pre-scales by YaRN's magnitude (all of it ends up here), in float32."""
    inv = f32(f32(1) / f32(freq_scale))
    org = f32(f32(attn_factor) * f32(f32(1) + f32(f32(0.1) * logf(inv))))
    mscale = f32(org * f32(f32(1) + f32(f32(f32(0.1) * f32(yarn_log_mul)) * logf(inv))))
    return float(f32(f32(f32(f32(1) * mscale) * mscale) / np.sqrt(f32(key_length_mla))))


def layer_tensors(hp: HParams, il: int) -> Shapes:
    """One layer: latent attention and the FFN."""
    m = hp.mla
    assert m is not None
    E, H, dk, p = hp.n_embd, hp.n_head, m.qk_nope + m.qk_rope, f"blk.{il}."
    shapes = {p + "attn_norm.weight": (E,), p + "attn_kv_a_norm.weight": (m.kv_lora_rank,),
              p + "attn_kv_a_mqa.weight": (m.kv_lora_rank + m.qk_rope, E),
              p + "attn_k_b.weight": (H, m.kv_lora_rank, m.qk_nope),
              p + "attn_v_b.weight": (H, m.v_head, m.kv_lora_rank),
              p + "attn_output.weight": (E, H * m.v_head)}
    if m.q_lora_rank:
        shapes.update({p + "attn_q_a.weight": (m.q_lora_rank, E), p + "attn_q_a_norm.weight": (m.q_lora_rank,),
                       p + "attn_q_b.weight": (H * dk, m.q_lora_rank)})
    else:
        shapes[p + "attn_q.weight"] = (H * dk, E)
    shapes.update(ffn_tensors(hp, il))
    return shapes


def head_tensors(hp: HParams, il: int) -> Shapes:
    """The draft head's block: llama.cpp's deepseek2 ``graph_mtp`` asserts the q-LoRA form (``attn_q_a``)."""
    m = hp.mla
    assert m is not None
    if not m.q_lora_rank:
        raise ModelFileError(f"{hp.arch}: the next-token-prediction head needs attention.q_lora_rank > 0 (llama.cpp's "
                             "MTP graph for deepseek2 asserts the q-LoRA projections attn_q_a / attn_q_b)")
    return layer_tensors(hp, il)


def tensors(hp: HParams) -> Shapes:
    shapes = globals_(hp)
    for il in range(hp.n_layer):
        shapes.update(layer_tensors(hp, il))
    return shapes


def latent_attention(b: Builder, il: int, x: Tensor) -> Tensor:
    """Queries, the compressed KV and the rope key as ``deepseek2.cpp`` builds them (absorbed MLA)."""
    c, hp, p = b.c, b.hp, f"blk.{il}."
    m = hp.mla
    assert m is not None
    T, H, R, r, dn = x.ne[1], hp.n_head, m.kv_lora_rank, m.qk_rope, m.qk_nope
    if m.q_lora_rank:
        q = b.linear(p + "attn_q_b", b.norm(b.linear(p + "attn_q_a", x), p + "attn_q_a_norm.weight"))
    else:
        q = b.linear(p + "attn_q", x)
    q = c.reshape(q, (T, H, dn + r))                                   # per head: [nope | rope]
    kvp = b.linear(p + "attn_kv_a_mqa", x)                              # [T, R + r]
    row, ef = kvp.nb[1], kvp.dtype.type_size
    kv_cmpr = c.view(kvp, (T, R), (row,), 0)
    k_pe = b.rope(c.view(kvp, (T, 1, r), (row, row), R * ef), il)
    kv_cmpr = b.norm(kv_cmpr, p + "attn_kv_a_norm.weight")
    q_nope = c.view(q, (T, H, dn), (q.nb[2], q.nb[1]), 0)
    q_pe = b.rope(c.view(q, (T, H, r), (q.nb[2], q.nb[1]), dn * ef), il)
    q_abs = c.mul_mat(b.w[p + "attn_k_b.weight"], c.permute(q_nope, (1, 0, 2)))  # [H, T, R]
    q_cur = c.concat(c.permute(q_abs, (1, 0, 2)), q_pe, axis=-1)             # [T, H, R + r]: latent first
    k_cur = c.concat(c.reshape(kv_cmpr, (T, 1, R)), k_pe, axis=-1)           # [T, 1, R + r]
    out = b.attend_latent(il, q_cur, k_cur, b.w[p + "attn_v_b.weight"])
    return output_projection(b, il, out)


def layer(b: Builder, il: int, x: Tensor) -> Tensor:
    return decoder_layer(b, il, x, latent_attention)


FAMILY = Family("deepseek2", read, tensors, layer, extra_nodes=32, head_attention=latent_attention,
                head_tensors=head_tensors)
