"""The decoder graph for one ubatch shape, op for op as llama.cpp builds it.

Matching llama.cpp's op sequence (including its quirks: the shared-expert gate
as ``silu(x)/x``, the ``argsort`` expert order, the transposed V cache read by
``mul_mat``) is what makes the logits agree with llama.cpp's to rounding.
A graph is built once per ``(n_tokens, n_kv, n_outputs)`` and reused: only
its inputs change from one ubatch to the next.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .._native import lib
from ..ggml.context import Arena, Context
from ..ggml.graph import Graph
from ..ggml.tensor import Tensor
from ..moe.ffn import MoERegion, build_moe_ffn
from .hparams import HParams
from .kv_cache import KVCache

# nodes and leafs per layer besides the weighted sum, which takes two per expert used (llama.cpp's adds)
NODES_PER_LAYER = 96


@dataclass
class DecoderGraph:
    ctx: Context
    graph: Graph
    inputs: dict[str, Tensor]
    logits: Tensor
    regions: list[MoERegion] = field(default_factory=list)
    # (first tensor-struct offset in ctx's pool, kind, layer): which part of the model built a node
    segments: list[tuple[int, str, int]] = field(default_factory=list)

    def owner(self, t: Tensor) -> tuple[str, int]:
        """("embd" | "layer" | "attn" | "output", layer) of a node of this graph."""
        # segments are in creation order: the last one starting at or before t's struct is its part
        k = bisect.bisect_right(self._starts, self.ctx.offset_of(t)) - 1
        return self.segments[k][1:] if k >= 0 else ("embd", -1)

    def __post_init__(self):
        self._starts = [start for start, _, _ in self.segments]

    def close(self) -> None:
        self.ctx.close()


def graph_size(hp: HParams) -> int:
    return (NODES_PER_LAYER + 2 * hp.n_used) * hp.n_layer + 64


def _norm(c: Context, x: Tensor, w: Tensor, eps: float) -> Tensor:
    return c.mul(c.rms_norm(x, eps), w)


def _attention(c: Context, g: Graph, hp: HParams, w: dict, kv: KVCache, il: int, cur: Tensor,
               inp: dict[str, Tensor], n_kv: int, flash: bool, mark) -> Tensor:
    T, hd, p = cur.ne[1], hp.head_dim, f"blk.{il}."
    q, k, v = (c.mul_mat(w[p + f"attn_{n}.weight"], cur) for n in "qkv")
    if hp.qkv_bias:
        q, k, v = (c.add(t, w[p + f"attn_{n}.bias"]) for t, n in zip((q, k, v), "qkv"))
    q = c.reshape(q, (T, hp.n_head, hd))
    k = c.reshape(k, (T, hp.n_head_kv, hd))
    v = c.reshape(v, (T, hp.n_head_kv, hd))
    if hp.qk_norm:
        q = _norm(c, q, w[p + "attn_q_norm.weight"], hp.rms_eps)
        k = _norm(c, k, w[p + "attn_k_norm.weight"], hp.rms_eps)
    q = c.rope(q, inp["pos"], n_dims=hp.n_rot, mode=hp.rope_mode, freq_base=hp.rope_freq_base,
               freq_scale=hp.rope_freq_scale, n_ctx_orig=hp.n_ctx_train)
    k = c.rope(k, inp["pos"], n_dims=hp.n_rot, mode=hp.rope_mode, freq_base=hp.rope_freq_base,
               freq_scale=hp.rope_freq_scale, n_ctx_orig=hp.n_ctx_train)

    # store this ubatch's K and V; the reads below come later in the graph
    mark("attn", il)  # from here to the output projection: where the KV cache lives
    kc, vc, E = kv.k[il], kv.v[il], hp.n_embd_kv
    g.expand(c.set_rows(kc, c.reshape(k, (T, E)), inp["k_idxs"]))
    if kv.v_trans:
        flat = c.reshape(v, (T * E, 1))
        g.expand(c.set_rows(c.reshape(vc, (kv.n_ctx * E, 1)), flat, inp["v_idxs"]))
    else:
        g.expand(c.set_rows(vc, c.reshape(v, (T, E)), inp["k_idxs"]))

    row_k = kc.dtype.row_size(hd)
    keys = c.view(kc, (n_kv, hp.n_head_kv, hd), (kc.nb[1], row_k))
    qp = c.permute(q, (1, 0, 2))                                  # [H, T, hd]
    kp = c.permute(keys, (1, 0, 2))                               # [Hkv, n_kv, hd]
    scale = 1.0 / math.sqrt(hd)
    if flash:
        row_v = vc.dtype.row_size(hd)
        vp = c.permute(c.view(vc, (n_kv, hp.n_head_kv, hd), (vc.nb[1], row_v)), (1, 0, 2))
        out = c.flash_attn(qp, kp, vp, inp["mask"], scale)        # [T, H, hd]
        lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
        out = c.reshape(out, (T, hp.n_embd_q))
    else:
        kq = c.mul_mat_f32(kp, qp)                                # [H, T, n_kv]
        kq = c.soft_max(kq, inp["mask"], scale)
        el = vc.dtype.type_size
        # the transposed cache: [hd, Hkv, n_kv] with cells contiguous
        vt = c.view(vc, (hd, hp.n_head_kv, n_kv), (kv.n_ctx * el, kv.n_ctx * hd * el))
        kqv = c.mul_mat(c.permute(vt, (1, 0, 2)), kq)             # [H, T, hd]
        out = c.reshape(c.cont(c.permute(kqv, (1, 0, 2))), (T, hp.n_embd_q))
    mark("layer", il)
    return c.mul_mat(w[p + "attn_output.weight"], out)


def _shared_expert(c: Context, w: dict, il: int, cur: Tensor) -> Tensor:
    p = f"blk.{il}."
    gate_in = c.mul_mat(w[p + "ffn_gate_inp_shexp.weight"], cur)  # [T, 1]
    gate = c.div(c.silu(gate_in), gate_in)                         # llama.cpp's sigmoid
    act = c.swiglu(c.mul_mat(w[p + "ffn_gate_shexp.weight"], cur), c.mul_mat(w[p + "ffn_up_shexp.weight"], cur))
    return c.mul(c.mul_mat(w[p + "ffn_down_shexp.weight"], act), gate)


def context_size(hp: HParams) -> int:
    """Bytes of the context a decoder graph is built in."""
    size = graph_size(hp)
    return Context.size_for(2 * size, graph_size=size)  # views are tensors too


def build_decoder(hp: HParams, w: dict, experts: list, kv: KVCache, n_tokens: int, n_kv: int, n_out: int,
                  flash: bool, arena: Arena | None = None) -> DecoderGraph:
    """Logits [n_out, n_vocab] of the last ``n_out`` tokens of an ubatch of ``n_tokens``."""
    size = graph_size(hp)
    c = Context(n_tensors=2 * size, graph_size=size, arena=arena)  # views are tensors too
    g = c.new_graph(size)
    inp = {"tokens": c.new_tensor("i32", (n_tokens,), "inp_tokens"),
           "pos": c.new_tensor("i32", (n_tokens,), "inp_pos"),
           "k_idxs": c.new_tensor("i64", (n_tokens,), "inp_k_idxs"),
           "mask": c.new_tensor("f16" if flash else "f32", (n_tokens, n_kv), "inp_kq_mask")}
    if kv.v_trans:
        inp["v_idxs"] = c.new_tensor("i64", (n_tokens * hp.n_embd_kv,), "inp_v_idxs")
    if n_out < n_tokens:
        inp["out_ids"] = c.new_tensor("i32", (n_out,), "inp_out_ids")
    for t in inp.values():
        t.set_input()
    segments = []

    def mark(kind: str, il: int) -> None:
        segments.append((c.used, kind, il))

    mark("embd", -1)
    cur = c.get_rows(w["token_embd.weight"], inp["tokens"])
    regions = []
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        mark("layer", il)
        residual = cur
        cur = _attention(c, g, hp, w, kv, il, _norm(c, cur, w[p + "attn_norm.weight"], hp.rms_eps), inp, n_kv,
                         flash, mark)
        if il == hp.n_layer - 1 and "out_ids" in inp:
            cur = c.get_rows(cur, inp["out_ids"])
            residual = c.get_rows(residual, inp["out_ids"])
        ffn_inp = c.add(cur, residual)
        cur = _norm(c, ffn_inp, w[p + "ffn_norm.weight"], hp.rms_eps)
        r = build_moe_ffn(c, g, cur, w[p + "ffn_gate_inp.weight"], experts[il], hp.n_used,
                          norm_weights=hp.norm_expert_weights, weights_scale=hp.expert_weights_scale,
                          name=f"blk.{il}.moe")
        regions.append(r)
        moe_out = r.out
        if hp.shared_expert:
            moe_out = c.add(moe_out, _shared_expert(c, w, il, cur))
        cur = c.add(moe_out, ffn_inp)
    mark("output", -1)
    cur = _norm(c, cur, w["output_norm.weight"], hp.rms_eps)
    logits = c.mul_mat(w.get("output.weight", w["token_embd.weight"]), cur)
    logits.name = "result_output"
    logits.set_output()
    g.expand(logits)
    return DecoderGraph(c, g, inp, logits, regions, segments)


__all__ = ["DecoderGraph", "build_decoder", "context_size", "graph_size"]
