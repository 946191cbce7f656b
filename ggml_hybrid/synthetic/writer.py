"""GGUF writers: a synthetic model of any family in the real layout, and an FFN-only MoE stack."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ArgumentError
from ..ggml.dtypes import GGMLType, GGMLTypeLike, as_ggml_type
from ..ggml.quant import quantize
from .spec import GATINGS, PRE, ModelSpec
from .vocab import bpe_vocab, spm_vocab

if TYPE_CHECKING:
    import gguf

    # a tensor as GGUFWriter.add_tensor takes it: the values, and GGML's type of raw (quantized) bytes
    Encoded = tuple[np.ndarray, gguf.GGMLQuantizationType | None]

# chat templates as the families' files carry them (llama.cpp recognises each by a marker in it)
TEMPLATES = {
    "gpt-oss": "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
               "<|start|>assistant",
    "glm4moe": "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}<|assistant|>",
    "deepseek2": "{% for m in messages %}{% if m['role'] == 'user' %}<\uff5cUser\uff5c>{{ m['content'] }}{% else %}"
                 "<\uff5cAssistant\uff5c>{{ m['content'] }}<\uff5cend\u2581of\u2581sentence\uff5c>{% endif %}"
                 "{% endfor %}<\uff5cAssistant\uff5c>",
}


def _encode(data: np.ndarray, t: GGMLType) -> Encoded:
    import gguf

    if t == GGMLType.F32:
        return data, None
    if t == GGMLType.F16:
        return data.astype(np.float16), None
    return quantize(data, t), gguf.GGMLQuantizationType(int(t))


def _matrix(rng: np.random.Generator, shape: tuple[int, ...], t: GGMLType, scale: float = 1.0) -> Encoded:
    data = (rng.standard_normal(shape) * (scale / np.sqrt(shape[-1]))).astype(np.float32)
    return _encode(data, t)


class _Writer:
    """Adds tensors in order, drawing their values from one generator (so a spec always gives the same file)."""

    def __init__(self, w: gguf.GGUFWriter, spec: ModelSpec) -> None:
        self.w, self.spec = w, spec
        self.rng = np.random.default_rng(spec.seed)

    def add(self, name: str, data_raw: Encoded) -> None:
        data, raw = data_raw
        self.w.add_tensor(name, data, raw_dtype=raw)

    def vec(self, n: int, scale: float = 0.1, center: float = 1.0) -> Encoded:
        return (center + scale * self.rng.standard_normal(n)).astype(np.float32), None

    def mat(self, name: str, shape: tuple[int, ...], expert: bool = False, scale: float = 1.0) -> None:
        self.add(name, _matrix(self.rng, shape, self.spec.matrix_type(shape[-1], expert), scale))

    def f32(self, name: str, shape: tuple[int, ...], scale: float = 1.0) -> None:
        self.add(name, _matrix(self.rng, shape, GGMLType.F32, scale))


def write_model(path: str | os.PathLike[str], spec: ModelSpec | None = None, **overrides: Any) -> str:
    """Write the model described by ``spec`` (with ``overrides``) to ``path``; returns the path."""
    import gguf

    spec = ModelSpec(**{**asdict(spec or ModelSpec()), **overrides})
    spec.check()
    arch = spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"ggml-hybrid synthetic {arch}")
    if arch in ("qwen3moe", "qwen2moe", "llama"):
        _first_three(w, spec)
    else:
        wr = _Writer(w, spec)
        {"olmoe": _olmoe, "glm4moe": _glm4moe, "deepseek2": _deepseek2, "gpt-oss": _gpt_oss, "qwen3next": _hybrid,
         "qwen35moe": _hybrid}[arch](w, wr, spec)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _tokenizer(w: gguf.GGUFWriter, spec: ModelSpec, add_bos: bool | None = None) -> None:
    if spec.vocab == "spm":
        v = spm_vocab(spec.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(v.tokens)
        w.add_token_scores(v.scores)
        w.add_token_types(v.types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        return
    pre = PRE[spec.arch]
    v = bpe_vocab(pre, spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    w.add_token_merges(v.merges)
    if v.bos is not None:
        w.add_bos_token_id(v.bos)
    if v.eos is not None:
        w.add_eos_token_id(v.eos)
    w.add_add_bos_token(pre == "llama-bpe" if add_bos is None else add_bos)
    if spec.arch in TEMPLATES:
        w.add_chat_template(TEMPLATES[spec.arch])


def _common_meta(w: gguf.GGUFWriter, spec: ModelSpec, n_ff: int, n_blocks: int | None = None,
                 n_head_kv: int | None = None) -> None:
    """The keys every family's converter writes, in a fixed order."""
    w.add_block_count(n_blocks or spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv if n_head_kv is None else n_head_kv)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_used)
    if spec.weights_scale:
        w.add_expert_weights_scale(spec.weights_scale)
    if spec.n_group:
        w.add_expert_group_count(spec.n_group)
        w.add_expert_group_used_count(spec.n_group_used)
    if spec.rope_scaling:
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling))
        w.add_rope_scaling_factor(spec.rope_factor)
    if spec.rope_orig_ctx:
        w.add_rope_scaling_orig_ctx_len(spec.rope_orig_ctx)


