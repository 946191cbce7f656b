"""The KV cache laid out as llama.cpp lays it out, with one slot per sequence.

Per layer, K is ``[n_ctx, n_embd_k]`` (one row per cell). V is ``[n_ctx, n_embd_v]``
without flash attention but read transposed (``[n_embd_v, n_ctx]``: each head
element's values for all cells are contiguous, which is what the ``kqv`` product
wants), and written element by element through ``set_rows``; with flash
attention V is stored like K. A cache without V (``n_embd_v = 0``: multi-head
latent attention) reads its values from the K rows. Cell ``c`` holds position
``c``: one sequence, no shifting. Graphs view only the first ``n_kv`` cells,
``n_kv`` padded to 256 like llama.cpp so that a decode graph is reused for 256
tokens.

Sliding-window layers (``n_swa``) use the same layout with their own mask (a
query at position p sees positions p - n_swa < p' <= p): llama-cpp-python's
default (``swa_full``) keeps their caches full-size, which is what makes cell =
position hold for them too. With a quantized K (or V) cache and head sizes that
are multiples of 64, llama.cpp rotates queries, keys and values by a
Walsh-Hadamard matrix before they meet the cache (``rotation_sizes``); the
matrices are inputs of each graph.

Only the layers given (``layers``, default every layer) have a cache: a recurrent model's
delta-net layers keep a recurrent state instead (:mod:`ggml_hybrid.model.recurrent_state`).

A cache of ``n_seq`` sequences (``n_parallel``) holds one slot per sequence: its own K and V
tensors of ``n_ctx`` cells in a buffer of its own, laid out exactly as a one-sequence cache, so
cell = position holds in every slot, a slot is cleared on its own, and the cache is ``n_seq``
times the bytes of one sequence's (what ``plan --parallel`` counts). A sequence's attention reads
only its slot, through the same views a one-sequence graph uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .._native import lib
from ..errors import ContextFullError
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.dtypes import as_ggml_type
from ..ggml.tensor import Tensor

KV_PAD = 256


class SeqRows(NamedTuple):
    """The tokens of one sequence in an ubatch: its KV slot, how many, and the cells its attention sees.

    A named tuple: graph keys are made of these every ubatch, and a tuple hashes and compares in C."""

    seq: int
    n_tokens: int
    n_kv: int


def seq_input(name: str, i: int) -> str:
    """The name of the ``i``-th sequence's own input ``name`` (``k_idxs``, ``mask``, ``mask_swa``, ``v_idxs``)."""
    return f"{name}.{i}"


def rotation_sizes(type_k, type_v, head_k: int, head_v: int) -> tuple[int, int]:
    """Sizes of llama.cpp's Hadamard rotations of K and V (0: none), ``llama_kv_cache``'s rule.

    K: a quantized K cache with a head size that is a multiple of 64 is rotated in runs of the
    largest power of two (>= 64) that divides the head size; V likewise, in runs of 64.
    """
    rot_k = rot_v = 0
    if as_ggml_type(type_k).is_quantized and head_k > 0 and head_k % 64 == 0:
        rot_k = 64
        while head_k % (rot_k * 2) == 0:
            rot_k *= 2
    if as_ggml_type(type_v).is_quantized and head_v > 0 and head_v % 64 == 0:
        rot_v = 64
    return rot_k, rot_v


def hadamard(n: int) -> np.ndarray:
    """llama.cpp's ``ggml_gen_hadamard``: the orthonormal Sylvester matrix, entries +-1/sqrtf(n) (F32)."""
    h = np.full((1, 1), 1.0 / float(np.sqrt(np.float32(n))), np.float32)  # C: 1.0 / sqrtf(n), a double
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h.astype(np.float32)


