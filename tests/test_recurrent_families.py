"""Recurrent models (qwen3next, qwen35moe: gated delta-net layers between attention layers): every expert mode and
executor bit-identical to resident, the expert region exactly the routed experts, chunked prompts equal to one-shot
ones, recurrent states per sequence slot (each sequence as if alone, a reused slot clean, a failed eval undone),
inspect and plan counting the state next to the KV cache, and clear refusals of bad files."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
from helpers import region_weights, rewrite_gguf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ggml_hybrid.errors import ArgumentError, GgmlHybridError, ModelFileError
from ggml_hybrid.model.decoder import SeqRows, build_decoder, seq_input
from ggml_hybrid.model.recurrent_state import RecurrentState
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model

SPECS = {
    "qwen3next": dict(arch="qwen3next", n_layer=4, n_rot=8, attn_interval=2),
    "qwen35moe": dict(arch="qwen35moe", n_layer=4, n_rot=8, attn_interval=2, weight_type="q8_0"),
}
PROMPT = "The cache runs the hits first, then the misses."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    out = {name: write_model(d / f"{name}.gguf", seed=23, **spec) for name, spec in SPECS.items()}
    # delta-net layers only: no KV cache at all, so several sequences need nothing but their state slots
    out["recurrent_only"] = write_model(d / "recurrent_only.gguf", arch="qwen35moe", n_layer=2,
                                        recurrent_layers="1,1", seed=24)
    return out


def _tokens(path):
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        return m.tokenizer.encode(PROMPT)


def _run(path, opts: SessionOptions, tokens):
    """A prompt in two evals, then three single-token evals: the logits of every position, and the counters."""
    with MoEModel(path, opts) as m:
        rows = [m.eval(tokens[:6], "all"), m.eval(tokens[6:-3], "all")]
        rows += [m.eval(tokens[i:i + 1], "all") for i in range(len(tokens) - 3, len(tokens))]
        return np.concatenate(rows), m.counters


MODES = {
    "cpu_moe": dict(cpu_moe=True),
    "n_cpu_moe": dict(n_cpu_moe=2),
    "disk_share_0": dict(disk_experts=True, expert_cache_slots=3),
    "disk_share_0.5": dict(disk_experts=True, expert_cache_slots=3, moe_cpu_share=0.5),
    "disk_share_auto": dict(disk_experts=True, expert_cache_slots=3, moe_cpu_share="auto"),
    # layers (and their states) split over two devices; states and KV cache in host memory
    "two_devices": dict(virtual_devices=2, disk_experts=True, expert_cache_slots=3),
    "no_kv_offload": dict(virtual_devices=2, no_kv_offload=True, n_cpu_moe=1),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("executor", ["native", "python"])
def test_every_mode_is_bit_identical_to_resident(models, name, executor):
    path = models[name]
    tokens = _tokens(path)
    base = dict(n_threads=1, n_ctx=128, ubatch_size=8)
    ref, _ = _run(path, SessionOptions(**base), tokens)
    for mode, extra in MODES.items():
        if executor == "python" and not extra.get("disk_experts"):
            continue  # only disk layers have an executor
        got, counters = _run(path, SessionOptions(**base, **extra, moe_executor=executor), tokens)
        assert np.array_equal(got, ref), (mode, executor)
        if mode == "disk_share_0":
            assert counters.total.misses > 0 and counters.total.cpu_misses == 0
        elif mode == "disk_share_0.5":
            assert counters.total.misses > 0 and counters.total.cpu_misses > 0


HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_REF = sorted(glob.glob(os.path.join(HERE, "fixtures", "llama_ref", "qwen3next_*.npz"))
                   + glob.glob(os.path.join(HERE, "fixtures", "llama_ref", "qwen35moe_*.npz")))


@pytest.mark.parametrize("fixture", LLAMA_REF, ids=[os.path.basename(f)[:-4] for f in LLAMA_REF])
def test_every_mode_equals_llama_cpp(tmp_path, fixture):
    """Straight against llama.cpp: the fixtures' own files with their experts on the CPU, on disk behind a cache
    with each CPU share (misses forced by 3 slots): llama.cpp's logits, bit for bit where the CPU's SIMD features
    are those of the recording (test_lm checks the resident path on every fixture the same way)."""
    from make_reference_fixtures import load_for_cpu

    z, exact = load_for_cpu(fixture)
    if not exact:
        pytest.skip("no recording on a CPU with this one's SIMD features: bit-identity is not expected")
    path = write_model(tmp_path / "m.gguf", ModelSpec(**json.loads(str(z["spec"]))))
    tokens = z["tokens"].tolist()
    base = dict(n_threads=1, n_ctx=512, ubatch_size=int(z["ubatch"]), **json.loads(str(z["options"])))
    for mode, extra in MODES.items():
        with MoEModel(path, SessionOptions(**base, **extra)) as m:
            assert np.array_equal(m.eval(tokens, "all"), z["logits"]), mode
            if "decode_from" in z:
                m.reset()
                n = int(z["decode_from"])
                rows = [m.eval(tokens[:n], "all")] + [m.eval(tokens[i:i + 1], "all") for i in range(n, len(tokens))]
                assert np.array_equal(np.concatenate(rows), z["decode_logits"]), (mode, "decode")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_region_covers_exactly_the_routed_experts(models, name):
    with MoEModel(models[name], SessionOptions(n_threads=1, disk_experts=True, expert_cache_slots=4)) as m:
        g = m._graph((SeqRows(0, 4, 256),), 4)
        for il in range(m.hp.n_layer):  # delta-net and attention layers alike
            kinds = {n.split(".")[2] for n in region_weights(g.regions[il])}
            assert kinds == {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}, (il, kinds)
        assert set(m.layout.expert_mode) == {"disk"}
        # the gated shared expert and its gate stay with the layer, never in a cache
        cached = {n for ex in m.experts.executors if ex is not None for n in ex.names.values()}
        assert cached and not any("shexp" in n for n in cached)
        assert all(f"blk.{il}.ffn_{k}_shexp.weight" in m.weights for il in range(m.hp.n_layer)
                   for k in ("gate", "up", "down", "gate_inp"))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunked_prompts_equal_one_shot(models, name):
    """The recurrent states carry exactly from one ubatch to the next: any split of at least two tokens per
    ubatch gives the one-shot logits (as in llama.cpp; single-token ubatches take other F32 kernels)."""
    path = models[name]
    tokens = _tokens(path)
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=128)) as m:
        one_shot = m.eval(tokens, "all")
        for cuts in ([5], [2, 9, 11], [len(tokens) - 2]):
            m.reset()
            bounds = [0, *cuts, len(tokens)]
            got = np.concatenate([m.eval(tokens[a:b], "all") for a, b in zip(bounds, bounds[1:])])
            assert np.array_equal(got, one_shot), cuts
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=128, ubatch_size=3)) as m:
        assert np.array_equal(m.eval(tokens, "all"), one_shot)


def test_reset_starts_from_zero_states(models):
    path = models["qwen3next"]
    tokens = _tokens(path)
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=128)) as m:
        first = m.eval(tokens, "all")
        assert any(np.abs(ssm).max() > 0 for _, ssm in m.rs.state().values())
        m.reset()
        assert all(not conv.any() and not ssm.any() for conv, ssm in m.rs.state().values())
        assert np.array_equal(m.eval(tokens, "all"), first)


def test_a_failed_eval_leaves_the_recurrent_state_as_it_was(models):
    """A fault in the second ubatch: the states written by the first are not the sequence's; it goes on as if the
    failed call had never been made."""
    path = models["qwen35moe"]
    tokens = _tokens(path)
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=128, ubatch_size=4)) as m:
        m.eval(tokens[:3])
        clean = m.eval(tokens[3:], "all")
        m.reset()
        m.eval(tokens[:3])
        before = m.rs.state()
        real, seen = m._ubatch, []

        def dies_on_the_second(part, n_out):  # a test double: the second ubatch fails, as a Ctrl-C could
            seen.append(len(part))
            if len(seen) == 2:
                raise KeyboardInterrupt
            return real(part, n_out)

        m._ubatch = dies_on_the_second
        with pytest.raises(KeyboardInterrupt):
            m.eval(tokens[3:], "all")
        m._ubatch = real
        after = m.rs.state()
        assert all(np.array_equal(before[i][0], after[i][0]) and np.array_equal(before[i][1], after[i][1])
                   for i in before)
        assert np.array_equal(m.eval(tokens[3:], "all"), clean)


class Slots:
    """Several sequences through one model's graph, each in its own state slot (the memory API the serving engine
    drives): ``eval(seq, tokens)`` runs one ubatch of slot ``seq``."""

    def __init__(self, m: MoEModel, n_seq: int) -> None:
        dn = m.hp.delta_net
        assert dn is not None and not m.kv.layers  # no KV cache: the states are the whole memory
        self.m = m
        self.rs = RecurrentState(m.hp.n_layer, dn.layers, dn.conv_state, dn.ssm_state, m.host, n_seq=n_seq)
        self.graphs: dict[int, object] = {}

    def eval(self, seq: int, tokens) -> np.ndarray:
        m, n = self.m, len(tokens)
        if n not in self.graphs:
            g = build_decoder(m.hp, m.weights, m.experts.weights, m.kv, (SeqRows(0, n, 256),), n, False,
                              rs=self.rs)
            m.sched.set_pins(g.graph, m._pins(g))
            self.graphs[n] = g
        g = self.graphs[n]
        self.rs.begin(seq)
        m.sched.alloc(g.graph)
        feed = {"tokens": np.asarray(tokens, np.int32), **{seq_input(k, 0): v for k, v in self.rs.inputs(seq).items()}}
        for name, t in g.inputs.items():
            t.set(feed[name])
        m.sched.compute(g.graph)
        self.rs.advance(seq)
        self.rs.commit(seq)
        return g.logits.numpy().reshape(n, -1)

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.rs.close()


def test_sequences_in_their_own_slots_are_each_as_if_alone(models):
    path = models["recurrent_only"]
    rng = np.random.default_rng(5)
    seqs = [rng.integers(1, 380, 9).tolist() for _ in range(4)]
    chunks = [(0, 3), (3, 5), (5, 9)]
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=64)) as m:
        alone = []
        for toks in seqs:
            m.reset()
            alone.append(np.concatenate([m.eval(toks[a:b], "all") for a, b in chunks]))
        slots = Slots(m, 3)
        try:
            got: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
            for a, b in chunks:  # three sequences, their ubatches interleaved
                for s in (0, 1, 2):
                    got[s].append(slots.eval(s, seqs[s][a:b]))
            for s in (0, 1, 2):
                assert np.array_equal(np.concatenate(got[s]), alone[s]), s
            # slot 1 reused for a new sequence: it starts from zero states, the others keep theirs
            slots.rs.clear(1)
            reused = np.concatenate([slots.eval(1, seqs[3][a:b]) for a, b in chunks])
            assert np.array_equal(reused, alone[3])
            assert np.array_equal(slots.eval(0, [7, 8]), _continue(m, seqs[0], [7, 8]))
        finally:
            slots.close()


def _continue(m: MoEModel, prefix, more) -> np.ndarray:
    m.reset()
    m.eval(prefix[:3], "all")
    m.eval(prefix[3:5], "all")
    m.eval(prefix[5:], "all")
    return m.eval(more, "all")


def test_recurrent_state_slots():
    from ggml_hybrid.ggml.backend import cpu

    with cpu(1) as b:
        rs = RecurrentState(3, [0, 2], 6, 8, b, n_seq=2)
        try:
            assert rs.n_rows == 5 and rs.bytes_per_sequence == 4 * 2 * (6 + 8)
            with pytest.raises(ArgumentError, match="no eval in progress"):
                rs.rows(0)
            rs.begin(0)
            assert rs.rows(0) == (4, 0)  # a fresh slot reads the zero row, writes its first row
            rs.advance(0)
            assert rs.rows(0) == (0, 0)  # the next ubatch goes on from what the first wrote
            rs.commit(0)
            rs.begin(0)
            assert rs.rows(0) == (0, 1)  # the next eval writes the other row
            rs.abandon(0)
            rs.begin(0)
            assert rs.rows(0) == (0, 1)  # an abandoned eval changed nothing
            rs.commit(0)                 # nothing written: the state stays where it was
            rs.begin(1)
            assert rs.rows(1) == (4, 2)
            rs.clear(0)
            rs.begin(0)
            assert rs.rows(0)[0] == 4
            with pytest.raises(GgmlHybridError, match="seq"):
                rs.begin(2)
        finally:
            rs.close()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_inspect_and_plan_count_the_recurrent_state(models, name):
    from ggml_hybrid.plan.model_info import describe, format_text
    from ggml_hybrid.plan.plan_text import format_text as plan_text
    from ggml_hybrid.plan.planner import plan

    d = describe(models[name])
    f = d["family"]
    assert f["supported"] and f["attention"] == "gated delta-net + grouped-query"
    assert f["delta_net_layers"] == 2 and f["attention_layers"] == 2
    # KV only for the two attention layers; per sequence per delta-net layer: conv (4-1) * (2*32 + 64) floats and
    # ssm 16 * 64 floats (F32)
    assert f["kv_bytes_per_token"]["f16"] == 2 * 2 * 2 * 32 * 2
    per_seq = 2 * 4 * (3 * 128 + 16 * 64)
    assert f["recurrent_bytes_per_sequence"] == per_seq
    assert "recurrent state per sequence" in format_text(d)
    p = plan(models[name], SessionOptions(n_ctx=256), parallel=PLAN_PARALLEL)
    assert p.kv.per_token == f["kv_bytes_per_token"]["f16"]
    r = p.recurrent
    assert r is not None and r.per_sequence == per_seq and r.parallel == PLAN_PARALLEL
    # two rows per slot and one zero row, measured on the dry run's buffers; counted in the host's resident total
    assert r.total >= (2 * PLAN_PARALLEL + 1) * per_seq and r.total == sum(v.recurrent for v in p.devices.values()) \
        + p.host.recurrent
    assert p.host.resident_total == p.host.kv_cache + p.host.recurrent + p.host.compute
    assert "recurrent state" in plan_text(p) and p.to_dict()["recurrent"] == {
        "per_sequence": per_seq, "parallel": PLAN_PARALLEL, "total": r.total}
    one = plan(models[name], SessionOptions(n_ctx=256), parallel=1)
    assert one.recurrent is not None and one.recurrent.total >= 3 * per_seq
    # for one sequence, exactly what a load allocates (run stats count it too)
    for items in ([], ["virtual_devices=2", "no_kv_offload=true", "disk_experts=1", "expert_cache_slots=2"]):
        opts = SessionOptions.parse(items + ["n_ctx=256", "n_threads=1"])
        q = plan(models[name], opts)
        with MoEModel(models[name], opts) as m:
            for dev in m.devices:
                assert q.devices[dev].recurrent == m.device_memory(dev)["recurrent"]
                assert q.devices[dev].total == sum(m.device_memory(dev).values())
            assert q.host.recurrent == m.rs.nbytes(m.host)
    # the states live with their layers' memory: split over two devices, or all in host memory without offload
    two = plan(models[name], SessionOptions(n_ctx=256, virtual_devices=2))
    delta_on = {two.layout.kv[i] for i in (0, 2)}  # layers 1 and 3 attend
    assert all((v.recurrent > 0) == (d in delta_on) for d, v in two.devices.items()) and two.host.recurrent == 0
    assert sum(v.recurrent for v in two.devices.values()) >= 3 * per_seq
    host = plan(models[name], SessionOptions(n_ctx=256, virtual_devices=2, no_kv_offload=True))
    assert all(v.recurrent == 0 for v in host.devices.values()) and host.host.recurrent >= 3 * per_seq


U32 = (gguf_type := __import__("gguf").GGUFValueType).UINT32
# (model, edit, words the one error must name): bad values and features that are not implemented
REFUSALS = [
    ("qwen3next", dict(set_keys={"qwen3next.ssm.inner_size": (48, U32)}), ["ssm.inner_size", "48", "16 * 4"]),
    ("qwen3next", dict(set_keys={"qwen3next.ssm.group_count": (3, U32)}), ["ssm.time_step_rank", "multiple"]),
    ("qwen3next", dict(set_keys={"qwen3next.ssm.conv_kernel": (1, U32)}), ["ssm.conv_kernel", "not supported"]),
    ("qwen3next", dict(set_keys={"qwen3next.full_attention_interval": (0, U32)}), ["full_attention_interval",
                                                                                  "in 1.."]),
    ("qwen3next", dict(drop_keys=("qwen3next.ssm.state_size",)), ["ssm.state_size"]),
    ("qwen3next", dict(set_keys={"qwen3next.attention.recurrent_layers": (
        [True, False], gguf_type.ARRAY, gguf_type.BOOL)}), ["attention.recurrent_layers", "one per block"]),
    ("qwen3next", dict(set_keys={"qwen3next.rope.dimension_count": (40, U32)}), ["rope.dimension_count", "40"]),
    ("qwen35moe", dict(drop_keys=("qwen35moe.rope.dimension_sections",)), ["rope.dimension_sections"]),
    ("qwen35moe", dict(set_keys={"qwen35moe.rope.dimension_sections": (
        [2, 1, 1], gguf_type.ARRAY, gguf_type.INT32)}), ["rope.dimension_sections", "4 non-negative"]),
    ("qwen35moe", dict(set_keys={"qwen35moe.rope.dimension_sections": (
        [0, 0, 0, 4], gguf_type.ARRAY, gguf_type.INT32)}), ["rope.dimension_sections", "first three"]),
    ("qwen35moe", dict(drop_tensors=("blk.0.attn_qkv.weight",)), ["blk.0.attn_qkv.weight"]),
    ("qwen35moe", dict(tensors={"blk.0.ssm_conv1d.weight": np.ones((128, 4), np.float16)}),
     ["blk.0.ssm_conv1d.weight", "F32"]),
    ("qwen35moe", dict(tensors={"blk.0.attn_qkv.scale": np.ones(1, np.float32)}), ["blk.0.attn_qkv.scale"]),
    ("qwen35moe", dict(drop_tensors=("blk.1.ffn_gate_inp_shexp.weight",)), ["blk.1.ffn_gate_inp_shexp.weight"]),
]


@pytest.mark.parametrize("name, edit, words", REFUSALS, ids=[f"{r[0]}-{r[2][0]}-{i}" for i, r in enumerate(REFUSALS)])
def test_bad_files_are_one_clear_error(models, tmp_path, name, edit, words):
    from click.testing import CliRunner

    from ggml_hybrid.cli import main

    path = rewrite_gguf(models[name], tmp_path / "edited.gguf", **edit)
    with pytest.raises(ModelFileError) as ei:
        MoEModel(path, SessionOptions(n_threads=1))
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    r = CliRunner().invoke(main, ["run", path, "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and r.output.count("error:") == 1 and words[0] in r.output


def test_cuda_limits_are_refused_before_ggml_would_abort(models):
    from ggml_hybrid.gguf.store import GGUFStore
    from ggml_hybrid.model.families import read_hparams
    from ggml_hybrid.model.families.recurrent import check_cuda

    store = GGUFStore(models["qwen3next"])
    try:
        hp = read_hparams(store)
    finally:
        store.close()
    check_cuda("m.gguf", hp, ["CUDA0"])  # state size 16, channels 128 with width 4: GGML's kernels take them
    check_cuda("m.gguf", hp, ["DEV0"])
    from dataclasses import replace

    odd = replace(hp, delta_net=replace(hp.delta_net, d_state=24))
    check_cuda("m.gguf", odd, ["DEV0"])  # the CPU takes any size
    with pytest.raises(ModelFileError, match="ssm.state_size = 24 is not supported on a CUDA device"):
        check_cuda("m.gguf", odd, ["CUDA0"])
    with pytest.raises(ModelFileError, match="ssm.conv_kernel = 6"):
        check_cuda("m.gguf", replace(hp, delta_net=replace(hp.delta_net, d_conv=6)), ["CUDA0"])


PLAN_PARALLEL = 2


@pytest.fixture(scope="module")
def slotted(models):
    """One model per (family, n_parallel), loaded once for the hypothesis examples."""
    held: dict[tuple[str, int], MoEModel] = {}

    def get(name: str, n_parallel: int, ubatch: int) -> MoEModel:
        key = (name, n_parallel, ubatch)
        if key not in held:
            held[key] = MoEModel(models[name], SessionOptions(n_threads=1, n_ctx=64, n_parallel=n_parallel,
                                                             ubatch_size=ubatch))
        return held[key]

    yield get
    for m in held.values():
        m.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: each example costs model evals
@given(data=st.data(), name=st.sampled_from(sorted(SPECS)), n_parallel=st.integers(2, 3),
       ubatch=st.sampled_from([3, 512]))
def test_each_sequence_of_a_recurrent_model_is_as_if_alone(slotted, data, name, n_parallel, ubatch):
    """Sequences of a qwen35moe / qwen3next model sharing one model, their prompts evaluated in their slots and
    their tokens decoded together (several per ubatch), arriving at drawn steps, finished slots reused, a
    sequence moved to a lower slot: each sequence's logits are bit for bit those of running it alone."""
    n_seqs = data.draw(st.integers(n_parallel, n_parallel + 2), "sequences")
    seqs = [(data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=9), f"prompt {j}"),
             data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=5), f"tokens {j}")) for j in range(n_seqs)]
    alone_m = slotted(name, 1, ubatch)
    alone = []
    for prompt, more in seqs:
        alone_m.reset()
        rows = [alone_m.eval(prompt)[-1]]
        rows += [alone_m.eval([t])[-1] for t in more[:-1]]
        alone.append(rows)
    m = slotted(name, n_parallel, ubatch)
    m.reset()
    got: list[list[np.ndarray]] = [[] for _ in seqs]
    waiting = list(range(n_seqs))
    slot_of: dict[int, int] = {}     # sequence -> slot
    done: dict[int, int] = {}        # sequence -> tokens fed after its prompt
    while waiting or slot_of:
        free = [s for s in range(n_parallel) if s not in slot_of.values()]
        if waiting and free and data.draw(st.booleans(), "arrive"):
            j, slot = waiting.pop(0), free[0]
            m.reset(slot)
            got[j].append(m.eval(seqs[j][0], seq=slot)[-1])
            slot_of[j], done[j] = slot, 0
            continue
        if slot_of and free and min(free) < max(slot_of.values()) and data.draw(st.booleans(), "move"):
            j = max(slot_of, key=lambda k: slot_of[k])
            m.move(slot_of[j], min(free))
            slot_of[j] = min(free)
            continue
        step = [(j, seqs[j][1][done[j]]) for j in slot_of if done[j] < len(seqs[j][1]) - 1]
        if step:
            out = m.decode([(slot_of[j], t) for j, t in step])
            for (j, _), row in zip(step, out):
                got[j].append(row)
                done[j] += 1
        for j in [j for j in slot_of if done[j] == len(seqs[j][1]) - 1]:
            m.reset(slot_of.pop(j))  # as the engine frees a finished request's slot
        if not step and waiting and not slot_of:
            j, slot = waiting.pop(0), 0
            m.reset(slot)
            got[j].append(m.eval(seqs[j][0], seq=slot)[-1])
            slot_of[j], done[j] = slot, 0
    for j in range(n_seqs):
        assert len(got[j]) == len(alone[j])
        assert all(np.array_equal(a, b) for a, b in zip(got[j], alone[j])), (j, seqs[j])


