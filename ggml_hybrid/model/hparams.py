"""Hyperparameters of a MoE decoder from GGUF metadata, checked against the tensor shapes.

Everything a graph needs is read and checked here, before any memory is
allocated, so that a file llama.cpp would refuse is refused with a message
naming the key or tensor, what was found and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ModelFileError, NotMoEError
from ..ggml.dtypes import GGMLType
from .gguf_store import GGUFStore


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one supported ``general.architecture`` from another (as llama.cpp builds it)."""

    rope_mode: str             # "neox" or "normal"
    qk_norm: bool              # per-head RMS norm of q and k
    qkv_bias: bool             # biases on the q/k/v projections
    shared_expert: bool        # a shared expert with a sigmoid gate next to the routed ones
    norm_expert_weights: bool  # the top-k routing weights are renormalised to sum to 1


ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec(rope_mode="neox", qk_norm=True, qkv_bias=False, shared_expert=False,
                         norm_expert_weights=True),
    "qwen2moe": ArchSpec(rope_mode="neox", qk_norm=False, qkv_bias=True, shared_expert=True,
                         norm_expert_weights=False),
    "llama": ArchSpec(rope_mode="normal", qk_norm=False, qkv_bias=False, shared_expert=False,
                      norm_expert_weights=True),
}


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int
    rope_mode: str
    rope_freq_base: float
    rope_freq_scale: float
    rms_eps: float
    qk_norm: bool
    qkv_bias: bool
    shared_expert: bool
    norm_expert_weights: bool
    expert_weights_scale: float
    tied_output: bool

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