def _first_three(w: gguf.GGUFWriter, spec: ModelSpec) -> None:
    """qwen3moe, qwen2moe and llama: the original writer (its output is pinned by the fixtures' hashes)."""
    t = as_ggml_type(spec.weight_type)
    rng = np.random.default_rng(spec.seed)
    arch = spec.arch
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    # llama (Mixtral) sizes its experts by feed_forward_length; the qwen MoEs by expert_feed_forward_length
    w.add_feed_forward_length(spec.n_ff_exp if arch == "llama" else spec.n_ff_exp * spec.n_used)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    if arch == "llama":
        w.add_rope_dimension_count(spec.head_dim)
        w.add_vocab_size(spec.vocab_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
    if spec.weights_scale:  # not read by these three: files that carry it must give the same logits
        w.add_expert_weights_scale(spec.weights_scale)
    if spec.rope_scaling:
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling))
        w.add_rope_scaling_factor(spec.rope_factor)
    if spec.rope_orig_ctx:
        w.add_rope_scaling_orig_ctx_len(spec.rope_orig_ctx)
    _tokenizer(w, spec)

    E, d, hd = spec.n_embd, spec.n_head * spec.head_dim, spec.head_dim
    kv = spec.n_head_kv * hd

    def add(name: str, data_raw: Encoded) -> None:
        data, raw = data_raw
        w.add_tensor(name, data, raw_dtype=raw)

    def vec(n: int, scale: float = 0.1, center: float = 1.0) -> Encoded:
        return (center + scale * rng.standard_normal(n)).astype(np.float32), None

    add("token_embd.weight", _encode(rng.standard_normal((spec.vocab_size, E)).astype(np.float32), t))
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vec(E))
        add(p + "attn_q.weight", _matrix(rng, (d, E), t))
        add(p + "attn_k.weight", _matrix(rng, (kv, E), t))
        add(p + "attn_v.weight", _matrix(rng, (kv, E), t))
        if arch == "qwen2moe":
            for n, rows in (("q", d), ("k", kv), ("v", kv)):
                add(p + f"attn_{n}.bias", vec(rows, 0.1, 0.0))
        add(p + "attn_output.weight", _matrix(rng, (E, d), t))
        if arch == "qwen3moe":
            add(p + "attn_q_norm.weight", vec(hd))
            add(p + "attn_k_norm.weight", vec(hd))
        add(p + "ffn_norm.weight", vec(E))
        add(p + "ffn_gate_inp.weight", _matrix(rng, (spec.n_expert, E), GGMLType.F32))
        add(p + "ffn_gate_exps.weight", _matrix(rng, (spec.n_expert, spec.n_ff_exp, E), t))
        add(p + "ffn_up_exps.weight", _matrix(rng, (spec.n_expert, spec.n_ff_exp, E), t))
        add(p + "ffn_down_exps.weight", _matrix(rng, (spec.n_expert, E, spec.n_ff_exp), t))
        if arch == "qwen2moe":
            add(p + "ffn_gate_inp_shexp.weight", vec(E, 1.0 / np.sqrt(E), 0.0))
            add(p + "ffn_gate_shexp.weight", _matrix(rng, (spec.n_ff_shexp, E), t))
            add(p + "ffn_up_shexp.weight", _matrix(rng, (spec.n_ff_shexp, E), t))
            add(p + "ffn_down_shexp.weight", _matrix(rng, (E, spec.n_ff_shexp), t))
    add("output_norm.weight", vec(E))
    if not spec.tie_embeddings:
        add("output.weight", _matrix(rng, (spec.vocab_size, E), t))


def _embeddings(wr: _Writer) -> None:
    s = wr.spec
    wr.add("token_embd.weight", _encode(wr.rng.standard_normal((s.vocab_size, s.n_embd)).astype(np.float32),
                                        s.matrix_type(s.n_embd)))