@pytest.mark.parametrize("name", list(SPECS))
def test_plan_parallel_recurrent_bytes_equal_the_runtime(models, name):
    """``plan --parallel N`` of a recurrent model: its recurrent (and KV) bytes per device and host are what a
    model loaded with ``n_parallel=N`` allocates."""
    from ggml_hybrid.plan.planner import plan

    for items in ([], ["virtual_devices=2", "disk_experts=1", "expert_cache_slots=2"], ["no_kv_offload=true"]):
        opts = SessionOptions.parse(items + ["n_ctx=256", "n_threads=1"])
        q = plan(models[name], opts, parallel=3)
        with MoEModel(models[name], opts.merged(n_parallel=3)) as m:
            assert m.rs is not None and m.rs.n_seq == 3
            for dev in m.devices:
                mem = m.device_memory(dev)
                assert (q.devices[dev].recurrent, q.devices[dev].kv_cache) == (mem["recurrent"], mem["kv_cache"])
            assert q.host.recurrent == m.rs.nbytes(m.host)
            assert q.recurrent is not None and q.recurrent.total == m.rs.nbytes()
            assert q.recurrent.total >= 7 * q.recurrent.per_sequence


def test_a_recurrent_sequence_goes_forward_only(models):
    """``truncate`` cannot take a recurrent state back: it refuses, and the sequence is untouched; keeping
    everything is allowed; one-sequence ``decode`` steps equal evals token by token (states committed per step)."""
    path = models["qwen35moe"]
    tokens = _tokens(path)
    with MoEModel(path, SessionOptions(n_threads=1, n_ctx=128)) as m:
        assert m.recurrent
        want = m.eval(tokens, "all")
        m.reset()
        m.eval(tokens[:4])
        with pytest.raises(ArgumentError, match=r"truncate: n_keep=2 < the 4 positions.*reset the sequence"):
            m.truncate(2)
        m.truncate(4)
        m.truncate(9)
        assert m.n_past == 4
        got = [m.decode([(0, t)])[0] for t in tokens[4:]]
        assert np.array_equal(np.stack(got), want[4:])
