"""gpt-oss through the native executor and the host tier: its experts' biases and clamped SwiGLU (``swiglu_oai``)
built by the C expert graphs, in every expert mode (cache slots, a CPU share, the host tier feeding slots or a CPU
playing the device), bit-identical to the resident default path.

The oracle is the default resident path of the same file (no region, every expert in memory), which is itself
bit-identical to llama.cpp (tests/test_reference.py): every run below must give its logits bit for bit and greedy
decoding its tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.moe.host_tier import frame_bytes
from ggml_hybrid.moe.native_executor import NativeExpertExecutor
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

# tests/test_families.py's gpt-oss: MXFP4 experts with biases, sliding-window layers, YaRN
SPEC = dict(arch="gpt-oss", n_layer=2, head_dim=32, expert_type="mxfp4", weight_type="q8_0", rope_scaling="yarn",
            rope_factor=8.0, rope_orig_ctx=256, n_swa=4)
PROMPT = [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gptoss") / "gptoss.gguf", seed=17, **SPEC)


def _layer_need(path):
    """The least tier: one layer's experts, weights and biases, in the tier's frames (from the file's tensors)."""
    store = GGUFStore(path)
    try:
        infos = [t for t in store.tensors() if t.name.startswith("blk.0.ffn_") and "_exps." in t.name]
        assert any(t.name.endswith(".bias") for t in infos)  # gpt-oss: the experts have biases
        return frame_bytes([[i.nbytes // i.shape[0] for i in infos]]) * infos[0].shape[0]
    finally:
        store.close()


def _n_expert(path):
    store = GGUFStore(path)
    try:
        return store.info("blk.0.ffn_down_exps.weight").shape[0]
    finally:
        store.close()


def _greedy(path, opts, n=5):
    """Prompt logits and n greedy steps (all logits), the tokens, and what ran: the executors' kinds and modes, the
    tier's counters, the layers' counters."""
    with MoEModel(path, opts) as m:
        out, toks = [m.eval(PROMPT, "all")], []
        for _ in range(n):
            toks.append(int(np.argmax(out[-1][-1])))
            out.append(m.eval([toks[-1]], "all"))
        exs = [e for e in m.experts.executors if e is not None]
        ran = {"native": {e.native for e in exs}, "modes": {getattr(e, "mode", "python") for e in exs},
               "tier": m.experts.tier.counters if m.experts.tier is not None else None,
               "counters": m.counters.total}
        return np.concatenate(out), toks, ran


BASE = dict(n_threads=1, n_ctx=256)


@pytest.fixture(scope="module")
def resident(gptoss):
    return _greedy(gptoss, SessionOptions(**BASE))


def test_the_native_executor_builds_gpt_oss_experts(gptoss):
    store = GGUFStore(gptoss)
    try:
        names = {k: f"blk.0.ffn_{k.removesuffix('_b')}_exps.{'bias' if k.endswith('_b') else 'weight'}"
                 for k in ("gate", "up", "down", "gate_b", "up_b", "down_b")}
        assert all(n in store for n in names.values())
    finally:
        store.close()
    assert NativeExpertExecutor.supports(names, "swiglu_oai")
    # a fused gate_up has no place for gate and up biases, nor for the clamped SwiGLU's two inputs
    assert not NativeExpertExecutor.supports({"gate_up": "g", "down": "d", "down_b": "b"}, "swiglu_oai")


# (options, the executor modes the run must have used: slots fed from the mapping, slots fed from the tier, or a
# CPU playing the device computing straight from the tier's frames)
MODES = {
    "slots": (dict(expert_cache_slots=2), {"slots"}),
    "share": (dict(expert_cache_slots=2, moe_cpu_share=0.5), {"slots"}),
    "share-auto": (dict(expert_cache_slots=2, moe_cpu_share="auto"), {"slots"}),
    "tier-direct": (dict(expert_cache_slots=2, host_tier_bytes="need", repack=False), {"direct"}),
    "tier-share": (dict(expert_cache_slots=2, host_tier_bytes="need", moe_cpu_share=0.5), {"tier"}),
    "tier-auto": (dict(expert_cache_slots=3, host_tier_bytes="need", moe_cpu_share="auto"), {"tier"}),
    "tier-all": (dict(expert_cache_slots=1, host_tier_bytes="all", moe_cpu_share=0.5, moe_prefetch=True), {"tier"}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_native_mode_gives_the_resident_tokens_and_logits(gptoss, resident, mode):
    extra, modes = MODES[mode]
    need = _layer_need(gptoss)
    tier = {"need": need, "all": SPEC["n_layer"] * need}.get(extra.get("host_tier_bytes"), 0)
    opts = SessionOptions(**BASE, **{**extra, "host_tier_bytes": tier}, disk_experts=True)
    ref, ref_toks, _ = resident
    got, toks, ran = _greedy(gptoss, opts)
    assert ran["native"] == {True} and ran["modes"] == modes, ran
    assert toks == ref_toks
    np.testing.assert_array_equal(got, ref)
    c = ran["counters"]
    assert c.misses + c.cpu_misses > 0 or mode == "tier-direct"
    if tier:
        assert ran["tier"].misses > 0 and ran["tier"].bytes_read > 0
        if mode == "tier-all":  # a tier holding every expert reads each one once, evicting none
            assert ran["tier"].evictions == 0 and ran["tier"].misses <= SPEC["n_layer"] * _n_expert(gptoss)


def test_the_python_executor_stays_an_option_with_the_tier(gptoss, resident):
    opts = SessionOptions(**BASE, disk_experts=True, expert_cache_slots=2, host_tier_bytes=_layer_need(gptoss),
                          moe_cpu_share=0.5, moe_executor="python")
    got, toks, ran = _greedy(gptoss, opts)
    assert ran["native"] == {False}
    assert toks == resident[1]
    np.testing.assert_array_equal(got, resident[0])
    assert ran["tier"].misses > 0


def test_run_serves_gpt_oss_from_the_host_tier(gptoss):
    """The command of issue 46 that was refused: the experts from disk through a host tier, the resident tokens."""
    base = ["run", gptoss, "-p", "Hello", "-n", "4", "-t", "1", "-c", "256", "--temp", "0", "--json"]
    ref = CliRunner().invoke(main, base)
    assert ref.exit_code == 0, ref.output
    r = CliRunner().invoke(main, [*base, "--expert-cache-slots", "4", "--host-tier", "30M"])
    assert r.exit_code == 0, r.output
    got, want = json.loads(r.output), json.loads(ref.output)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    assert got["host_tier"] is not None and got["counters"]["routed"] > 0



# -- the converter-made gpt-oss (tests/test_converted.py's files): the tier's logits are llama.cpp's ----------------

CONVERTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "converted")
# (options, the executors' mode)
TIER_MODES = {"tier": (dict(moe_cpu_share=0.5), "tier"), "tier-direct": (dict(repack=False), "direct"),
              "tier-auto": (dict(moe_cpu_share="auto"), "tier")}


@pytest.mark.parametrize("mode", sorted(TIER_MODES))
@pytest.mark.parametrize("t", ["f32", "f16", "q8_0", "q4_k_m"])
def test_converted_gpt_oss_through_the_tier_gives_llama_cpps_logits(mode, t):
    """llama.cpp's logits recorded on the converter-made file (the whole prompt, and the token-by-token decode where
    recorded), bit for bit on a CPU of the recording's SIMD features (else within test_converted's bound), now
    with every expert read through the host tier and computed by the native executor."""
    from make_reference_fixtures import load_for_cpu
    from test_converted import _parity

    fx, exact = load_for_cpu(os.path.join(CONVERTED, "gpt-oss.npz"), None)
    fx = {**fx, "exact": exact}
    path = os.path.join(CONVERTED, f"gpt-oss-{t}.gguf")
    tokens = [int(x) for x in fx["tokens"]]
    opts = SessionOptions(**BASE, disk_experts=True, expert_cache_slots=2, host_tier_bytes=_layer_need(path),
                          **TIER_MODES[mode][0])
    with MoEModel(path, opts) as m:
        assert m.experts.tier is not None
        assert {(e.native, e.mode) for e in m.experts.executors if e is not None} == {(True, TIER_MODES[mode][1])}
        _parity(m.eval(tokens, "all"), fx[f"{t}_logits"], fx, t)
        if f"{t}_decode" in fx:
            m.reset()
            n = int(fx["decode_from"])
            rows = [m.eval(tokens[:n], "all")] + [m.eval(tokens[i:i + 1], "all") for i in range(n, len(tokens))]
            _parity(np.concatenate(rows), fx[f"{t}_decode"], fx, t)
        assert m.experts.tier.counters.misses > 0
