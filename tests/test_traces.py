"""Routing traces: file round trip and damage, hand-computed replays, Belady's ceiling, synthetic skew,
CPU-share semantics and the replay_trace CLI."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import struct
import warnings
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_hybrid.errors import GgmlHybridError
from ggml_hybrid.moe.slot_cache import SlotCache
from ggml_hybrid.moe.traces import (
    HEADER_SIZE,
    MAGIC,
    LinkCost,
    ReplayResult,
    Trace,
    TraceError,
    TraceTruncatedWarning,
    TraceWriter,
    modeled_time_per_token,
    read_trace,
    replay,
    synthetic_trace,
)

ROOT = Path(__file__).resolve().parents[1]


def _load_cli():
    spec = importlib.util.spec_from_file_location("replay_trace", ROOT / "tools" / "replay_trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ids_of(*tokens):
    """A (T, k) int32 id array from token rows."""
    return np.array(tokens, dtype=np.int32).reshape(len(tokens), -1)


def same_calls(a, b) -> bool:
    return len(a) == len(b) and all(la == lb and ia.dtype == ib.dtype and np.array_equal(ia, ib)
                                    for (la, ia), (lb, ib) in zip(a, b))


def write(path, n_layer, n_expert, n_used, calls):
    with TraceWriter(path, n_layer, n_expert, n_used) as w:
        for layer, ids in calls:
            w.record(layer, ids)
    return path


# -- strategies ------------------------------------------------------------------------------------


@st.composite
def traces(draw, max_expert=8, max_calls=25, max_tokens=3, fit=False):
    """Random traces; with ``fit`` every call's distinct experts fit in the returned slot count."""
    n_expert = draw(st.integers(2, max_expert))
    n_used = draw(st.integers(1, min(3, n_expert)))
    n_slots = draw(st.integers(n_used if fit else 1, n_expert))
    n_layer = draw(st.integers(1, 2))
    calls = []
    for _ in range(draw(st.integers(0, max_calls))):
        layer = draw(st.integers(0, n_layer - 1))
        rows, seen = [], set()
        for _ in range(draw(st.integers(1, max_tokens))):
            tok = draw(st.permutations(range(n_expert)))[:n_used]
            if fit and rows and len(seen | set(tok)) > n_slots:
                break
            rows.append(tok)
            seen |= set(tok)
        calls.append((layer, ids_of(*rows)))
    return Trace(n_layer, n_expert, n_used, calls), n_slots


costs = st.builds(LinkCost,
                  bus_bytes_per_s=st.sampled_from([10.0, 50.0, 100.0, 400.0]),
                  cpu_bytes_per_s=st.sampled_from([10.0, 50.0, 100.0, 400.0]),
                  device_s_per_row=st.sampled_from([0.0, 0.01, 0.1]),
                  cpu_s_per_row=st.sampled_from([0.0, 0.05, 0.3]),
                  expert_bytes=st.sampled_from([1, 100]))


# -- file format -----------------------------------------------------------------------------------


@given(n_layer=st.integers(1, 5), n_expert=st.sampled_from([1, 2, 7, 256, 257, 1000]),
       data=st.data(), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=40)
