"""The host expert tier (host_tier_bytes): bit-identical to resident, its counters, its faults, its options, and its
read-ahead of the lookahead prefetch's predictions (moe_prefetch).

The oracle is the default resident path of the same file (no region, every expert in memory): every run with the
tier must give its outputs bit for bit, and greedy decoding its tokens. A routing trace (moe_route_trace) is the
oracle of the read-ahead: its prediction is the trace's own next rows, so nothing read ahead may be wasted.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import ggml_hybrid as gh
from ggml_hybrid._native import ffi, lib
from ggml_hybrid._native.managed import live_objects
from ggml_hybrid.ggml.repack import repack_buffer_type
from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.machine import cgroup_memory_left
from ggml_hybrid.moe.host_tier import AUTO_SLACK, HostTier, auto_budget, entry_bytes
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.moe.traces import Trace
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model, write_moe_stack
from ggml_hybrid.units import MiB

TYPES = ["f32", "f16", "q8_0", "q4_K", "q6_K"]


def _x(n_tokens, n_embd, seed):
    return np.random.default_rng(seed).standard_normal((n_tokens, n_embd)).astype(np.float32)


def _layer_need(path):
    """Bytes the tier needs for one layer's experts (its minimum budget), from the file's own tensors."""
    store = GGUFStore(path)
    try:
        infos = [t for t in store.tensors() if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight")]
        return entry_bytes([i.nbytes // i.shape[0] for i in infos]) * infos[0].shape[0]
    finally:
        store.close()


def _expert_bytes(path):
    """Bytes of one expert of layer 0 in the file (its tensors' rows)."""
    store = GGUFStore(path)
    try:
        return sum(t.nbytes // t.shape[0] for t in store.tensors()
                   if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight"))
    finally:
        store.close()


@st.composite
def cases(draw):
    t = draw(st.sampled_from(TYPES))
    unit = gh.as_ggml_type(t).block_size if t.startswith("q") else 32
    n_expert = draw(st.integers(2, 32))
    return dict(
        expert_type=t, n_expert=n_expert, n_used=draw(st.integers(1, min(8, n_expert))),
        n_embd=unit * draw(st.integers(1, 2)), n_ff=unit * draw(st.integers(1, 2)),
        n_tokens=draw(st.integers(1, 48)), slots=draw(st.integers(1, n_expert)),
        policy=draw(st.sampled_from(["freq", "lru", "lfu"])), fused=draw(st.booleans()), seed=draw(st.integers(0, 999)),
        budget_layers=draw(st.sampled_from([1.0, 1.5, 3.0])), share=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
        repack=draw(st.booleans()), fault=draw(st.sampled_from([None, None, "eio", "short"])),
        fault_after=draw(st.integers(0, 12)), prefetch=draw(st.booleans()),
        prefetch_experts=draw(st.integers(0, n_expert)))


def _repacked(path, name="blk.0.ffn_down_exps.weight"):
    store = GGUFStore(path)
    try:
        info = store.info(name)
        return repack_buffer_type(info.dtype, info.shape, "mul_mat_id") is not None
    finally:
        store.close()


@dataclass
class TierRun:
    """One drawn configuration run with the tier: what the invariants below are checked on."""

    case: dict
    budget: int
    direct: bool            # the executors computed straight from the tier's frames
    should_be_direct: bool  # what the rule says: a CPU share of 0 and experts the CPU does not repack
    fault_message: str | None  # the typed error of the faulted call, if the injected fault fired
    outputs: list           # (got, resident) per forward after the fault
    tier: object            # TierCounters
    slots: object           # the layers' LayerCounters, summed
    expert_bytes: int       # one expert's bytes in the file (its tensors' rows)
    kinds: int              # expert tensors per layer


def _tier_run(tmp_path, case) -> TierRun:
    path = write_moe_stack(tmp_path / f"m{case['seed']}.gguf", n_layer=3, n_embd=case["n_embd"], n_ff=case["n_ff"],
                           n_expert=case["n_expert"], n_used=case["n_used"], expert_type=case["expert_type"],
                           fused=case["fused"], seed=case["seed"])
    # the tier's frames are plain CPU memory: the worker computes plain rows, which equal resident's where resident
    # experts are not repacked (repack=false, or a type the CPU does not repack)
    repack = case["repack"] and not (case["share"] and _repacked(path))
    budget = int(_layer_need(path) * case["budget_layers"])
    # the drawn size, then decode-sized calls (the lookahead predicts calls of up to 16 tokens)
    xs = [_x(n, case["n_embd"], case["seed"] + i) for i, n in enumerate([case["n_tokens"], 1, 2, 1])]
    with MoEStackSession(path, SessionOptions(repack=repack)) as s:
        refs = [s.forward(x) for x in xs]
    items = ["disk_experts=1", f"expert_cache_slots={case['slots']}", f"expert_eviction={case['policy']}",
             f"host_tier_bytes={budget}", f"moe_cpu_share={case['share']}", f"repack={int(repack)}"]
    if case["prefetch"]:
        # 0: the default bound (n_used experts)
        items += ["moe_prefetch=1", f"moe_prefetch_bytes={case['prefetch_experts'] * _expert_bytes(path)}"]
    message = None
    with MoEStackSession(path, SessionOptions.parse(items)) as s:
        direct = s.layers.executors[0].tier_direct
        if case["fault"] is not None:
            s.layers.tier.inject_fault(after=case["fault_after"], kind=case["fault"])
            try:
                s.forward(xs[0])
            except gh.errors.ModelFileError as e:
                message = str(e)
            s.layers.tier.inject_fault(after=-1)  # a fault that did not fire (fewer reads) fires on no later call
        outputs = [(s.forward(x), ref) for x, ref in zip(xs, refs)]
        tier, slots = s.layers.tier.counters, s.counters.total
    kinds = ("gate_up", "down") if case["fused"] else ("gate", "up", "down")
    return TierRun(case, budget, direct, case["share"] == 0 and not (repack and _repacked(path)), message, outputs,
                   tier, slots, sum(GGUFStore(path).info(f"blk.0.ffn_{k}_exps.weight").nbytes // case["n_expert"]
                                    for k in kinds), len(kinds))


def outputs_are_residents(run: TierRun) -> None:
    """Every way the tier serves gives resident's outputs bit for bit: the device's slots (a CPU playing the device
    with repacked slots), the CPU worker (its rows from the tier's frames), a CPU playing the device straight from
    the frames; after a failed call too."""
    for got, ref in run.outputs:
        np.testing.assert_array_equal(got, ref)


def direct_where_the_rule_says(run: TierRun) -> None:
    """A CPU playing the device computes straight from the frames exactly without a CPU share and with experts it
    does not repack."""
    assert run.direct == run.should_be_direct


def a_fault_fails_one_call_naming_its_cause(run: TierRun) -> None:
    """An injected read fault that fires fails at most the call that needed it, with the typed error naming the
    cause; a read-ahead's fault is forgotten (the call reads the expert again): counted, no call failed."""
    faulted = run.fault_message is not None
    if faulted:
        assert "short read" in run.fault_message if run.case["fault"] == "short" else \
            "Input/output error" in run.fault_message
    assert faulted <= run.tier.faults <= (run.case["fault"] is not None)


def within_its_budget(run: TierRun) -> None:
    """The tier never holds more than its budget."""
    assert run.tier.bytes_held <= run.budget


def every_read_ahead_is_judged(run: TierRun) -> None:
    """Every read-ahead is judged by the call it was for (each forward runs every layer): used if routed to; none
    without the lookahead."""
    if run.tier.faults:
        return  # the failed call's counts are partial
    assert run.tier.ahead == run.tier.ahead_used + run.tier.ahead_wasted
    assert run.tier.ahead_used <= run.slots.predicted_right
    if not run.case["prefetch"]:
        assert run.tier.ahead == 0 and run.slots.prefetched == 0


def every_expert_asks_the_tier_once(run: TierRun) -> None:
    """Straight from the frames, every distinct expert of every call asked the tier once and no slot was loaded;
    else every slot load (a prefetch's too) and every CPU expert asked it once: from RAM or a read-ahead (a hit) or
    from the file (a miss); a prefetch's slot loads take only what the tier holds."""
    if run.tier.faults:
        return
    tier, slots = run.tier, run.slots
    if run.direct:
        assert tier.hits + tier.misses == slots.distinct == slots.hits and slots.misses == slots.prefetched == 0
    else:
        assert tier.hits + tier.misses == slots.misses + slots.cpu_misses + slots.prefetched


def reads_are_whole_experts_in_4k_blocks(run: TierRun) -> None:
    """Each expert read from the file, by a call or ahead, is its tensors' bytes, each rounded out to 4 KiB."""
    if run.tier.faults:
        return
    reads = run.tier.misses + run.tier.ahead
    assert reads * run.expert_bytes <= run.tier.bytes_read <= reads * (run.expert_bytes + run.kinds * 8192)


TIER_INVARIANTS = (outputs_are_residents, direct_where_the_rule_says, a_fault_fails_one_call_naming_its_cause,
                   within_its_budget, every_read_ahead_is_judged, every_expert_asks_the_tier_once,
                   reads_are_whole_experts_in_4k_blocks)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_the_tier_keeps_its_invariants(tmp_path, case):
    """Each drawn configuration (type, experts, slots, policy, budget, CPU share, repacking, a read fault, the
    lookahead) run once; each named invariant above checked on it (a failure names its invariant)."""
    run = _tier_run(tmp_path, case)
    for check in TIER_INVARIANTS:
        check(run)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    return write_moe_stack(tmp_path_factory.mktemp("tier") / "stack.gguf", n_layer=3, n_embd=256, n_ff=256,
                           n_expert=16, n_used=4, expert_type="q4_K", seed=7)


def _expert_spans(path):
    """The byte ranges of the file's routed experts."""
    store = GGUFStore(path)
    try:
        return [(t.offset, t.offset + t.nbytes) for t in store.tensors() if "_exps." in t.name]
    finally:
        store.close()


def _mapped_ranges(path):
    """The address ranges of this process's mappings of ``path`` and their file offsets (/proc/self/maps)."""
    ino = Path(path).stat().st_ino
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and int(f[4]) == ino and f[5] == str(Path(path).resolve()):
            lo, hi = (int(v, 16) for v in f[0].split("-"))
            out.append((lo, hi, int(f[2], 16)))
    return out


def _resident_pages(path, spans):
    """Pages of ``spans`` of the file in the page cache (mincore over a fresh read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size, page = Path(path).stat().st_size, mmap.PAGESIZE
    vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    view = np.frombuffer(m, np.uint8)
    try:
        assert libc.mincore(view.ctypes.data, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(vec[p] & 1 for lo, hi in spans for p in range((lo + page - 1) // page, hi // page))
    finally:
        del view
        m.close()


def test_a_cpu_playing_the_device_runs_straight_from_the_tier_with_the_experts_unmapped(tmp_path):
    """CPU only, experts of a type the CPU does not repack: every expert runs from the tier's frames (no slot, no
    copy), the file's experts are not mapped at all (/proc/self/maps), the tier's direct reads leave none of them in
    the page cache (mincore), and the outputs are resident's bit for bit."""
    path = write_moe_stack(tmp_path / "q8.gguf", n_layer=3, n_embd=256, n_ff=512, n_expert=16, n_used=4,
                           expert_type="q8_0", seed=4)
    assert not _repacked(path)
    spans = _expert_spans(path)
    xs = [_x(n, 256, 20 + n) for n in (7, 1, 1, 3)]
    items = ["disk_experts=1", "expert_cache_slots=2", f"host_tier_bytes={2 * _layer_need(path)}"]
    with MoEStackSession(path, SessionOptions.parse(items)) as s:
        # the file's pages out of the page cache now: the buffered reads of its header at load read ahead into the
        # experts (a small file), which the tier then must not bring back
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        outs = [s.forward(x) for x in xs]
        ex = s.layers.executors[0]
        assert ex.tier_direct and ex.slot_bytes == 0 and s.counters.total.misses == 0
        assert s.layers.tier.buffer_type == "CPU"
        tier = s.layers.tier.counters
        assert tier.misses > 0 and tier.hits + tier.misses == s.counters.total.distinct
        maps = _mapped_ranges(path)
        assert maps, "the session maps the file (its dense tensors)"
        page = 4096
        for lo, hi, off in maps:  # no mapping of the file covers a whole page of an expert
            for a, b in spans:
                inner = ((a + page - 1) // page * page, b // page * page)
                assert inner[1] <= inner[0] or off + (hi - lo) <= inner[0] or off >= inner[1], (a, b, lo, hi, off)
        assert s.layers.unmapped >= sum(b - a for a, b in spans) - 2 * page * len(spans)
        direct = s.layers.tier.direct
        resident = _resident_pages(path, spans)
    if direct:  # O_DIRECT reads (not on tmpfs): the experts cost no page cache
        assert resident == 0
    with MoEStackSession(path, SessionOptions()) as s:
        for x, out in zip(xs, outs):
            np.testing.assert_array_equal(out, s.forward(x))
    assert _resident_pages(path, spans) > 0  # the check can see pages: the mapped run faulted them in


def test_the_cpu_worker_runs_from_the_tier(stack):
    """moe_cpu_share with the tier: the worker's rows come from the tier's frames (the mapping's experts are gone:
    reading them would give zeros), bit for bit as resident (plain kernels: repack=false)."""
    xs = [_x(n, 256, 40 + n) for n in (9, 1, 1, 4, 1)]
    with MoEStackSession(stack, SessionOptions(repack=False)) as s:
        refs = [s.forward(x) for x in xs]
    items = ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0.5", "repack=0",
             f"host_tier_bytes={_layer_need(stack)}"]
    with MoEStackSession(stack, SessionOptions.parse(items)) as s:
        assert not s.layers.executors[0].tier_direct
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        c, tier = s.counters.total, s.layers.tier.counters
        assert c.cpu_misses > 0 and c.misses > 0
        assert tier.hits + tier.misses == c.misses + c.cpu_misses
        info = s.store.info("blk.0.ffn_down_exps.weight")
        lo, hi = -info.offset % 4096, (info.offset + info.nbytes) // 4096 * 4096 - info.offset  # its whole pages
        raw = np.asarray(s.store.raw(info.name)).reshape(-1)
        assert s.layers.unmapped > 0 and hi - lo > 4096 and not raw[lo:hi].any() and raw[hi:].any()


def test_a_budget_holding_every_expert_reads_each_once(stack):
    xs = [_x(5, 256, i) for i in range(4)]
    with MoEStackSession(stack, SessionOptions()) as s:
        refs = [s.forward(x) for x in xs]
    with MoEStackSession(stack, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2",
                                                      "host_tier_bytes=64M"])) as s:
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        tier, slots = s.layers.tier.counters, s.counters.total
    assert tier.evictions == 0 and tier.misses <= 3 * 16  # each expert read from the file at most once
    assert tier.hits == slots.misses - tier.misses > 0    # two slots thrash; the tier serves the reloads
    assert tier.bytes_held == tier.misses * _layer_need(stack) // 16


