"""Hyperparameters of a MoE decoder from GGUF metadata, checked against the tensor shapes.

Everything a graph needs is read and checked here, before any memory is
allocated, so that a file llama.cpp would refuse is refused with a message
naming the key or tensor, what was found and what was expected. The keys every
architecture shares are read here (llama.cpp's ``llama_model_base::load_hparams``);
each family (:mod:`ggml_hybrid.model.families`) reads its own and lists its tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ModelFileError, NotMoEError
from ..ggml.dtypes import GGMLType
from ..ggml.ops import MATMUL_WEIGHTS
from ..gguf.metadata import MAX_EXPERTS, MAX_LAYERS, meta_int
from ..gguf.store import GGUFStore, same_shape
from ..moe.ffn import Routing
from .rope import Rope

GATINGS = {1: "softmax", 2: "sigmoid"}  # expert_gating_func values the families here use


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (deepseek2), in the absorbed form llama.cpp runs."""

    q_lora_rank: int   # 0: queries straight from attn_q
    kv_lora_rank: int  # the compressed KV (the cache holds it plus the shared rope key)
    qk_nope: int       # per-head query/key dims without rope
    qk_rope: int       # per-head rope dims (= rope.n_rot)
    v_head: int        # per-head value dims after decompression


@dataclass(frozen=True)
class SWA:
    """Sliding-window attention on some layers (gpt-oss): they see the last ``n_swa`` positions only."""

    n_swa: int
    layers: tuple[bool, ...]  # per layer: sliding window or full attention
    freq_base: float          # the rope of the window layers
    freq_scale: float


@dataclass(frozen=True)
class DeltaNet:
    """Gated delta-net (linear attention) layers between the attention layers (qwen3next, qwen35moe).

    Each such layer keeps a recurrent state per sequence instead of a KV cache: the last
    ``d_conv - 1`` inputs of its short convolution (``conv_state`` floats) and one ``d_state`` x
    ``d_state`` matrix per value head (``ssm_state`` floats).
    """

    recurrent: tuple[bool, ...]  # per layer: a delta-net layer (else an attention layer)
    d_conv: int                  # ssm.conv_kernel: the short convolution's width
    d_state: int                 # ssm.state_size: the head size of the delta-net's q, k and v
    n_k_heads: int               # ssm.group_count: query/key heads
    n_v_heads: int               # ssm.time_step_rank: value heads (each with its own gate and state)
    k_repeat: str                # how value heads share query/key heads: "interleave" (h // r) or "tile" (h % n_k)
    qkvz_fused: bool = False     # qwen3next's legacy ssm_in (q, k, v, z grouped per key head)
    ba_fused: bool = False       # beta and alpha in one ssm_ba (grouped per key head), not ssm_beta + ssm_alpha

    @property
    def key_dim(self) -> int:
        return self.d_state * self.n_k_heads

    @property
    def value_dim(self) -> int:
        return self.d_state * self.n_v_heads

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: every query, key and value."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state(self) -> int:
        """Floats of a layer's convolution state per sequence (llama.cpp's ``n_embd_r``)."""
        return (self.d_conv - 1) * self.conv_channels

    @property
    def ssm_state(self) -> int:
        """Floats of a layer's delta-rule state per sequence (llama.cpp's ``n_embd_s``)."""
        return self.d_state * self.value_dim

    @property
    def layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if r]

    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state over all delta-net layers (F32, as llama.cpp keeps it)."""
        return len(self.layers) * 4 * (self.conv_state + self.ssm_state)


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int               # layers the graph runs (block_count minus next-token-prediction layers)
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int              # per-head size of the queries and keys the attention multiplies
    head_dim_v: int            # per-head size of the values
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_used: int
    n_ff_exp: int              # routed expert width
    rms_eps: float
    rope: Rope
    routing: Routing
    kq_scale: float            # the attention scale, as llama.cpp computes it (float32)
    tied_output: bool
    n_layer_all: int = 0       # block_count (0: same as n_layer)
    n_ff: int = 0              # width of the dense FFN of the leading dense layers
    n_dense_lead: int = 0      # leading layers with a dense FFN instead of experts
    n_ff_shexp: int = 0        # shared expert width (0: none)
    # the shared expert is scaled by sigmoid(ffn_gate_inp_shexp . x): "" no gate, "silu_div" llama.cpp's qwen2moe
    # form silu(x)/x, "sigmoid" a plain sigmoid (qwen3next, qwen35moe)
    shared_gate: str = ""
    qk_norm: str = "none"      # none | head (per-head RMS norm) | full (over all heads, before the reshape)
    attn_biases: tuple[str, ...] = ()  # projections with a bias: q, k, v, o
    ffn_norm: str = "ffn_norm"  # the pre-FFN norm's tensor (glm4moe and gpt-oss: post_attention_norm)
    mla: MLA | None = None
    swa: SWA | None = None
    sinks: bool = False        # attention sinks (gpt-oss)
    expert_biases: bool = False   # router and per-expert biases (gpt-oss)
    selection_bias: bool = False  # exp_probs_b: a per-expert bias added for choosing experts only
    fused_gate_up: bool = False   # the experts' gate and up in one ffn_gate_up_exps tensor
    out_rows_late: bool = False  # output rows are picked after the last layer (gpt-oss), not inside it
    f32_acc: bool = False      # the attention output and dense FFN projections ask for F32 accumulation (GLM)
    delta_net: DeltaNet | None = None  # linear-attention layers with recurrent states (qwen3next, qwen35moe)

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_k(self) -> int:
        """K cache row width per layer: every KV head's key (MLA: the compressed KV and the rope key)."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope
        return self.n_head_kv * self.head_dim

    @property
    def kv_v(self) -> int:
        """V cache row width per layer (0 for MLA: the values are read from the K cache)."""
        return 0 if self.mla is not None else self.n_head_kv * self.head_dim_v

    @property
    def kv_layers(self) -> list[int]:
        """The layers with a KV cache: every layer but the delta-net ones."""
        dn = self.delta_net
        return [i for i in range(self.n_layer) if dn is None or not dn.recurrent[i]]

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.n_dense_lead, self.n_layer))


