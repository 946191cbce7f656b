"""MoE routing traces: record them, read them back, synthesize them, and replay them through expert caches.

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
    11     1     flags     uint8, 0 (reserved)
    12     4     n_layer   uint32, 1..65536
    16     4     n_expert  uint32, 1..65536
    20     4     n_used    uint32, 1..n_expert
    24     4     crc32     uint32, zlib.crc32 of bytes 0..23

followed by records, one per layer call, appended as the run goes::

    layer  uint16            0..n_layer-1
    T      uint32            tokens of the call, >= 1
    ids    T * n_used ints   id_bytes each, token-major (row t holds the k experts of token t)

A decode step of a 64-expert top-8 model costs 6 + 8 = 14 bytes per layer call. Records carry
no checksum: a complete record is checked against the header (layer and id ranges, distinct ids
per token), and an incomplete *final* record (the process died while writing it) is dropped by
:func:`read_trace` with a :class:`TraceTruncatedWarning`; ``Trace.truncated`` counts it.
:class:`TraceWriter` writes the header at once and each record with a single ``write`` followed
by a flush, so a trace survives the death of the writing process up to its last whole record.

Replay
------
:func:`replay` runs one cache of ``n_slots`` slots per layer over a trace. A call requests the
distinct experts of its ``ids``, with ``rows`` = the number of tokens routed to each.
``"lru"`` and ``"lfu"`` are :class:`~ggml_hybrid.expert_cache.SlotCache` itself, so the replay
counts exactly what the runtime cache does. ``"belady"`` is the offline optimum (the ceiling)
under the same rules as SlotCache:

* a hit is an expert resident when the call starts; misses are loaded in rounds: round 1 loads at
  most ``n_slots - hits`` misses and never evicts a hit of the call; a later round loads up to
  ``n_slots`` misses and may evict anything but its own loads (experts computed earlier in the call
  included), exactly the SlotCache round structure;
* the victim is the evictable resident whose next use (the next call of the same layer that
  requests it) is farthest in the future; never used again counts as infinitely far. Ties
  (including several never used again) go to the lowest expert id;
* misses are loaded farthest-next-use first (ties by lowest expert id), so the misses used again
  soonest are loaded in the last round and stay resident. This matters only when a call's
  distinct experts exceed ``n_slots``.

With calls whose distinct experts fit in ``n_slots`` (always the case for decode when
``n_used <= n_slots``), this is Belady's rule over "set" requests, which is optimal: no policy
obeying the rules loads fewer experts (the tests check this against an exhaustive search on small
traces), so its hits bound LRU's and LFU's from above. When a call's distinct experts exceed
``n_slots`` it is a heuristic, not a bound: such a call cannot keep all of its experts, and one
of its hits may have to give way to its later loads, which farthest-next-use does not foresee.
For example, with 1 slot and calls {0 (1 row), 1 (2 rows)}, {0, 1}, {1}, LRU and LFU get 2 hits
and this rule 1 (the tests pin this case).

CPU share and modeled time
--------------------------
``share`` (``moe_cpu_share``) sends part of a call's misses to the CPU instead of loading them:
with ``n_miss`` misses, ``n_cpu = floor(share * n_miss + 0.5)``, and the CPU takes the misses
with the fewest rows (the tail of SlotCache's load order: decreasing rows, ties by increasing
expert id, so among equal rows the CPU takes the highest ids). CPU experts are not loaded into the
cache: the cache only sees the device experts (hits + device misses), so hit rate and bytes
moved reflect the share. ``share="auto"`` chooses, per call, the ``n_cpu`` in ``0..n_miss`` with
the smallest modeled layer time (ties: the smallest ``n_cpu``, which keeps more experts on the
device); it needs a :class:`LinkCost`.

The modeled time of a layer call with cost ``c`` (:class:`LinkCost`)::

    cpu    = sum over CPU misses of (c.expert_bytes / c.cpu_bytes_per_s + rows * c.cpu_s_per_row)
    device = device_misses * c.expert_bytes / c.bus_bytes_per_s + device_rows * c.device_s_per_row
    time   = max(cpu, device)

where ``device_rows`` counts the rows of every expert computed on the device (hits and device
misses). The time per token is the sum over calls divided by the number of tokens,
``sum(T) / n_layer`` (every token passes through every layer once).

Auto is greedy: it minimizes each call's time given the cache state. On a fixed sequence of
hits and misses it is never slower than any fixed share (see :func:`modeled_time_per_token` on
a :class:`ReplayResult`), but in a coupled replay a CPU miss is not cached, so a later call may
miss again where share 0 would hit: a coupled auto replay can be slower than a fixed share.

Synthetic traces
----------------
:func:`synthetic_trace` draws traces with controllable skew and temporal reuse; see its docstring.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
import zlib
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Union

import numpy as np

from ..errors import GgmlHybridError
from .slot_cache import SlotCache

__all__ = [
    "FORMAT_VERSION", "MAGIC", "POLICIES", "CallRecord", "LayerStats", "LinkCost", "ReplayResult", "Trace",
    "TraceError", "TraceTruncatedWarning", "TraceWriter", "modeled_time_per_token", "parse_share", "read_trace",
    "replay", "synthetic_trace",
]

MAGIC = b"GGMLHTRC"
FORMAT_VERSION = 1
POLICIES = ("lru", "lfu", "belady")

_HEAD = struct.Struct("<8sHBBIII")  # magic, version, id_bytes, flags, n_layer, n_expert, n_used
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEAD.size + _CRC.size  # 28
_REC = struct.Struct("<HI")  # layer, T
_MAX_LAYERS = 1 << 16
_MAX_EXPERTS = 1 << 16
_MAX_T = (1 << 32) - 1


class TraceError(GgmlHybridError, ValueError):
    """A routing trace, trace record, trace file or replay request that the rules reject."""


class TraceTruncatedWarning(UserWarning):
    """A trace file ends in an incomplete record, which the reader dropped."""


def _id_bytes(n_expert: int) -> int:
    return 1 if n_expert <= 256 else 2


def _id_dtype(id_bytes: int) -> np.dtype:
    return np.dtype("<u1") if id_bytes == 1 else np.dtype("<u2")


def _int(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TraceError(f"{what} must be an int, got {value!r} of type {type(value).__name__}")
    return int(value)


def _check_shape(n_layer, n_expert, n_used, where: str) -> tuple[int, int, int]:
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


def _check_call(layer, ids, n_layer: int, n_expert: int, n_used: int, where: str) -> tuple[int, np.ndarray]:
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
    calls: list = field(default_factory=list)
    truncated: int = 0
    truncated_bytes: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.n_layer, self.n_expert, self.n_used = _check_shape(self.n_layer, self.n_expert, self.n_used, "Trace")
        checked = []
        for i, call in enumerate(self.calls):
            try:
                layer, ids = call
            except (TypeError, ValueError):
                raise TraceError(f"Trace: calls[{i}] must be a (layer, ids) pair, got {call!r}") from None
            checked.append(_check_call(layer, ids, self.n_layer, self.n_expert, self.n_used, f"Trace: calls[{i}]"))
        self.calls = checked

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

    def write(self, path) -> None:
        """Write the trace to ``path`` in the trace file format."""
        with TraceWriter(path, self.n_layer, self.n_expert, self.n_used) as w:
            for layer, ids in self.calls:
                w.record(layer, ids)

    def __repr__(self) -> str:
        extra = f", truncated={self.truncated}" if self.truncated else ""
        return (f"Trace(n_layer={self.n_layer}, n_expert={self.n_expert}, n_used={self.n_used}, "
                f"calls={len(self.calls)}{extra})")


class TraceWriter:
    """Append routing records to a trace file as the run goes; a context manager.

    ``TraceWriter(path, n_layer, n_expert, n_used)`` creates (or overwrites) ``path`` and writes
    the header at once; :meth:`record` appends one layer call with a single write and a flush.
    """

    def __init__(self, path, n_layer: int, n_expert: int, n_used: int):
        self.n_layer, self.n_expert, self.n_used = _check_shape(n_layer, n_expert, n_used, "TraceWriter")
        self.path = os.fspath(path)
        self.records = 0
        self._dtype = _id_dtype(_id_bytes(self.n_expert))
        head = _HEAD.pack(MAGIC, FORMAT_VERSION, _id_bytes(self.n_expert), 0, self.n_layer, self.n_expert, self.n_used)
        self._f = open(self.path, "wb")
        try:
            self._f.write(head + _CRC.pack(zlib.crc32(head)))
            self._f.flush()
        except BaseException:
            self._f.close()
            raise

    @property
    def closed(self) -> bool:
        return self._f is None

    def record(self, layer: int, ids: np.ndarray) -> None:
        """Append the call of ``layer`` with expert ids ``ids`` (integer array of shape ``(T, n_used)``)."""
        if self._f is None:
            raise TraceError(f"TraceWriter({self.path!r}).record: the writer is closed")
        layer, ids = _check_call(layer, ids, self.n_layer, self.n_expert, self.n_used,
                                 f"TraceWriter.record (record {self.records})")
        self._f.write(_REC.pack(layer, ids.shape[0]) + ids.astype(self._dtype).tobytes())
        self._f.flush()
        self.records += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._f is None else "open"
        return f"TraceWriter({self.path!r}, records={self.records}, {state})"


def read_trace(path, warn: bool = True) -> Trace:
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
    if flags != 0:
        raise TraceError(f"{where}: corrupted header: flags={flags}, expected 0")

    dtype = _id_dtype(id_bytes)
    calls = []
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
        try:
            calls.append(_check_call(layer, ids, n_layer, n_expert, n_used, f"{where}: record {rec} at byte {pos}"))
        except TraceError as e:
            raise TraceError(str(e)) from None
        pos += _REC.size + size
    if truncated and warn:
        warnings.warn(TraceTruncatedWarning(
            f"{where}: dropped an incomplete final record ({truncated_bytes} bytes at byte {pos}); "
            f"kept {len(calls)} complete records"), stacklevel=2)
    trace = Trace.__new__(Trace)  # records are validated above: skip __post_init__
    trace.n_layer, trace.n_expert, trace.n_used = n_layer, n_expert, n_used
    trace.calls, trace.truncated, trace.truncated_bytes, trace.meta = calls, truncated, truncated_bytes, {}
    return trace


# -- synthetic traces ------------------------------------------------------------------------------


def _fraction(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TraceError(f"synthetic_trace: {what} must be a number in [0, 1], got {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise TraceError(f"synthetic_trace: {what}={value} must be in [0, 1]")
    return value


def synthetic_trace(n_layer: int, n_expert: int, n_used: int, n_calls: int, tokens_per_call: int = 1,
                    hot_fraction: float = 0.2, hot_traffic: float = 0.8, reuse: float = 0.5, seed: int = 0) -> Trace:
    """A random trace with skewed expert popularity and temporal reuse, deterministic in ``seed``.

    * Calls cycle through the layers in order: call ``c`` is layer ``c % n_layer`` (a decode).
    * Skew: each layer has its own random hot set of ``n_hot = floor(hot_fraction * n_expert + 0.5)``
      experts. A token takes ``h`` hot experts and ``n_used - h`` cold ones, each group uniform
      within itself, where ``h`` is ``n_used * hot_traffic`` rounded stochastically (``floor`` or
      ``ceil``, with the expected value ``n_used * hot_traffic``), clipped to what the groups can
      supply (``max(0, n_used - n_cold) <= h <= min(n_used, n_hot)``). Unless clipped, the hot
      experts take ``hot_traffic`` of the traffic in expectation, whatever ``reuse`` is.
    * Reuse: token ``t`` of a call starts from token ``t`` of the previous call of the same layer
      (think of ``tokens_per_call`` parallel sequences): each of its previous experts is kept with
      probability ``reuse``, the kept ones are cut down at random to the ``h`` hot / ``n_used - h``
      cold wanted, and the rest is drawn from the skewed distribution. ``reuse=0`` draws every call
      afresh; ``reuse=1`` repeats the previous set up to the changes ``h`` forces.
    * Expert ids of a token are distinct. ``trace.meta`` holds the parameters and ``"hot"``: the
      sorted hot set of each layer.
    """
    n_layer, n_expert, n_used = _check_shape(n_layer, n_expert, n_used, "synthetic_trace")
    n_calls = _int(n_calls, "synthetic_trace: n_calls")
    tokens_per_call = _int(tokens_per_call, "synthetic_trace: tokens_per_call")
    seed = _int(seed, "synthetic_trace: seed")
    if n_calls < 0:
        raise TraceError(f"synthetic_trace: n_calls={n_calls} must be >= 0")
    if not 1 <= tokens_per_call <= 1 << 20:
        raise TraceError(f"synthetic_trace: tokens_per_call={tokens_per_call} must be in 1..{1 << 20}")
    hot_fraction = _fraction(hot_fraction, "hot_fraction")
    hot_traffic = _fraction(hot_traffic, "hot_traffic")
    reuse = _fraction(reuse, "reuse")

    rng = np.random.default_rng(seed)
    k = n_used
    n_hot = min(n_expert, int(math.floor(hot_fraction * n_expert + 0.5)))
    n_cold = n_expert - n_hot
    hot_sets = [np.sort(rng.choice(n_expert, n_hot, replace=False)).astype(np.int32) for _ in range(n_layer)]
    is_hot = np.zeros((n_layer, n_expert), dtype=bool)
    pools = []
    for layer, hs in enumerate(hot_sets):
        is_hot[layer, hs] = True
        pools.append((hs, np.flatnonzero(~is_hot[layer]).astype(np.int32)))
    h_lo, h_hi = max(0, k - n_cold), min(k, n_hot)
    target = k * hot_traffic
    base = math.floor(target)
    frac = target - base

    def pick(pool: np.ndarray, kept: np.ndarray, want: int) -> np.ndarray:
        if kept.size > want:
            kept = rng.permutation(kept)[:want]
        need = want - kept.size
        if need == 0:
            return kept
        avail = pool[~np.isin(pool, kept)] if kept.size else pool
        return np.concatenate([kept, rng.choice(avail, need, replace=False)])

    empty = np.zeros(0, dtype=np.int32)
    prev: list = [None] * n_layer
    calls = []
    for c in range(n_calls):
        layer = c % n_layer
        hot_pool, cold_pool = pools[layer]
        ids = np.empty((tokens_per_call, k), dtype=np.int32)
        for t in range(tokens_per_call):
            h = min(h_hi, max(h_lo, base + int(rng.random() < frac)))
            if prev[layer] is None or reuse == 0.0:
                kept_hot = kept_cold = empty
            else:
                kept = prev[layer][t][rng.random(k) < reuse]
                mask = is_hot[layer, kept]
                kept_hot, kept_cold = kept[mask], kept[~mask]
            row = np.concatenate([pick(hot_pool, kept_hot, h), pick(cold_pool, kept_cold, k - h)])
            ids[t] = rng.permutation(row)
        prev[layer] = ids
        calls.append((layer, ids))
    trace = Trace(n_layer, n_expert, n_used, calls)
    trace.meta = dict(generator="synthetic_trace", n_calls=n_calls, tokens_per_call=tokens_per_call,
                      hot_fraction=hot_fraction, hot_traffic=hot_traffic, reuse=reuse, seed=seed, n_hot=n_hot,
                      hot=[hs.tolist() for hs in hot_sets])
    return trace


# -- cost model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkCost:
    """Costs of the modeled time: bytes per second of the host->device bus and of the CPU reading
    expert weights, seconds per (token, expert) row on the device and on the CPU, bytes per expert."""

    bus_bytes_per_s: float
    cpu_bytes_per_s: float
    device_s_per_row: float
    cpu_s_per_row: float
    expert_bytes: int

    def __post_init__(self):
        for name in ("bus_bytes_per_s", "cpu_bytes_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
                raise TraceError(f"LinkCost: {name}={v!r} must be a finite number > 0")
        for name in ("device_s_per_row", "cpu_s_per_row"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise TraceError(f"LinkCost: {name}={v!r} must be a finite number >= 0")
        v = self.expert_bytes
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise TraceError(f"LinkCost: expert_bytes={v!r} must be an int >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


def parse_share(value) -> Union[float, str]:
    """``value`` as a moe_cpu_share: a number in [0, 1] (or its text) or ``"auto"`` (the session option's rule)."""
    from ..options import OptionError, SessionOptions

    v = float(value) if isinstance(value, (np.integer, np.floating)) else value
    try:
        return SessionOptions.from_dict({"moe_cpu_share": v}).moe_cpu_share
    except OptionError:
        raise TraceError(f"share {value!r} must be a number in [0, 1] or 'auto'") from None


def _times(hit_rows: int, miss_rows_asc: tuple, n_cpu: int, cost: LinkCost) -> float:
    """Modeled time of one call whose CPU takes the ``n_cpu`` first (fewest-row) misses."""
    cpu_rows = sum(miss_rows_asc[:n_cpu])
    dev_rows = hit_rows + sum(miss_rows_asc[n_cpu:])
    cpu = n_cpu * (cost.expert_bytes / cost.cpu_bytes_per_s) + cpu_rows * cost.cpu_s_per_row
    dev = ((len(miss_rows_asc) - n_cpu) * (cost.expert_bytes / cost.bus_bytes_per_s)
           + dev_rows * cost.device_s_per_row)
    return max(cpu, dev)


def _split(hit_rows: int, miss_rows_asc: tuple, share, cost: LinkCost | None) -> tuple[int, float | None]:
    """``(n_cpu, modeled time or None)`` for one call under ``share``."""
    n = len(miss_rows_asc)
    if share == "auto":
        best, best_t = 0, _times(hit_rows, miss_rows_asc, 0, cost)
        for n_cpu in range(1, n + 1):
            t = _times(hit_rows, miss_rows_asc, n_cpu, cost)
            if t < best_t:
                best, best_t = n_cpu, t
        return best, best_t
    n_cpu = int(math.floor(share * n + 0.5))
    return n_cpu, (None if cost is None else _times(hit_rows, miss_rows_asc, n_cpu, cost))


# -- replay ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRecord:
    """One replayed call: rows of its hits, rows of its misses (ascending: the CPU takes a prefix),
    how many misses went to the CPU, and its modeled time (None without a cost)."""

    layer: int
    tokens: int
    hit_rows: int
    miss_rows: tuple
    n_cpu: int
    time_s: float | None


class _HitRate:
    """``hits / distinct`` for the replay counters (0.0 when nothing was requested)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.distinct if self.distinct else 0.0


@dataclass(frozen=True)
class LayerStats(_HitRate):
    """Replay counters of one layer. ``misses`` are loads; ``cpu`` counts misses run on the CPU."""

    layer: int
    calls: int
    distinct: int
    hits: int
    misses: int
    cpu: int
    evictions: int
    bytes_moved: int
    time_s: float | None

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class ReplayResult(_HitRate):
    """Totals of a replay. ``distinct == hits + misses + cpu`` (requested experts over all calls);
    ``misses`` are loads over the bus, ``bytes_moved = misses * expert_bytes``, ``hit_rate = hits /
    distinct``. ``modeled_s_per_token`` is None when the replay had no cost."""

    policy: str
    n_slots: int
    share: Any
    expert_bytes: int
    cost: LinkCost | None
    n_layer: int
    token_rows: int
    calls: int
    distinct: int
    hits: int
    misses: int
    cpu: int
    evictions: int
    rounds: int
    bytes_moved: int
    modeled_s_per_token: float | None
    layers: tuple
    call_log: tuple = field(repr=False, default=())

    @property
    def tokens(self) -> float:
        return self.token_rows / self.n_layer

    def to_dict(self, layers: bool = True) -> dict:
        d = {k: getattr(self, k) for k in ("policy", "n_slots", "share", "expert_bytes", "calls", "token_rows",
                                           "distinct", "hits", "misses", "cpu", "evictions", "rounds",
                                           "bytes_moved", "modeled_s_per_token")}
        d["tokens"] = self.tokens
        d["hit_rate"] = self.hit_rate
        d["cost"] = None if self.cost is None else self.cost.to_dict()
        if layers:
            d["layers"] = [s.to_dict() for s in self.layers]
        return d


class _Belady:
    """Offline-optimal residency of one layer (see the module docstring for the rule)."""

    def __init__(self, n_slots: int, requests: list):
        self.n_slots = n_slots
        self.resident: set[int] = set()
        self.uses: dict[int, deque] = {}
        for i, req in enumerate(requests):
            for e in req:
                self.uses.setdefault(e, deque()).append(i)
        self.hits = self.misses = self.evictions = self.rounds = self.distinct = 0

    def _next(self, e: int) -> float:
        q = self.uses.get(e)
        return q[0] if q else math.inf

    def _evict(self, n: int, candidates) -> None:
        order = sorted(candidates, key=lambda e: (-self._next(e), e))
        for e in order[:n]:
            self.resident.discard(e)
        self.evictions += min(n, len(order))

    def plan(self, i: int, requested, device) -> None:
        """Call ``i`` of the layer: ``requested`` = every expert it routes to (advances next uses),
        ``device`` = the experts computed on the device (go through the cache)."""
        for e in requested:
            q = self.uses[e]
            assert q[0] == i
            q.popleft()
        self.distinct += len(device)
        if not device:
            return
        hits = {e for e in device if e in self.resident}
        misses = sorted((e for e in device if e not in self.resident), key=lambda e: (-self._next(e), e))
        self.hits += len(hits)
        self.misses += len(misses)
        cap = self.n_slots - len(hits)
        pos, first = 0, True
        while first or pos < len(misses):
            batch = misses[pos:pos + cap]
            pos += len(batch)
            need = len(self.resident) + len(batch) - self.n_slots
            if need > 0:
                self._evict(need, self.resident - hits if first else self.resident)
            self.resident.update(batch)
            self.rounds += 1
            cap, first = self.n_slots, False


def _check_replay_args(trace, n_slots, policy, share, cost, expert_bytes):
    if not isinstance(trace, Trace):
        raise TraceError(f"replay: trace must be a Trace, got {type(trace).__name__}")
    n_slots = _int(n_slots, "replay: n_slots")
    if not 1 <= n_slots <= trace.n_expert:
        raise TraceError(f"replay: n_slots={n_slots} must be in 1..n_expert={trace.n_expert}")
    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        raise TraceError(f"replay: policy {policy!r} must be one of {POLICIES}")
    share = parse_share(share)
    if cost is not None and not isinstance(cost, LinkCost):
        raise TraceError(f"replay: cost must be a LinkCost or None, got {type(cost).__name__}")
    if share == "auto" and cost is None:
        raise TraceError("replay: share='auto' needs a cost (LinkCost) to choose the CPU misses")
    if expert_bytes is None:
        expert_bytes = cost.expert_bytes if cost is not None else 1
    else:
        expert_bytes = _int(expert_bytes, "replay: expert_bytes")
        if expert_bytes < 1:
            raise TraceError(f"replay: expert_bytes={expert_bytes} must be >= 1")
        if cost is not None and expert_bytes != cost.expert_bytes:
            raise TraceError(f"replay: expert_bytes={expert_bytes} differs from cost.expert_bytes="
                             f"{cost.expert_bytes}; give one of them")
    return n_slots, policy.lower(), share, expert_bytes


def replay(trace: Trace, n_slots: int, policy: str = "lru", share=0.0, cost: LinkCost | None = None,
           expert_bytes: int | None = None) -> ReplayResult:
    """Replay ``trace`` through one ``n_slots``-slot cache per layer under ``policy`` ("lru", "lfu", "belady").

    ``share`` (a number in [0, 1] or "auto") sends that share of each call's misses to the CPU;
    those are not loaded. ``expert_bytes`` (default ``cost.expert_bytes``, else 1) prices a load.
    With a ``cost`` the result carries the modeled time per token. See the module docstring.
    """
    n_slots, policy, share, expert_bytes = _check_replay_args(trace, n_slots, policy, share, cost, expert_bytes)
    L = trace.n_layer
    uniq_calls = []
    for layer, ids in trace.calls:
        experts, rows = np.unique(ids, return_counts=True)
        uniq_calls.append((layer, int(ids.shape[0]), experts.tolist(), rows.tolist()))

    if policy == "belady":
        per_layer: list[list] = [[] for _ in range(L)]
        for layer, _, experts, _ in uniq_calls:
            per_layer[layer].append(experts)
        caches = [_Belady(n_slots, per_layer[layer]) for layer in range(L)]
        local = [0] * L
    else:
        caches = [SlotCache(trace.n_expert, n_slots, policy) for _ in range(L)]

    log = []
    cpu_count = [0] * L
    for layer, n_tok, experts, rows in uniq_calls:
        cache = caches[layer]
        resident = cache.resident if policy == "belady" else cache.resident()
        hits = [(e, r) for e, r in zip(experts, rows) if e in resident]
        # SlotCache's load order: decreasing rows, ties by increasing expert id; the CPU takes the tail
        misses = sorted(((e, r) for e, r in zip(experts, rows) if e not in resident), key=lambda t: (-t[1], t[0]))
        hit_rows = sum(r for _, r in hits)
        miss_rows = tuple(r for _, r in reversed(misses))
        n_cpu, t = _split(hit_rows, miss_rows, share, cost)
        device = hits + misses[:len(misses) - n_cpu]
        if policy == "belady":
            cache.plan(local[layer], experts, [e for e, _ in device])
            local[layer] += 1
        else:
            cache.plan([e for e, _ in device], [r for _, r in device])
        cpu_count[layer] += n_cpu
        log.append(CallRecord(layer, n_tok, hit_rows, miss_rows, n_cpu, t))

    calls_per_layer = [0] * L
    time_per_layer = [0.0] * L
    for rec in log:
        calls_per_layer[rec.layer] += 1
        if rec.time_s is not None:
            time_per_layer[rec.layer] += rec.time_s
    layers = []
    for layer, cache in enumerate(caches):
        if policy == "belady":
            d, h, m, ev, rd = cache.distinct, cache.hits, cache.misses, cache.evictions, cache.rounds
        else:
            c = cache.counters
            d, h, m, ev, rd = c.distinct, c.hits, c.misses, c.evictions, c.rounds
        layers.append((LayerStats(layer, calls_per_layer[layer], d + cpu_count[layer], h, m, cpu_count[layer], ev,
                                  m * expert_bytes, time_per_layer[layer] if cost is not None else None), rd))
    stats = tuple(s for s, _ in layers)
    token_rows = trace.token_rows
    modeled = None
    if cost is not None:
        modeled = _per_token(log, L)
    misses = sum(s.misses for s in stats)
    return ReplayResult(
        policy=policy, n_slots=n_slots, share=share, expert_bytes=expert_bytes, cost=cost, n_layer=L,
        token_rows=token_rows, calls=len(log), distinct=sum(s.distinct for s in stats),
        hits=sum(s.hits for s in stats), misses=misses, cpu=sum(s.cpu for s in stats),
        evictions=sum(s.evictions for s in stats), rounds=sum(rd for _, rd in layers),
        bytes_moved=misses * expert_bytes, modeled_s_per_token=modeled, layers=stats, call_log=tuple(log))


def _per_token(log, n_layer: int) -> float:
    token_rows = sum(rec.tokens for rec in log)
    if not token_rows:
        return 0.0
    return sum(rec.time_s for rec in log) * n_layer / token_rows


def modeled_time_per_token(source, share=None, cost: LinkCost | None = None, *, n_slots: int | None = None,
                           policy: str = "lru") -> float:
    """Modeled seconds per token.

    * ``source`` a :class:`ReplayResult`: the result's hits and misses per call are kept fixed and
      ``share`` (default: the result's own) splits each call's misses, priced with ``cost``
      (default: the result's own). With the result's own share and cost this is exactly
      ``result.modeled_s_per_token``; with ``share="auto"`` it is never above any fixed share.
    * ``source`` a :class:`Trace`: a coupled replay ``replay(trace, n_slots, policy, share, cost)``
      (share default 0), whose cache sees only the device experts; ``n_slots`` and ``cost`` are required.
    """
    if isinstance(source, ReplayResult):
        share = source.share if share is None else parse_share(share)
        cost = source.cost if cost is None else cost
        if not isinstance(cost, LinkCost):
            raise TraceError("modeled_time_per_token: the result has no cost; pass cost=LinkCost(...)")
        log = [CallRecord(r.layer, r.tokens, r.hit_rows, r.miss_rows, 0,
                          _split(r.hit_rows, r.miss_rows, share, cost)[1]) for r in source.call_log]
        return _per_token(log, source.n_layer)
    if isinstance(source, Trace):
        if cost is None or n_slots is None:
            raise TraceError("modeled_time_per_token: a Trace needs n_slots=... and cost=LinkCost(...)")
        return replay(source, n_slots, policy, share=0.0 if share is None else share, cost=cost).modeled_s_per_token
    raise TraceError(f"modeled_time_per_token: source must be a ReplayResult or a Trace, got {type(source).__name__}")