class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_embd_k: int, n_embd_v: int, type_k: str, type_v: str, backends,
                 v_trans: bool, clear: bool = True, *, rot: tuple[int, int] = (0, 0), n_swa: int = 0,
                 layers: Sequence[int] | None = None, n_seq: int = 1):
        """``backends``: one Backend for every layer, or a list giving each layer's; ``layers``: the layers
        that have a cache (default: all).

        ``rot``: the Hadamard rotation sizes (:func:`rotation_sizes`); ``n_swa``: the sliding window of
        the layers that have one (0: none); ``n_seq``: sequence slots. ``clear=False`` (planning: nothing
        is ever computed) only reserves the memory.
        """
        self.n_layer, self.n_ctx, self.v_trans = n_layer, n_ctx, v_trans
        self.n_embd_k, self.n_embd_v = n_embd_k, n_embd_v
        self.type_k, self.type_v = as_ggml_type(type_k), as_ggml_type(type_v)
        self.rot_k, self.rot_v = rot
        self.n_swa = n_swa
        self.n_seq = n_seq
        per_layer = list(backends) if isinstance(backends, (list, tuple)) else [backends] * n_layer
        self.layers = list(range(n_layer)) if layers is None else sorted(layers)
        # per slot: one context and buffer per backend, as a one-sequence cache has them
        self.parts: list[tuple[Backend, Context, Buffer, int]] = []
        self.k: list[list[Tensor | None]] = []    # [seq][layer]; None: no cache (delta-net layer)
        self.v: list[list[Tensor | None]] = []    # [seq][layer]; None: no V (latent attention) or no cache
        for seq in range(n_seq):
            suffix = f"_s{seq}" if n_seq > 1 else ""
            k: dict[int, Tensor] = {}
            v: dict[int, Tensor] = {}
            for b in {id(per_layer[i]): per_layer[i] for i in self.layers}.values():
                on_b = [i for i in self.layers if per_layer[i] is b]
                ctx = Context(n_tensors=2 * len(on_b))
                for i in on_b:
                    k[i] = ctx.new_tensor(self.type_k, (n_ctx, n_embd_k), f"cache_k_l{i}{suffix}")
                    if n_embd_v:
                        v[i] = ctx.new_tensor(self.type_v, (n_ctx, n_embd_v), f"cache_v_l{i}{suffix}")
                buf = ctx.allocate(b, "any", virtual=not clear)
                if clear:
                    buf.clear(0)  # masked cells are multiplied by 0: they must not hold NaN
                self.parts.append((b, ctx, buf, seq))
            self.k.append([k.get(i) for i in range(n_layer)])
            self.v.append([v.get(i) for i in range(n_layer)])
        self.used = [0] * n_seq  # cells (= positions) held per slot

    @property
    def n_past(self) -> int:
        """Positions held by slot 0 (the one sequence of a one-sequence cache)."""
        return self.used[0]

    @n_past.setter
    def n_past(self, value: int) -> None:
        self.used[0] = value

    @staticmethod
    def layer_bytes(n_ctx: int, n_embd_k: int, type_k: str, type_v: str, n_embd_v: int | None = None) -> int:
        """Bytes of one layer's K and V (without buffer alignment padding); V as wide as K unless given."""
        n_embd_v = n_embd_k if n_embd_v is None else n_embd_v
        return n_ctx * (as_ggml_type(type_k).row_size(n_embd_k) +
                        (as_ggml_type(type_v).row_size(n_embd_v) if n_embd_v else 0))

    def nbytes(self, backend: Backend | None = None) -> int:
        return sum(buf.size for b, _, buf, _ in self.parts if backend is None or b is backend)

    def n_kv_for(self, n_tokens: int, seq: int = 0, offset: int = 0) -> int:
        """Cells a graph over the next ``n_tokens`` tokens of sequence ``seq`` must see (``offset``: tokens that come
        before them in the same step, a verify step's)."""
        end = self.used[seq] + offset + n_tokens
        if end > self.n_ctx:
            raise ContextFullError(f"{end} tokens do not fit the context of {self.n_ctx} cells "
                                   f"(n_ctx={self.n_ctx}; {self.used[seq]} already used)")
        return min(self.n_ctx, -(-end // KV_PAD) * KV_PAD)

    def inputs(self, n_tokens: int, n_kv: int, mask_dtype, seq: int = 0, offset: int = 0) -> dict[str, np.ndarray]:
        """Positions, write indices, the causal masks and rotations for the next ``n_tokens`` tokens of ``seq``
        (``offset`` of them past its position)."""
        start = self.used[seq] + offset
        pos = np.arange(start, start + n_tokens, dtype=np.int32)
        cells = np.arange(n_kv)[None, :]
        seen = cells <= pos[:, None]
        mask = np.where(seen, 0.0, -np.inf).astype(mask_dtype)
        out: dict[str, np.ndarray] = {"pos": pos, "k_idxs": pos.astype(np.int64), "mask": mask}
        if self.n_swa:
            out["mask_swa"] = np.where(seen & (cells > pos[:, None] - self.n_swa), 0.0, -np.inf).astype(mask_dtype)
        if self.v_trans and self.n_embd_v:
            # element (t, d) of V goes to cell pos[t] of row d of the transposed cache
            d = np.arange(self.n_embd_v, dtype=np.int64)
            out["v_idxs"] = (d[None, :] * self.n_ctx + pos[:, None]).reshape(-1)
        if self.rot_k:
            out["k_rot"] = hadamard(self.rot_k)
        if self.rot_v:
            out["v_rot"] = hadamard(self.rot_v)
        return out

    def clear(self, seq: int | None = None) -> None:
        """Empty one slot (``seq``) or all of them: zeroed cells, position 0."""
        for _, _, buf, s in self.parts:
            if seq is None or s == seq:
                buf.clear(0)
        for s in range(self.n_seq):
            if seq is None or s == seq:
                self.used[s] = 0

    def move(self, src: int, dst: int) -> None:
        """Sequence ``src`` into the empty slot ``dst``: every cell copied byte for byte (so the sequence
        computes exactly as it did in ``src``), then ``src`` cleared."""
        for layer in self.layers:
            k_src, k_dst = self.k[src][layer], self.k[dst][layer]
            assert k_src is not None and k_dst is not None
            lib.ggml_backend_tensor_copy(k_src.ptr, k_dst.ptr)
            v_src, v_dst = self.v[src][layer], self.v[dst][layer]
            if v_src is not None and v_dst is not None:
                lib.ggml_backend_tensor_copy(v_src.ptr, v_dst.ptr)
        self.used[dst] = self.used[src]
        self.clear(src)

    def close(self) -> None:
        for _, ctx, _, _ in self.parts:
            ctx.close()


__all__ = ["ContextFullError", "KVCache", "KV_PAD", "SeqRows", "hadamard", "rotation_sizes", "seq_input"]
