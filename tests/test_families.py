"""The families beyond qwen: every expert mode bit-identical to resident, dense layers and shared experts outside
the expert cache, the region covering exactly the routed experts, traces of MoE layers only, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import region_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_hybrid.errors import ModelFileError, OptionError
from ggml_hybrid.model.kv_cache import SeqRows
from ggml_hybrid.moe.traces import read_trace
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

# small models of each family, with what makes it different switched on (dense leading layers, groups, MXFP4...)
SPECS = {
    "olmoe": dict(arch="olmoe", n_head_kv=4, head_dim=16),
    "glm4moe": dict(arch="glm4moe", n_layer=3, n_dense_lead=1, n_rot=16, gating="sigmoid", weights_scale=2.5,
                    nextn=1, qk_norm=True),
    "deepseek2": dict(arch="deepseek2", n_layer=3, n_dense_lead=1, n_expert=16, n_used=4, gating="sigmoid",
                      weights_scale=2.5, n_group=4, n_group_used=2, rope_scaling="yarn", rope_factor=40.0,
                      rope_orig_ctx=512, yarn_log_mul=0.1),
    "gpt-oss": dict(arch="gpt-oss", n_layer=2, head_dim=32, expert_type="mxfp4", weight_type="q8_0",
                    rope_scaling="yarn", rope_factor=8.0, rope_orig_ctx=256, n_swa=4),
    "llama-spm": dict(arch="llama", vocab="spm", vocab_size=512),
}
PROMPT = "The cache runs the hits first, then the misses."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {name: write_model(d / f"{name}.gguf", seed=17, **spec) for name, spec in SPECS.items()}


def _logits(path, opts: SessionOptions, tokens):
    with MoEModel(path, opts) as m:
        first = m.eval(tokens[:5], "all")
        return np.concatenate([first, m.eval(tokens[5:], "all")]), m.counters


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SPECS)), mode=st.sampled_from(["cpu_moe", "n_cpu_moe", "cache", "hybrid", "auto"]),
       slots=st.integers(1, 8), share=st.sampled_from([0.5, 1.0]), ubatch=st.sampled_from([3, 512]),
       flash=st.booleans())
def test_every_mode_is_bit_identical_to_resident(models, name, mode, slots, share, ubatch, flash):
    path = models[name]
    base = dict(n_threads=1, n_ctx=256, ubatch_size=ubatch, flash_attn=flash)
    extra = {"cpu_moe": dict(cpu_moe=True), "n_cpu_moe": dict(n_cpu_moe=2),
             "cache": dict(disk_experts=True, expert_cache_slots=slots),
             "hybrid": dict(disk_experts=True, expert_cache_slots=slots, moe_cpu_share=share),
             "auto": dict(disk_experts=True, expert_cache_slots=slots, moe_cpu_share="auto")}[mode]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
    ref, _ = _logits(path, SessionOptions(**base), tokens)
    got, counters = _logits(path, SessionOptions(**base, **extra), tokens)
    assert np.array_equal(got, ref)
    if mode in ("cache", "hybrid", "auto"):
        assert counters.total.misses + counters.total.cpu_misses > 0


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("share", [0.0, 0.5, "auto"])
def test_disk_experts_with_each_cpu_share_for_every_family(models, name, share):
    path = models[name]
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
    ref, _ = _logits(path, SessionOptions(n_threads=1, n_ctx=256), tokens)
    got, counters = _logits(path, SessionOptions(n_threads=1, n_ctx=256, disk_experts=True, expert_cache_slots=2,
                                                 moe_cpu_share=share), tokens)
    assert np.array_equal(got, ref)
    if share == 0.5:
        assert counters.total.cpu_misses > 0 and counters.total.misses > 0
    elif share == 0.0:
        assert counters.total.cpu_misses == 0 and counters.total.misses > 0


@pytest.mark.parametrize("name", ["glm4moe", "deepseek2", "gpt-oss"])
def test_region_covers_exactly_the_routed_experts(models, name):
    with MoEModel(models[name], SessionOptions(n_threads=1, disk_experts=True, expert_cache_slots=4)) as m:
        g = m._graph((SeqRows(0, 4, 256),), 4)
        hp = m.hp
        for il in range(hp.n_layer):
            r = g.regions[il]
            if il < hp.n_dense_lead:
                assert r is None and m.experts.executors[il] is None  # a dense layer has no region, no cache
                continue
            used = region_weights(r)
            assert used and all(n.startswith(f"blk.{il}.ffn_") and "_exps." in n for n in used), used
            kinds = {n.split(".")[2] for n in used}
            assert kinds == {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
        # dense layers and shared experts stay where the layout puts them, never in a cache
        assert m.layout.expert_mode[:hp.n_dense_lead] == ("dense",) * hp.n_dense_lead
        assert set(m.layout.expert_mode[hp.n_dense_lead:]) == {"disk"}
        cached = {n for ex in m.experts.executors if ex is not None for n in ex.names.values()}
        assert not any("shexp" in n or ".ffn_gate." in n or ".ffn_up." in n for n in cached)


def test_n_cpu_moe_counts_dense_layers_as_llama_cpp(models):
    # llama.cpp's --n-cpu-moe N matches blk.0 .. blk.N-1 expert tensors: a dense layer 0 has none
    with MoEModel(models["deepseek2"], SessionOptions(n_threads=1, n_cpu_moe=2)) as m:
        assert m.layout.expert_mode == ("dense", "cpu", "resident")
        assert m.layout.tensors["blk.0.ffn_down.weight"] != "CPU" or not m.devices


def test_traces_record_moe_layers_only(models, tmp_path):
    trace = tmp_path / "t.bin"
    with MoEModel(models["glm4moe"], SessionOptions(n_threads=1, disk_experts=True, expert_cache_slots=3,
                                                    trace_path=str(trace))) as m:
        m.eval(m.tokenizer.encode(PROMPT))
    t = read_trace(trace)
    assert t.n_layer == 2  # three layers, the first dense
    assert {layer for layer, _ in t.calls} == {0, 1}


def test_gpt_oss_sliding_window_layers_see_only_the_window(models):
    """Layers 0 and 2.. use the sliding window: a token more than n_swa back changes nothing in their mask."""
    with MoEModel(models["gpt-oss"], SessionOptions(n_threads=1)) as m:
        assert m.hp.swa is not None and m.hp.swa.layers == (True, False)
        feed = m.kv.inputs(3, 256, np.float32)
    pos = feed["pos"]
    cells = np.arange(256)
    for t, p in enumerate(pos):
        assert np.array_equal(np.isfinite(feed["mask_swa"][t]), (cells <= p) & (cells > p - 4))
        assert np.array_equal(np.isfinite(feed["mask"][t]), cells <= p)


@pytest.mark.parametrize("opts, msg", [
    (dict(cache_type_k="q8_0"), "same type"),
    (dict(cache_type_k="q8_0", cache_type_v="q8_0"), "flash_attn"),
])
def test_latent_cache_types_are_refused_like_llama_cpp(models, opts, msg):
    with pytest.raises(OptionError, match=msg):
        MoEModel(models["deepseek2"], SessionOptions(n_threads=1, **opts))


def test_unsupported_family_names_the_architecture(tmp_path):
    from helpers import rewrite_gguf

    src = write_model(tmp_path / "q.gguf")
    path = rewrite_gguf(src, tmp_path / "x.gguf", arch="jamba")
    with pytest.raises(ModelFileError, match="general.architecture = 'jamba' is not supported"):
        MoEModel(path, SessionOptions(n_threads=1))


@pytest.mark.parametrize("name", ["deepseek2", "gpt-oss", "glm4moe"])
def test_inspect_and_plan_know_the_family(models, name):
    from ggml_hybrid.plan.model_info import describe
    from ggml_hybrid.plan.planner import plan

    d = describe(models[name])
    f, spec = d["family"], SPECS[name]
    assert f["supported"] and f["dense_layers"] == spec.get("n_dense_lead", 0)
    assert d["experts"]["moe_layers"] == spec.get("n_layer", 2) - spec.get("n_dense_lead", 0)
    # KV per token from the metadata alone: latent attention caches kv_lora_rank + rope dims, K only
    n_layer = spec.get("n_layer", 2)
    if name == "deepseek2":
        assert f["attention"] == "latent (MLA)" and f["kv_bytes_per_token"]["f16"] == n_layer * (64 + 32) * 2
    else:
        kv_heads, hd = 2, spec.get("head_dim", 32)
        assert f["kv_bytes_per_token"]["f16"] == n_layer * 2 * kv_heads * hd * 2
    if name == "gpt-oss":
        assert f["sliding_window"] == {"n_swa": 4, "layers": 1}
    # the planner's dry run allocates exactly that per token
    p = plan(models[name], SessionOptions(n_ctx=256))
    assert p.kv.per_token == f["kv_bytes_per_token"]["f16"]
    assert p.layout.experts[:f["dense_layers"]] == ["dense"] * f["dense_layers"]


U32, F32, STR = (gguf_type := __import__("gguf").GGUFValueType).UINT32, gguf_type.FLOAT32, gguf_type.STRING
# (family, edit, words the one error must name): files of a family that use a feature not implemented here
REFUSALS = [
    ("deepseek2", dict(drop_keys=("deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla")),
     ["deepseek2", "key_length_mla", "legacy"]),
    ("deepseek2", dict(set_keys={"deepseek2.attention.temperature_scale": (0.5, F32)}),
     ["deepseek2", "attention.temperature_scale"]),
    ("deepseek2", dict(set_keys={"deepseek2.expert_gating_func": (3, U32)}), ["deepseek2", "expert_gating_func"]),
    ("glm4moe", dict(set_keys={"glm4moe.rope.dimension_sections": ([8, 8, 0, 0], gguf_type.ARRAY, gguf_type.INT32)}),
     ["glm4moe", "rope.dimension_sections", "M-RoPE"]),
    ("glm4moe", dict(set_keys={"glm4moe.expert_shared_count": (0, U32)}), ["glm4moe", "expert_shared_count"]),
    ("glm4moe", dict(set_keys={"glm4moe.leading_dense_block_count": (3, U32)}),
     ["glm4moe", "leading_dense_block_count"]),
    ("gpt-oss", dict(set_keys={"gpt-oss.rope.dimension_count": (16, U32)}), ["gpt-oss", "rope.dimension_count"]),
    ("gpt-oss", dict(set_keys={"gpt-oss.rope.scaling.type": ("longrope", STR)}), ["gpt-oss", "longrope"]),
    ("olmoe", dict(set_keys={"olmoe.nextn_predict_layers": (1, U32)}), ["olmoe", "nextn_predict_layers"]),
    ("llama-spm", dict(tensors={"blk.0.rope_freqs.weight": np.ones(16, np.float32)}),
     ["llama", "blk.0.rope_freqs.weight"]),
]


@pytest.mark.parametrize("name, edit, words", REFUSALS, ids=[f"{r[0]}-{r[2][1]}" for r in REFUSALS])
def test_unsupported_features_are_one_clear_error(models, tmp_path, name, edit, words):
    from click.testing import CliRunner
    from helpers import rewrite_gguf

    from ggml_hybrid.cli import main

    path = rewrite_gguf(models[name], tmp_path / "edited.gguf", **edit)
    with pytest.raises(ModelFileError) as ei:
        MoEModel(path, SessionOptions(n_threads=1))
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    r = CliRunner().invoke(main, ["run", path, "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and r.output.count("error:") == 1 and words[1] in r.output