def meta_int(store: GGUFStore, key: str, default=None, lo: int = 1, per_layer: str = "uniform") -> int:
    """Integer metadata ``key`` (``default`` when absent; absent without default is an error), >= ``lo``.

    Per-layer arrays are read as one value: ``per_layer="uniform"`` requires every layer to agree
    (what the graphs support), ``"max"`` takes the largest (for reports).
    """
    v = store.meta(key, default)
    if isinstance(v, list):
        if not v or (per_layer == "uniform" and any(x != v[0] for x in v)):
            raise ModelFileError(f"{store.path!r}: {key} = {v!r}: per-layer values that differ are not supported")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ModelFileError(f"{store.path!r}: {key} = {v!r} must hold integers")
        v = v[0] if per_layer == "uniform" else max(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be an integer >= {lo}")
    return v


def meta_float(store: GGUFStore, key: str, default: float, lo: float, hi: float) -> float:
    """Real metadata ``key`` in ``[lo, hi]`` (``default`` when absent)."""
    v = store.meta(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be a number in [{lo}, {hi}]")
    return float(v)


@dataclass(frozen=True)
class StackHParams:
    """What a stack of MoE FFN layers (:class:`~ggml_hybrid.moe.stack_session.MoEStackSession`) needs."""

    arch: str
    n_layer: int
    n_embd: int
    n_expert: int
    n_used: int
    rms_eps: float


def architecture(store: GGUFStore) -> str:
    """``general.architecture``, which must be a name."""
    arch = store.meta("general.architecture", "")
    if not isinstance(arch, str):
        raise ModelFileError(f"{store.path!r}: general.architecture = {arch!r} is not a name")
    return arch


def read_stack_hparams(store: GGUFStore) -> StackHParams:
    """Hyperparameters of an FFN-only MoE stack, checked against its tensors before anything is allocated."""
    arch = architecture(store)
    n_layer = meta_int(store, f"{arch}.block_count")
    n_embd = meta_int(store, f"{arch}.embedding_length")
    n_expert = meta_int(store, f"{arch}.expert_count")
    n_used = meta_int(store, f"{arch}.expert_used_count")
    if n_used > n_expert:
        raise ModelFileError(f"{store.path!r}: {n_used} experts used per token but only {n_expert} exist")
    if "blk.0.ffn_gate_inp.weight" not in store:
        raise NotMoEError(f"{store.path!r} is not a MoE model: it has no routed experts (blk.0.ffn_gate_inp)")
    if f"blk.{n_layer - 1}.ffn_gate_inp.weight" not in store or f"blk.{n_layer}.ffn_gate_inp.weight" in store:
        raise ModelFileError(f"{store.path!r}: {arch}.block_count = {n_layer} does not match the blk.N tensors")
    for i in range(n_layer):
        for name, want in ((f"blk.{i}.ffn_gate_inp.weight", (n_expert, n_embd)),
                           (f"blk.{i}.ffn_norm.weight", (n_embd,))):
            shape = store.info(name).shape
            if shape != want:
                raise ModelFileError(f"{store.path!r}: {name} has shape {shape}, expected {want} from the metadata")
    eps = meta_float(store, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, 0.0, 0.5)
    return StackHParams(arch, n_layer, n_embd, n_expert, n_used, eps)


def read_hparams(store: GGUFStore, require_moe: bool = True) -> HParams:
    arch = architecture(store)
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"{store.path!r}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(ARCHITECTURES))}")
    spec = ARCHITECTURES[arch]
    n_layer = meta_int(store, f"{arch}.block_count")
    n_embd = meta_int(store, f"{arch}.embedding_length")
    n_head = meta_int(store, f"{arch}.attention.head_count")
    n_head_kv = meta_int(store, f"{arch}.attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise ModelFileError(f"{store.path!r}: {n_head} attention heads are not a multiple of {n_head_kv} KV heads")
    head_dim = meta_int(store, f"{arch}.attention.key_length", n_embd // n_head)
    if meta_int(store, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelFileError(f"{store.path!r}: key and value head sizes differ, which is not supported")
    n_rot = meta_int(store, f"{arch}.rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise ModelFileError(f"{store.path!r}: partial rotary embedding ({n_rot} of {head_dim}) is not supported")
    scaling = store.meta(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ModelFileError(f"{store.path!r}: rope scaling {scaling!r} is not supported")
    if "token_embd.weight" not in store:
        raise ModelFileError(f"{store.path!r} has no tensor 'token_embd.weight'")
    n_vocab = store.info("token_embd.weight").shape[0]
    n_expert = meta_int(store, f"{arch}.expert_count", 0, lo=0)
    has_router = "blk.0.ffn_gate_inp.weight" in store
    if n_expert == 0 or not has_router:
        if require_moe:
            raise NotMoEError(f"{store.path!r} is a dense {arch} model ({arch}.expert_count = {n_expert}, "
                              f"router tensor {'present' if has_router else 'absent'}); a MoE model is required")
        raise ModelFileError(f"{store.path!r}: dense models are not supported yet")
    n_used = meta_int(store, f"{arch}.expert_used_count")
    if n_used > n_expert:
        raise ModelFileError(f"{store.path!r}: {arch}.expert_used_count = {n_used} exceeds {arch}.expert_count = "
                             f"{n_expert} (experts used per token must exist)")
    if arch == "llama":  # Mixtral-style files size the experts by feed_forward_length
        n_ff_exp = meta_int(store, f"{arch}.feed_forward_length")
    else:
        ff_default = meta_int(store, f"{arch}.feed_forward_length", 1) // n_used if store.has(
            f"{arch}.feed_forward_length") else None
        n_ff_exp = meta_int(store, f"{arch}.expert_feed_forward_length", ff_default)
    if arch == "qwen2moe" and n_head * head_dim != n_embd:
        raise ModelFileError(f"{store.path!r}: qwen2moe needs head_count*key_length = embedding_length, got "
                             f"{n_head}*{head_dim} != {n_embd}")
    n_ff_shexp = meta_int(store, f"{arch}.expert_shared_feed_forward_length", n_ff_exp) if spec.shared_expert else 0
    hp = HParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_rot=n_rot, n_vocab=n_vocab, n_ctx_train=meta_int(store, f"{arch}.context_length", 4096),
        n_expert=n_expert, n_used=n_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp, rope_mode=spec.rope_mode,
        rope_freq_base=meta_float(store, f"{arch}.rope.freq_base", 10000.0, 1e-3, 1e12),
        rope_freq_scale=1.0 / meta_float(store, f"{arch}.rope.scaling.factor", 1.0, 1e-6, 1e6),
        rms_eps=meta_float(store, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, 0.0, 0.5),
        qk_norm=spec.qk_norm, qkv_bias=spec.qkv_bias, shared_expert=spec.shared_expert,
        norm_expert_weights=spec.norm_expert_weights,
        expert_weights_scale=meta_float(store, f"{arch}.expert_weights_scale", 1.0, 0.0, 1e6) or 1.0,
        tied_output="output.weight" not in store)
    check_tensors(store, hp)
    return hp


def tensor_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, with its numpy-order shape."""
    E, V = hp.n_embd, hp.n_vocab
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    if not hp.tied_output:
        shapes["output.weight"] = (V, E)
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (E,), p + "attn_q.weight": (hp.n_embd_q, E),
                       p + "attn_k.weight": (hp.n_embd_kv, E), p + "attn_v.weight": (hp.n_embd_kv, E),
                       p + "attn_output.weight": (E, hp.n_embd_q), p + "ffn_norm.weight": (E,),
                       p + "ffn_gate_inp.weight": (hp.n_expert, E),
                       p + "ffn_gate_exps.weight": (hp.n_expert, hp.n_ff_exp, E),
                       p + "ffn_up_exps.weight": (hp.n_expert, hp.n_ff_exp, E),
                       p + "ffn_down_exps.weight": (hp.n_expert, E, hp.n_ff_exp)})
        if hp.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (hp.head_dim,), p + "attn_k_norm.weight": (hp.head_dim,)})
        if hp.qkv_bias:
            shapes.update({p + "attn_q.bias": (hp.n_embd_q,), p + "attn_k.bias": (hp.n_embd_kv,),
                           p + "attn_v.bias": (hp.n_embd_kv,)})
        if hp.shared_expert:
            shapes.update({p + "ffn_gate_inp_shexp.weight": (E,), p + "ffn_gate_shexp.weight": (hp.n_ff_shexp, E),
                           p + "ffn_up_shexp.weight": (hp.n_ff_shexp, E),
                           p + "ffn_down_shexp.weight": (E, hp.n_ff_shexp)})
    return shapes


def check_tensors(store: GGUFStore, hp: HParams) -> None:
    from ..ggml.ops import MATMUL_WEIGHTS

    for name, want in tensor_shapes(hp).items():
        if name not in store:
            raise ModelFileError(f"{store.path!r}: {hp.arch} needs tensor {name!r}, which the file lacks")
        info = store.info(name)
        if info.shape != want:
            raise ModelFileError(f"{store.path!r}: {name} has shape {info.shape}, expected {want} from the metadata")
        # norms, biases and the shared-expert gate are added or multiplied in F32, as llama.cpp stores them;
        # matrices go through mul_mat / get_rows, which take the float and quantized weight types
        vector = len(want) == 1
        if vector and info.dtype != GGMLType.F32:
            raise ModelFileError(f"{store.path!r}: {name} is {info.dtype.name}; vectors (norms, biases) must be F32")
        if not vector and info.dtype not in MATMUL_WEIGHTS:
            raise ModelFileError(f"{store.path!r}: {name} is {info.dtype.name}, not a weight type GGML can multiply "
                                 "(a float or quantized type)")
    if f"blk.{hp.n_layer}.attn_norm.weight" in store:
        raise ModelFileError(f"{store.path!r}: {hp.arch}.block_count = {hp.n_layer} but blk.{hp.n_layer} exists")


__all__ = ["ARCHITECTURES", "ArchSpec", "HParams", "StackHParams", "architecture", "check_tensors", "meta_float",
           "meta_int", "read_hparams", "read_stack_hparams", "tensor_shapes"]
