"""What qwen3next and qwen35moe share: gated delta-net layers between gated attention layers, routed experts
and a sigmoid-gated shared expert in every layer.

llama.cpp: ``src/models/qwen3next.cpp``, ``src/models/qwen35moe.cpp`` (``load_arch_hparams``,
``load_arch_tensors``). Keys besides the common ones: ``expert_feed_forward_length`` (else
``feed_forward_length / expert_used_count``), ``expert_shared_feed_forward_length`` (else
``feed_forward_length``), the required ``attention.layer_norm_rms_epsilon`` (every RMS norm and
the L2 norms), the five required ``ssm.*`` keys, and which layers are delta-net layers:
``attention.recurrent_layers`` (one flag per block) or else ``full_attention_interval``
(default 4: every fourth layer is an attention layer). ``expert_weights_scale``,
``expert_weights_norm`` and ``expert_gating_func`` are not read: softmax, normalised top-k.
The next-token-prediction block (``nextn_predict_layers``) is a gated attention layer with experts after the
layers (:func:`head_tensors`): the draft head (:mod:`ggml_hybrid.model.mtp`), loaded only for speculative
decoding, as llama.cpp skips its tensors otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import ModelFileError
from ...ggml.dtypes import GGMLType
from ...gguf.metadata import meta_int
from ...gguf.store import GGUFStore
from ..hparams import Common, DeltaNet, HParams, Routing, refuse
from .base import Shapes, base_hparams, expert_width, ffn_tensors, globals_

# GGML's CUDA kernels abort outside these (the CPU ones take any): the delta rule's head size and the
# convolution's width (when the convolution runs on the GPU: channels a multiple of 128)
CUDA_STATE_SIZES = (16, 32, 64, 128)
CUDA_CONV_KERNELS = (3, 4, 5, 9, 15)


def bad_value(store: GGUFStore, key: str, value: object, rule: str) -> ModelFileError:
    return ModelFileError(f"{store.path!r}: {key} = {value!r}: {rule}")


def recurrent_layers(store: GGUFStore, c: Common) -> tuple[bool, ...]:
    """Per layer of the graph: a delta-net layer? ``attention.recurrent_layers`` (flags per block, or one value for
    all) when present, else every ``full_attention_interval``-th layer is an attention layer."""
    key = f"{c.arch}.attention.recurrent_layers"
    if store.has(key):
        v = store.meta(key, kind=("int", "ints", "bool", "bools"))
        if isinstance(v, list):
            if len(v) != c.n_layer_all or not all(isinstance(x, int) and x >= 0 for x in v):
                raise bad_value(store, key, v, f"must be {c.n_layer_all} flags, one per block (block_count)")
            return tuple(bool(x) for x in v[:c.n_layer])
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad_value(store, key, v, "must be a flag per block or one unsigned integer for all")
        return (bool(v),) * c.n_layer
    interval = meta_int(store, f"{c.arch}.full_attention_interval", 4)
    return tuple((i + 1) % interval != 0 for i in range(c.n_layer))


def read_delta_net(store: GGUFStore, c: Common, *, k_repeat: str, ba_fused: bool) -> DeltaNet:
    a = c.arch

    def key(k: str) -> str:
        return f"{a}.ssm.{k}"

    d_conv, d_inner, d_state = meta_int(store, key("conv_kernel")), meta_int(store, key("inner_size")), \
        meta_int(store, key("state_size"))
    nv, nk = meta_int(store, key("time_step_rank")), meta_int(store, key("group_count"))
    if d_conv < 2:
        raise refuse(store, a, key("conv_kernel"), f"a convolution of width {d_conv} (no state to carry)")
    if nv % nk:
        raise bad_value(store, key("time_step_rank"), nv, f"the value heads must be a multiple of the {nk} key heads "
                   f"({key('group_count')})")
    if d_inner != d_state * nv:
        raise bad_value(store, key("inner_size"), d_inner, f"must be {key('state_size')} * {key('time_step_rank')} = "
                   f"{d_state} * {nv} = {d_state * nv} (the graph reshapes by both)")
    recurrent = recurrent_layers(store, c)
    qkvz_fused = False
    first = next((i for i, r in enumerate(recurrent) if r), None)
    if first is not None and f"blk.{first}.attn_qkv.weight" not in store:
        if a != "qwen3next" or f"blk.{first}.ssm_in.weight" not in store:
            want = "attn_qkv and attn_gate" + (" (or the legacy ssm_in)" if a == "qwen3next" else "")
            raise ModelFileError(f"{store.path!r}: {a} needs tensor 'blk.{first}.attn_qkv.weight' ({want}), which "
                                 "the file lacks")
        qkvz_fused = True
    return DeltaNet(recurrent, d_conv, d_state, nk, nv, k_repeat, qkvz_fused=qkvz_fused, ba_fused=ba_fused)


def read(store: GGUFStore, c: Common, *, rope_mode: str, k_repeat: str, ba_fused: bool,
         sections: tuple[int, ...] = ()) -> HParams:
    a = c.arch
    if c.key_length != c.value_length:
        raise bad_value(store, f"{a}.attention.value_length", c.value_length, f"must equal {a}.attention.key_length = "
                   f"{c.key_length} (the graph asserts equal head sizes)")
    if c.n_rot % 2 or c.n_rot > c.key_length:
        raise bad_value(store, f"{a}.rope.dimension_count", c.n_rot, f"must be even and at most the head size "
                   f"{c.key_length}")
    dn = read_delta_net(store, c, k_repeat=k_repeat, ba_fused=ba_fused)
    n_ff_shexp = meta_int(store, f"{a}.expert_shared_feed_forward_length", c.n_ff or None)
    hp = base_hparams(store, c, rope_mode=rope_mode, n_ff_exp=expert_width(store, c, required=False),
                      routing=Routing("softmax", True, 0.0, c.n_group, c.n_group_used),
                      attn_biases=attn_biases_of(store, dn), n_ff_shexp=n_ff_shexp, shared_gate="sigmoid",
                      ffn_norm="post_attention_norm", out_rows_late=True, delta_net=dn,
                      fused_gate_up="blk.0.ffn_gate_up_exps.weight" in store)
    if sections:
        hp = replace(hp, rope=replace(hp.rope, sections=sections))
    for il in dn.layers:  # the convolution's CPU kernel reads F32 weights only (llama-quantize keeps them F32)
        name = f"blk.{il}.ssm_conv1d.weight"
        if name in store and store.info(name).dtype != GGMLType.F32:
            raise ModelFileError(f"{store.path!r}: {name} is {store.info(name).dtype.name}; the short convolution's "
                                 "weights must be F32")
    return hp


def attn_biases_of(store: GGUFStore, dn: DeltaNet) -> tuple[str, ...]:
    """The optional q/k/v biases, from the first attention layer."""
    first = next((i for i, r in enumerate(dn.recurrent) if not r), None)
    if first is None:
        return ()
    return tuple(n for n in "qkv" if f"blk.{first}.attn_{n}.bias" in store)


def layer_tensors(hp: HParams, il: int, recurrent: bool) -> Shapes:
    """One layer: a delta-net or a gated attention mixer (with their norms), then the FFN."""
    dn = hp.delta_net
    assert dn is not None
    E, H, hd = hp.n_embd, hp.n_head, hp.head_dim
    kv = hp.n_head_kv * hd
    p = f"blk.{il}."
    shapes: Shapes = {p + "attn_norm.weight": (E,)}
    if recurrent:
        C, vd = dn.conv_channels, dn.value_dim
        if dn.qkvz_fused:
            shapes[p + "ssm_in.weight"] = (2 * dn.key_dim + 2 * vd, E)
        else:
            shapes.update({p + "attn_qkv.weight": (C, E), p + "attn_gate.weight": (vd, E)})
        shapes.update({p + "ssm_conv1d.weight": (C, dn.d_conv), p + "ssm_dt.bias": (dn.n_v_heads,),
                       p + "ssm_a": (dn.n_v_heads,), p + "ssm_norm.weight": (dn.d_state,),
                       p + "ssm_out.weight": (E, vd)})
        if dn.ba_fused:
            shapes[p + "ssm_ba.weight"] = (2 * dn.n_v_heads, E)
        else:
            shapes.update({p + "ssm_beta.weight": (dn.n_v_heads, E), p + "ssm_alpha.weight": (dn.n_v_heads, E)})
    else:
        sizes = {"q": 2 * H * hd, "k": kv, "v": kv}
        shapes.update({p + f"attn_{n}.weight": (rows, E) for n, rows in sizes.items()})
        shapes.update({p + f"attn_{n}.bias": (sizes[n],) for n in hp.attn_biases})
        shapes.update({p + "attn_output.weight": (E, H * hd), p + "attn_q_norm.weight": (hd,),
                       p + "attn_k_norm.weight": (hd,)})
    shapes.update(ffn_tensors(hp, il))
    return shapes


def head_tensors(hp: HParams, il: int) -> Shapes:
    """The draft head's block: a gated attention layer with experts (llama.cpp's ``load_block_mtp``)."""
    return layer_tensors(hp, il, recurrent=False)


def tensors(hp: HParams) -> Shapes:
    dn = hp.delta_net
    assert dn is not None
    shapes = globals_(hp)
    for il in range(hp.n_layer):
        shapes.update(layer_tensors(hp, il, dn.recurrent[il]))
    return shapes


def check_cuda(path: str, hp: HParams, devices: list[str]) -> None:
    """Refuse what GGML's CUDA kernels would abort on, when a CUDA device is in use."""
    dn = hp.delta_net
    if dn is None or not dn.layers or not any(d.startswith("CUDA") for d in devices):
        return
    a = hp.arch
    if dn.d_state not in CUDA_STATE_SIZES:
        raise ModelFileError(f"{path!r}: {a}: {a}.ssm.state_size = {dn.d_state} is not supported on a CUDA device "
                             f"(GGML's kernel takes {', '.join(map(str, CUDA_STATE_SIZES))})")
    if dn.conv_channels % 128 == 0 and dn.d_conv not in CUDA_CONV_KERNELS:
        raise ModelFileError(f"{path!r}: {a}: {a}.ssm.conv_kernel = {dn.d_conv} is not supported on a CUDA device "
                             f"(GGML's kernel takes {', '.join(map(str, CUDA_CONV_KERNELS))})")


__all__ = ["CUDA_CONV_KERNELS", "CUDA_STATE_SIZES", "bad_value", "check_cuda", "head_tensors", "layer_tensors", "read",
           "read_delta_net", "recurrent_layers", "tensors"]
