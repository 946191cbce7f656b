"""The inputs of a decode step, written in place: one token for each sequence of the step.

A decode step of a one-thread CPU run takes a few milliseconds, and the general path that builds an ubatch's
inputs (``KVCache.inputs``: fresh masks, index ranges and dictionaries every step, then one checked ``set``
per tensor) cost about 5% of it, right after a compute has pushed the interpreter's working set out of the
caches: most of ggml-hybrid's decode gap to llama.cpp (docs/benchmarks.md, section 8). A :class:`StepFeed`
belongs to one cached decode graph: it holds one array per input of that graph and rewrites only the values
that move from step to step (the token, the position, the mask cells that come into view or leave a sliding
window, the V cache's write indices); the arrays and the logits are bound to their tensors once (a
:class:`StepIO`), so that ``Scheduler.step`` sets every input, computes and reads the logits in one native
call. The values are those ``KVCache.inputs`` gives for the same step, bit for bit (tests/test_step_feed.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._native import ffi, lib
from ..errors import DTypeError, IndexRangeError
from ..ggml.step_io import StepIO
from ..ggml.tensor import Tensor
from .kv_cache import KVCache, SeqRows, hadamard, seq_input
from .recurrent_state import RecurrentState
from .rope import Rope


class StepFeed:
    """The inputs of one decode graph (``seq_rows``: one token per sequence, every row an output)."""

    def __init__(self, kv: KVCache, rs: RecurrentState | None, rope: Rope, seq_rows: tuple[SeqRows, ...],
                 inputs: dict[str, Tensor], logits: Tensor, mask_dtype: type) -> None:
        n = len(seq_rows)
        self.kv, self.rs = kv, rs
        self.seqs = [s.seq for s in seq_rows]
        sections = bool(rope.sections)  # M-RoPE: four position rows (p, p, p, 0)
        a: dict[str, np.ndarray] = {"tokens": np.zeros(n, np.int32),
                                    "pos": np.zeros(4 * n if sections else n, np.int32)}
        if "out_ids" in inputs:
            a["out_ids"] = np.arange(n, dtype=np.int32)
        for name, size in (("k_rot", kv.rot_k), ("v_rot", kv.rot_v)):
            if size:
                a[name] = hadamard(size)
        v_trans = bool(kv.v_trans and kv.n_embd_v)  # V written column by column: n_embd_v indices per token
        # per row: its K index, masks and V indices (None where the model has none), then its cells
        rows: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None, int]] = []
        self._rs_rows: list[tuple[np.ndarray, np.ndarray]] = []  # the recurrent states' rows (set here, not in C)
        for i, seg in enumerate(seq_rows):
            k_idx = a[seq_input("k_idxs", i)] = np.zeros(1, np.int64)
            mask = a[seq_input("mask", i)] = np.zeros((1, seg.n_kv), mask_dtype)
            swa: np.ndarray | None = np.zeros((1, seg.n_kv), mask_dtype) if kv.n_swa else None
            v_idx = np.zeros(kv.n_embd_v, np.int64) if v_trans else None
            if swa is not None:
                a[seq_input("mask_swa", i)] = swa
            if v_idx is not None:
                a[seq_input("v_idxs", i)] = v_idx
            rows.append((k_idx, mask, swa, v_idx, seg.n_kv))
            if rs is not None:
                self._rs_rows.append((np.zeros(1, np.int32), np.zeros(1, np.int32)))
                a[seq_input("rs_read", i)], a[seq_input("rs_write", i)] = self._rs_rows[-1]
        self.arrays = a
        # a family whose graph takes inputs of its own keeps the general path
        self.complete = set(a) == set(inputs)
        if not self.complete:
            return
        if np.dtype(mask_dtype) not in (np.float32, np.float16):
            raise DTypeError(f"StepFeed: masks are f32 or f16, got {np.dtype(mask_dtype)}")
        # the native writer's view of the arrays; the cdata views keep them alive
        c = self._c = ffi.new("struct hy_feed *")
        c_rows = self._c_rows = ffi.new("struct hy_feed_row[]", n)
        self._views = [ffi.from_buffer("int32_t[]", a["tokens"]), ffi.from_buffer("int32_t[]", a["pos"])]
        c.n_rows, c.sections, c.mask_f16, c.n_swa = n, sections, np.dtype(mask_dtype) == np.float16, kv.n_swa
        c.n_embd_v, c.n_ctx, c.rows, c.tokens, c.pos = kv.n_embd_v, kv.n_ctx, c_rows, *self._views
        for row, (k_idx, mask, swa, v_idx, n_kv) in zip(c_rows, rows):
            views = [ffi.from_buffer("int64_t[]", k_idx), ffi.from_buffer(mask)]
            row.k_idx, row.mask = views
            if swa is not None:
                views.append(ffi.from_buffer(swa))
                row.mask_swa = views[-1]
            if v_idx is not None:
                views.append(ffi.from_buffer("int64_t[]", v_idx))
                row.v_idx = views[-1]
            row.n_kv, row.at = n_kv, -2  # -2: never written, so the first write is whole
            self._views += views
        self._c_tok = ffi.new("int32_t[]", n)
        self._c_pos = ffi.new("int64_t[]", n)
        self.io = StepIO([(inputs[k], v) for k, v in a.items()], logits)

    @classmethod
    def of(cls, kv: KVCache, rs: RecurrentState | None, rope: Rope, seq_rows: tuple[SeqRows, ...], n_out: int,
           inputs: dict[str, Tensor], logits: Tensor, mask_dtype: type) -> StepFeed | None:
        """The feed of a decode step's graph (one token per sequence, the logits of every row), else None."""
        if n_out != len(seq_rows) or any(s.n_tokens != 1 for s in seq_rows):
            return None
        feed = cls(kv, rs, rope, seq_rows, inputs, logits, mask_dtype)
        return feed if feed.complete else None

    def write(self, tokens: Sequence[int] | np.ndarray, offsets: Sequence[int] | None = None,
              rs_rows: Sequence[tuple[int, int]] | None = None) -> None:
        """Fill the arrays for the step that appends ``tokens[i]`` to the i-th sequence (``Scheduler.step``
        with :attr:`io` sets them).

        A verify step gives a sequence several rows: ``offsets[i]`` is row i's position past its sequence's (0
        for every row by default), ``rs_rows[i]`` its recurrent state rows (default: the sequence's eval in
        progress, :meth:`RecurrentState.rows`)."""
        c_tok, c_pos, used = self._c_tok, self._c_pos, self.kv.used
        for i, seq in enumerate(self.seqs):
            c_tok[i] = tokens[i]
            c_pos[i] = used[seq] + (offsets[i] if offsets is not None else 0)
        bad = lib.hy_feed_write(self._c, c_tok, c_pos)
        if bad:
            seq = self.seqs[bad - 1]
            raise IndexRangeError(f"StepFeed.write: sequence {seq} is at position {c_pos[bad - 1]}, outside the "
                                  f"{self._c_rows[bad - 1].n_kv} cells of this step's graph")
        if self.rs is not None:
            for i, (seq, (read, write)) in enumerate(zip(self.seqs, self._rs_rows)):
                read[0], write[0] = rs_rows[i] if rs_rows is not None else self.rs.rows(seq)


__all__ = ["StepFeed"]