def _output(wr: _Writer) -> None:
    s = wr.spec
    wr.add("output_norm.weight", wr.vec(s.n_embd))
    if not s.tie_embeddings:
        wr.mat("output.weight", (s.vocab_size, s.n_embd))


def _qkv(wr: _Writer, p: str, biases: bool) -> None:
    s = wr.spec
    E, q, kv = s.n_embd, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    wr.add(p + "attn_norm.weight", wr.vec(E))
    for n, rows in (("q", q), ("k", kv), ("v", kv)):
        wr.mat(p + f"attn_{n}.weight", (rows, E))
        if biases:
            wr.add(p + f"attn_{n}.bias", wr.vec(rows, 0.1, 0.0))
    wr.mat(p + "attn_output.weight", (E, q))


def _routed(wr: _Writer, p: str, expert_biases: bool = False, selection_bias: bool = False) -> None:
    s = wr.spec
    E, X, F = s.n_embd, s.n_expert, s.n_ff_exp
    wr.f32(p + "ffn_gate_inp.weight", (X, E), s.router_scale)
    if expert_biases:
        wr.add(p + "ffn_gate_inp.bias", wr.vec(X, 0.5, 0.0))
    if selection_bias:  # large enough to change which experts are picked
        b, _ = wr.vec(X, 0.5, 0.0)
        b[:s.bias_pin] += 5.0
        wr.add(p + "exp_probs_b.bias", (b, None))
    for kind, shape in (("gate", (X, F, E)), ("up", (X, F, E)), ("down", (X, E, F))):
        wr.mat(p + f"ffn_{kind}_exps.weight", shape, expert=True)
        if expert_biases:
            wr.add(p + f"ffn_{kind}_exps.bias", (wr.vec(X * shape[1], 0.1, 0.0)[0].reshape(X, shape[1]), None))


def _swiglu_ffn(wr: _Writer, p: str, suffix: str, width: int) -> None:
    E = wr.spec.n_embd
    wr.mat(p + f"ffn_gate{suffix}.weight", (width, E))
    wr.mat(p + f"ffn_up{suffix}.weight", (width, E))
    wr.mat(p + f"ffn_down{suffix}.weight", (E, width))


def _olmoe(w: gguf.GGUFWriter, wr: _Writer, s: ModelSpec) -> None:
    _common_meta(w, s, s.n_ff_exp)  # olmoe: feed_forward_length is the experts' width
    _tokenizer(w, s)
    E = s.n_embd
    _embeddings(wr)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        _qkv(wr, p, biases=False)
        wr.add(p + "attn_q_norm.weight", wr.vec(E))
        wr.add(p + "attn_k_norm.weight", wr.vec(E))
        wr.add(p + "ffn_norm.weight", wr.vec(E))
        _routed(wr, p)
    _output(wr)


def _moe_layer_meta(w: gguf.GGUFWriter, s: ModelSpec) -> None:
    """glm4moe / deepseek2: expert width, shared experts, dense layers, routing keys."""
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_expert_shared_count(s.n_shared)
    w.add_leading_dense_block_count(s.n_dense_lead)
    if s.gating:
        import gguf

        w.add_expert_gating_func(gguf.ExpertGatingFuncType(GATINGS[s.gating]))
    w.add_expert_weights_norm(s.norm_weights)


def _nextn(wr: _Writer, p: str) -> None:
    E = wr.spec.n_embd
    wr.mat(p + "nextn.eh_proj.weight", (E, 2 * E))
    wr.add(p + "nextn.enorm.weight", wr.vec(E))
    wr.add(p + "nextn.hnorm.weight", wr.vec(E))
    wr.add(p + "nextn.shared_head_norm.weight", wr.vec(E))


def _glm4moe(w: gguf.GGUFWriter, wr: _Writer, s: ModelSpec) -> None:
    _common_meta(w, s, s.n_ff, s.n_layer + s.nextn)
    if s.nextn:
        w.add_nextn_predict_layers(s.nextn)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rot)
    _moe_layer_meta(w, s)
    _tokenizer(w, s, add_bos=False)
    E = s.n_embd
    _embeddings(wr)
    for i in range(s.n_layer + s.nextn):
        p = f"blk.{i}."
        _qkv(wr, p, biases=s.qkv_bias)
        if s.qk_norm:
            wr.add(p + "attn_q_norm.weight", wr.vec(s.head_dim))
            wr.add(p + "attn_k_norm.weight", wr.vec(s.head_dim))
        wr.add(p + "post_attention_norm.weight", wr.vec(E))
        if i < s.n_dense_lead:
            _swiglu_ffn(wr, p, "", s.n_ff)
            continue
        _routed(wr, p, selection_bias=True)
        _swiglu_ffn(wr, p, "_shexp", s.n_ff_exp * s.n_shared)
        if i >= s.n_layer:
            _nextn(wr, p)
    _output(wr)


