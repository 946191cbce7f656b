#!/usr/bin/env python3
"""The Hugging Face side of the converter pipeline: tiny random models made with ``transformers``' own classes,
and their float32 logits (the independent oracle).

Runs in an environment with torch, transformers (5.x: it has all eleven classes), tokenizers and sentencepiece; it
does not import ggml_hybrid. Subcommands (one JSON line on stdout each):

    python tools/converted/hf_side.py make FAMILY OUTDIR      # config, safetensors and tokenizer, seeded
    python tools/converted/hf_side.py logits HFDIR --tokens 1,2,3 --out logits.npy [--greedy N]

``make`` saves what ``save_pretrained`` writes, plus, for the families whose published checkpoints carry
next-token-prediction (MTP) weights that transformers does not model (GLM-4.5's and GLM-4.7-Flash's
``model.layers.N``, Qwen3-Next's and Qwen3.5's ``mtp.*``), those tensors in the published layout, so the converter
sees what it sees on a published checkpoint. ``logits`` evaluates the token ids in float32 with eager attention and
prints the greedy continuation of ``--greedy`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

# one small, fixed corpus: the tokenizers are trained on it (deterministic: no shuffling, one thread)
_WORDS = ("the quick brown fox jumps over the lazy dog while a naive cafe owner counts 12345 coins and "
          "def forward(x): return x + 3.14159 # it's 2026; we'll see what they've done, HTTPServer DEJA vu "
          "Hello, world! tokens experts routers layers attention heads keys values queries models files weights "
          "logits prompts caches states gates norms biases shards graphs kernels threads devices hosts")
CORPUS = [_WORDS, _WORDS.upper(), _WORDS.title(), "  ".join(_WORDS.split()[::-1]), "0123456789 " * 8,
          "naïve café 東京 日本語のテキスト、カタカナ！ ÀÉÎõü ÄÖÜäöü ĞÜ"]

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
INST = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
        "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")

# the regexes the families' published tokenizer.json files split with (qwen2's is also Qwen3.5's minus marks)
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# family -> the transformers class, the BPE pre-tokenizer name the converter would detect on the published
# tokenizer (a tiny trained tokenizer has no known hash: see run_converter.py), special tokens, and the config
FAMILIES: dict[str, dict] = {
    "qwen2moe": dict(
        cls="Qwen2MoeForCausalLM", pre="qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                    max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)),
    "qwen3moe": dict(
        cls="Qwen3MoeForCausalLM", pre="qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                    max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)),
    "mixtral": dict(
        cls="MixtralForCausalLM", pre=None, spm=True, specials=(), bos="<s>", eos="</s>", template=INST,
        config=dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=512, rope_theta=1000000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-5, sliding_window=None)),
    "olmoe": dict(
        cls="OlmoeForCausalLM", pre="olmo", specials=("<|endoftext|>", "<|padding|>"), bos=None,
        eos="<|endoftext|>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                    max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-5, clip_qkv=None)),
    # V2's layout: softmax gating, plain top-k, no routed scaling. (Not V2-Lite's: without q-LoRA llama.cpp reads no
    # q_lora_rank key only at V2-Lite's layer counts, 26 and 27, and refuses a tiny file that has none)
    "deepseek2": dict(
        cls="DeepseekV2ForCausalLM", pre="deepseek-v3", specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                    num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, topk_method="greedy",
                    scoring_func="softmax", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    norm_topk_prob=False, moe_layer_freq=1,
                    max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)),
    # V3's: q-LoRA, sigmoid gating with the selection bias, grouped routing, routed scaling
    "deepseek3": dict(
        cls="DeepseekV3ForCausalLM", pre="deepseek-v3", specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                    num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2,
                    topk_method="noaux_tc", scoring_func="sigmoid",
                    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
                    tie_word_embeddings=False, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "mscale": 1.0, "mscale_all_dim": 1.0})),
    "glm4moe": dict(
        cls="Glm4MoeForCausalLM", pre="glm4", specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>",
                                                          "<|assistant|>", "<|observation|>"),
        bos=None, eos="<|endoftext|>", template=CHATML, mtp="glm",
        config=dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                    n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                    attention_bias=True, num_nextn_predict_layers=1, max_position_embeddings=512,
                    rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # GLM-4.7-Flash's layout: deepseek2's latent attention and routing, and a next-token-prediction block (the
    # deepseek2 architecture's only converter that writes one: DeepseekV2/V3 files drop theirs)
    "glm47flash": dict(
        cls="Glm4MoeLiteForCausalLM", pre="glm4", specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>",
                                                            "<|assistant|>", "<|observation|>"),
        bos=None, eos="<|endoftext|>", template=CHATML, mtp="glm",
        config=dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                    mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1,  # the published config's
                    num_attention_heads=4, num_key_value_heads=4,
                    n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                    routed_scaling_factor=1.8, norm_topk_prob=True, num_nextn_predict_layers=1,
                    max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})),
    "gpt-oss": dict(
        cls="GptOssForCausalLM", pre="gpt-4o", specials=("<|startoftext|>", "<|endoftext|>", "<|return|>",
                                                         "<|channel|>", "<|message|>", "<|end|>", "<|start|>"),
        bos="<|startoftext|>", eos="<|return|>", template=CHATML,
        config=dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    experts_per_token=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": True})),
    "qwen3next": dict(
        cls="Qwen3NextForCausalLM", pre="qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", template=CHATML, mtp="qwen",
        config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                    layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                    decoder_sparse_step=1, max_position_embeddings=512, rope_theta=10000.0,
                    tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "qwen35moe": dict(
        cls="Qwen3_5MoeForCausalLM", pre="qwen35", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", template=CHATML, mtp="qwen",
        config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=512, mtp_num_hidden_layers=1, tie_word_embeddings=False,
                    rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
}


def _bpe_tokenizer(fam: dict, vocab: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    regex = GPT2_RE if fam["pre"] in ("olmo",) else QWEN2_RE
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in dict.fromkeys(fam["specials"] + tuple(t for t in (fam["bos"], fam["eos"]) if t))]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    from transformers import PreTrainedTokenizerFast

    kw = {"eos_token": fam["eos"]}
    if fam["bos"]:
        kw["bos_token"] = fam["bos"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=fam["template"], **kw)


def _spm_tokenizer(out: str, fam: dict, vocab: int):
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, num_threads=1, character_coverage=0.98,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, shuffle_input_sentence=False,
                                   minloglevel=2)
    path = os.path.join(out, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(out, legacy=False, add_bos_token=True, add_eos_token=False,
                                          chat_template=fam["template"])


def _seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)


def _randomize(model, seed: int) -> None:
    """Every parameter drawn again: weights ~ N(0, 0.5/sqrt(fan_in)) and norms ~ 1 + N(0, 0.1), so that layers,
    routers and gates all matter (transformers' own init leaves norms at 1 and biases at 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 or "norm" in name:
                base = 1.0 if "norm" in name and "bias" not in name else 0.0
                if name.endswith("A_log"):
                    base = 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / fan_in ** 0.5) * 2)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _mtp_tensors(fam: dict, cfg, seed: int) -> dict:
    """The next-token-prediction block of a published checkpoint, made as one more decoder layer of the same class
    (seeded), in the checkpoint's own naming."""
    import transformers

    cfg2 = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": cfg.num_hidden_layers + 1,
                            **({"layer_types": list(cfg.layer_types) + ["full_attention"]}
                               if getattr(cfg, "layer_types", None) else {}),
                            **({"mlp_layer_types": list(cfg.mlp_layer_types) + ["sparse"]}
                               if getattr(cfg, "mlp_layer_types", None) else {})})
    _seed(seed)
    big = getattr(transformers, fam["cls"])(cfg2)
    _randomize(big, seed)
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint's own layout (per-expert tensors), as saved
        big.save_pretrained(tmp, safe_serialization=True)
        sd = {}
        for fn in sorted(os.listdir(tmp)):
            if fn.endswith(".safetensors"):
                sd.update(load_file(os.path.join(tmp, fn)))
    n = cfg.num_hidden_layers
    E = cfg.hidden_size
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    layer = {k[len(f"model.layers.{n}."):]: v for k, v in sd.items() if k.startswith(f"model.layers.{n}.")}
    extra = {"eh_proj.weight": torch.randn(E, 2 * E, generator=g) / (2 * E) ** 0.5,
             "enorm.weight": 1 + 0.1 * torch.randn(E, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(E, generator=g),
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(E, generator=g)}
    if fam["mtp"] == "glm":  # GLM-4.5: model.layers.N.{layer, eh_proj, enorm, hnorm, shared_head.norm}
        return {f"model.layers.{n}.{k}": v for k, v in {**layer, **extra}.items()}
    # Qwen3-Next / Qwen3.5: mtp.layers.0.*, mtp.fc, mtp.pre_fc_norm_embedding / _hidden, mtp.norm
    names = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
             "hnorm.weight": "pre_fc_norm_hidden.weight", "shared_head.norm.weight": "norm.weight"}
    out = {f"mtp.layers.0.{k}": v for k, v in layer.items()}
    out.update({f"mtp.{names[k]}": v for k, v in extra.items()})
    return out


