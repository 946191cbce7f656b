"""The pieces every family's decoder layer is built from, op for op as llama.cpp's ``llm_graph_context``.

A :class:`Builder` holds what one ubatch's graph is built with (context, graph,
weights, KV cache, inputs) and offers llama.cpp's shared pieces: ``build_norm``
(:meth:`Builder.norm`), the KV store and ``build_attn_mha`` (:meth:`Builder.attend`,
with the Hadamard rotation of quantized caches and the F16 cast flash attention
needs), ``build_ffn`` (:meth:`Builder.ffn`) and ``build_moe_ffn`` (:meth:`Builder.moe`,
whose region covers exactly the routed experts). :func:`decoder_layer` is the
layer most families share; they differ in their attention (:func:`standard_attention`
or deepseek2's latent attention) and in what their hyperparameters switch on.
"""

from __future__ import annotations

from collections.abc import Callable

from .._native import lib
from ..ggml.context import Context
from ..ggml.dtypes import GGMLType
from ..ggml.graph import Graph
from ..ggml.tensor import Tensor
from ..moe.ffn import ExpertWeights, MoERegion, Router, build_moe_ffn
from .hparams import HParams
from .kv_cache import KVCache, SeqRows, seq_input
from .recurrent_state import RecurrentState


class Builder:
    def __init__(self, c: Context, g: Graph, hp: HParams, w: dict[str, Tensor], experts: list[ExpertWeights | None],
                 kv: KVCache, inp: dict[str, Tensor], seq_rows: tuple[SeqRows, ...], flash: bool,
                 rs: RecurrentState | None = None) -> None:
        self.c, self.g, self.hp, self.w, self.experts, self.kv = c, g, hp, w, experts, kv
        self.inp, self.seq_rows, self.flash = inp, seq_rows, flash
        self.rs = rs  # the recurrent states of delta-net layers (None: a model without them)
        self.late_rows = False  # the last layer runs over every row (:meth:`rows` picks none): a draft head's input
        # one per layer with routed experts, a loaded draft head's block (layer n_layer) included
        self.regions: list[MoERegion | None] = [None] * max(hp.n_layer, len(experts))
        # (first tensor-struct offset in c's pool, kind, layer): which part of the model built a node
        self.segments: list[tuple[int, str, int]] = []

    def mark(self, kind: str, il: int) -> None:
        self.segments.append((self.c.used, kind, il))

    # -- small pieces -----------------------------------------------------------

    def norm(self, x: Tensor, weight: str) -> Tensor:
        """``build_norm(LLM_NORM_RMS)``: rms_norm, then the weight."""
        return self.c.mul(self.c.rms_norm(x, self.hp.rms_eps), self.w[weight])

    def linear(self, name: str, x: Tensor, bias: bool = False) -> Tensor:
        """``name.weight`` times x (``build_lora_mm``), plus ``name.bias`` when asked."""
        y = self.c.mul_mat(self.w[name + ".weight"], x)
        return self.c.add(y, self.w[name + ".bias"]) if bias else y

    def rope(self, x: Tensor, il: int) -> Tensor:
        """The layer's rope over x [T, heads, d] (sliding-window layers may have their own base and scale;
        M-RoPE models rotate by four positions per token)."""
        kw = self.hp.rope.kwargs()
        if self.hp.rope.sections:
            return self.c.rope_multi(x, self.inp["pos"], sections=self.hp.rope.sections, **kw)
        swa = self.hp.swa
        if swa is not None and swa.layers[il]:
            kw.update(freq_base=swa.freq_base, freq_scale=swa.freq_scale)
        return self.c.rope(x, self.inp["pos"], **kw)

    def rows(self, il: int, *xs: Tensor) -> tuple[Tensor, ...]:
        """In the last layer, only the rows whose logits are wanted (llama.cpp's ``inp_out_ids``)."""
        if il != self.hp.n_layer - 1 or "out_ids" not in self.inp or self.hp.out_rows_late or self.late_rows:
            return xs
        return tuple(self.c.get_rows(x, self.inp["out_ids"]) for x in xs)

    def ffn(self, x: Tensor, prefix: str) -> Tensor:
        """``build_ffn`` SiLU/parallel: ``down(silu(gate x) * up x)`` (dense layers, shared experts)."""
        c = self.c
        up = self.linear(prefix.replace("*", "up"), x)
        act = c.swiglu(self.linear(prefix.replace("*", "gate"), x), up)
        out = self.linear(prefix.replace("*", "down"), act)
        if self.hp.f32_acc:
            lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
        return out

    # -- attention ---------------------------------------------------------------

    def _hadamard(self, x: Tensor, which: str) -> Tensor:
        rot = self.inp.get(which)
        return x if rot is None else self.c.mul_mat_hadamard(rot, x)

    def _mask(self, il: int, i: int) -> Tensor:
        swa = self.hp.swa
        return self.inp[seq_input("mask_swa" if swa is not None and swa.layers[il] else "mask", i)]

    def _rows(self, x: Tensor, r0: int, n: int) -> Tensor:
        """Rows r0 .. r0 + n of x [T, ...] (2 or 3 dimensions), a view."""
        c = self.c
        if x.ndim == 2:
            return c.view(x, (n, x.ne[0]), (x.nb[1],), r0 * x.nb[1])
        return c.view(x, (n, x.ne[1], x.ne[0]), (x.nb[2], x.nb[1]), r0 * x.nb[2])

    def per_sequence(self, xs: tuple[Tensor, ...], one: Callable[..., Tensor]) -> Tensor:
        """``one(i, seq_rows, *their rows of xs)`` for each sequence of the ubatch, the results' rows
        ([T_i, n] each) joined in order.

        xs are [T, ...] over all rows of the ubatch; a single sequence gets them whole, so a
        one-sequence graph is exactly what it always was.
        """
        c = self.c
        if len(self.seq_rows) == 1:
            return one(0, self.seq_rows[0], *xs)
        out: Tensor | None = None
        r0 = 0
        for i, seg in enumerate(self.seq_rows):
            part = one(i, seg, *(self._rows(x, r0, seg.n_tokens) for x in xs))
            out = part if out is None else c.concat(out, part, axis=0, ndim=2)
            r0 += seg.n_tokens
        assert out is not None
        return out

    def attend(self, il: int, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> Tensor:
        """Store k [T, Hkv, dk] and v [T, Hkv, dv] in the layer's cache, attend q [T, H, dk] to every cell
        the mask allows; returns [T, H * dv] (before the output projection). Each sequence of the ubatch
        stores to and attends over its own slot."""
        q, k = self._hadamard(q, "k_rot"), self._hadamard(k, "k_rot")
        v = self._hadamard(v, "v_rot")
        # llama.cpp's order: q, v, then k, whose rope is then followed by its store (GGML's Vulkan backend fuses
        # the rope with the K store, and its graph optimizer keeps fusable neighbours together)
        self.g.expand(q, v, k)
        # store this ubatch's K and V; the reads below come later in the graph
        self.mark("attn", il)  # from here to the output projection: where the KV cache lives
        out = self.per_sequence((q, k, v), lambda i, seg, q, k, v: self._attend_one(il, i, seg, q, k, v, sinks))
        out = self._hadamard(out, "v_rot")
        self.mark("layer", il)
        return out

    def _attend_one(self, il: int, i: int, seg: SeqRows, q: Tensor, k: Tensor, v: Tensor,
                    sinks: Tensor | None) -> Tensor:
        c, g, kv, hp, n_kv = self.c, self.g, self.kv, self.hp, seg.n_kv
        T, hd, hdv = q.ne[2], q.ne[0], v.ne[0]
        kc, vc = kv.k[seg.seq][il], kv.v[seg.seq][il]
        assert kc is not None and vc is not None
        ek, ev = kv.n_embd_k, kv.n_embd_v
        k_idxs = self.inp[seq_input("k_idxs", i)]
        # the rows of K and V as llama.cpp's cpy_k/cpy_v give them to set_rows: views (a rope followed by a view and
        # a set_rows is the pattern GGML's Vulkan backend fuses), or two reshapes for the transposed V
        g.expand(c.set_rows(kc, c.view(k, (T, ek), (k.nb[2],)), k_idxs))
        if kv.v_trans:
            flat = c.reshape(c.reshape(v, (T, ev)), (T * ev, 1))
            g.expand(c.set_rows(c.reshape(vc, (kv.n_ctx * ev, 1)), flat, self.inp[seq_input("v_idxs", i)]))
        else:
            g.expand(c.set_rows(vc, c.view(v, (T, ev), (v.nb[2],)), k_idxs))
        keys = c.view(kc, (n_kv, hp.n_head_kv, hd), (kc.nb[1], kc.dtype.row_size(hd)))
        qp = c.permute(q, (1, 0, 2))                                  # [H, T, hd]
        kp = c.permute(keys, (1, 0, 2))                               # [Hkv, n_kv, hd]
        mask = self._mask(il, i)
        if self.flash:
            vp = c.permute(c.view(vc, (n_kv, hp.n_head_kv, hdv), (vc.nb[1], vc.dtype.row_size(hdv))), (1, 0, 2))
            out = self._flash(qp, kp, vp, mask, sinks)                 # [T, H, hdv]
            return c.reshape(out, (T, hp.n_head * hdv))
        kq = c.soft_max(c.mul_mat_f32(kp, qp), mask, hp.kq_scale, sinks=sinks)  # [H, T, n_kv]
        el = vc.dtype.type_size
        # the transposed cache: [hdv, Hkv, n_kv] with cells contiguous
        vt = c.view(vc, (hdv, hp.n_head_kv, n_kv), (kv.n_ctx * el, kv.n_ctx * hdv * el))
        kqv = c.mul_mat(c.permute(vt, (1, 0, 2)), kq)             # [H, T, hdv]
        return c.reshape(c.cont(c.permute(kqv, (1, 0, 2))), (T, hp.n_head * hdv))

    def attend_latent(self, il: int, q: Tensor, k: Tensor, v_mla: Tensor) -> Tensor:
        """Multi-head latent attention (absorbed): store k [T, 1, R + r] in the layer's K-only cache, attend q
        [T, H, R + r] with the first R values of each cached row as the value, decompress through v_mla
        [H, dv, R]; returns [T, H * dv]. ``build_attn`` with ``llm_graph_input_attn_k`` and ``v_mla``."""
        self.mark("attn", il)
        out = self.per_sequence((q, k), lambda i, seg, q, k: self._attend_latent_one(il, i, seg, q, k, v_mla))
        self.mark("layer", il)
        return out

    def _attend_latent_one(self, il: int, i: int, seg: SeqRows, q: Tensor, k: Tensor, v_mla: Tensor) -> Tensor:
        c, g, kv, hp, n_kv = self.c, self.g, self.kv, self.hp, seg.n_kv
        T, dk, R = q.ne[2], q.ne[0], v_mla.ne[0]
        kc = kv.k[seg.seq][il]
        assert kc is not None
        g.expand(c.set_rows(kc, c.view(k, (T, dk), (k.nb[2],)), self.inp[seq_input("k_idxs", i)]))
        row = kc.dtype.row_size(dk)
        keys = c.view(kc, (n_kv, 1, dk), (kc.nb[1], row))
        vals = c.view(kc, (n_kv, 1, R), (kc.nb[1], row))             # the same rows: their latent part
        qp, kp, vp = (c.permute(t, (1, 0, 2)) for t in (q, keys, vals))
        mask = self._mask(il, i)
        if self.flash:
            out = self._flash(qp, kp, vp, mask, None)                   # [T, H, R]
            out = c.mul_mat(v_mla, c.permute(out, (1, 0, 2)))          # [H, T, dv]
        else:
            kq = c.soft_max(c.mul_mat_f32(kp, qp), mask, hp.kq_scale)  # [H, T, n_kv]
            vt = c.cont(c.transpose(vp))                               # [1, R, n_kv], copied out of the cache
            out = c.mul_mat(v_mla, c.mul_mat(vt, kq))                  # [H, T, R] -> [H, T, dv]
        return c.reshape(c.cont(c.permute(out, (1, 0, 2))), (T, hp.n_head * v_mla.ne[1]))

    def _flash(self, qp: Tensor, kp: Tensor, vp: Tensor, mask: Tensor, sinks: Tensor | None) -> Tensor:
        """``flash_attn_ext`` as llama.cpp calls it: K and V of an F32 cache are first cast to F16."""
        c = self.c
        if kp.dtype == GGMLType.F32:
            kp = c.cast(kp, GGMLType.F16)
        if vp.dtype == GGMLType.F32:
            vp = c.cast(vp, GGMLType.F16)
        out = c.flash_attn(qp, kp, vp, mask, self.hp.kq_scale, sinks=sinks)
        lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
        return out

    # -- experts --------------------------------------------------------------------

    def moe(self, il: int, x: Tensor) -> Tensor:
        """The routed experts of layer il over the normed x [T, n_embd]; the region is kept for the cache."""
        hp, w, p = self.hp, self.w, f"blk.{il}."
        experts = self.experts[il]
        assert experts is not None, f"layer {il} has no routed experts"
        router = Router(w[p + "ffn_gate_inp.weight"], w.get(p + "ffn_gate_inp.bias"), w.get(p + "exp_probs_b.bias"))
        region = build_moe_ffn(self.c, self.g, x, router, experts, hp.n_used, hp.routing, name=f"blk.{il}.moe")
        self.regions[il] = region
        return region.out

    def shared_expert(self, il: int, x: Tensor) -> Tensor:
        """The shared expert next to the routed ones: plain, or scaled by a sigmoid gate (qwen2moe's computed as
        llama.cpp computes it there, ``silu(x)/x``; qwen3next's and qwen35moe's a plain sigmoid)."""
        c, p = self.c, f"blk.{il}."
        out = self.ffn(x, p + "ffn_*_shexp")
        if not self.hp.shared_gate:
            return out
        gate_in = c.mul_mat(self.w[p + "ffn_gate_inp_shexp.weight"], x)  # [T, 1]
        if self.hp.shared_gate == "sigmoid":
            return c.mul(out, c.sigmoid(gate_in))
        return c.mul(out, c.div(c.silu(gate_in), gate_in))


def standard_attention(b: Builder, il: int, x: Tensor) -> Tensor:
    """Self-attention of the families with q/k/v projections (``build_qkv``), output projection included."""
    c, hp, p = b.c, b.hp, f"blk.{il}."
    T = x.ne[1]
    q, k, v = (b.linear(p + f"attn_{n}", x, n in hp.attn_biases) for n in "qkv")
    if hp.qk_norm == "full":  # olmoe: one RMS over all heads of a token, before the reshape
        q, k = b.norm(q, p + "attn_q_norm.weight"), b.norm(k, p + "attn_k_norm.weight")
    q = c.reshape(q, (T, hp.n_head, hp.head_dim))
    k = c.reshape(k, (T, hp.n_head_kv, hp.head_dim))
    v = c.reshape(v, (T, hp.n_head_kv, hp.head_dim_v))
    if hp.qk_norm == "head":
        q, k = b.norm(q, p + "attn_q_norm.weight"), b.norm(k, p + "attn_k_norm.weight")
    q, k = b.rope(q, il), b.rope(k, il)
    out = b.attend(il, q, k, v, b.w[p + "attn_sinks.weight"] if hp.sinks else None)
    return output_projection(b, il, out)


def output_projection(b: Builder, il: int, x: Tensor) -> Tensor:
    out = b.linear(f"blk.{il}.attn_output", x)
    if b.hp.f32_acc:
        lib.ggml_prec_set_acc(out.ptr, lib.GGML_PREC_F32)
    if "o" in b.hp.attn_biases:
        out = b.c.add(out, b.w[f"blk.{il}.attn_output.bias"])
    return out


Attention = Callable[[Builder, int, Tensor], Tensor]


def decoder_layer(b: Builder, il: int, x: Tensor, attention: Attention = standard_attention) -> Tensor:
    """One pre-norm layer: x + attention(norm x), then + FFN(norm) (dense, or routed plus shared experts)."""
    c, hp, p = b.c, b.hp, f"blk.{il}."
    cur = attention(b, il, b.norm(x, p + "attn_norm.weight"))
    cur, x = b.rows(il, cur, x)
    ffn_inp = c.add(cur, x)
    cur = b.norm(ffn_inp, p + hp.ffn_norm + ".weight")
    if il < hp.n_dense_lead:
        out = b.ffn(cur, p + "ffn_*")
    else:
        out = b.moe(il, cur)
        if hp.n_ff_shexp:
            out = c.add(out, b.shared_expert(il, cur))  # routed first, then shared, as llama.cpp adds them
    return c.add(out, ffn_inp)


__all__ = ["Attention", "Builder", "decoder_layer", "output_projection", "standard_attention"]
