"""The device expert cache as a region executor: one MoE layer's routed experts.

Each layer owns ``n_slots`` expert slots on the device (plus one zeroed scratch
slot) for each expert tensor (gate, up, down or the fused gate_up). A call reads
the routed expert ids, asks the :class:`~ggml_hybrid.expert_cache.SlotCache` for a
plan (hits first, then misses loaded into slots, in rounds when the call needs
more experts than there are slots), and computes each round with ``mul_mat_id``
over the slot tensors with the ids remapped to slots. Rows whose expert is not
in the round point at the scratch slot and are discarded. Every expert therefore
sees exactly the rows, in the same order, as in the resident ``mul_mat_id``,
which is what makes the result bit-identical on the CPU. The weighted sum over
the selected experts is then built with the same ops as the resident graph.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from ._lib import ffi, lib
from .backend import Backend
from .context import Context
from .expert_cache import SlotCache
from .moe import ExpertWeights, expert_ffn, weighted_sum
from .regions import RegionCall
from .store import GGUFStore


@dataclass
class LayerCounters:
    calls: int = 0
    routed: int = 0        # (token, expert) pairs
    distinct: int = 0      # distinct experts, summed over calls
    hits: int = 0
    misses: int = 0        # experts loaded into slots
    bytes_loaded: int = 0
    evictions: int = 0
    rounds: int = 0
    device_ns: int = 0     # time spent in the executor

    def add(self, other: "LayerCounters") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict:
        return asdict(self)


class _Bucket:
    """Preallocated graphs for one token count: expert FFN over the slots, and the weighted sum."""

    def __init__(self, slots: ExpertWeights, device: Backend, n_tokens: int, n_used: int, n_embd: int, glu: str):
        self.ctx = c = Context(n_tensors=32, graph_size=64)
        self.x = c.new_tensor("f32", (n_tokens, 1, n_embd), "x")
        self.ids = c.new_tensor("i32", (n_tokens, n_used), "slot_ids")
        self.down = expert_ffn(c, slots, self.x, self.ids, glu)
        self.g_experts = c.new_graph(32).expand(self.down)
        self.experts_in = c.new_tensor("f32", (n_tokens, n_used, n_embd), "experts")
        self.w = c.new_tensor("f32", (n_tokens, n_used, 1), "weights")
        self.out = weighted_sum(c, self.experts_in, self.w)
        self.g_sum = c.new_graph(32).expand(self.out)
        self.buffer = c.allocate(device, "compute")


class ExpertCacheExecutor:
    """Region executor for one layer: resident hits, misses loaded into device slots."""

    def __init__(self, store: GGUFStore, layer: int, names: dict[str, str], device: Backend, n_slots: int,
                 policy: str, n_used: int, glu: str = "swiglu"):
        self.store, self.layer, self.names, self.device = store, layer, names, device
        self.n_used, self.glu = n_used, glu
        infos = {k: store.info(n) for k, n in names.items()}
        self.n_expert = infos["down"].shape[0]
        self.n_embd = infos["down"].shape[1]
        self.cache = SlotCache(self.n_expert, n_slots, policy)
        self.scratch = n_slots  # the extra, zeroed slot that absorbs rows outside a round
        self.ctx = Context(n_tensors=len(names))
        self.slot_tensors = {k: self.ctx.new_tensor(info.dtype, (n_slots + 1,) + info.shape[1:], f"slots.{k}")
                             for k, info in infos.items()}
        self.buffer = self.ctx.allocate(device, "weights")
        self.buffer.clear(0)
        self.slots = ExpertWeights(**self.slot_tensors)
        self.expert_nbytes = {k: t.nb[2] for k, t in self.slot_tensors.items()}
        self.counters = LayerCounters()
        self._buckets: dict[int, _Bucket] = {}

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the slots, scratch included."""
        return sum(t.nbytes for t in self.slot_tensors.values())

    def _bucket(self, n_tokens: int) -> _Bucket:
        b = self._buckets.get(n_tokens)
        if b is None:
            b = self._buckets[n_tokens] = _Bucket(self.slots, self.device, n_tokens, self.n_used, self.n_embd,
                                                  self.glu)
        return b

    def _load(self, expert: int, slot: int) -> int:
        n = 0
        for kind, t in self.slot_tensors.items():
            data = self.store.expert_bytes(self.names[kind], expert)
            nbytes = self.expert_nbytes[kind]
            lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(data), slot * nbytes, nbytes)
            n += nbytes
        return n

    def __call__(self, call: RegionCall):
        t0 = time.perf_counter_ns()
        x3, ids_t, w_t = call.inputs
        ids = ids_t.numpy()
        n_tokens = ids.shape[0] if ids.ndim == 2 else 1
        ids = ids.reshape(n_tokens, self.n_used)
        experts, rows = np.unique(ids, return_counts=True)
        rounds = self.cache.plan(experts.tolist(), rows.tolist())
        b = self._bucket(n_tokens)
        xv = x3.numpy().reshape(n_tokens, 1, self.n_embd)
        c = self.counters
        merged = None
        for rnd in rounds:
            for expert, slot in rnd.loads:
                c.bytes_loaded += self._load(expert, slot)
            slot_of = np.full(self.n_expert, self.scratch, np.int32)
            for expert, slot in rnd.hits + rnd.loads:
                slot_of[expert] = slot
            b.ids.set(slot_of[ids])
            b.x.set(xv)
            b.g_experts.compute(self.device)
            down = b.down.numpy()
            if len(rounds) == 1:
                merged = down
            else:
                if merged is None:
                    merged = np.empty_like(down)
                mask = slot_of[ids] != self.scratch
                merged[mask] = down[mask]
            c.hits += len(rnd.hits)
            c.misses += len(rnd.loads)
            c.evictions += len(rnd.evicted)
        b.experts_in.set(merged)
        b.w.set(w_t.numpy().reshape(n_tokens, self.n_used, 1))
        b.g_sum.compute(self.device)
        call.write_output(0, b.out.numpy().reshape(call.outputs[0].shape))
        c.calls += 1
        c.routed += ids.size
        c.distinct += len(experts)
        c.rounds += len(rounds)
        c.device_ns += time.perf_counter_ns() - t0

    def close(self) -> None:
        for b in self._buckets.values():
            b.ctx.close()
        self._buckets.clear()
        self.ctx.close()
