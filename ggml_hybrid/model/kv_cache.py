"""A single-sequence KV cache laid out as llama.cpp lays it out.

Per layer, K is ``[n_ctx, n_embd_kv]`` (one row per cell). V is the same
without flash attention but read transposed (``[n_embd_kv, n_ctx]``: each head
element's values for all cells are contiguous, which is what the ``kqv``
product wants), and written element by element through ``set_rows``; with
flash attention V is stored like K. Cell ``c`` holds position ``c``: one
sequence, no shifting. Graphs view only the first ``n_kv`` cells, ``n_kv``
padded to 256 like llama.cpp so that a decode graph is reused for 256 tokens.
"""

from __future__ import annotations

import numpy as np

from ..errors import ContextFullError
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.dtypes import as_ggml_type
from ..ggml.tensor import Tensor

KV_PAD = 256



class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_embd_kv: int, type_k: str, type_v: str, backends,
                 v_trans: bool, clear: bool = True):
        """``backends``: one Backend for every layer, or a list giving each layer's.

        ``clear=False`` (planning: nothing is ever computed) only reserves the memory.
        """
        self.n_layer, self.n_ctx, self.n_embd_kv, self.v_trans = n_layer, n_ctx, n_embd_kv, v_trans
        self.type_k, self.type_v = as_ggml_type(type_k), as_ggml_type(type_v)
        per_layer = list(backends) if isinstance(backends, (list, tuple)) else [backends] * n_layer
        k: dict[int, Tensor] = {}
        v: dict[int, Tensor] = {}
        self.parts: list[tuple[Backend, Context, Buffer]] = []  # one context and buffer per backend
        for b in {id(b): b for b in per_layer}.values():
            layers = [i for i in range(n_layer) if per_layer[i] is b]
            ctx = Context(n_tensors=2 * len(layers))
            for i in layers:
                k[i] = ctx.new_tensor(self.type_k, (n_ctx, n_embd_kv), f"cache_k_l{i}")
                v[i] = ctx.new_tensor(self.type_v, (n_ctx, n_embd_kv), f"cache_v_l{i}")
            buf = ctx.allocate(b, "any", virtual=not clear)
            if clear:
                buf.clear(0)  # masked cells are multiplied by 0: they must not hold NaN
            self.parts.append((b, ctx, buf))
        self.k = [k[i] for i in range(n_layer)]
        self.v = [v[i] for i in range(n_layer)]
        self.n_past = 0

    @staticmethod
    def layer_bytes(n_ctx: int, n_embd_kv: int, type_k: str, type_v: str) -> int:
        """Bytes of one layer's K and V (without buffer alignment padding)."""
        return n_ctx * (as_ggml_type(type_k).row_size(n_embd_kv) + as_ggml_type(type_v).row_size(n_embd_kv))

    def nbytes(self, backend: Backend | None = None) -> int:
        return sum(buf.size for b, _, buf in self.parts if backend is None or b is backend)

    def n_kv_for(self, n_tokens: int) -> int:
        """Cells a graph over the next ``n_tokens`` tokens must see."""
        end = self.n_past + n_tokens
        if end > self.n_ctx:
            raise ContextFullError(f"{end} tokens do not fit the context of {self.n_ctx} cells "
                                   f"(n_ctx={self.n_ctx}; {self.n_past} already used)")
        return min(self.n_ctx, -(-end // KV_PAD) * KV_PAD)

    def inputs(self, n_tokens: int, n_kv: int, mask_dtype) -> dict[str, np.ndarray]:
        """Positions, write indices and the causal mask for the next ``n_tokens`` tokens."""
        pos = np.arange(self.n_past, self.n_past + n_tokens, dtype=np.int32)
        mask = np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(mask_dtype)
        out: dict[str, np.ndarray] = {"pos": pos, "k_idxs": pos.astype(np.int64), "mask": mask}
        if self.v_trans:
            # element (t, d) of V goes to cell pos[t] of row d of the transposed cache
            d = np.arange(self.n_embd_kv, dtype=np.int64)
            out["v_idxs"] = (d[None, :] * self.n_ctx + pos[:, None]).reshape(-1)
        return out

    def clear(self) -> None:
        for _, _, buf in self.parts:
            buf.clear(0)
        self.n_past = 0

    def close(self) -> None:
        for _, ctx, _ in self.parts:
            ctx.close()


__all__ = ["KVCache", "ContextFullError", "KV_PAD"]
