"""The recurrent states of a recurrent model's delta-net layers, one per sequence slot.

llama.cpp keeps, per delta-net layer and sequence, the last ``d_conv - 1`` inputs of the
short convolution (``cache_r``, laid out ``[channel][time]``) and the delta rule's
matrices (``cache_s``, one transposed ``d_state x d_state`` matrix per value head), both
F32; a graph reads its sequences' rows with ``get_rows`` and writes the new states back
after the layer. So does this memory, with two differences that change no number:

- Each slot has two rows per layer, and an eval writes the one its sequence does not
  currently read from; only when the whole eval succeeded does the slot switch to it
  (:meth:`commit`). A failed eval therefore leaves the sequence exactly as it was, as the
  KV cache does (its cells past ``n_past`` are simply overwritten later). The price is twice
  llama.cpp's state memory, plus one row.
- With ``depth`` rows per slot (speculative decoding: ``draft_max + 2``), a verify step of k + 1 tokens
  writes the state after each of them to its own row (:meth:`chain`, each token reading the row the one
  before wrote), and keeps the row after the last accepted token (:meth:`commit_row`): rejected drafts are
  rolled back by not keeping their rows, where llama.cpp saves a checkpoint and evaluates the accepted
  tokens again.
- That one extra row per layer is never written and holds zeros: a fresh or cleared
  sequence reads it (llama.cpp zeroes the row of a new sequence inside the graph; the values
  read are the same zeros). Clearing a slot writes nothing.

Rows are graph inputs (``rs_read``, ``rs_write``), so one graph serves every slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._native import ffi, lib
from ..checks import check_int
from ..errors import ArgumentError
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.tensor import Tensor


class RecurrentState:
    def __init__(self, n_layer: int, layers: Sequence[int], conv_state: int, ssm_state: int, backends,
                 n_seq: int = 1, clear: bool = True, depth: int = 2) -> None:
        """``layers``: the delta-net layers; ``conv_state`` / ``ssm_state``: floats per sequence and layer;
        ``backends``: one Backend, or one per layer (the layer's KV device); ``n_seq``: sequence slots;
        ``depth``: rows per slot (2; more for verify steps of ``depth - 1`` tokens). ``clear=False`` (planning:
        nothing is ever computed) only reserves the memory."""
        self.n_seq = check_int(n_seq, "RecurrentState: n_seq", 1)
        self.depth = check_int(depth, "RecurrentState: depth", 2)
        self.layers = sorted(layers)
        self.conv_state, self.ssm_state = conv_state, ssm_state
        self.n_rows = self.depth * self.n_seq + 1
        self.zero_row = self.depth * self.n_seq
        per_layer = list(backends) if isinstance(backends, (list, tuple)) else [backends] * n_layer
        conv: dict[int, Tensor] = {}
        ssm: dict[int, Tensor] = {}
        self.parts: list[tuple[Backend, Context, Buffer]] = []
        for b in {id(per_layer[i]): per_layer[i] for i in self.layers}.values():
            on_b = [i for i in self.layers if per_layer[i] is b]
            ctx = Context(n_tensors=2 * len(on_b))
            for i in on_b:
                conv[i] = ctx.new_tensor("f32", (self.n_rows, conv_state), f"cache_r_l{i}")
                ssm[i] = ctx.new_tensor("f32", (self.n_rows, ssm_state), f"cache_s_l{i}")
            buf = ctx.allocate(b, "any", virtual=not clear)
            if clear:
                buf.clear(0)
            self.parts.append((b, ctx, buf))
        self.conv: list[Tensor | None] = [conv.get(i) for i in range(n_layer)]
        self.ssm: list[Tensor | None] = [ssm.get(i) for i in range(n_layer)]
        self._src = [self.zero_row] * self.n_seq   # the row holding each slot's state
        self._work: list[int | None] = [None] * self.n_seq  # the row an eval in progress writes
        self._started = [False] * self.n_seq        # whether that eval has written its row yet

    def _slot(self, seq: int) -> int:
        return check_int(seq, "RecurrentState: seq", 0, self.n_seq - 1)

    def _free_rows(self, seq: int) -> list[int]:
        """Slot ``seq``'s rows other than the one holding its state, in order."""
        first = self.depth * seq
        return [r for r in range(first, first + self.depth) if r != self._src[seq]]

    def begin(self, seq: int = 0) -> None:
        """Start an eval of slot ``seq``: its ubatches will write a row of the slot other than its state's."""
        seq = self._slot(seq)
        self._work[seq] = self._free_rows(seq)[0]
        self._started[seq] = False

    def chain(self, seq: int, n: int) -> list[tuple[int, int]]:
        """(read, write) rows of ``n`` tokens of slot ``seq`` computed one after the other, each written to a row
        of its own (a verify step): the first reads the slot's state, each next one the row before it wrote.
        The slot's state stays as it was until :meth:`commit_row`. No eval of the slot may be in progress."""
        seq = self._slot(seq)
        check_int(n, "RecurrentState.chain: n", 1, self.depth - 1)
        if self._work[seq] is not None:
            raise ArgumentError(f"RecurrentState.chain: slot {seq} has an eval in progress")
        rows = self._free_rows(seq)[:n]
        return list(zip([self._src[seq], *rows[:-1]], rows))

    def commit_row(self, seq: int, row: int | None) -> None:
        """Slot ``seq``'s state is now ``row`` (one :meth:`chain` gave; ``None``: it stays as it was)."""
        seq = self._slot(seq)
        if row is not None:
            first = self.depth * seq
            if not first <= row < first + self.depth:
                raise ArgumentError(f"RecurrentState.commit_row: row {row} is not one of slot {seq}'s")
            self._src[seq] = row

    def rows(self, seq: int = 0) -> tuple[int, int]:
        """(read, write) rows of slot ``seq``'s next ubatch: the first reads the committed state, the next ones
        what the previous ubatch wrote."""
        seq = self._slot(seq)
        work = self._work[seq]
        if work is None:
            raise ArgumentError(f"RecurrentState.rows: slot {seq} has no eval in progress (call begin first)")
        return (work if self._started[seq] else self._src[seq]), work

    def inputs(self, seq: int = 0) -> dict[str, np.ndarray]:
        """The graph inputs of slot ``seq``'s next ubatch."""
        read, write = self.rows(seq)
        return {"rs_read": np.array([read], np.int32), "rs_write": np.array([write], np.int32)}

    def advance(self, seq: int = 0) -> None:
        """An ubatch of slot ``seq`` has been computed: its state is in the working row now."""
        self._started[self._slot(seq)] = True

    def commit(self, seq: int = 0) -> None:
        """The eval succeeded: the slot's state is what it wrote (nothing changes if it wrote nothing)."""
        seq = self._slot(seq)
        work = self._work[seq]
        if self._started[seq] and work is not None:
            self._src[seq] = work
        self._work[seq], self._started[seq] = None, False

    def abandon(self, seq: int = 0) -> None:
        """The eval failed: the slot keeps the state it had before it."""
        seq = self._slot(seq)
        self._work[seq], self._started[seq] = None, False

    def clear(self, seq: int = 0) -> None:
        """Slot ``seq`` starts a new sequence: its next eval reads zeros."""
        seq = self._slot(seq)
        self._src[seq] = self.zero_row
        self._work[seq], self._started[seq] = None, False

    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s committed state into slot ``dst`` (its rows copied byte for byte, so the sequence
        goes on from ``dst`` exactly as from ``src``), then ``src`` cleared. No eval of either may be in
        progress."""
        src, dst = self._slot(src), self._slot(dst)
        if self._work[src] is not None or self._work[dst] is not None:
            raise ArgumentError(f"RecurrentState.move: slot {src} or {dst} has an eval in progress")
        row = self._src[src]
        if row == self.zero_row:
            self._src[dst] = self.zero_row
        else:
            to = self.depth * dst
            for t in (*self.conv, *self.ssm):
                if t is not None:
                    size = t.nb[1]
                    buf = ffi.new("char[]", size)
                    lib.ggml_backend_tensor_get(t.ptr, buf, row * size, size)
                    lib.ggml_backend_tensor_set(t.ptr, buf, to * size, size)
            self._src[dst] = to
        self.clear(src)

    def state(self, seq: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Slot ``seq``'s committed state per delta-net layer: (conv [channels, d_conv - 1] flat, ssm) copies."""
        row = self._src[self._slot(seq)]
        out = {}
        for i in self.layers:
            conv, ssm = self.conv[i], self.ssm[i]
            assert conv is not None and ssm is not None
            out[i] = (conv.numpy()[row].copy(), ssm.numpy()[row].copy())
        return out

    def save(self, seq: int = 0) -> list[bytes]:
        """Slot ``seq``'s committed state, every delta-net layer's conv then ssm row, as bytes (a checkpoint that
        :meth:`load` puts back). No eval of the slot may be in progress."""
        seq = self._slot(seq)
        if self._work[seq] is not None:
            raise ArgumentError(f"RecurrentState.save: slot {seq} has an eval in progress")
        row = self._src[seq]
        out = []
        for t in self._tensors():
            size = t.nb[1]
            buf = ffi.new("char[]", size)
            lib.ggml_backend_tensor_get(t.ptr, buf, row * size, size)
            out.append(bytes(ffi.buffer(buf, size)))
        return out

    def load(self, seq: int, rows: list[bytes]) -> None:
        """Put a checkpoint of :meth:`save` back into slot ``seq``: it goes on exactly as the slot it was saved
        from went on at that point. No eval of the slot may be in progress."""
        seq = self._slot(seq)
        if self._work[seq] is not None:
            raise ArgumentError(f"RecurrentState.load: slot {seq} has an eval in progress")
        tensors = self._tensors()
        if len(rows) != len(tensors) or any(len(r) != t.nb[1] for r, t in zip(rows, tensors)):
            raise ArgumentError(f"RecurrentState.load: the checkpoint has {len(rows)} rows; slot {seq} takes "
                                f"{len(tensors)} of this model's sizes")
        to = self.depth * seq
        for r, t in zip(rows, tensors):
            lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(r), to * t.nb[1], t.nb[1])
        self._src[seq] = to

    def _tensors(self) -> list[Tensor]:
        return [t for i in self.layers for t in (self.conv[i], self.ssm[i]) if t is not None]

    @property
    def bytes_per_sequence(self) -> int:
        """One sequence's state, as llama.cpp counts it (F32, every delta-net layer)."""
        return 4 * len(self.layers) * (self.conv_state + self.ssm_state)

    def nbytes(self, backend: Backend | None = None) -> int:
        return sum(buf.size for b, _, buf in self.parts if backend is None or b is backend)

    def close(self) -> None:
        for _, ctx, _ in self.parts:
            ctx.close()


__all__ = ["RecurrentState"]
