"""The valid model files every fuzz case starts from, generated once per output folder.

They are written in a separate process: the generator trains a vocabulary with the ``tokenizers``
package, whose thread pool must not exist in the process that forks the cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .proc import child_env

# small files (tens of KiB) so that a case costs milliseconds of compute, in each supported layout
SPECS = {
    "qwen3moe-q8_0": dict(arch="qwen3moe", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff_exp=32,
                          n_expert=4, n_used=2, vocab_size=320, weight_type="q8_0", seed=5),
    "qwen3moe-f32-tied": dict(arch="qwen3moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16,
                              n_ff_exp=32, n_expert=4, n_used=2, vocab_size=320, weight_type="f32",
                              tie_embeddings=True, seed=6),
    "qwen2moe-f16": dict(arch="qwen2moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff_exp=32,
                         n_expert=4, n_used=2, n_ff_shexp=32, vocab_size=320, weight_type="f16", seed=7),
    "llama-q8_0": dict(arch="llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff_exp=32,
                       n_expert=4, n_used=2, vocab_size=320, weight_type="q8_0", seed=8),
    # the later families, as tests/test_families.py writes them: their own keys, dense leading layers,
    # next-token-prediction layers, latent attention, YaRN, sliding windows, MXFP4 experts, SentencePiece
    "olmoe": dict(arch="olmoe", n_head_kv=4, head_dim=16, seed=11),
    "glm4moe": dict(arch="glm4moe", n_layer=3, n_dense_lead=1, n_rot=16, gating="sigmoid", weights_scale=2.5,
                    nextn=1, qk_norm=True, seed=12),
    "deepseek2": dict(arch="deepseek2", n_layer=3, n_dense_lead=1, n_expert=16, n_used=4, gating="sigmoid",
                      weights_scale=2.5, n_group=4, n_group_used=2, rope_scaling="yarn", rope_factor=40.0,
                      rope_orig_ctx=512, yarn_log_mul=0.1, seed=13),
    "gpt-oss": dict(arch="gpt-oss", n_layer=2, head_dim=32, expert_type="mxfp4", weight_type="q8_0",
                    rope_scaling="yarn", rope_factor=8.0, rope_orig_ctx=256, n_swa=4, seed=14),
    "llama-spm": dict(arch="llama", vocab="spm", vocab_size=512, seed=15),
    # the recurrent families (gated delta-net layers, recurrent states), as tests/test_recurrent_families.py writes them
    "qwen3next": dict(arch="qwen3next", n_layer=4, n_rot=8, attn_interval=2, seed=16),
    "qwen35moe": dict(arch="qwen35moe", n_layer=4, n_rot=8, attn_interval=2, weight_type="q8_0", seed=17),
}
STACKS = {"stack-q8_0": dict(n_layer=2, n_embd=32, n_ff=32, n_expert=4, n_used=2, expert_type="q8_0", seed=9)}
# big enough that a run lasts seconds: Ctrl-C lands in loading, prompt, decode or shutdown
SIGNAL_SPEC = {"signal-qwen3moe": dict(arch="qwen3moe", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                                       n_ff_exp=128, n_expert=16, n_used=4, vocab_size=384, weight_type="q8_0",
                                       seed=10)}


def _write_all(folder: str) -> dict[str, str]:
    from ggml_hybrid.synthetic import ModelSpec, write_model, write_moe_stack

    out = {}
    for name, spec in {**SPECS, **SIGNAL_SPEC}.items():
        out[name] = write_model(os.path.join(folder, name + ".gguf"), ModelSpec(**spec))  # type: ignore[arg-type]
    for name, kw in STACKS.items():
        out[name] = write_moe_stack(os.path.join(folder, name + ".gguf"), **kw)
    return out


def ensure_models(folder: str) -> dict[str, str]:
    """name -> path of every base model under ``folder`` (written by a child process the first time)."""
    os.makedirs(folder, exist_ok=True)
    index = os.path.join(folder, "models.json")
    if not os.path.exists(index):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-m` from here finds ggfuzz
        subprocess.run([sys.executable, "-m", "ggfuzz.models", os.path.abspath(folder)], cwd=here, check=True,
                       env=child_env())
    with open(index) as f:
        models: dict[str, str] = json.load(f)
    return models


__all__ = ["SIGNAL_SPEC", "SPECS", "STACKS", "ensure_models"]

if __name__ == "__main__":  # ensure_models' child: writes the models and their index
    with open(os.path.join(sys.argv[1], "models.json"), "w") as index_file:
        json.dump(_write_all(sys.argv[1]), index_file)
