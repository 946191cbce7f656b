"""What a synthetic model looks like: :class:`ModelSpec`, checked before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArgumentError
from ..ggml.dtypes import GGMLType, as_ggml_type

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe", "glm4moe", "deepseek2", "gpt-oss", "qwen3next", "qwen35moe")
RECURRENT = ("qwen3next", "qwen35moe")  # gated delta-net layers between attention layers
# each family's tokenizer.ggml.pre, as its real files have it (llama with vocab="spm": SentencePiece)
PRE = {"qwen3moe": "qwen2", "qwen2moe": "qwen2", "llama": "llama-bpe", "olmoe": "olmo", "glm4moe": "glm4",
       "deepseek2": "deepseek-v3", "gpt-oss": "gpt-4o", "qwen3next": "qwen2", "qwen35moe": "qwen35"}
GATINGS = {"softmax": 1, "sigmoid": 2}


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
    n_ff_shexp: int = 64          # qwen2moe, qwen3next, qwen35moe
    vocab_size: int = 384
    n_ctx_train: int = 4096
    weight_type: str = "f32"      # matrices: attention, experts, embeddings, output
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False  # no output.weight: logits from token_embd (qwen3moe, llama, glm4moe, deepseek2)
    seed: int = 0
    # -- the families added later (each field says which use it; defaults leave the first three unchanged) --
    expert_type: str = ""         # the routed experts' type when not weight_type (gpt-oss: mxfp4)
    n_dense_lead: int = 0         # glm4moe, deepseek2: leading dense layers
    n_ff: int = 128               # their FFN width
    n_shared: int = 1             # glm4moe, deepseek2: expert_shared_count
    n_rot: int = 0                # rotary dims (0: the head size); glm4moe: partial; deepseek2: qk_rope
    qkv_bias: bool = True         # glm4moe, gpt-oss: q/k/v biases
    qk_norm: bool = False         # glm4moe: per-head q/k norms
    nextn: int = 0                # glm4moe, deepseek2: next-token-prediction layers (not in the graph)
    gating: str = ""              # glm4moe, deepseek2: expert_gating_func ("": not written, the family default)
    norm_weights: bool = True     # glm4moe, deepseek2: expert_weights_norm
    weights_scale: float = 0.0    # expert_weights_scale, written when not 0 (every family; most must ignore it)
    selection_bias: bool = True   # deepseek2: exp_probs_b (glm4moe always has it)
    n_group: int = 0              # expert_group_count / expert_group_used_count (0: not written)
    n_group_used: int = 0
    q_lora_rank: int = 32         # deepseek2 (0: attn_q, the "lite" form)
    kv_lora_rank: int = 64
    qk_nope: int = 64
    v_head: int = 32
    n_swa: int = 0                # gpt-oss: sliding window (0: 16)
    rope_scaling: str = ""        # "", "linear" or "yarn"
    rope_factor: float = 1.0
    rope_orig_ctx: int = 0        # rope.scaling.original_context_length (0: not written)
    yarn_log_mul: float = 0.0     # deepseek2: rope.scaling.yarn_log_multiplier (0.1 * mscale_all_dim)
    router_scale: float = 1.0     # scales the router weights (tiny sigmoid probabilities exercise the weight clamp)
    bias_pin: int = 0             # exp_probs_b +5 on the first bias_pin experts: always chosen, whatever their weight
    vocab: str = ""               # llama: "spm" for a SentencePiece vocabulary (Mixtral's published files)
    # qwen3next, qwen35moe: gated delta-net layers (d_state: their head size; k/v heads: ssm.group_count and
    # ssm.time_step_rank), every attn_interval-th layer an attention layer (full_attention_interval), or the
    # per-layer flags of recurrent_layers ("1,0,1,1": written as attention.recurrent_layers instead)
    d_conv: int = 4
    d_state: int = 16
    n_k_heads: int = 2
    n_v_heads: int = 4
    attn_interval: int = 2
    recurrent_layers: str = ""
    rope_sections: str = "2,1,1,0"  # qwen35moe: rope.dimension_sections
    qkvz_fused: bool = False      # qwen3next: the legacy ssm_in projection instead of attn_qkv + attn_gate

    def check(self) -> None:
        if self.arch not in ARCHS:
            raise ArgumentError(f"arch={self.arch!r} is not one of {ARCHS}")
        t = as_ggml_type(self.weight_type)
        recurrent = self.arch in RECURRENT
        shexp = ("n_ff_shexp",) if self.arch == "qwen2moe" or recurrent else ()
        for name in ("n_embd", "n_ff_exp") + shexp + (("value_dim",) if recurrent else ()):
            if getattr(self, name) % t.block_size:
                raise ArgumentError(f"{name}={getattr(self, name)} must be a multiple of the {t.name} block size "
                                    f"{t.block_size}")
        if (self.n_head * self.head_dim) % t.block_size:
            raise ArgumentError(f"n_head*head_dim={self.n_head * self.head_dim} must be a multiple of the {t.name} "
                                f"block size {t.block_size}")
        if self.expert_type:
            e = as_ggml_type(self.expert_type)
            for name in ("n_embd", "n_ff_exp"):
                if getattr(self, name) % e.block_size:
                    raise ArgumentError(f"{name}={getattr(self, name)} must be a multiple of the {e.name} block size")
        if self.n_head % self.n_head_kv:
            raise ArgumentError(f"n_head={self.n_head} must be a multiple of n_head_kv={self.n_head_kv}")
        if not 1 <= self.n_used <= self.n_expert:
            raise ArgumentError(f"n_used={self.n_used} must be in 1..n_expert={self.n_expert}")
        if self.arch in ("qwen2moe", "olmoe") and self.n_head * self.head_dim != self.n_embd:
            raise ArgumentError(f"{self.arch}: n_head*head_dim must equal n_embd")
        if self.arch == "olmoe" and self.n_head_kv != self.n_head:
            raise ArgumentError("olmoe: n_head_kv must equal n_head (its k norm is n_embd wide)")
        if self.arch in ("glm4moe", "deepseek2") and not 0 <= self.n_dense_lead < self.n_layer:
            raise ArgumentError(f"n_dense_lead={self.n_dense_lead} must leave a MoE layer of {self.n_layer}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ArgumentError(f"n_rot={self.n_rot} must be even and at most head_dim={self.head_dim}")
        if self.gating not in ("",) + tuple(GATINGS):
            raise ArgumentError(f"gating={self.gating!r} must be '', 'softmax' or 'sigmoid'")
        if self.rope_scaling not in ("", "linear", "yarn"):
            raise ArgumentError(f"rope_scaling={self.rope_scaling!r} must be '', 'linear' or 'yarn'")
        if self.vocab not in ("", "spm") or (self.vocab == "spm" and self.arch != "llama"):
            raise ArgumentError(f"vocab={self.vocab!r}: 'spm' is for arch='llama' (Mixtral)")
        if recurrent:
            self._check_hybrid()
        if self.vocab_size < (512 if self.vocab == "spm" else 300):
            raise ArgumentError(f"vocab_size={self.vocab_size} must be >= {512 if self.vocab == 'spm' else 300} "
                                "(the bytes, the specials and some merges)")

    def _check_hybrid(self) -> None:
        if self.n_v_heads % self.n_k_heads:
            raise ArgumentError(f"n_v_heads={self.n_v_heads} must be a multiple of n_k_heads={self.n_k_heads}")
        if self.d_conv < 2 or self.attn_interval < 1:
            raise ArgumentError(f"d_conv={self.d_conv} must be >= 2 and attn_interval={self.attn_interval} >= 1")
        if self.recurrent_layers and len(self.recurrent_flags) != self.n_layer + self.nextn:
            raise ArgumentError(f"recurrent_layers={self.recurrent_layers!r} must hold one flag per block "
                                f"({self.n_layer + self.nextn})")
        if len(self.sections) != 4 or sum(self.sections) > self.head_dim or not any(self.sections[:3]):
            raise ArgumentError(f"rope_sections={self.rope_sections!r} must be 4 counts, not all of the first three "
                                f"0, summing to at most head_dim={self.head_dim}")

    @property
    def value_dim(self) -> int:
        return self.d_state * self.n_v_heads

    @property
    def sections(self) -> list[int]:
        return [int(x) for x in self.rope_sections.split(",")]

    @property
    def recurrent_flags(self) -> list[bool]:
        """Per block (next-token-prediction blocks included): a delta-net layer? (those blocks are attention)."""
        if self.recurrent_layers:
            return [x.strip() not in ("0", "") for x in self.recurrent_layers.split(",")]
        return [i < self.n_layer and (i + 1) % self.attn_interval != 0 for i in range(self.n_layer + self.nextn)]

    @property
    def rot(self) -> int:
        """Rotary dims: deepseek2's qk_rope (default 32), else the head size unless partial."""
        if self.arch == "deepseek2":
            return self.n_rot or 32
        return self.n_rot or self.head_dim

    def matrix_type(self, cols: int, expert: bool = False) -> GGMLType:
        """The type of a matrix with rows of ``cols``: llama-quant's fallback when the rows do not fit the blocks."""
        t = as_ggml_type(self.expert_type if expert and self.expert_type else self.weight_type)
        if cols % t.block_size == 0:
            return t
        return GGMLType.Q8_0 if cols % 32 == 0 else GGMLType.F16


__all__ = ["ARCHS", "GATINGS", "ModelSpec", "RECURRENT", "PRE"]