def make(family: str, out: str, seed: int = 0) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    fam = FAMILIES[family]
    os.makedirs(out, exist_ok=True)
    tok = _spm_tokenizer(out, fam, 400) if fam.get("spm") else _bpe_tokenizer(fam, 300)
    n_tok = len(tok)
    vocab = (n_tok + 63) // 64 * 64  # padded as published vocabularies are: the converter writes [PAD] tokens
    cls = getattr(transformers, fam["cls"])
    cfg = cls.config_class(vocab_size=vocab, **{k: v for k, v in fam["config"].items()},
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    _seed(seed)
    model = cls(cfg).eval()
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    extra = {}
    if fam.get("mtp"):
        from safetensors.torch import save_file

        extra = _mtp_tensors(fam, cfg, seed + 100)
        save_file({k: v.contiguous() for k, v in extra.items()}, os.path.join(out, "mtp.safetensors"),
                  metadata={"format": "pt"})
        index_path = os.path.join(out, "model.safetensors.index.json")
        from safetensors import safe_open

        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            main = list(f.keys())
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in main}}
        index["weight_map"].update({k: "mtp.safetensors" for k in extra})
        with open(index_path, "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
    return {"family": family, "dir": out, "vocab": vocab, "tokens": n_tok, "mtp_tensors": len(extra),
            "params": sum(p.numel() for p in model.parameters())}


def logits(hf_dir: str, tokens: list[int], n_greedy: int) -> tuple[np.ndarray, list[int]]:
    import torch
    import transformers

    torch.set_num_threads(1)
    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = getattr(transformers, cfg.architectures[0])
    model = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(ids).logits[0].float().numpy()
        greedy: list[int] = []
        if n_greedy:
            gen = model.generate(ids, max_new_tokens=n_greedy, min_new_tokens=n_greedy, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
            greedy = gen[0, len(tokens):].tolist()
    return out, greedy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("family", choices=sorted(FAMILIES))
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    lg = sub.add_parser("logits")
    lg.add_argument("hf_dir")
    lg.add_argument("--tokens", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--greedy", type=int, default=0)
    ns = ap.parse_args()
    if ns.cmd == "make":
        print(json.dumps(make(ns.family, ns.out, ns.seed)))
        return 0
    import transformers

    arr, greedy = logits(ns.hf_dir, [int(t) for t in ns.tokens.split(",")], ns.greedy)
    np.save(ns.out, arr)
    print(json.dumps({"greedy": greedy, "transformers": transformers.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
