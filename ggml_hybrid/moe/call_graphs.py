"""The graphs and host arrays of the Python executor's calls (:mod:`.executor`): one :class:`Bucket` of graphs per
token count, the host arrays they share, and the two raw GGML calls its hot path makes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._native import CData, ffi, lib
from .._native.status import check_status
from ..ggml.backend import Backend
from ..ggml.context import Arena, Context
from ..ggml.tensor import Tensor
from .ffn import ExpertWeights, expert_ffn, weighted_sum

MAX_BUCKETS = 8  # token-count graphs kept per layer
BUCKET_TENSORS, BUCKET_GRAPH = 32, 64


class HostScratch:
    """The host arrays of a layer's calls, sized for the most tokens seen (grown by powers of two)."""

    def __init__(self, n_used: int, n_embd: int) -> None:
        self.n_used, self.n_embd, self.rows = n_used, n_embd, 0
        self.slot_ids = np.empty((0, n_used), np.int32)
        self.merged = np.empty((0, n_used, n_embd), np.float32)

    def views(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        if n_tokens > self.rows:
            self.rows = 1 << (n_tokens - 1).bit_length()
            self.slot_ids = np.empty((self.rows, self.n_used), np.int32)
            self.merged = np.empty((self.rows, self.n_used, self.n_embd), np.float32)
        return self.slot_ids[:n_tokens], self.merged[:n_tokens]


class Bucket:
    """Preallocated graphs for one token count: expert FFN over the slots (or the tier's frames), and the weighted
    sum.

    The hot path uses raw pointers and preallocated host arrays: the graphs are checked once here, and each call
    then costs a handful of C calls. The tensors live in the layer's shared compute buffer, the structs in an arena
    of its graph cache, the host arrays are views of the layer's scratch: a new token count allocates nothing once
    those have grown to the largest count seen.
    """

    def __init__(self, experts: ExpertWeights, device: Backend, n_tokens: int, n_used: int, n_embd: int, glu: str,
                 arena: Arena, host: HostScratch) -> None:
        self.ctx = c = Context(n_tensors=BUCKET_TENSORS, graph_size=BUCKET_GRAPH, arena=arena)
        self.x = c.new_tensor("f32", (n_tokens, 1, n_embd), "x")
        self.ids = c.new_tensor("i32", (n_tokens, n_used), "slot_ids")
        self.down = expert_ffn(c, experts, self.x, self.ids, glu)
        self.g_experts = c.new_graph(32).expand(self.down)
        self.experts_in = c.new_tensor("f32", (n_tokens, n_used, n_embd), "experts")
        self.w = c.new_tensor("f32", (n_tokens, n_used, 1), "weights")
        self.out = weighted_sum(c, self.experts_in, self.w)
        self.g_sum = c.new_graph(32).expand(self.out)
        for g in (self.g_experts, self.g_sum):
            g.check_supported([device], id(device))
        self.slot_ids, self.merged = host.views(n_tokens)
        self.b_slot_ids, self.b_merged = ffi.from_buffer(self.slot_ids), ffi.from_buffer(self.merged)

    def pointers(self) -> None:
        """Raw pointers for the hot path, once the tensors have their memory."""
        self.p_x, self.p_ids, self.p_down, self.p_experts, self.p_w, self.p_out = (
            t.ptr for t in (self.x, self.ids, self.down, self.experts_in, self.w, self.out))
        self.pg_experts, self.pg_sum = self.g_experts.ptr, self.g_sum.ptr

    def close(self) -> None:
        self.ctx.close()


def compute(backend_ptr: CData, graph_ptr: CData) -> None:
    status = lib.ggml_backend_graph_compute(backend_ptr, graph_ptr)
    check_status(status, "expert cache graph")


def read_rows(t: Tensor, n_rows: int, n_cols: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A [rows, cols] tensor that may be a strided view (top-k ids are one), read from any backend."""
    p = t.ptr
    nb1 = p.nb[1]
    raw = np.empty(int(lib.ggml_nbytes(p)), np.uint8)
    lib.ggml_backend_tensor_get(p, ffi.from_buffer(raw), 0, raw.nbytes)
    item = np.dtype(dtype).itemsize
    if nb1 == n_cols * item:
        return raw.view(dtype).reshape(n_rows, n_cols)
    padded = np.empty(n_rows * nb1, np.uint8)
    padded[:raw.nbytes] = raw
    return padded.view(dtype).reshape(n_rows, nb1 // item)[:, :n_cols]


__all__ = ["BUCKET_GRAPH", "BUCKET_TENSORS", "MAX_BUCKETS", "Bucket", "HostScratch", "compute", "read_rows"]
