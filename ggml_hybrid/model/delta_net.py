"""The layers of recurrent models (qwen3next, qwen35moe): gated delta-net layers and gated attention.

Op for op as llama.cpp builds them (``src/models/qwen3next.cpp``, ``qwen35moe.cpp`` and
``delta-net-base.cpp``) for one sequence per ubatch:

- :func:`delta_net`: the q/k/v and output-gate projections, beta and the decay gate, the short
  causal convolution over the sequence's conv state and this ubatch's inputs, SiLU, L2-normed
  q and k, the fused ``gated_delta_net`` over the sequence's state (always the fused op, as
  llama.cpp 0.3.36 always chooses it), the RMS norm gated by SiLU(z), the output projection. The
  new conv and delta states are written to the rows the :class:`RecurrentState` says.
- :func:`gated_attention`: queries and their per-head sigmoid gate from one projection, q/k RMS
  norms, rope (partial; M-RoPE for qwen35moe), attention over the KV cache, the gate, the output.

Numbers that llama.cpp computes in float32 are computed so here (the L2 norm's ``eps / n`` and
``1 / sqrtf(n)``).
"""

from __future__ import annotations

import numpy as np

from ..ggml.tensor import Tensor
from .hparams import DeltaNet
from .kv_cache import seq_input
from .layers import Builder, decoder_layer

f32 = np.float32


def l2_norm(b: Builder, x: Tensor) -> Tensor:
    """llama.cpp's ``build_gdn_l2_norm``: ``x / sqrt(sum x^2 + eps)`` as rms_norm(eps / n) scaled by 1/sqrtf(n)."""
    n = f32(x.ne[0])
    return b.c.scale(b.c.rms_norm(x, float(f32(b.hp.rms_eps) / n)), float(f32(1) / np.sqrt(n)))


def _qkvz(b: Builder, il: int, x: Tensor, dn: DeltaNet) -> tuple[Tensor, Tensor]:
    """The convolution's input [T, channels] (all q, then all k, then all v) and the output gate z [T, value_dim]."""
    c, p = b.c, f"blk.{il}."
    T = x.ne[1]
    if not dn.qkvz_fused:
        return b.linear(p + "attn_qkv", x), b.linear(p + "attn_gate", x)
    # qwen3next's legacy ssm_in: per key head [q (d), k (d), v (r d), z (r d)]
    d, nk, r = dn.d_state, dn.n_k_heads, dn.n_v_heads // dn.n_k_heads
    mixed = c.reshape(b.linear(p + "ssm_in", x), (T, nk, 2 * d + 2 * r * d))
    strides = (mixed.nb[2], mixed.nb[1])

    def part(width: int, offset: int) -> Tensor:
        return c.view(mixed, (T, nk, width), strides, offset * 4)

    z = c.cont(part(r * d, 2 * d + r * d))
    q, k, v = (c.reshape(c.cont(part(w, o)), (T, nk * w)) for w, o in ((d, 0), (d, d), (r * d, 2 * d)))
    return c.concat(c.concat(q, k, axis=-1), v, axis=-1), c.reshape(z, (T, dn.value_dim))


def _beta_gate(b: Builder, il: int, x: Tensor, dn: DeltaNet) -> tuple[Tensor, Tensor]:
    """beta = sigmoid(b) and the decay gate g = softplus(a + dt_bias) * ssm_a (<= 0), each [T, n_v_heads, 1]."""
    c, p = b.c, f"blk.{il}."
    T, nv, nk = x.ne[1], dn.n_v_heads, dn.n_k_heads
    if dn.ba_fused:
        # ssm_ba: per key head [beta (r), alpha (r)]; value head k r + j is key head k's j-th
        r = nv // nk
        ba = c.reshape(b.linear(p + "ssm_ba", x), (T, nk, 2 * r))
        strides = (ba.nb[2], ba.nb[1])
        beta = c.sigmoid(c.cont(c.view(ba, (T, nk, r), strides, 0)))
        alpha = c.reshape(c.cont(c.view(ba, (T, nk, r), strides, r * 4)), (T, nv))
    else:
        beta = c.sigmoid(c.reshape(b.linear(p + "ssm_beta", x), (T, nv, 1)))
        # reshaped before the bias as llama.cpp does (a mul_mat directly followed by an add is a fusion of GGML's
        # Vulkan backend that llama.cpp's graph does not get here)
        alpha = c.reshape(b.linear(p + "ssm_alpha", x), (T, nv))
    gate = c.mul(c.softplus(c.add(alpha, b.w[p + "ssm_dt.bias"])), b.w[p + "ssm_a"])
    return c.reshape(beta, (T, nv, 1)), c.reshape(gate, (T, nv, 1))


def delta_net(b: Builder, il: int, x: Tensor) -> Tensor:
    """A gated delta-net layer's mixer over the normed x [T, n_embd]; returns [T, n_embd].

    The projections take every row of the ubatch; the convolution and the delta rule run once per sequence,
    over its own rows and state (as its attention does), so each sequence computes what it would alone."""
    dn = b.hp.delta_net
    assert dn is not None
    qkv, z = _qkvz(b, il, x, dn)
    beta, gate = _beta_gate(b, il, x, dn)
    normed = b.per_sequence((qkv, z, beta, gate), lambda i, seg, *xs: _recurrent(b, il, i, *xs))
    return b.linear(f"blk.{il}.ssm_out", normed)


