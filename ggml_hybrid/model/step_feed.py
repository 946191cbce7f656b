"""The inputs of a decode step, written in place: one token for each sequence of the step.

A decode step of a one-thread CPU run takes a few milliseconds, and the general path that builds an
ubatch's inputs (``KVCache.inputs``: fresh masks, index ranges and dictionaries every step, then one
checked ``set`` per tensor) cost about 5% of it, right after a compute has pushed the interpreter's
working set out of the caches: most of ggml-hybrid's decode gap to llama.cpp (docs/benchmarks.md, section
8). A :class:`StepFeed` belongs to one cached decode graph: it holds one array per input of that graph,
rewrites only the values that move from step to step (the token, the position, one mask row, the V
cache's write indices), and hands each array to its tensor with one ``ggml_backend_tensor_set``
(``Tensor.feeder``). The values are those ``KVCache.inputs`` gives for the same step, bit for bit
(tests/test_step_feed.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..ggml.tensor import Tensor
from .kv_cache import KVCache, SeqRows, hadamard, seq_input
from .recurrent_state import RecurrentState
from .rope import Rope


class StepFeed:
    """The inputs of one decode graph (``seq_rows``: one token per sequence, every row an output)."""

    def __init__(self, kv: KVCache, rs: RecurrentState | None, rope: Rope, seq_rows: tuple[SeqRows, ...],
                 inputs: dict[str, Tensor], mask_dtype: type) -> None:
        n = len(seq_rows)
        self.kv, self.rs = kv, rs
        self.sections = bool(rope.sections)  # M-RoPE: four position rows (p, p, p, 0)
        a: dict[str, np.ndarray] = {"tokens": np.zeros(n, np.int32),
                                    "pos": np.zeros(4 * n if self.sections else n, np.int32)}
        if "out_ids" in inputs:
            a["out_ids"] = np.arange(n, dtype=np.int32)
        for name, size in (("k_rot", kv.rot_k), ("v_rot", kv.rot_v)):
            if size:
                a[name] = hadamard(size)
        self._v_cols = np.arange(kv.n_embd_v, dtype=np.int64) * kv.n_ctx if kv.v_trans and kv.n_embd_v else None
        for i, seg in enumerate(seq_rows):
            a[seq_input("k_idxs", i)] = np.zeros(1, np.int64)
            a[seq_input("mask", i)] = np.zeros((1, seg.n_kv), mask_dtype)
            if kv.n_swa:
                a[seq_input("mask_swa", i)] = np.zeros((1, seg.n_kv), mask_dtype)
            if self._v_cols is not None:
                a[seq_input("v_idxs", i)] = np.zeros(kv.n_embd_v, np.int64)
            if rs is not None:
                a[seq_input("rs_read", i)] = np.zeros(1, np.int32)
                a[seq_input("rs_write", i)] = np.zeros(1, np.int32)
        self.arrays = a
        # per sequence of the step: its slot and the rows of its own inputs (None where the model has none)
        self._rows = [(seq, a[seq_input("k_idxs", i)], a[seq_input("mask", i)][0],
                       a[seq_input("mask_swa", i)][0] if kv.n_swa else None, a.get(seq_input("v_idxs", i)),
                       a.get(seq_input("rs_read", i)), a.get(seq_input("rs_write", i)))
                      for i, seq in enumerate(s.seq for s in seq_rows)]
        # a family whose graph takes inputs of its own keeps the general path
        self.complete = set(a) == set(inputs)
        if not self.complete:
            return
        self._feeders = [inputs[k].feeder(v) for k, v in a.items()]

    @classmethod
    def of(cls, kv: KVCache, rs: RecurrentState | None, rope: Rope, seq_rows: tuple[SeqRows, ...], n_out: int,
           inputs: dict[str, Tensor], mask_dtype: type) -> StepFeed | None:
        """The feed of a decode step's graph (one token per sequence, the logits of every row), else None."""
        if n_out != len(seq_rows) or any(s.n_tokens != 1 for s in seq_rows):
            return None
        feed = cls(kv, rs, rope, seq_rows, inputs, mask_dtype)
        return feed if feed.complete else None

    def write(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Fill the arrays for the step that appends ``tokens[i]`` to the i-th sequence, and set every input."""
        kv, n_swa = self.kv, self.kv.n_swa
        self.arrays["tokens"][:] = tokens
        pos = self.arrays["pos"]
        for i, (seq, k_idx, mask, swa, v_idx, rs_read, rs_write) in enumerate(self._rows):
            p = kv.used[seq]
            pos[i] = k_idx[0] = p
            mask[:p + 1] = 0
            mask[p + 1:] = -np.inf
            if swa is not None:
                swa[:] = -np.inf
                swa[max(p - n_swa + 1, 0):p + 1] = 0
            if v_idx is not None and self._v_cols is not None:
                np.add(self._v_cols, p, out=v_idx)
            if self.rs is not None and rs_read is not None and rs_write is not None:
                rs_read[0], rs_write[0] = self.rs.rows(seq)
        if self.sections:
            n = len(self._rows)
            pos[n:3 * n] = np.tile(pos[:n], 2)
        for feed in self._feeders:
            feed()


__all__ = ["StepFeed"]