def _deepseek2(w: gguf.GGUFWriter, wr: _Writer, s: ModelSpec) -> None:
    H, E, R, r = s.n_head, s.n_embd, s.kv_lora_rank, s.rot
    dk = s.qk_nope + r
    # the absorbed layout, as the current converter writes it: one KV head of the compressed KV + rope key
    _common_meta(w, s, s.n_ff, s.n_layer + s.nextn, n_head_kv=1)
    if s.nextn:
        w.add_nextn_predict_layers(s.nextn)
    w.add_vocab_size(s.vocab_size)
    w.add_rope_dimension_count(r)
    w.add_q_lora_rank(s.q_lora_rank)  # 0: queries from attn_q (required unless the "lite" layer counts)
    w.add_kv_lora_rank(R)
    w.add_key_length(R + r)
    w.add_value_length(R)
    w.add_key_length_mla(dk)
    w.add_value_length_mla(s.v_head)
    _moe_layer_meta(w, s)
    if s.yarn_log_mul:
        w.add_rope_scaling_yarn_log_mul(s.yarn_log_mul)
    _tokenizer(w, s, add_bos=True)
    _embeddings(wr)
    for i in range(s.n_layer + s.nextn):
        p = f"blk.{i}."
        wr.add(p + "attn_norm.weight", wr.vec(E))
        if s.q_lora_rank:
            wr.mat(p + "attn_q_a.weight", (s.q_lora_rank, E))
            wr.add(p + "attn_q_a_norm.weight", wr.vec(s.q_lora_rank))
            wr.mat(p + "attn_q_b.weight", (H * dk, s.q_lora_rank))
        else:
            wr.mat(p + "attn_q.weight", (H * dk, E))
        wr.mat(p + "attn_kv_a_mqa.weight", (R + r, E))
        wr.add(p + "attn_kv_a_norm.weight", wr.vec(R))
        wr.mat(p + "attn_k_b.weight", (H, R, s.qk_nope))
        wr.mat(p + "attn_v_b.weight", (H, s.v_head, R))
        wr.mat(p + "attn_output.weight", (E, H * s.v_head))
        wr.add(p + "ffn_norm.weight", wr.vec(E))
        if i < s.n_dense_lead:
            _swiglu_ffn(wr, p, "", s.n_ff)
            continue
        _routed(wr, p, selection_bias=s.selection_bias)
        _swiglu_ffn(wr, p, "_shexp", s.n_ff_exp * s.n_shared)
        if i >= s.n_layer:
            _nextn(wr, p)
    _output(wr)


def _gpt_oss(w: gguf.GGUFWriter, wr: _Writer, s: ModelSpec) -> None:
    _common_meta(w, s, s.n_ff_exp)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_sliding_window(s.n_swa or 16)
    _tokenizer(w, s, add_bos=False)
    E = s.n_embd
    _embeddings(wr)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        _qkv(wr, p, biases=s.qkv_bias)
        wr.add(p + "attn_output.bias", wr.vec(E, 0.1, 0.0))
        wr.add(p + "attn_sinks.weight", wr.vec(s.n_head, 1.0, 0.0))
        wr.add(p + "post_attention_norm.weight", wr.vec(E))
        _routed(wr, p, expert_biases=True)
    _output(wr)