def _recurrent(b: Builder, il: int, i: int, qkv: Tensor, z: Tensor, beta: Tensor, gate: Tensor) -> Tensor:
    """The ``i``-th sequence's convolution, delta rule and gated norm over its rows (qkv [T, channels], z
    [T, value_dim], beta and gate [T, n_v_heads, 1]) from and to its state rows; returns [T, value_dim]."""
    c, g, hp, p, rs = b.c, b.g, b.hp, f"blk.{il}.", b.rs
    dn = hp.delta_net
    assert dn is not None and rs is not None
    conv_all, ssm_all = rs.conv[il], rs.ssm[il]
    assert conv_all is not None and ssm_all is not None
    T = qkv.ne[1]
    d, nk, nv, C, K = dn.d_state, dn.n_k_heads, dn.n_v_heads, dn.conv_channels, dn.d_conv
    read, write = b.inp[seq_input("rs_read", i)], b.inp[seq_input("rs_write", i)]

    # the convolution's input: the sequence's last K - 1 inputs per channel, then this ubatch's
    b.mark("attn", il)  # state reads and writes live with the layer's memory, as KV stores do
    history = c.reshape(c.get_rows(conv_all, read), (C, K - 1))
    b.mark("layer", il)
    conv_in = c.concat(history, c.transpose(qkv), axis=-1)                    # [C, K - 1 + T]
    last = c.view(conv_in, (C, K - 1), (conv_in.nb[1],), T * 4)               # the new conv state
    b.mark("attn", il)
    g.expand(c.set_rows(conv_all, c.reshape(c.cont(last), (1, dn.conv_state)), write))
    state = c.reshape(c.get_rows(ssm_all, read), (nv, d, d))
    b.mark("layer", il)

    conv = c.silu(c.ssm_conv(c.reshape(conv_in, (1, C, K - 1 + T)), b.w[p + "ssm_conv1d.weight"]))  # [1, T, C]
    row = conv.nb[1]

    def heads(n: int, offset: int) -> Tensor:
        return c.view(conv, (T, n, d), (row, d * 4), offset * 4)

    q, k, v = l2_norm(b, heads(nk, 0)), l2_norm(b, heads(nk, dn.key_dim)), heads(nv, 2 * dn.key_dim)
    if dn.k_repeat == "interleave" and nk != nv:
        # qwen3next: value head h reads key head h // r, made explicit with a repeat (as llama.cpp does)
        r = nv // nk
        q, k = (c.reshape(c.repeat(c.reshape(t, (T, nk, 1, d)), (T, nk, r, d)), (T, nv, d)) for t in (q, k))
    # qwen35moe's value head h reads key head h % n_k: the op's own broadcast
    out = c.gated_delta_net(q, k, v, gate, beta, state)                       # [T + d, nv d]
    o = c.view(out, (T, nv, d), (nv * d * 4, d * 4))
    new_state = c.view(out, (1, dn.ssm_state), (dn.ssm_state * 4,), nv * d * T * 4)
    b.mark("attn", il)
    g.expand(c.set_rows(ssm_all, new_state, write))
    b.mark("layer", il)

    # the RMS norm of each head's output, gated by SiLU(z); then the output projection
    normed = c.mul(c.mul(c.rms_norm(o, hp.rms_eps), b.w[p + "ssm_norm.weight"]), c.silu(c.reshape(z, (T, nv, d))))
    return c.reshape(normed, (T, dn.value_dim))


def gated_attention(b: Builder, il: int, x: Tensor) -> Tensor:
    """Attention whose output is gated per head by sigmoid of a second half of the query projection."""
    c, hp, p = b.c, b.hp, f"blk.{il}."
    T, H, hd = x.ne[1], hp.n_head, hp.head_dim
    qg = b.linear(p + "attn_q", x, "q" in hp.attn_biases)                       # [T, H 2 hd]: per head q, then gate
    k = c.reshape(b.linear(p + "attn_k", x, "k" in hp.attn_biases), (T, hp.n_head_kv, hd))
    v = c.reshape(b.linear(p + "attn_v", x, "v" in hp.attn_biases), (T, hp.n_head_kv, hd))
    strides = (qg.nb[1], 2 * hd * 4)
    q = c.view(qg, (T, H, hd), strides, 0)
    gate = c.view(qg, (T, H, hd), strides, hd * 4)
    q, k = b.norm(q, p + "attn_q_norm.weight"), b.norm(k, p + "attn_k_norm.weight")
    q, k = b.rope(q, il), b.rope(k, il)
    out = b.attend(il, q, k, v)                                                 # [T, H hd]
    out = c.mul(out, c.sigmoid(c.reshape(c.cont(gate), (T, H * hd))))
    return b.linear(p + "attn_output", out)


def layer(b: Builder, il: int, x: Tensor) -> Tensor:
    """One layer of a recurrent model: delta-net or gated attention, then the routed experts and the gated shared
    expert (:func:`~ggml_hybrid.model.layers.decoder_layer`; the output rows are picked after the last layer)."""
    dn = b.hp.delta_net
    assert dn is not None
    return decoder_layer(b, il, x, delta_net if dn.recurrent[il] else gated_attention)


__all__ = ["delta_net", "gated_attention", "l2_norm", "layer"]
