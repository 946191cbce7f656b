"""Routing trace files: the :class:`Trace` type, :class:`TraceWriter` and :func:`read_trace`.

A *routing trace* holds, for every MoE layer call of a run, the layer index and the expert ids
the router picked: an int array ``ids`` of shape ``(T, k)`` for ``T`` tokens routed to
``k = n_used`` distinct experts each.

File format (version 1, all integers little-endian)
----------------------------------------------------
Header, 28 bytes::

    offset size  field
    0      8     magic     b"GGMLHTRC"
    8      2     version   uint16, 1
    10     1     id_bytes  uint8: 1 when n_expert <= 256 (ids stored as uint8), else 2 (uint16)
    11     1     flags     uint8: 0, or 1 (FLAG_PREDICTIONS: every record carries a prediction)
    12     4     n_layer   uint32, 1..65536
    16     4     n_expert  uint32, 1..65536
    20     4     n_used    uint32, 1..n_expert
    24     4     crc32     uint32, zlib.crc32 of bytes 0..23

followed by records, one per layer call, appended as the run goes::

    layer  uint16            0..n_layer-1
    T      uint32            tokens of the call, >= 1
    ids    T * n_used ints   id_bytes each, token-major (row t holds the k experts of token t)

and, in a file whose flags are ``FLAG_PREDICTIONS`` (a run with ``moe_prefetch``), after the ids::

    n_pred uint16            0 (no prediction for this call) .. n_expert
    pred   n_pred ints       id_bytes each: the experts the lookahead predicted for this call, distinct, in
                             the order their misses load in (most-voted first)

A decode step of a 64-expert top-8 model costs 6 + 8 = 14 bytes per layer call. Records carry
no checksum: a complete record is checked against the header (layer and id ranges, distinct ids
per token), and an incomplete *final* record (the process died while writing it) is dropped by
:func:`read_trace` with a :class:`TraceTruncatedWarning`; ``Trace.truncated`` counts it.
:class:`TraceWriter` writes the header at once and each record with a single ``write`` followed
by a flush, so a trace survives the death of the writing process up to its last whole record.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, cast

import numpy as np

from ...checks import check_int
from ...errors import TraceError, TraceTruncatedWarning
from ...files import AtomicFile

__all__ = ["FLAG_PREDICTIONS", "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "Trace", "TraceWriter", "read_trace"]

MAGIC = b"GGMLHTRC"
FORMAT_VERSION = 1

_HEAD = struct.Struct("<8sHBBIII")  # magic, version, id_bytes, flags, n_layer, n_expert, n_used
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 28
_REC = struct.Struct("<HI")  # layer, T
_PRED = struct.Struct("<H")  # n_pred
FLAG_PREDICTIONS = 1
_MAX_LAYERS = 1 << 16
_MAX_EXPERTS = 1 << 16
_MAX_T = (1 << 32) - 1




def _id_bytes(n_expert: int) -> int:
    return 1 if n_expert <= 256 else 2


def _id_dtype(id_bytes: int) -> np.dtype:
    return np.dtype("<u1") if id_bytes == 1 else np.dtype("<u2")


def _int(value: object, what: str) -> int:
    return check_int(value, what, error=TraceError)


def _check_shape(n_layer: object, n_expert: object, n_used: object, where: str) -> tuple[int, int, int]:
    n_layer = _int(n_layer, f"{where}: n_layer")
    n_expert = _int(n_expert, f"{where}: n_expert")
    n_used = _int(n_used, f"{where}: n_used")
    if not 1 <= n_layer <= _MAX_LAYERS:
        raise TraceError(f"{where}: n_layer={n_layer} must be in 1..{_MAX_LAYERS}")
    if not 1 <= n_expert <= _MAX_EXPERTS:
        raise TraceError(f"{where}: n_expert={n_expert} must be in 1..{_MAX_EXPERTS}")
    if not 1 <= n_used <= n_expert:
        raise TraceError(f"{where}: n_used={n_used} must be in 1..n_expert={n_expert}")
    return n_layer, n_expert, n_used


def _check_call(layer: object, ids: object, n_layer: int, n_expert: int, n_used: int,
                where: str) -> tuple[int, np.ndarray]:
    """``(layer, ids as a C-contiguous int32 (T, n_used) array)`` or TraceError naming the value and the rule."""
    layer = _int(layer, f"{where}: layer")
    if not 0 <= layer < n_layer:
        raise TraceError(f"{where}: layer {layer} is out of range [0, {n_layer})")
    if not isinstance(ids, np.ndarray):
        raise TraceError(f"{where}: ids must be a numpy array of shape (T, {n_used}), got {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise TraceError(f"{where}: ids must have an integer dtype (int32 preferred), got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[1] != n_used:
        raise TraceError(f"{where}: ids must have shape (T, n_used={n_used}), got {ids.shape}")
    if not 1 <= ids.shape[0] <= _MAX_T:
        raise TraceError(f"{where}: ids has T={ids.shape[0]} tokens; a call routes 1..{_MAX_T} tokens")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= n_expert:
        bad = lo if lo < 0 else hi
        raise TraceError(f"{where}: expert id {bad} is out of range [0, {n_expert})")
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if n_used > 1:
        s = np.sort(ids, axis=1)
        dup = np.nonzero(s[:, 1:] == s[:, :-1])
        if dup[0].size:
            t = int(dup[0][0])
            raise TraceError(f"{where}: token {t} lists expert {int(s[t, dup[1][0]])} twice in {ids[t].tolist()}; "
                             "the experts of a token are distinct")
    return layer, ids


def _check_prediction(predicted: object, n_expert: int, where: str) -> np.ndarray:
    """A call's prediction as a 1-D int32 array of distinct ids in range (empty: none), or TraceError."""
    if predicted is None:
        return np.empty(0, np.int32)
    p = np.asarray(predicted)
    if p.ndim != 1 or (p.size and p.dtype.kind not in "iu"):
        raise TraceError(f"{where}: a prediction must be a 1-D sequence of expert ids, got {p!r}")
    p = p.astype(np.int32)
    if p.size and (int(p.min()) < 0 or int(p.max()) >= n_expert):
        raise TraceError(f"{where}: predicted expert id {int(p.min()) if p.min() < 0 else int(p.max())} is out "
                         f"of range [0, {n_expert})")
    if len(np.unique(p)) != p.size:
        raise TraceError(f"{where}: the prediction {p.tolist()} lists an expert twice; its experts are distinct")
    return p