def test_round_trip(tmp_path_factory, n_layer, n_expert, data, seed):
    n_used = data.draw(st.integers(1, min(n_expert, 6)))
    shapes = data.draw(st.lists(st.tuples(st.integers(0, n_layer - 1), st.integers(1, 5)), max_size=12))
    rng = np.random.default_rng(seed)
    dtype = data.draw(st.sampled_from([np.int32, np.int64, np.uint16, np.int16]))
    calls = [(layer, np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(T)]).astype(dtype))
             for layer, T in shapes]
    path = write(tmp_path_factory.mktemp("rt") / "t.trc", n_layer, n_expert, n_used, calls)
    id_bytes = 1 if n_expert <= 256 else 2
    assert path.stat().st_size == HEADER_SIZE + sum(6 + T * n_used * id_bytes for _, T in shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete file reads without a warning
        tr = read_trace(path)
    assert (tr.n_layer, tr.n_expert, tr.n_used, tr.truncated) == (n_layer, n_expert, n_used, 0)
    assert same_calls(tr.calls, [(layer, ids.astype(np.int32)) for layer, ids in calls])


def test_header_layout(tmp_path):
    path = write(tmp_path / "t.trc", 3, 300, 2, [(2, ids_of([299, 0]))])
    raw = path.read_bytes()
    assert raw[:8] == MAGIC
    assert struct.unpack_from("<HBBIII", raw, 8) == (1, 2, 0, 3, 300, 2)
    assert struct.unpack_from("<I", raw, 24)[0] == zlib.crc32(raw[:24])
    # record: layer uint16, T uint32, then T*k uint16 ids (n_expert > 256)
    assert raw[28:] == struct.pack("<HIHH", 2, 1, 299, 0)


def test_truncated_file_keeps_complete_records(tmp_path):
    calls = [(0, ids_of([1, 2])), (1, ids_of([3, 0], [2, 1])), (0, ids_of([0, 3], [1, 2], [2, 0]))]
    full = write(tmp_path / "full.trc", 2, 4, 2, calls).read_bytes()
    end2 = HEADER_SIZE + (6 + 2) + (6 + 4)  # end of the second record
    assert len(full) == end2 + 6 + 6
    for cut in range(end2 + 1, len(full)):  # every cut inside the last record, header included
        p = tmp_path / f"cut{cut}.trc"
        p.write_bytes(full[:cut])
        with pytest.warns(TraceTruncatedWarning, match="incomplete final record"):
            tr = read_trace(p)
        assert tr.truncated == 1 and tr.truncated_bytes == cut - end2
        assert same_calls(tr.calls, calls[:2])
        assert read_trace(p, warn=False).n_calls == 2
    p = tmp_path / "boundary.trc"
    p.write_bytes(full[:end2])  # cut at a record boundary: nothing is missing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = read_trace(p)
    assert tr.truncated == 0 and same_calls(tr.calls, calls[:2])
    p.write_bytes(full[:HEADER_SIZE])  # header only: an empty trace
    assert read_trace(p).n_calls == 0


def _header(version=1, id_bytes=1, flags=0, n_layer=2, n_expert=4, n_used=2, magic=MAGIC, crc=None):
    head = struct.pack("<8sHBBIII", magic, version, id_bytes, flags, n_layer, n_expert, n_used)
    return head + struct.pack("<I", zlib.crc32(head) if crc is None else crc)


@pytest.mark.parametrize("raw, fault", [
    (b"", "0 bytes, fewer than the 28-byte header"),
    (_header()[:20], "20 bytes, fewer than the 28-byte header"),
    (_header(magic=b"GGUF\0\0\0\0"), "magic is b'GGUF"),
    (_header(version=7), "format version 7 is not supported"),
    (_header(crc=1234), "checksum 0x000004d2 does not match"),
    (_header()[:16] + b"\x05" + _header()[17:], "checksum"),  # n_expert corrupted after writing
    (_header(n_used=5), "n_used=5 must be in 1..n_expert=4"),
    (_header(n_layer=0), "n_layer=0 must be in 1..65536"),
    (_header(n_expert=0, n_used=0), "n_expert=0 must be in 1..65536"),
    (_header(id_bytes=2), "id_bytes=2 but n_expert=4 requires 1"),
    (_header(flags=2), "flags=2, expected 0 or 1"),
])
def test_corrupted_header(tmp_path, raw, fault):
    p = tmp_path / "bad.trc"
    p.write_bytes(raw + struct.pack("<HI", 0, 1) + bytes([1, 2]))
    if len(raw) < HEADER_SIZE:
        p.write_bytes(raw)
    with pytest.raises(TraceError, match="corrupted header") as info:
        read_trace(p)
    assert str(p) in str(info.value) and fault in str(info.value)
    assert isinstance(info.value, GgmlHybridError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("record, fault", [
    (struct.pack("<HI", 2, 1) + bytes([0, 1]), "record 1 at byte 36: layer 2 is out of range [0, 2)"),
    (struct.pack("<HI", 1, 0), "record 1 at byte 36: T=0"),
    (struct.pack("<HI", 1, 1) + bytes([0, 4]), "record 1 at byte 36: expert id 4 is out of range [0, 4)"),
    (struct.pack("<HI", 1, 1) + bytes([3, 3]), "record 1 at byte 36: token 0 lists expert 3 twice"),
])
def test_corrupted_record(tmp_path, record, fault):
    p = tmp_path / "bad.trc"
    good = struct.pack("<HI", 0, 1) + bytes([1, 2])
    p.write_bytes(_header() + good + record + good)  # damage in the middle, a whole record after it
    with pytest.raises(TraceError) as info:
        read_trace(p)
    assert str(p) in str(info.value) and fault in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.trc")


@pytest.mark.parametrize("layer, ids, fault", [
    (-1, ids_of([0, 1]), "layer -1 is out of range [0, 3)"),
    (3, ids_of([0, 1]), "layer 3 is out of range [0, 3)"),
    (True, ids_of([0, 1]), "layer must be an int, got the bool True"),
    (1.0, ids_of([0, 1]), "layer must be an int, got 1.0"),
    (0, [[0, 1]], "ids must be a numpy array of shape (T, 2), got list"),
    (0, np.array([[0.0, 1.0]]), "ids must have an integer dtype (int32 preferred), got float64"),
    (0, np.array([[True, False]]), "integer dtype"),
    (0, np.array([0, 1], dtype=np.int32), "ids must have shape (T, n_used=2), got (2,)"),
    (0, ids_of([0, 1, 2]), "ids must have shape (T, n_used=2), got (1, 3)"),
    (0, np.zeros((0, 2), dtype=np.int32), "ids has T=0 tokens"),
    (0, ids_of([0, 1], [5, 1]), "expert id 5 is out of range [0, 5)"),
    (0, ids_of([0, -2]), "expert id -2 is out of range [0, 5)"),
    (0, ids_of([0, 1], [4, 4]), "token 1 lists expert 4 twice in [4, 4]"),
])
def test_writer_rejects_invalid_records(tmp_path, layer, ids, fault):
    path = tmp_path / "t.trc"
    with TraceWriter(path, 3, 5, 2) as w:
        w.record(1, ids_of([3, 4]))
        with pytest.raises(TraceError) as info:
            w.record(layer, ids)
        assert fault in str(info.value) and "record 1" in str(info.value)
        w.record(2, ids_of([0, 4]))
    assert w.records == 2
    # the rejected record left no bytes behind; Trace validates calls by the same rules
    assert same_calls(read_trace(path).calls, [(1, ids_of([3, 4])), (2, ids_of([0, 4]))])
    with pytest.raises(TraceError, match=re.escape(fault)):
        Trace(3, 5, 2, [(layer, ids)])


def test_writer_shape_and_closed(tmp_path):
    for args, fault in [((0, 4, 2), "n_layer=0 must be in 1..65536"),
                        ((2, 4, 5), "n_used=5 must be in 1..n_expert=4"),
                        ((2, 70000, 2), "n_expert=70000 must be in 1..65536"),
                        ((2, 4, 0), "n_used=0 must be in 1..n_expert=4")]:
        with pytest.raises(TraceError, match=re.escape(fault)):
            TraceWriter(tmp_path / "x.trc", *args)
    w = TraceWriter(tmp_path / "t.trc", 1, 4, 1)
    w.record(0, ids_of([1]))
    w.close()
    assert w.closed
    with pytest.raises(TraceError, match="closed"):
        w.record(0, ids_of([1]))


def test_writer_survives_a_dying_process(tmp_path):
    """Records are flushed as they are written: the partial file is readable while the writer is still open,
    and the destination (an older trace here) is replaced only by the complete file, at close."""
    path = tmp_path / "live.trc"
    path.write_bytes(b"an older trace")
    w = TraceWriter(path, 2, 4, 1)
    w.record(0, ids_of([1]))
    w.record(1, ids_of([2], [3]))
    want = [(0, ids_of([1])), (1, ids_of([2], [3]))]
    assert same_calls(read_trace(w.partial_path).calls, want)
    assert path.read_bytes() == b"an older trace"
    w.close()
    assert same_calls(read_trace(path).calls, want) and sorted(p.name for p in tmp_path.iterdir()) == ["live.trc"]


# -- hand-computed replays -------------------------------------------------------------------------

# One expert per token (k=1), 4 experts, 2 slots per layer. Hits worked out by hand:
#
# layer 0: 0 1 0 2 1 0 3 0 1 (one token per call)
#   LRU   : 0m 1m 0H 2m(evict 1) 1m(evict 0) 0m(evict 2) 3m(evict 1) 0H 1m(evict 3)        -> 2 hits
#   LFU   : 0m 1m 0H(uses 2) 2m(evict 1) 1m(evict 2) 0H(uses 3) 3m(evict 1) 0H 1m(evict 3)  -> 3 hits
#   Belady: 0m 1m 0H 2m(next: 0@c6, 1@c5 -> evict 0) 1H 0m(1@c9, 2 never -> evict 2)
#           3m(0@c8, 1@c9 -> evict 1) 0H 1m                                                -> 3 hits
# layer 1: 0 0 0 1 2 1 2 1 2
#   LRU   : 0m 0H 0H 1m 2m(evict 0) then 1 2 1 2 all hits                                  -> 6 hits
#   LFU   : 0 has 3 uses, so 1 and 2 keep evicting each other: 0m 0H 0H 1m 2m 1m 2m 1m 2m  -> 2 hits
#   Belady: 0m 0H 0H 1m 2m(0 never again -> evict 0) then hits                             -> 6 hits
# layer 2: [0] [1] [0,2,3] [1] [2]   (call 3 has 3 distinct experts > 2 slots: two rounds)
#   LRU   : 0m 1m | call 3: 0 hit and protected, round 1 loads 2 (ids ascending) evicting 1,
#           round 2 loads 3 evicting 0 (0 and 2 both at tick 3, 0 in the lower slot) -> {3,2} |
#           1m evicts 3 (slot 0) | 2H                                                      -> 2 hits
#   LFU   : as LRU up to round 2, which evicts 2 (1 use) rather than 0 (2 uses) -> {0,3} |
#           1m evicts 3 | 2m evicts 1                                                      -> 1 hit
#   Belady: call 3: 0 hit (never used again, but protected in round 1); misses farthest first:
#           3 (never), then 2 (call 5). Round 1 loads 3 evicting 1 (the only evictable);
#           round 2 loads 2 evicting 0 (0 and 3 never used again: tie -> lowest id) -> {3,2} |
#           1m evicts 3 (never) | 2H                                                       -> 2 hits
#           (evicting the hit 0 in round 1 would give 3 hits: the within-call rule costs one)
# layer 3: [2,2,0,1] [0] [1]   (rows 2:2, 0:1, 1:1)
#   LRU/LFU: loads by decreasing rows 2, 0 then round 2 loads 1 evicting 2 (slot 0) -> {1,0}
#           | 0H | 1H                                                                      -> 2 hits
#           (ignoring rows, loads 0, 1 then 2 -> {2,1}: only 1 hit)
#   Belady: loads farthest first 2 (never), 1 (call 3), 0 (call 2); round 2 evicts 2 -> 2 hits
HAND_LAYERS = [
    [[0], [1], [0], [2], [1], [0], [3], [0], [1]],
    [[0], [0], [0], [1], [2], [1], [2], [1], [2]],
    [[0], [1], [0, 2, 3], [1], [2]],
    [[2, 2, 0, 1], [0], [1]],
]
HAND_HITS = {"lru": [2, 6, 2, 2], "lfu": [3, 2, 1, 2], "belady": [3, 6, 2, 2]}
HAND_DISTINCT = [9, 9, 7, 5]


def hand_trace() -> Trace:
    calls = []
    for step in itertools.zip_longest(*HAND_LAYERS):  # interleave the layers: they must not interact
        calls += [(layer, ids_of(*[[e] for e in tokens])) for layer, tokens in enumerate(step) if tokens]
    return Trace(4, 4, 1, calls)


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_hand_computed_replay(policy):
    r = replay(hand_trace(), 2, policy, expert_bytes=10)
    assert [s.hits for s in r.layers] == HAND_HITS[policy]
    assert [s.distinct for s in r.layers] == HAND_DISTINCT
    assert [s.misses for s in r.layers] == [d - h for d, h in zip(HAND_DISTINCT, HAND_HITS[policy])]
    assert [s.calls for s in r.layers] == [9, 9, 5, 3]
    assert r.hits == sum(HAND_HITS[policy]) and r.distinct == 30 and r.cpu == 0
    assert r.misses == 30 - r.hits and r.bytes_moved == 10 * r.misses
    assert r.hit_rate == pytest.approx(r.hits / 30)
    assert r.modeled_s_per_token is None
    assert {"lru": 12, "lfu": 8, "belady": 13}[policy] == r.hits


def test_belady_is_not_a_ceiling_when_calls_exceed_the_slots():
    """Hand-computed: 1 slot, calls {0:1 row, 1:2 rows}, {0, 1}, {1}.

    LRU/LFU: call 1 loads 1 (more rows) then 0 -> {0}; call 2 hits 0 and must then load 1 over it
    -> {1}; call 3 hits 1: 2 hits. Belady: 0 and 1 are both next used by call 2 (tie: lowest id
    first), so it loads 0 then 1 -> {1}; call 2 hits 1 and loads 0 over it -> {0}; call 3 misses:
    1 hit. In an oversubscribed call a hit cannot stay resident, which farthest-next-use ignores.
    """
    tr = Trace(1, 2, 1, [(0, ids_of([0], [1], [1])), (0, ids_of([1], [0])), (0, ids_of([1]))])
    assert [replay(tr, 1, p).hits for p in ("lru", "lfu", "belady")] == [2, 2, 1]


# -- properties of the replay -----------------------------------------------------------------------


@given(traces(fit=True))
@settings(max_examples=60)
def test_belady_at_least_lru_and_lfu(case):
    tr, n_slots = case
    b = replay(tr, n_slots, "belady")
    for policy in ("lru", "lfu", "freq"):
        assert b.hits >= replay(tr, n_slots, policy).hits
    assert b.hits + b.misses == b.distinct


def _optimal_misses(requests, n_slots):
    """Fewest loads over every residency choice the rules allow (calls that fit in n_slots)."""
    states = {frozenset(): 0}
    for req in requests:
        req, new = frozenset(req), {}
        for state, cost in states.items():
            cost += len(req - state)
            union = state | req
            if len(union) <= n_slots:
                outs = [union]
            else:  # keep the call's experts and any n_slots - |req| of the others
                outs = [req | frozenset(x) for x in itertools.combinations(sorted(state - req), n_slots - len(req))]
            for o in outs:
                new[o] = min(new.get(o, cost), cost)
        states = new
    return min(states.values())


@given(traces(max_expert=5, max_calls=10, fit=True))
@settings(max_examples=40)
def test_belady_is_optimal_when_calls_fit(case):
    tr, n_slots = case
    expected = sum(_optimal_misses([np.unique(ids).tolist() for la, ids in tr.calls if la == layer], n_slots)
                   for layer in range(tr.n_layer))
    assert replay(tr, n_slots, "belady").misses == expected


@given(traces(), st.sampled_from(["lru", "lfu", "freq"]))
@settings(max_examples=40)
def test_lru_lfu_replay_is_slot_cache(case, policy):
    tr, n_slots = case
    caches = [SlotCache(tr.n_expert, n_slots, policy) for _ in range(tr.n_layer)]
    for layer, ids in tr.calls:
        experts, rows = np.unique(ids, return_counts=True)
        caches[layer].plan(experts.tolist(), rows.tolist())
    r = replay(tr, n_slots, policy)
    for stats, cache in zip(r.layers, caches):
        c = cache.counters
        assert (stats.hits, stats.misses, stats.distinct, stats.evictions) == (c.hits, c.misses, c.distinct,
                                                                                 c.evictions)
    assert r.rounds == sum(c.counters.rounds for c in caches)


# -- synthetic traces -----------------------------------------------------------------------------


@pytest.mark.parametrize("hot_fraction, hot_traffic, reuse", [(0.2, 0.8, 0.0), (0.2, 0.8, 0.6), (0.1, 0.5, 0.3),
                                                              (0.5, 0.9, 0.9)])
def test_synthetic_skew(hot_fraction, hot_traffic, reuse):
    tr = synthetic_trace(4, 64, 8, 600, tokens_per_call=2, hot_fraction=hot_fraction, hot_traffic=hot_traffic,
                         reuse=reuse, seed=1)
    n_hot = round(hot_fraction * 64)
    assert [la for la, _ in tr.calls] == [c % 4 for c in range(600)]  # layers cycle like a decode
    assert all(ids.shape == (2, 8) and all(len(set(row)) == 8 for row in ids.tolist()) for _, ids in tr.calls)
    hot = tr.meta["hot"]
    assert all(len(h) == n_hot for h in hot) and len({tuple(h) for h in hot}) == 4  # a subset per layer
    for layer in range(4):
        ids = np.concatenate([ids.ravel() for la, ids in tr.calls if la == layer])
        counts = np.bincount(ids, minlength=64)
        assert counts[hot[layer]].sum() / ids.size == pytest.approx(hot_traffic, abs=0.02)
        # the hot set is what a reader of the trace sees as the most popular experts
        top = np.argsort(-counts, kind="stable")[:n_hot]
        assert counts[top].sum() / ids.size == pytest.approx(hot_traffic, abs=0.03)


def test_synthetic_reuse_raises_lru_hit_rate():
    rates = [replay(synthetic_trace(4, 64, 8, 400, reuse=reuse, seed=3), 16, "lru").hit_rate
             for reuse in (0.0, 0.5, 0.9)]
    assert rates[0] + 0.08 < rates[1] and rates[1] + 0.05 < rates[2]
    # consecutive calls of a layer share experts in proportion to reuse
    tr = synthetic_trace(2, 64, 8, 400, reuse=0.9, seed=3, hot_traffic=0.0, hot_fraction=0.0)
    by_layer = [[ids[0] for la, ids in tr.calls if la == layer] for layer in range(2)]
    overlap = np.mean([len(set(a) & set(b)) for seq in by_layer for a, b in zip(seq, seq[1:])])
    assert overlap == pytest.approx(0.9 * 8, abs=0.4)


def test_synthetic_is_deterministic_and_validated():
    a, b = synthetic_trace(3, 16, 4, 50, seed=7), synthetic_trace(3, 16, 4, 50, seed=7)
    assert same_calls(a.calls, b.calls) and not same_calls(a.calls, synthetic_trace(3, 16, 4, 50, seed=8).calls)
    for kwargs, fault in [(dict(reuse=1.5), "reuse=1.5 must be in [0, 1]"),
                          (dict(hot_traffic=-0.1), "hot_traffic=-0.1 must be in [0, 1]"),
                          (dict(tokens_per_call=0), "tokens_per_call=0 must be in"),
                          (dict(n_calls=-1), "n_calls=-1 must be >= 0")]:
        args = dict(n_layer=2, n_expert=8, n_used=2, n_calls=4) | kwargs
        with pytest.raises(TraceError, match=re.escape(fault)):
            synthetic_trace(**args)


# -- CPU share and modeled time --------------------------------------------------------------------

# bus 50 B/s, cpu 50 B/s, 0.01 s/row on the device, 0.1 s/row on the CPU, 100-byte experts
HAND_COST = LinkCost(bus_bytes_per_s=50.0, cpu_bytes_per_s=50.0, device_s_per_row=0.01, cpu_s_per_row=0.1,
                     expert_bytes=100)


def test_share_hand_computed():
    """Call 1 routes tokens [0,0,0,1] (expert 0: 3 rows, 1: 1 row, both misses), call 2 routes [1].

    A load is 100/50 = 2 s on the bus or on the CPU; 5 tokens (one layer).
    share 0:   call 1 device 2*2 + 4*0.01 = 4.04; call 2 hits 1: 0.01         -> 4.05/5 = 0.81 s
    share 0.5: call 1 n_cpu = floor(1 + 0.5) = 1, the CPU takes expert 1 (fewest rows):
               max(cpu 2 + 0.1, device 2 + 0.03) = 2.1; call 2: 1 is a miss, n_cpu = floor(0.5 + 0.5) = 1:
               cpu 2.1                                                         -> 4.2/5 = 0.84 s
    share 1:   call 1 cpu 4 + 0.4 = 4.4; call 2 cpu 2.1                          -> 6.5/5 = 1.3 s
    auto:      call 1 n_cpu 0: 4.04, 1: 2.1, 2: 4.4 -> 1 (2.1), the remembered share becomes 1/1;
               call 2: 1 is a miss again, device 2.01 < cpu 2.1, but not by the 5% hysteresis, so the
               CPU keeps it (share 1 of 1 miss): as share 0.5                  -> 4.2/5 = 0.84 s
    auto without hysteresis: call 2 goes to the device                       -> 4.11/5 = 0.822 s
    The coupled auto replay is slower than share 0: its CPU expert was not cached.
    """
    tr = Trace(1, 2, 1, [(0, ids_of([0], [0], [0], [1])), (0, ids_of([1]))])
    expected = {0.0: (0.81, 1, 2, 0), 0.5: (0.84, 0, 1, 2), 1.0: (1.3, 0, 0, 3), "auto": (0.84, 0, 1, 2)}
    for share, (t, hits, loads, cpu) in expected.items():
        r = replay(tr, 2, "lru", share=share, cost=HAND_COST)
        assert r.modeled_s_per_token == pytest.approx(t)
        assert (r.hits, r.misses, r.cpu, r.distinct, r.bytes_moved) == (hits, loads, cpu, 3, 100 * loads)
        assert modeled_time_per_token(tr, share, HAND_COST, n_slots=2) == pytest.approx(t)
    assert [c.n_cpu for c in replay(tr, 2, "lru", share="auto", cost=HAND_COST).call_log] == [1, 1]
    eager = replay(tr, 2, "lru", share="auto", cost=HAND_COST, hysteresis=0.0)
    assert eager.modeled_s_per_token == pytest.approx(0.822) and [c.n_cpu for c in eager.call_log] == [1, 0]
    # on share 0's fixed hits and misses, auto puts expert 1 on the CPU in call 1 and call 2 still hits
    r0 = replay(tr, 2, "lru", cost=HAND_COST)
    assert modeled_time_per_token(r0, "auto") == pytest.approx((2.1 + 0.01) / 5)
    assert modeled_time_per_token(r0, 1.0) == pytest.approx((4.4 + 0.01) / 5)


@given(traces(), st.sampled_from(["lru", "lfu", "freq", "belady"]), costs)
@settings(max_examples=40)
def test_share_zero_is_the_plain_replay(case, policy, cost):
    """A CPU share of 0 replays as no share at all: the same counts per layer, nothing on the CPU, and the bus moves
    each load's bytes."""
    tr, n_slots = case
    plain = replay(tr, n_slots, policy)
    zero = replay(tr, n_slots, policy, share=0.0, cost=cost, expert_bytes=cost.expert_bytes)

    def counts(r):
        return [(s.calls, s.distinct, s.hits, s.misses, s.cpu, s.evictions) for s in r.layers]

    assert counts(zero) == counts(plain) and zero.bytes_moved == plain.misses * cost.expert_bytes
    assert (zero.hits, zero.misses, zero.cpu, zero.evictions) == (plain.hits, plain.misses, 0, plain.evictions)


@given(traces(), st.sampled_from(["lru", "lfu", "freq", "belady"]), costs)
@settings(max_examples=40)
def test_share_one_loads_nothing(case, policy, cost):
    """A CPU share of 1: no load, no hit, no eviction, every distinct expert of every call on the CPU."""
    tr, n_slots = case
    plain = replay(tr, n_slots, policy)
    one = replay(tr, n_slots, policy, share=1.0, cost=cost)
    assert (one.misses, one.bytes_moved, one.hits, one.evictions) == (0, 0, 0, 0)
    assert one.cpu == one.distinct == plain.distinct


@given(traces(), st.sampled_from(["lru", "lfu", "freq", "belady"]), costs)
@settings(max_examples=40)
def test_share_one_models_every_row_on_the_cpu(case, policy, cost):
    """All on the CPU, the modeled time is every distinct expert read once per call and every (token, expert) row
    computed there."""
    tr, n_slots = case
    one = replay(tr, n_slots, policy, share=1.0, cost=cost)
    cpu_s = sum(len(np.unique(ids)) * cost.expert_bytes / cost.cpu_bytes_per_s + ids.size * cost.cpu_s_per_row
                for _, ids in tr.calls)
    assert one.modeled_s_per_token == pytest.approx(cpu_s * tr.n_layer / tr.token_rows if tr.calls else 0.0)


@given(traces(), st.sampled_from(["lru", "lfu", "freq", "belady"]))
@settings(max_examples=40)
def test_a_half_share_takes_half_the_misses_rounded_half_up(case, policy):
    """A CPU share of 0.5: each call's CPU takes floor(0.5 * misses + 0.5) of its misses, and every distinct expert
    is a hit, a load or a CPU expert, once."""
    tr, n_slots = case
    plain = replay(tr, n_slots, policy)
    half = replay(tr, n_slots, policy, share=0.5)
    assert half.hits + half.misses + half.cpu == half.distinct == plain.distinct
    assert all(c.n_cpu == math.floor(0.5 * len(c.miss_rows) + 0.5) for c in half.call_log)


@given(traces(), st.sampled_from(["lru", "lfu", "freq", "belady"]), costs)
@settings(max_examples=40)
def test_auto_is_never_slower_than_a_fixed_share(case, policy, cost):
    tr, n_slots = case
    for base_share in (0.0, "auto"):
        r = replay(tr, n_slots, policy, share=base_share, cost=cost)
        assert modeled_time_per_token(r) == r.modeled_s_per_token  # its own share and cost, exactly
        auto = modeled_time_per_token(r, "auto", cost)
        for share in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
            assert auto <= modeled_time_per_token(r, share, cost)
    assert isinstance(r, ReplayResult) and r.share == "auto"


def _plain_victim_key(s, policy, slot):
    e = s["slots"][slot]
    return (s["computed"][e], slot) if policy == "lru" else (s["count"][e], s["last"][e], slot)


def _plain_share_replay(tr, n_slots, policy, share, cpu_rule):
    """A plain model of the rules, written apart from SlotCache and cpu_share, for calls that fit in the slots
    (one round): per layer, slots, the tick each resident was last computed, a request history (count, last
    tick) of every expert; the CPU takes round(share * misses) of the misses, fewest rows first, ties by
    (count, last request) under the reuse rule, then by id; loads (most rows first, then id) go to the free
    slots (lowest first) then to the victims: LRU (last computed, slot) or 'freq' (count, last request, slot)."""
    loads = cpu = 0
    state = [dict(slots=[None] * n_slots, computed={}, count={}, last={}, tick=0) for _ in range(tr.n_layer)]
    for layer, ids in tr.calls:
        s = state[layer]
        s["tick"] += 1
        t = s["tick"]
        experts, counts = np.unique(ids, return_counts=True)
        rows = dict(zip(experts.tolist(), counts.tolist()))
        misses = [e for e in rows if e not in s["slots"]]
        if cpu_rule == "reuse":
            order = sorted(misses, key=lambda e, s=s, rows=rows: (rows[e], s["count"].get(e, 0), s["last"].get(e, 0),
                                                                  e))
        else:
            order = sorted(misses, key=lambda e, rows=rows: (rows[e], e))
        k = int(Fraction(repr(float(share))) * len(misses) + Fraction(1, 2))
        on_cpu = set(order[:k])
        cpu += len(on_cpu)
        for e in rows:
            s["count"][e] = s["count"].get(e, 0) + 1
            s["last"][e] = t
        device = [e for e in rows if e not in on_cpu]
        new = sorted((e for e in device if e not in s["slots"]), key=lambda e, rows=rows: (-rows[e], e))
        for e in device:
            if e in s["slots"]:
                s["computed"][e] = t
        free = [i for i, e in enumerate(s["slots"]) if e is None]
        victims = sorted((i for i, e in enumerate(s["slots"]) if e is not None and e not in device),
                         key=lambda i, s=s: _plain_victim_key(s, policy, i))
        for e, i in zip(new, free + victims):
            s["slots"][i] = e
            s["computed"][e] = t
        loads += len(new)
    return loads, cpu


@given(traces(fit=True), st.sampled_from(["lru", "freq"]), st.sampled_from([0.25, 0.5, 0.75]),
       st.sampled_from(["reuse", "rows"]))
@settings(max_examples=80)
def test_the_cpu_share_rules_replay_as_a_plain_model(case, policy, share, cpu_rule):
    tr, n_slots = case
    r = replay(tr, n_slots, policy, share=share, cpu_rule=cpu_rule)
    assert (r.misses, r.cpu) == _plain_share_replay(tr, n_slots, policy, share, cpu_rule)


def test_replay_rejects_bad_requests():
    tr = hand_trace()
    for kwargs, fault in [(dict(n_slots=0), "n_slots=0 must be in 1..n_expert=4"),
                          (dict(n_slots=5), "n_slots=5 must be in 1..n_expert=4"),
                          (dict(policy="fifo"), "policy 'fifo' must be one of"),
                          (dict(share=1.5), "share 1.5 must be a number in"),
                          (dict(share="auto"), "share='auto' needs a cost"),
                          (dict(cost=HAND_COST, expert_bytes=7), "expert_bytes=7 differs from cost.expert_bytes=100")]:
        with pytest.raises(TraceError, match=re.escape(fault)):
            replay(tr, **(dict(n_slots=2) | kwargs))
    with pytest.raises(TraceError, match="expert_bytes must be an int >= 1, got 0"):
        LinkCost(1.0, 1.0, 0.0, 0.0, 0)
    with pytest.raises(TraceError, match="bus_bytes_per_s must be a finite number > 0, got 0.0"):
        LinkCost(0.0, 1.0, 0.0, 0.0, 1)
    with pytest.raises(TraceError, match="has no cost"):
        modeled_time_per_token(replay(tr, 2))


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli():
    return _load_cli().cli


def test_cli_synth_and_replay(cli, tmp_path):
    out = tmp_path / "s.trc"
    r = CliRunner().invoke(cli, ["synth", str(out), "--layers", "4", "--experts", "16", "--used", "2",
                                 "--calls", "60", "--tokens", "2", "--hot-fraction", "0.25", "--hot-traffic", "0.7",
                                 "--reuse", "0.4", "--seed", "5"])
    assert r.exit_code == 0, r.output
    assert same_calls(read_trace(out).calls, synthetic_trace(4, 16, 2, 60, tokens_per_call=2, hot_fraction=0.25,
                                                             hot_traffic=0.7, reuse=0.4, seed=5).calls)
    args = [str(out), "--slots", "4", "--slots", "8", "--policy", "lru", "--policy", "belady",
            "--share", "0", "--share", "auto", "--expert-bytes", "1000"]
    table = CliRunner().invoke(cli, args)
    assert table.exit_code == 0, table.output
    rows = [line.split() for line in table.stdout.splitlines() if line.split()[:1] in (["lru"], ["belady"])]
    assert [(p, s, sh) for p, s, sh, *_ in rows] == [(p, s, sh) for p in ("lru", "belady") for s in ("4", "8")
                                                     for sh in ("0", "auto")]
    assert CliRunner().invoke(cli, ["replay", *args]).stdout == table.stdout  # explicit command, same output

    doc = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)
    assert doc["trace"]["calls"] == 60 and len(doc["results"]) == 8
    cost = LinkCost(25e9, 20e9, 2e-6, 30e-6, 1000)
    assert doc["cost"] == cost.to_dict()
    tr = read_trace(out)
    for res in doc["results"]:
        ref = replay(tr, res["n_slots"], res["policy"], share=res["share"], cost=cost)
        assert (res["hits"], res["misses"], res["cpu"], res["bytes_moved"]) == (ref.hits, ref.misses, ref.cpu,
                                                                                  ref.bytes_moved)
        assert res["modeled_us_per_token"] == pytest.approx(ref.modeled_s_per_token * 1e6)
        assert len(res["layers"]) == 4
    hit_rate = {(p, int(s), sh): float(h) for p, s, sh, _rule, h, *_ in rows}
    assert hit_rate[("lru", 8, "0")] == pytest.approx(replay(tr, 8, "lru").hit_rate, abs=5e-4)
    # the runtime's default eviction is named; the CPU share's rule before the history replays beside the runtime's
    assert "runtime default eviction: freq" in table.stdout and doc["runtime_policy"] == "freq"
    both = json.loads(CliRunner().invoke(cli, [str(out), "--slots", "4", "--policy", "freq", "--share", "0.5",
                                               "--cpu-rule", "reuse,rows", "--json"]).stdout)
    assert [r["cpu_rule"] for r in both["results"]] == ["reuse", "rows"]
    for res in both["results"]:
        ref = replay(tr, 4, "freq", share=0.5, cpu_rule=res["cpu_rule"])
        assert (res["misses"], res["cpu"]) == (ref.misses, ref.cpu)


@pytest.mark.parametrize("make, args, fault", [
    (True, ["--slots", "99"], "--slots 99 exceeds the trace's n_expert=16"),
    (True, [], "Missing option '--slots'"),
    (True, ["--slots", "4", "--share", "half"], "share 'half' must be a number in [0, 1] or 'auto'"),
    (True, ["--slots", "4", "--bogus"], "No such option '--bogus'"),
    (False, ["--slots", "4"], "corrupted header: magic is"),
])
def test_cli_errors(cli, tmp_path, make, args, fault):
    path = tmp_path / "t.trc"
    if make:
        synthetic_trace(2, 16, 2, 10).write(path)
    else:
        path.write_bytes(b"not a trace at all, just some bytes")
    r = CliRunner().invoke(cli, [str(path), *args])
    assert r.exit_code == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("replay_trace: error: ") and fault in r.stderr


def test_cli_synth_error_and_truncated_note(cli, tmp_path):
    r = CliRunner().invoke(cli, ["synth", str(tmp_path / "x.trc"), "--reuse", "2"])
    assert r.exit_code == 2 and r.stderr == "replay_trace: error: synthetic_trace: reuse=2.0 must be in [0, 1]\n"
    path = tmp_path / "t.trc"
    synthetic_trace(2, 16, 2, 10).write(path)
    path.write_bytes(path.read_bytes()[:-1])
    r = CliRunner().invoke(cli, [str(path), "--slots", "4"])
    assert r.exit_code == 0 and "dropped an incomplete final record (7 bytes)" in r.stderr
    assert "9 calls" in r.stdout