def test_the_budget_is_capped_at_what_the_tier_can_hold(stack):
    with MoEStackSession(stack, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2",
                                                      "host_tier_bytes=1T"])) as s:
        assert s.layers.tier.budget == 3 * _layer_need(stack)


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_failed_read_is_a_typed_error_and_the_next_call_works(stack, kind):
    x = _x(6, 256, 3)
    with MoEStackSession(stack, SessionOptions()) as s:
        ref = s.forward(x)
    with MoEStackSession(stack, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=4",
                                                      f"host_tier_bytes={_layer_need(stack)}"])) as s:
        s.layers.tier.inject_fault(after=5, kind=kind)
        why = "Input/output error" if kind == "eio" else "short read"
        with pytest.raises(gh.errors.ModelFileError, match=f"layer [0-2]: .*{why}"):
            s.forward(x)
        assert s.layers.tier.counters.faults == 1
        np.testing.assert_array_equal(s.forward(x), ref)  # nothing of the failed read was kept
        np.testing.assert_array_equal(s.forward(x), ref)


def test_a_truncated_copy_is_a_typed_error_not_a_crash(tmp_path, stack):
    copy = tmp_path / "copy.gguf"
    shutil.copy(stack, copy)
    with MoEStackSession(copy, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2",
                                                     "host_tier_bytes=64M"])) as s:
        s.forward(_x(2, 256, 0))
        with open(copy, "r+b") as f:
            f.truncate(Path(copy).stat().st_size // 2)
        with pytest.raises(gh.errors.ModelFileError, match="changed on disk"):
            for i in range(8):  # a call with a miss checks the file before its reads
                s.forward(_x(4, 256, 100 + i))


def test_a_file_renamed_over_the_path_does_not_matter(tmp_path, stack):
    """The tier reads the file as opened (reopened through its descriptor), not whatever the path names now."""
    copy = tmp_path / "copy.gguf"
    shutil.copy(stack, copy)
    x = _x(4, 256, 9)
    with MoEStackSession(stack, SessionOptions()) as s:
        ref = s.forward(x)
    with MoEStackSession(copy, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2",
                                                     "host_tier_bytes=64M"])) as s:
        other = tmp_path / "other.gguf"
        other.write_bytes(b"\0" * 4096)
        other.replace(copy)
        np.testing.assert_array_equal(s.forward(x), ref)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_decoder_with_the_tier_gives_the_resident_tokens_and_logits(tmp_path, prefetch):
    path = write_model(tmp_path / "q.gguf", arch="qwen3moe", n_layer=3, seed=5, expert_type="q8_0")
    base = dict(n_threads=1, n_ctx=64)

    def greedy(opts):
        with MoEModel(path, opts) as m:
            logits = m.eval([1, 2, 3, 4, 5], "all")
            out, toks = [logits], []
            for _ in range(6):
                toks.append(int(np.argmax(out[-1][-1])))
                out.append(m.eval([toks[-1]], "all"))
            tier = m.experts.tier.counters if m.experts.tier is not None else None
            return np.concatenate(out), toks, tier

    ref, ref_toks, _ = greedy(SessionOptions(**base))
    got, toks, tier = greedy(SessionOptions(**base, disk_experts=True, expert_cache_slots=2,
                                            host_tier_bytes=_layer_need(path), moe_prefetch=prefetch))
    assert toks == ref_toks
    np.testing.assert_array_equal(got, ref)
    assert tier is not None and tier.misses > 0 and tier.bytes_read > 0
    assert (tier.ahead > 0) == prefetch and tier.ahead == tier.ahead_used + tier.ahead_wasted


