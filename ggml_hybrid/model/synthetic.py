"""Small random-weight MoE language models in the real GGUF layouts, for tests, the demo and benchmarks.

``write_model(path, ModelSpec(...))`` writes a file that llama.cpp loads as the
same architecture: ``qwen3moe`` (per-head q/k norm), ``qwen2moe`` (q/k/v biases
and a shared expert with its sigmoid gate) or ``llama`` with routed experts
(Mixtral style). Matrices are quantized with GGML's own routines; norms, biases
and the router stay F32 as llama.cpp's quantizer leaves them. The vocabulary is
a byte-level BPE trained (by the ``tokenizers`` package) on a fixed corpus, so
the same spec always gives the same file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ArgumentError
from ..ggml.dtypes import GGMLType, as_ggml_type
from ..ggml.quant import quantize

ARCHS = ("qwen3moe", "qwen2moe", "llama")
_PRE = {"qwen3moe": "qwen2", "qwen2moe": "qwen2", "llama": "llama-bpe"}
_SPECIALS = {"qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             "llama-bpe": ["<|begin_of_text|>", "<|end_of_text|>"]}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
Only the experts a token needs are read from memory, so a large model can run on a small GPU.
Once upon a time there was a little model that lived on a disk and dreamed of the cache.
It's the hits that run first; the misses are loaded into slots, and some of them run on the CPU.
We don't copy weights we do not need. They'll be there when we're ready, and I'd say that's fine.
Numbers like 12345, 3.14159 and 2026 appear in text too, as do dates such as 2026-11-29.
def forward(x): return x + attention(norm(x))  # code is text as well
Hello, world! Hello again, world. How are you today? I am fine, thank you.
Ünïcödé letters, naïve café, façade, 東京 and Москва are words in other scripts.
    Indented lines, tabs\tand trailing spaces   are whitespace the tokenizer must keep.
"""


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "qwen3moe"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff_exp: int = 64
    n_expert: int = 8
    n_used: int = 2
    n_ff_shexp: int = 64          # qwen2moe only
    vocab_size: int = 384
    n_ctx_train: int = 4096
    weight_type: str = "f32"      # matrices: attention, experts, embeddings, output
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False  # no output.weight: logits from token_embd (qwen3moe, llama)
    seed: int = 0

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise ArgumentError(f"arch={self.arch!r} is not one of {ARCHS}")
        t = as_ggml_type(self.weight_type)
        for name in ("n_embd", "n_ff_exp") + (("n_ff_shexp",) if self.arch == "qwen2moe" else ()):
            if getattr(self, name) % t.block_size:
                raise ArgumentError(f"{name}={getattr(self, name)} must be a multiple of the {t.name} block size "
                                 f"{t.block_size}")
        if (self.n_head * self.head_dim) % t.block_size:
            raise ArgumentError(f"n_head*head_dim={self.n_head * self.head_dim} must be a multiple of the {t.name} "
                             f"block size {t.block_size}")
        if self.n_head % self.n_head_kv:
            raise ArgumentError(f"n_head={self.n_head} must be a multiple of n_head_kv={self.n_head_kv}")
        if not 1 <= self.n_used <= self.n_expert:
            raise ArgumentError(f"n_used={self.n_used} must be in 1..n_expert={self.n_expert}")
        if self.arch == "qwen2moe" and self.n_head * self.head_dim != self.n_embd:
            raise ArgumentError("qwen2moe: n_head*head_dim must equal n_embd")
        if self.vocab_size < 300:
            raise ArgumentError(f"vocab_size={self.vocab_size} must be >= 300 (256 bytes, specials, merges)")


def train_vocab(pre: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE trained on the fixed corpus."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from .tokenizer import PRE_TOKENIZERS

    specials = _SPECIALS[pre]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre][0]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    # pad with unused tokens so the vocabulary has exactly the requested size
    while len(tokens) < vocab_size - len(specials):
        tokens.append(f"<unused{len(tokens)}>")
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges


def _matrix(rng, shape, t: GGMLType):
    data = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return _encode(data, t)


def _encode(data: np.ndarray, t: GGMLType):
    import gguf

    if t == GGMLType.F32:
        return data, None
    if t == GGMLType.F16:
        return data.astype(np.float16), None
    return quantize(data, t), gguf.GGMLQuantizationType(int(t))


def write_model(path, spec: ModelSpec | None = None, **overrides) -> str:
    """Write the model described by ``spec`` (with ``overrides``) to ``path``; returns the path."""
    import gguf

    spec = ModelSpec(**{**asdict(spec or ModelSpec()), **overrides})
    spec.check()
    t = as_ggml_type(spec.weight_type)
    rng = np.random.default_rng(spec.seed)
    arch, pre = spec.arch, _PRE[spec.arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"ggml-hybrid synthetic {arch}")
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
    tokens, types, merges = train_vocab(pre, spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    specials = _SPECIALS[pre]
    w.add_bos_token_id(tokens.index(specials[0]))
    w.add_eos_token_id(tokens.index(specials[0] if pre == "qwen2" else specials[1]))
    w.add_add_bos_token(pre == "llama-bpe")

    E, d, hd = spec.n_embd, spec.n_head * spec.head_dim, spec.head_dim
    kv = spec.n_head_kv * hd

    def add(name, data_raw):
        data, raw = data_raw
        w.add_tensor(name, data, raw_dtype=raw)

    def vec(n, scale=0.1, center=1.0):
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_moe_stack(path, n_layer=4, n_embd=256, n_ff=256, n_expert=16, n_used=4, expert_type="q8_0",
                    fused=False, seed=0) -> str:
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

    def experts(rows, cols):
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


__all__ = ["ARCHS", "ModelSpec", "train_vocab", "write_model", "write_moe_stack"]