# -- traces ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Trace:
    """A routing trace: ``calls`` is a list of ``(layer, ids)`` with ``ids`` an int32 ``(T, n_used)`` array.

    The constructor validates every call (layer range, ids shape, range and distinctness per token)
    and converts ids to int32. ``truncated`` and ``truncated_bytes`` count the incomplete final
    record a reader dropped; ``meta`` holds generator details (not stored on disk).
    """

    n_layer: int
    n_expert: int
    n_used: int
    calls: list[tuple[int, np.ndarray]] = field(default_factory=list)
    truncated: int = 0
    truncated_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    # one per call (an empty array: no prediction for it), or None: the run recorded no predictions
    predictions: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        self.n_layer, self.n_expert, self.n_used = _check_shape(self.n_layer, self.n_expert, self.n_used, "Trace")
        checked = []
        for i, call in enumerate(self.calls):
            try:
                layer, ids = call
            except (TypeError, ValueError):
                raise TraceError(f"Trace: calls[{i}] must be a (layer, ids) pair, got {call!r}") from None
            checked.append(_check_call(layer, ids, self.n_layer, self.n_expert, self.n_used, f"Trace: calls[{i}]"))
        self.calls = checked
        if self.predictions is not None:
            if len(self.predictions) != len(self.calls):
                raise TraceError(f"Trace: {len(self.predictions)} predictions for {len(self.calls)} calls; one each")
            self.predictions = [_check_prediction(p, self.n_expert, f"Trace: predictions[{i}]")
                                for i, p in enumerate(self.predictions)]

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def token_rows(self) -> int:
        """Sum of T over all calls (token-layer passes)."""
        return sum(int(ids.shape[0]) for _, ids in self.calls)

    @property
    def tokens(self) -> float:
        """Tokens of the trace: ``sum(T) / n_layer``."""
        return self.token_rows / self.n_layer

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` in the trace file format."""
        with TraceWriter(path, self.n_layer, self.n_expert, self.n_used,
                         predictions=self.predictions is not None) as w:
            for i, (layer, ids) in enumerate(self.calls):
                w.record(layer, ids, self.predictions[i] if self.predictions is not None else None)

    def __repr__(self) -> str:
        extra = f", truncated={self.truncated}" if self.truncated else ""
        return (f"Trace(n_layer={self.n_layer}, n_expert={self.n_expert}, n_used={self.n_used}, "
                f"calls={len(self.calls)}{extra})")


class TraceWriter:
    """Append routing records to a trace file as the run goes; a context manager.

    ``TraceWriter(path, n_layer, n_expert, n_used)`` writes the header at once to a temporary file
    next to ``path``; :meth:`record` appends one layer call with a single write and a flush, and
    :meth:`close` renames the file over ``path`` (an existing trace is replaced only then; a writer
    that is never closed leaves it untouched).
    """

    def __init__(self, path: str | os.PathLike[str], n_layer: int, n_expert: int, n_used: int,
                 predictions: bool = False) -> None:
        """``predictions``: every record carries the lookahead's prediction for its call (FLAG_PREDICTIONS)."""
        self.n_layer, self.n_expert, self.n_used = _check_shape(n_layer, n_expert, n_used, "TraceWriter")
        self.predictions = bool(predictions)
        self.path = os.fspath(path)
        self.records = 0
        self._dtype = _id_dtype(_id_bytes(self.n_expert))
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, _id_bytes(self.n_expert), FLAG_PREDICTIONS if self.predictions else 0,
                          self.n_layer, self.n_expert, self.n_used)
        self._out = AtomicFile(self.path)
        self._f: BinaryIO | None = cast(BinaryIO, self._out.file)
        try:
            self._f.write(head + _CRC.pack(zlib.crc32(head)))
            self._f.flush()
        except BaseException:
            self._out.discard()
            raise

    @property
    def closed(self) -> bool:
        return self._f is None

    @property
    def partial_path(self) -> str:
        """The temporary file the records go to until :meth:`close` (what a process that dies leaves)."""
        return self._out.tmp

    def record(self, layer: int, ids: np.ndarray, predicted: Any = None) -> None:
        """Append the call of ``layer`` with expert ids ``ids`` (integer array of shape ``(T, n_used)``) and, in a
        writer with ``predictions``, the experts predicted for it (None: no prediction)."""
        if self._f is None:
            raise TraceError(f"TraceWriter({self.path!r}).record: the writer is closed")
        where = f"TraceWriter.record (record {self.records})"
        layer, ids = _check_call(layer, ids, self.n_layer, self.n_expert, self.n_used, where)
        rec = _REC.pack(layer, ids.shape[0]) + ids.astype(self._dtype).tobytes()
        if self.predictions:
            p = _check_prediction(predicted, self.n_expert, where)
            rec += _PRED.pack(p.size) + p.astype(self._dtype).tobytes()
        elif predicted is not None:
            raise TraceError(f"{where}: a prediction for a trace without predictions (TraceWriter(..., "
                             "predictions=True) records them)")
        self._f.write(rec)
        self._f.flush()
        self.records += 1

    def close(self) -> None:
        if self._f is not None:
            self._f = None
            self._out.commit()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._f is None else "open"
        return f"TraceWriter({self.path!r}, records={self.records}, {state})"


def read_trace(path: str | os.PathLike[str], warn: bool = True) -> Trace:
    """Read a trace file. A corrupted header or record raises :class:`TraceError` naming the file and the fault.

    An incomplete final record is dropped; it is counted in ``Trace.truncated`` (and its bytes in
    ``truncated_bytes``) and, when ``warn``, reported with a :class:`TraceTruncatedWarning`.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"trace {path!r}: cannot read: {e.strerror or e}") from None
    where = f"trace {path!r}"
    if len(data) < HEADER_SIZE:
        raise TraceError(f"{where}: corrupted header: the file has {len(data)} bytes, fewer than the "
                         f"{HEADER_SIZE}-byte header")
    magic, version, id_bytes, flags, n_layer, n_expert, n_used = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise TraceError(f"{where}: corrupted header: magic is {magic!r}, expected {MAGIC!r} "
                         "(not a ggml_hybrid routing trace)")
    if version != FORMAT_VERSION:
        raise TraceError(f"{where}: corrupted header: format version {version} is not supported "
                         f"(this reader knows version {FORMAT_VERSION})")
    (crc,) = _CRC.unpack_from(data, _HEAD.size)
    if crc != zlib.crc32(data[:_HEAD.size]):
        raise TraceError(f"{where}: corrupted header: checksum {crc:#010x} does not match the header bytes "
                         f"(crc32 {zlib.crc32(data[:_HEAD.size]):#010x})")
    try:
        n_layer, n_expert, n_used = _check_shape(n_layer, n_expert, n_used, f"{where}: corrupted header")
    except TraceError as e:
        raise TraceError(str(e)) from None
    if id_bytes != _id_bytes(n_expert):
        raise TraceError(f"{where}: corrupted header: id_bytes={id_bytes} but n_expert={n_expert} "
                         f"requires {_id_bytes(n_expert)}")
    if flags not in (0, FLAG_PREDICTIONS):
        raise TraceError(f"{where}: corrupted header: flags={flags}, expected 0 or {FLAG_PREDICTIONS}")
    predictions: list[np.ndarray] | None = [] if flags & FLAG_PREDICTIONS else None

    dtype = _id_dtype(id_bytes)
    calls: list[tuple[int, np.ndarray]] = []
    pos, end = HEADER_SIZE, len(data)
    truncated = truncated_bytes = 0
    while pos < end:
        rec = len(calls)
        if end - pos < _REC.size:
            truncated, truncated_bytes = 1, end - pos
            break
        layer, n_tok = _REC.unpack_from(data, pos)
        if layer >= n_layer:
            raise TraceError(f"{where}: record {rec} at byte {pos}: layer {layer} is out of range [0, {n_layer})")
        if n_tok == 0:
            raise TraceError(f"{where}: record {rec} at byte {pos}: T=0; a call routes at least one token")
        size = n_tok * n_used * id_bytes
        if end - pos - _REC.size < size:
            truncated, truncated_bytes = 1, end - pos
            break
        ids = np.frombuffer(data, dtype=dtype, count=n_tok * n_used, offset=pos + _REC.size)
        ids = ids.reshape(n_tok, n_used).astype(np.int32)
        rec_where = f"{where}: record {rec} at byte {pos}"
        try:
            call = _check_call(layer, ids, n_layer, n_expert, n_used, rec_where)
        except TraceError as e:
            raise TraceError(str(e)) from None
        if predictions is not None:
            at = pos + _REC.size + size
            if end - at < _PRED.size:
                truncated, truncated_bytes = 1, end - pos
                break
            (n_pred,) = _PRED.unpack_from(data, at)
            if end - at - _PRED.size < n_pred * id_bytes:
                truncated, truncated_bytes = 1, end - pos
                break
            pred = np.frombuffer(data, dtype=dtype, count=n_pred, offset=at + _PRED.size)
            try:
                predictions.append(_check_prediction(pred.astype(np.int32), n_expert, rec_where))
            except TraceError as e:
                raise TraceError(str(e)) from None
            size += _PRED.size + n_pred * id_bytes
        calls.append(call)
        pos += _REC.size + size
    if truncated and warn:
        warnings.warn(TraceTruncatedWarning(
            f"{where}: dropped an incomplete final record ({truncated_bytes} bytes at byte {pos}); "
            f"kept {len(calls)} complete records"), stacklevel=2)
    trace = Trace.__new__(Trace)  # records are validated above: skip __post_init__
    trace.n_layer, trace.n_expert, trace.n_used = n_layer, n_expert, n_used
    trace.calls, trace.truncated, trace.truncated_bytes, trace.meta = calls, truncated, truncated_bytes, {}
    trace.predictions = predictions
    return trace