# -- read-ahead of the lookahead's predictions (moe_prefetch) ----------------------------------------------------

def _route_trace(path, n_layer, n_expert, n_used, tokens, seed):
    rng = np.random.default_rng(seed)
    calls = [(layer, np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(t)]))
             for t in tokens for layer in range(n_layer)]
    Trace(n_layer, n_expert, n_used, calls=calls).write(path)
    return calls


@pytest.mark.parametrize("budget_layers", [1, 3])
def test_read_ahead_on_a_route_trace_is_never_wasted_and_reads_each_routed_expert_once(tmp_path, stack,
                                                                                      budget_layers):
    """With moe_route_trace the prediction is the trace's own next rows (an oracle): every expert read ahead is
    routed to by its call. With a budget holding every expert, each (layer, expert) the trace routes to is read
    from the file exactly once, by a call or ahead of it, and a decode step's layers 1 and 2 read nothing."""
    tokens = [5] + [1] * 10
    calls = _route_trace(tmp_path / "r.ghtrace", 3, 16, 4, tokens, seed=2)
    pairs = {(layer, int(e)) for layer, ids in calls for e in ids.ravel()}
    decode_new = {int(e) for layer, ids in calls[3:] if layer == 0 for e in ids.ravel()} - \
        {int(e) for e in calls[0][1].ravel()}  # layer 0's experts first routed in a decode step
    xs = [_x(t, 256, 40 + i) for i, t in enumerate(tokens)]
    base = ["disk_experts=1", "expert_cache_slots=4", f"moe_route_trace={tmp_path / 'r.ghtrace'}", "n_threads=1",
            f"host_tier_bytes={budget_layers * _layer_need(stack)}"]
    with MoEStackSession(stack, SessionOptions.parse(base), benchmark=True) as s:  # the tier, no lookahead
        refs = [s.forward(x) for x in xs]
        plain = s.layers.tier.counters
    with MoEStackSession(stack, SessionOptions.parse([*base, "moe_prefetch=1"]), benchmark=True) as s:
        np.testing.assert_array_equal(s.forward(xs[0]), refs[0])
        after_prompt = s.layers.tier.counters
        for x, ref in zip(xs[1:], refs[1:]):
            np.testing.assert_array_equal(s.forward(x), ref)
        tier, slots = s.layers.tier.counters, s.counters.total
    assert slots.recall == 1.0 and slots.precision == 1.0  # the oracle
    assert tier.ahead > 0 and tier.ahead_used == tier.ahead and tier.ahead_wasted == 0
    assert tier.faults == 0 and plain.ahead == 0
    if budget_layers == 3:  # nothing is ever evicted: one read per routed expert
        assert plain.misses == len(pairs)
        assert tier.misses + tier.ahead == len(pairs) and tier.misses < plain.misses
        assert tier.misses - after_prompt.misses <= len(decode_new)


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_failed_read_fails_at_most_the_call_that_needed_it_with_read_ahead(stack, kind):
    """A fault in a read-ahead is dropped (the call that needs the expert reads it again), or fails the call that
    fetched it while it was in flight, with the typed error; every other call stays bit-identical."""
    xs = [_x(1, 256, 300 + i) for i in range(10)]
    with MoEStackSession(stack, SessionOptions()) as s:
        refs = [s.forward(x) for x in xs]
    items = ["disk_experts=1", "expert_cache_slots=2", "moe_prefetch=1", f"host_tier_bytes={_layer_need(stack)}"]
    failed = 0
    with MoEStackSession(stack, SessionOptions.parse(items)) as s:
        for i, (x, ref) in enumerate(zip(xs, refs)):
            if i == 3:
                s.layers.tier.inject_fault(after=2, kind=kind)
            try:
                got = s.forward(x)
            except gh.errors.ModelFileError:
                failed += 1
                continue
            np.testing.assert_array_equal(got, ref)
        tier = s.layers.tier.counters
    assert tier.faults == 1 and failed <= 1 and tier.ahead > 0