def refuse(store: GGUFStore, arch: str, key: str, what: str) -> ModelFileError:
    """The error for a file that uses a feature the family here does not implement."""
    return ModelFileError(f"{store.path!r}: {arch}: {key}: {what} is not supported")


@dataclass(frozen=True)
class Common:
    """The keys llama.cpp reads for every architecture (``llama_model_base::load_hparams``)."""

    arch: str
    n_layer_all: int
    n_layer: int        # n_layer_all - nextn_predict_layers
    n_embd: int
    n_ctx_train: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_rot: int
    n_expert: int
    n_used: int
    n_group: int
    n_group_used: int
    n_ff: int           # feed_forward_length (0 when absent)
    n_vocab: int
    tied_output: bool


def read_common(store: GGUFStore, arch: str, require_moe: bool = True) -> Common:
    def key(k: str) -> str:
        return f"{arch}.{k}"

    n_layer_all = meta_int(store, key("block_count"), hi=MAX_LAYERS)
    nextn = meta_int(store, key("nextn_predict_layers"), 0, lo=0)
    if nextn >= n_layer_all:
        raise ModelFileError(f"{store.path!r}: {key('nextn_predict_layers')} = {nextn} leaves no layer of the "
                             f"{n_layer_all} of {key('block_count')} (a file of next-token-prediction layers only)")
    n = n_layer_all
    n_embd = meta_int(store, key("embedding_length"))
    n_head = meta_int(store, key("attention.head_count"), n=n)
    n_head_kv = meta_int(store, key("attention.head_count_kv"), n_head, n=n)
    if n_head % n_head_kv:
        raise ModelFileError(f"{store.path!r}: {n_head} attention heads are not a multiple of {n_head_kv} KV heads")
    key_length = meta_int(store, key("attention.key_length"), n_embd // n_head)
    value_length = meta_int(store, key("attention.value_length"), n_embd // n_head)
    if "token_embd.weight" not in store:
        raise ModelFileError(f"{store.path!r} has no tensor 'token_embd.weight'")
    n_expert = meta_int(store, key("expert_count"), 0, lo=0, hi=MAX_EXPERTS)
    has_router = any(re.fullmatch(r"blk\.\d+\.ffn_gate_inp\.weight", t.name) for t in store.tensors())
    if n_expert == 0 or not has_router:
        if require_moe:
            raise NotMoEError(f"{store.path!r} is a dense {arch} model ({arch}.expert_count = {n_expert}, "
                              f"router tensor {'present' if has_router else 'absent'}); a MoE model is required")
        raise ModelFileError(f"{store.path!r}: dense models are not supported yet")
    n_used = meta_int(store, key("expert_used_count"), n=n)
    if n_used > n_expert:
        raise ModelFileError(f"{store.path!r}: {key('expert_used_count')} = {n_used} exceeds {key('expert_count')} = "
                             f"{n_expert} (experts used per token must exist)")
    n_group = meta_int(store, key("expert_group_count"), 0, lo=0)
    n_group_used = meta_int(store, key("expert_group_used_count"), 0, lo=0)
    if n_group >= n_expert:
        raise ModelFileError(f"{store.path!r}: {key('expert_group_count')} = {n_group} must be below "
                             f"{key('expert_count')} = {n_expert}")
    if n_group > 1 and (n_expert % n_group or not 0 < n_group_used < n_group):
        raise ModelFileError(f"{store.path!r}: {key('expert_group_count')} = {n_group} must divide {n_expert} experts "
                             f"and {key('expert_group_used_count')} = {n_group_used} must be in 1..{n_group - 1}")
    return Common(
        arch=arch, n_layer_all=n_layer_all, n_layer=n_layer_all - nextn, n_embd=n_embd,
        n_ctx_train=meta_int(store, key("context_length")), n_head=n_head, n_head_kv=n_head_kv,
        key_length=key_length, value_length=value_length,
        n_rot=meta_int(store, key("rope.dimension_count"), key_length), n_expert=n_expert, n_used=n_used,
        n_group=n_group, n_group_used=n_group_used, n_ff=meta_int(store, key("feed_forward_length"), 0, lo=0, n=n),
        n_vocab=store.info("token_embd.weight").shape[0], tied_output="output.weight" not in store)


_LAYER = re.compile(r"^blk\.(\d+)\.")


def check_shapes(store: GGUFStore, hp: HParams, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of ``shapes`` exists with its shape and a type GGML computes it in."""
    for name, want in shapes.items():
        if name not in store:
            raise ModelFileError(f"{store.path!r}: {hp.arch} needs tensor {name!r}, which the file lacks")
        info = store.info(name)
        if not same_shape(info.shape, want):
            raise ModelFileError(f"{store.path!r}: {name} has shape {info.shape}, expected {want} from the metadata")
        # norms, biases, sinks and the shared-expert gate are added or multiplied in F32, as llama.cpp stores
        # them; matrices go through mul_mat / get_rows, which take the float and quantized weight types
        vector = len(want) == 1 or name.endswith(".bias")
        if vector and info.dtype != GGMLType.F32:
            raise ModelFileError(f"{store.path!r}: {name} is {info.dtype.name}; vectors (norms, biases) must be F32")
        if not vector and info.dtype not in MATMUL_WEIGHTS:
            raise ModelFileError(f"{store.path!r}: {name} is {info.dtype.name}, not a weight type GGML can multiply "
                                 "(a float or quantized type)")


def check_tensors(store: GGUFStore, hp: HParams, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the graph uses exists with its shape and a type GGML computes it in; nothing else is there.

    Like llama.cpp, a file with tensors the architecture does not use is refused ("wrong number of
    tensors"), except the layers past ``n_layer`` (next-token-prediction layers), which are skipped (and checked
    when the draft head is asked for: :mod:`ggml_hybrid.model.mtp`).
    """
    check_shapes(store, hp, shapes)
    n_all = hp.n_layer_all or hp.n_layer
    for info in store.tensors():
        if info.name in shapes:
            continue
        m = _LAYER.match(info.name)
        if m and hp.n_layer <= int(m.group(1)) < n_all:
            continue  # a next-token-prediction layer: llama.cpp skips it too
        if m and int(m.group(1)) >= n_all:
            raise ModelFileError(f"{store.path!r}: {hp.arch}.block_count = {n_all} but {info.name} "
                                 f"(blk.{m.group(1)}) exists")
        raise ModelFileError(f"{store.path!r}: {hp.arch} does not use tensor {info.name!r} (a feature not supported "
                             "here, or a file llama.cpp refuses: 'wrong number of tensors')")


__all__ = ["GATINGS", "MLA", "SWA", "Common", "DeltaNet", "HParams", "Routing", "check_shapes", "check_tensors",
           "read_common", "refuse"]