def _hybrid(w: gguf.GGUFWriter, wr: _Writer, s: ModelSpec) -> None:
    """qwen3next / qwen35moe: gated delta-net layers and gated attention layers, experts and a gated shared expert
    in each (as llama.cpp's converter writes them: ``ssm_a`` holds -exp(A_log), norms already 1 + w)."""
    flags = s.recurrent_flags
    _common_meta(w, s, s.n_ff_exp * s.n_used, s.n_layer + s.nextn)
    if s.nextn:
        w.add_nextn_predict_layers(s.nextn)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rot)
    if s.arch == "qwen35moe":
        w.add_rope_dimension_sections(s.sections)
    w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    w.add_ssm_conv_kernel(s.d_conv)
    w.add_ssm_state_size(s.d_state)
    w.add_ssm_group_count(s.n_k_heads)
    w.add_ssm_time_step_rank(s.n_v_heads)
    w.add_ssm_inner_size(s.value_dim)
    if s.recurrent_layers:
        w.add_array(f"{s.arch}.attention.recurrent_layers", [bool(f) for f in flags])  # a BOOL array
    else:
        w.add_full_attention_interval(s.attn_interval)
    _tokenizer(w, s, add_bos=False)
    E, H, hd, kv = s.n_embd, s.n_head, s.head_dim, s.n_head_kv * s.head_dim
    kd, vd, nv = s.d_state * s.n_k_heads, s.value_dim, s.n_v_heads
    _embeddings(wr)
    for i in range(s.n_layer + s.nextn):
        p = f"blk.{i}."
        wr.add(p + "attn_norm.weight", wr.vec(E))
        wr.add(p + "post_attention_norm.weight", wr.vec(E))
        if flags[i]:
            if s.qkvz_fused:
                wr.mat(p + "ssm_in.weight", (2 * kd + 2 * vd, E))
            else:
                wr.mat(p + "attn_qkv.weight", (2 * kd + vd, E))
                wr.mat(p + "attn_gate.weight", (vd, E))
            conv = (0.5 * wr.rng.standard_normal((2 * kd + vd, s.d_conv))).astype(np.float32)
            wr.add(p + "ssm_conv1d.weight", (conv, None))  # F32 always: GGML's convolution reads no other type
            wr.add(p + "ssm_dt.bias", wr.vec(nv, 1.0, 0.0))
            wr.add(p + "ssm_a", ((-np.exp(0.5 * wr.rng.standard_normal(nv))).astype(np.float32), None))
            if s.arch == "qwen3next":
                wr.mat(p + "ssm_ba.weight", (2 * nv, E))
            else:
                wr.mat(p + "ssm_beta.weight", (nv, E))
                wr.mat(p + "ssm_alpha.weight", (nv, E))
            wr.add(p + "ssm_norm.weight", wr.vec(s.d_state))
            wr.mat(p + "ssm_out.weight", (E, vd))
        else:
            wr.mat(p + "attn_q.weight", (2 * H * hd, E))  # per head: the query, then its output gate
            wr.mat(p + "attn_k.weight", (kv, E))
            wr.mat(p + "attn_v.weight", (kv, E))
            wr.mat(p + "attn_output.weight", (E, H * hd))
            wr.add(p + "attn_q_norm.weight", wr.vec(hd))
            wr.add(p + "attn_k_norm.weight", wr.vec(hd))
        _routed(wr, p)
        wr.add(p + "ffn_gate_inp_shexp.weight", wr.vec(E, 1.0 / np.sqrt(E), 0.0))
        _swiglu_ffn(wr, p, "_shexp", s.n_ff_shexp)
        if i >= s.n_layer:
            _nextn(wr, p)
    _output(wr)


def write_moe_stack(path: str | os.PathLike[str], n_layer: int = 4, n_embd: int = 256, n_ff: int = 256,
                    n_expert: int = 16, n_used: int = 4, expert_type: GGMLTypeLike = "q8_0", fused: bool = False,
                    seed: int = 0) -> str:
    """Write a stack of MoE FFN layers as llama.cpp names them for qwen3moe (what MoEStackSession runs):
    ``blk.N.ffn_norm.weight``, ``blk.N.ffn_gate_inp.weight`` and the routed experts
    ``blk.N.ffn_{gate,up,down}_exps.weight`` (or the fused ``ffn_gate_up_exps``), random weights
    quantized by GGML; returns the path."""
    import gguf

    t = as_ggml_type(expert_type)
    for name, n in (("n_embd", n_embd), ("n_ff", n_ff)):
        if n % t.block_size:
            raise ArgumentError(f"{name}={n} must be a multiple of the {t.name} block size {t.block_size}")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff)
    w.add_layer_norm_rms_eps(1e-6)

    def experts(rows: int, cols: int) -> Encoded:
        # scaled so that activations stay O(1) through the stack
        data = (rng.standard_normal((n_expert, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return _encode(data, t)

    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                     (rng.standard_normal((n_expert, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
        kinds = [("gate_up", 2 * n_ff, n_embd)] if fused else [("gate", n_ff, n_embd), ("up", n_ff, n_embd)]
        for kind, rows, cols in kinds + [("down", n_embd, n_ff)]:
            data, raw = experts(rows, cols)
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


__all__ = ["TEMPLATES", "write_model", "write_moe_stack"]