def test_a_failed_read_ahead_is_forgotten_and_read_again(machine_model):
    store = GGUFStore(machine_model)
    names = {k: f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")}
    tier = HostTier(store, 2 * _layer_need(machine_model), "lru", n_threads=1)  # one thread: reads in queue order
    try:
        layer = tier.add_layer(0, names)
        tier.inject_fault(after=0, kind="eio")  # the first read: expert 3's
        assert lib.hy_tier_read_ahead(tier.ptr, layer, ffi.new("int32_t[]", [3, 5]), 2) == 2
        deadline = time.monotonic() + 30
        while not lib.hy_tier_holds(tier.ptr, layer, 5) and time.monotonic() < deadline:
            time.sleep(0.01)
        c = tier.counters
        assert c.faults == 1 and c.ahead == 2 and c.ahead_wasted == 1 and c.misses == 0
        assert not lib.hy_tier_holds(tier.ptr, layer, 3)  # nothing of the failed read kept
        assert lib.hy_tier_fetch(tier.ptr, layer, ffi.new("int32_t[]", [3, 5]), 2) == 0
        src = ffi.new("const uint8_t *[3]")
        for e in (3, 5):
            assert lib.hy_tier_get(tier.ptr, layer, e, src, ffi.NULL) == 0, ffi.string(lib.hy_tier_error(tier.ptr))
            for k, name in enumerate(names.values()):
                want = np.asarray(store.raw(name))[e].tobytes()
                assert bytes(ffi.buffer(src[k], len(want))) == want
        lib.hy_tier_settle(tier.ptr, layer, ffi.new("int32_t[]", [3, 5]), 2)
        lib.hy_tier_release(tier.ptr)
        c = tier.counters
        assert (c.misses, c.hits) == (1, 1)  # 3 read again by the call; 5 found held
        assert (c.ahead, c.ahead_used, c.ahead_wasted) == (2, 1, 1)
    finally:
        tier.close()
        store.close()


def _wait_held(tier, layer, experts):
    deadline = time.monotonic() + 30
    while not all(lib.hy_tier_holds(tier.ptr, layer, e) for e in experts) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_read_ahead_never_evicts_what_a_call_fetched_or_another_prediction(machine_model):
    store = GGUFStore(machine_model)
    per_expert = _layer_need(machine_model) // 16
    tier = HostTier(store, _layer_need(machine_model), "lru", n_threads=2)  # room for 16 experts, of 2 layers
    ids = lambda xs: ffi.new("int32_t[]", xs)
    try:
        a, b = (tier.add_layer(i, {k: f"blk.{i}.ffn_{k}_exps.weight" for k in ("gate", "up", "down")})
                for i in range(2))
        assert lib.hy_tier_fetch(tier.ptr, a, ids(list(range(10))), 10) == 0  # the current call's: pinned
        assert lib.hy_tier_read_ahead(tier.ptr, b, ids(list(range(6))), 6) == 6  # the room left
        _wait_held(tier, b, range(6))
        # the prediction grows: nothing can go (pinned, or predicted), so nothing more is read
        assert lib.hy_tier_read_ahead(tier.ptr, b, ids(list(range(8))), 8) == 0
        c = tier.counters
        assert c.bytes_held == 16 * per_expert and c.evictions == 0 and c.ahead == 6
        lib.hy_tier_release(tier.ptr)
        lib.hy_tier_settle(tier.ptr, b, ffi.NULL, 0)  # b's call never came: all six wasted
        assert tier.counters.ahead_wasted == 6
        # a new prediction evicts by the policy: the wasted ones, never used, go first
        assert lib.hy_tier_read_ahead(tier.ptr, b, ids([6, 7]), 2) == 2
        _wait_held(tier, b, [6, 7])
        assert tier.counters.evictions == 2
        assert all(lib.hy_tier_holds(tier.ptr, a, e) for e in range(10))
        assert sum(lib.hy_tier_holds(tier.ptr, b, e) for e in range(6)) == 4
    finally:
        tier.close()
        store.close()


@pytest.mark.parametrize("items, rule", [
    (["host_tier_bytes=1G"], "needs disk_experts=true"),
    (["disk_experts=1", "expert_cache_slots=2", "host_tier_bytes=1K"], "at least one layer's experts"),
])
def test_options_the_tier_cannot_serve_are_refused_before_running(stack, items, rule):
    with pytest.raises(OptionError, match=rule):
        MoEStackSession(stack, SessionOptions.parse(items))
    gc.collect()
    assert live_objects().get("host_tier", 0) == 0  # refused before any I/O thread started, or closed


@pytest.mark.parametrize("text, value", [("0", 0), ("2G", 2 << 30), ("1.5M", 3 * MiB // 2), ("auto", "auto"),
                                         ("AUTO", "auto"), ("4096", 4096)])
def test_host_tier_bytes_reads_sizes(text, value):
    assert SessionOptions.parse([f"host_tier_bytes={text}"]).host_tier_bytes == value


@pytest.mark.parametrize("text", ["-1", "lots", "1X", "nan", ""])
def test_host_tier_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(OptionError, match="host_tier_bytes"):
        SessionOptions.parse([f"host_tier_bytes={text}"])


def test_auto_leaves_what_the_session_holds_and_a_slack():
    """The rule (the session's bytes come from a dry run of it: tests/test_tier_margin.py)."""
    assert auto_budget(10 << 30, 1 << 30) == (9 << 30) - AUTO_SLACK
    assert auto_budget(200 * MiB, 100 * MiB) == 100 * MiB - AUTO_SLACK == 36 * MiB  # not a flat 128 MiB
    assert auto_budget(100 * MiB, 90 * MiB) == 0


def test_plan_counts_the_tier_and_says_when_the_model_does_not_fit(tmp_path):
    path = write_model(tmp_path / "q.gguf", arch="qwen3moe", n_layer=3, seed=5, expert_type="q8_0")
    routed = sum(t.nbytes for t in GGUFStore(path).tensors() if "_exps." in t.name)
    size = Path(path).stat().st_size
    base = dict(n_ctx=64, disk_experts=True, expert_cache_slots=2)
    without = plan(path, SessionOptions(**base), ram=1 << 30)
    assert without.host.host_tier == 0 and not any("does not fit" in w for w in without.warnings)
    small = plan(path, SessionOptions(**base, host_tier_bytes=routed // 2), ram=1 << 30)
    assert small.host.host_tier == routed // 2
    assert small.host.resident_total == without.host.resident_total + routed // 2
    big = plan(path, SessionOptions(**base, host_tier_bytes=1 << 40), ram=1 << 30)
    assert big.host.host_tier == routed  # never more than it can hold
    tight = plan(path, SessionOptions(**base), ram=size // 2)
    # half the file's size holds no tier beside auto's margin: it says so, with no size that would not work (0M)
    assert any("does not fit in --ram" in w and "neither does the least host tier" in w for w in tight.warnings)
    assert not any("--host-tier 0M" in w for w in tight.warnings)
    auto = plan(path, SessionOptions(**base, host_tier_bytes="auto"), ram=1 << 40)
    assert auto.host.host_tier == routed


def _cgroup(tmp_path, proc_line, files):
    tmp_path.mkdir()
    (tmp_path / "cgroup").write_text(proc_line + "\n")
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    return cgroup_memory_left(str(tmp_path / "cgroup"), str(tmp_path / "fs"))


def test_the_memory_cgroup_bounds_auto(tmp_path):
    v1 = {"memory/bench/memory.limit_in_bytes": "734003200\n", "memory/bench/memory.usage_in_bytes": "600000000\n",
          "memory/bench/memory.stat": "cache 500\ntotal_inactive_file 100000000\n"}
    assert _cgroup(tmp_path / "a", "4:memory:/bench", v1) == 734003200 - (600000000 - 100000000)
    v2 = {"x/memory.max": "1000000\n", "x/memory.current": "400000\n", "x/memory.stat": "inactive_file 0\n"}
    assert _cgroup(tmp_path / "b", "0::/x", v2) == 600000
    assert _cgroup(tmp_path / "c", "0::/x", {"x/memory.max": "max\n", "x/memory.current": "1\n"}) is None
    assert _cgroup(tmp_path / "d", "4:memory:/", {"memory/memory.limit_in_bytes": str(1 << 62),
                                                  "memory/memory.usage_in_bytes": "1"}) is None


# -- the tier alone, against the file's bytes ------------------------------------------------------------------

class TierMachine(RuleBasedStateMachine):
    """Random calls (fetch some experts, get some, read some ahead, settle a prediction, inject a fault, release) on
    a tier over a real file: every expert's bytes are the file's (read with numpy), the budget is never exceeded,
    read-aheads never keep a call from the budget, a fault fails only its get and the next get of that expert
    reads it again."""

    def __init__(self):
        super().__init__()
        self.store = GGUFStore(_MACHINE_MODEL[0])
        self.names = [{k: f"blk.{i}.ffn_{k}_exps.weight" for k in ("gate", "up", "down")} for i in range(2)]
        per_layer = _layer_need(_MACHINE_MODEL[0])
        self.budget = per_layer + per_layer // 2
        self.tier = HostTier(self.store, self.budget, "lru", n_threads=2)
        self.layers = [self.tier.add_layer(i, n) for i, n in enumerate(self.names)]
        self.capacity = self.budget // (per_layer // 16)  # experts the budget holds
        self.pinned: set[tuple[int, int]] = set()  # what the current call fetched: never evicted before release
        self.frames: dict[tuple[int, int], int] = {}
        self.faulted = False

    def teardown(self):
        self.tier.close()
        self.store.close()

    @rule(layer=st.integers(0, 1), experts=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True))
    def fetch(self, layer, experts):
        ids = ffi.new("int32_t[]", experts)
        rc = lib.hy_tier_fetch(self.tier.ptr, self.layers[layer], ids, len(experts))
        want = self.pinned | {(layer, e) for e in experts}
        if len(want) > self.capacity:  # more than one call may hold: refused, naming the budget
            assert rc == -1 and "budget" in ffi.string(lib.hy_tier_error(self.tier.ptr)).decode()
            self.release()
        else:
            assert rc == 0, ffi.string(lib.hy_tier_error(self.tier.ptr)).decode()
            self.pinned = want

    @rule(layer=st.integers(0, 1), e=st.integers(0, 15))
    def get(self, layer, e):
        src = ffi.new("const uint8_t *[3]")
        frame = ffi.new("int *")
        rc = lib.hy_tier_get(self.tier.ptr, self.layers[layer], e, src, frame)
        if (layer, e) not in self.pinned and len(self.pinned) + 1 > self.capacity:
            assert rc == -1 and "budget" in ffi.string(lib.hy_tier_error(self.tier.ptr)).decode()
            self.release()
            return
        self.pinned.add((layer, e))
        if rc != 0:
            assert self.faulted and "layer" in ffi.string(lib.hy_tier_error(self.tier.ptr)).decode()
            self.faulted = False
            return
        for k, name in enumerate(self.names[layer].values()):
            want = np.asarray(self.store.raw(name))[e].tobytes()
            assert bytes(ffi.buffer(src[k], len(want))) == want
        # the expert's frame: its bytes at the arena's frame, each kind at its fixed place (the CPU's 3-D view)
        arena = ffi.new("hy_tier_arena_info *")
        assert lib.hy_tier_arena(self.tier.ptr, arena) == 0 and 0 <= frame[0] < arena.n_frames
        for k in range(3):
            at = arena.base + frame[0] * arena.frame_bytes + lib.hy_tier_kind_pos(self.tier.ptr, self.layers[layer], k)
            assert at == src[k]
        self.frames[(layer, e)] = frame[0]
        held = [f for key, f in self.frames.items() if key in self.pinned]
        assert len(held) == len(set(held))  # two experts held at once never share a frame

    @rule(kind=st.sampled_from(["eio", "short"]))
    def fault(self, kind):
        if not self.faulted:
            self.tier.inject_fault(after=0, kind=kind)
            self.faulted = True  # the next read fails (if a read happens before the machine ends)

    @rule(layer=st.integers(0, 1), experts=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True))
    def read_ahead(self, layer, experts):
        """A prediction: reads start in the background, within the budget, evicting nothing the call holds."""
        n = lib.hy_tier_read_ahead(self.tier.ptr, self.layers[layer], ffi.new("int32_t[]", experts), len(experts))
        assert 0 <= n <= len(experts)

    @rule(layer=st.integers(0, 1), experts=st.lists(st.integers(0, 15), max_size=16, unique=True))
    def settle(self, layer, experts):
        lib.hy_tier_settle(self.tier.ptr, self.layers[layer], ffi.new("int32_t[]", experts or [0]), len(experts))

    @rule()
    def release(self):
        lib.hy_tier_release(self.tier.ptr)
        self.pinned = set()

    @invariant()
    def within_budget(self):
        c = self.tier.counters
        assert 0 <= c.bytes_held <= self.budget
        assert c.bytes_held % (_layer_need(_MACHINE_MODEL[0]) // 16) == 0  # whole experts only
        assert c.ahead_used + c.ahead_wasted <= c.ahead


_MACHINE_MODEL: list[str] = []


@pytest.fixture(scope="module")
def machine_model(tmp_path_factory):
    path = write_moe_stack(tmp_path_factory.mktemp("machine") / "m.gguf", n_layer=2, n_embd=256, n_ff=256,
                           n_expert=16, n_used=4, expert_type="q4_K", seed=3)
    _MACHINE_MODEL[:] = [path]
    return path


def test_the_tier_returns_the_files_bytes_under_random_calls(machine_model):
    run_state_machine_as_test(TierMachine, settings=settings(max_examples=25, stateful_step_count=30,
                                                             deadline=None))
