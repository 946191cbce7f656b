"""Checks that need a GPU backend: CUDA, or Vulkan (in CI: Mesa's lavapipe, a Vulkan driver that runs on the CPU,
with ``GGML_VK_VISIBLE_DEVICES=0``); skipped where this install has neither a CUDA nor a Vulkan device.

The device is the first of ``gpu_device_names()`` (CUDA0 before Vulkan0), or ``GGML_HYBRID_TEST_GPU``. Run by
tools/device_check.sh on a GPU machine. Oracles: numpy for the region test; for the models, the same generated
model resident on the device (the default path, bit-identical claims) and on the CPU (CPU-side arithmetic differs
from the device's: tools/parity.py's rules).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from parity import greedy_run, parity_rule

import ggml_hybrid as gh
from ggml_hybrid import lib
from ggml_hybrid._native import ffi
from ggml_hybrid._native.backends import optional_backends
from ggml_hybrid.cli import main
from ggml_hybrid.ggml.backend import Buffer, cpu_instance, gpu_device_names
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

_GPUS = gpu_device_names()
GPU = os.environ.get("GGML_HYBRID_TEST_GPU") or (_GPUS[0] if _GPUS else "")
BACKEND = GPU.rstrip("0123456789")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="no CUDA or Vulkan device in this build")]

# What each check allows, by backend, oracle and weight type (bit-identical where it holds, else a bound measured on
# a device and why): tools/parity.py's rules, which tools/device_check.py applies too.

PROMPT = [5, 17, 42, 101, 7, 250, 33, 64]
N_PREDICT = 8


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def model_path(request, tmp_path_factory):
    # 4 layers, 16 experts top-4: 2 slots per layer cannot hold a token's experts, so every step loads
    return write_model(tmp_path_factory.mktemp("gpu") / f"m_{request.param}.gguf", n_layer=4, n_expert=16, n_used=4,
                       weight_type=request.param, seed=3)


def _rule(path, oracle: str):
    """The rule of tools/parity.py for this backend against ``oracle``, for the model's weight type (m_TYPE.gguf)."""
    return parity_rule(BACKEND, oracle, Path(path).stem.split("_", 1)[1])


def _within(path, got, ref, oracle: str = "cpu") -> None:
    rule = _rule(path, oracle)
    ok, rel = rule.check(got[1], ref[1], got[0], ref[0])
    assert ok, f"{GPU} against {oracle}: relative diff {rel:.3g}, tokens {got[0]} vs {ref[0]}; rule: {rule.text}"


def _run(path, items=(), device=None):
    """(greedy tokens, logits of every eval, the expert counters' total, the layout), on GPU unless ``device``."""
    items = list(items) + ([f"devices={GPU}"] if device is None else [])
    with MoEModel(path, SessionOptions.parse(items), device=device) as m:
        tokens, logits = greedy_run(m, PROMPT, N_PREDICT)
        return tokens, logits, m.counters.total, m.layout


@pytest.fixture(scope="module")
def gpu_ref(model_path):
    tokens, logits, _, _ = _run(model_path)
    return tokens, logits


@pytest.fixture(scope="module")
def cpu_ref(model_path):
    dev = cpu_instance(0, 2)
    try:
        tokens, logits, _, _ = _run(model_path, device=dev)
    finally:
        dev.close()
    return tokens, logits


def test_gpu_backend_registers_its_devices():
    st = optional_backends()[BACKEND]
    assert st.loaded and st.devices >= 1 and st.detail == ""
    names = [d.name for d in gh.devices()]
    assert GPU in names and "CPU" in names
    out = CliRunner().invoke(main, ["devices"]).output
    rows = [ln.split() for ln in out.splitlines()]
    assert [GPU, "gpu"] in [r[:2] for r in rows], out


def test_default_path_runs_on_the_gpu(model_path, gpu_ref):
    with MoEModel(model_path, SessionOptions.parse([f"devices={GPU}"])) as m:
        assert m.device.name == GPU and set(m.layout.layer_device) == {GPU}
        assert m.device_memory()["weights"] > 0
        tokens, logits = greedy_run(m, PROMPT, N_PREDICT)
    np.testing.assert_array_equal(logits, gpu_ref[1])  # deterministic: the same run twice is the same


def test_gpu_matches_cpu(model_path, gpu_ref, cpu_ref):
    _within(model_path, gpu_ref, cpu_ref)


@pytest.mark.parametrize("share", ["0", "0.5", "auto"])
def test_expert_cache_on_the_gpu(model_path, gpu_ref, share):
    items = ["disk_experts=1", "expert_cache_slots=2", f"moe_cpu_share={share}"]
    tokens, logits, total, _ = _run(model_path, items)
    assert total.misses + total.cpu_misses > 0 and total.hits + total.misses + total.cpu_misses == total.distinct
    if share == "0":
        # the cache computes the same device ops over slot tensors: bit-identical to every expert resident
        assert total.cpu_misses == 0
        _within(model_path, (tokens, logits), gpu_ref, "resident")
    else:
        # the CPU's rows come from CPU arithmetic: within the device-vs-CPU rule (each expert's rows against that
        # expert alone on its backend: tests/test_gpu_experts.py)
        assert share == "auto" or total.cpu_misses > 0
        _within(model_path, (tokens, logits), gpu_ref)


@pytest.mark.parametrize("executor", ["native", "python"])
@pytest.mark.parametrize("n_prompt", [8, 12], ids=["mat-vec", "tiled"])
def test_expert_cache_rounds_keep_the_resident_kernels(model_path, executor, n_prompt):
    """A prompt whose experts need several rounds of 2 slots: on either side of GGML Vulkan's 8-token switch from
    the mat-vec mul_mat_id kernel to the tiled one, each round's rows equal every expert resident, bit for bit."""
    prompt = (PROMPT * 2)[:n_prompt]
    with MoEModel(model_path, SessionOptions.parse([f"devices={GPU}"])) as m:
        ref = m.eval(prompt, "all")
    items = ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0", f"moe_executor={executor}", f"devices={GPU}"]
    with MoEModel(model_path, SessionOptions.parse(items)) as m:
        got = m.eval(prompt, "all")
        assert m.counters.total.misses > 2 * m.hp.n_layer  # more experts than slots: several rounds per layer
    np.testing.assert_array_equal(got, ref)


def test_cpu_moe_keeps_experts_on_the_host(model_path, gpu_ref):
    tokens, logits, _, layout = _run(model_path, ["cpu_moe=1"])
    assert set(layout.expert_mode) == {"cpu"} and set(layout.layer_device) == {GPU}
    _within(model_path, (tokens, logits), gpu_ref)


def test_no_kv_offload_keeps_the_cache_on_the_host(model_path, gpu_ref):
    tokens, logits, _, layout = _run(model_path, ["no_kv_offload=1"])
    assert set(layout.kv_device) == {"CPU"}
    _within(model_path, (tokens, logits), gpu_ref)


@pytest.mark.parametrize("items", [["n_gpu_layers=2"], [r"override_tensor=blk\.[01]\.=CPU"]],
                         ids=["ngl", "override_tensor"])
def test_layers_split_between_the_gpu_and_cpu(model_path, gpu_ref, items):
    tokens, logits, _, layout = _run(model_path, items)
    placed = set(layout.tensors.values())
    assert {GPU, "CPU"} <= placed
    _within(model_path, (tokens, logits), gpu_ref)


def test_pinned_host_buffer_uploads_to_the_device():
    """The device's host buffer type (pinned memory): what pinned expert uploads go through."""
    dev = lib.ggml_backend_dev_by_name(GPU.encode())
    buft = lib.ggml_backend_dev_host_buffer_type(dev)
    assert buft != ffi.NULL
    pinned = Buffer(lib.ggml_backend_buft_alloc_buffer(buft, 1 << 20))
    assert pinned.is_host and "Host" in pinned.name
    device = gh.gpu(GPU)
    src_ctx, dst_ctx = gh.Context(n_tensors=2), gh.Context(n_tensors=2)
    src = src_ctx.new_tensor("q8_0", (64, 256), "staged")
    dst = dst_ctx.new_tensor("q8_0", (64, 256), "slot")
    pinned.place(src, 0)
    dst_ctx.allocate(device)
    data = gh.quantize(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), "q8_0")
    src.set(data)
    lib.ggml_backend_tensor_copy(src.ptr, dst.ptr)
    device.synchronize()
    np.testing.assert_array_equal(dst.numpy(), src.numpy())
    for x in (dst_ctx, src_ctx, pinned, device):
        x.close()


def test_region_on_the_device_gets_copies_of_host_inputs():
    dev, cpu = gh.gpu(GPU), gh.cpu(2)
    c = gh.Context(n_tensors=32, graph_size=64)
    x = c.new_tensor("f32", (4, 16), "x").set_input()
    pre = c.scale(x, 2.0)
    pre.name = "pre"
    g = c.new_graph(64).expand(pre)
    y = c.silu(c.scale(pre, 0.5))
    out = c.add(y, pre)
    g.expand(out)
    xv = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    seen = []

    def executor(call):
        seen.append((call.backend.name, call.inputs[0].is_host, call.inputs[0].name))
        call.compute_own_nodes()

    with gh.Scheduler([dev, cpu], graph_size=128) as s:
        s.set_tensor_backend(pre, cpu)  # the input is made on the host...
        s.add_region([pre], [y], executor, backend=dev)  # ...and the region runs on the device
        s.alloc(g)
        x.set(xv)
        s.compute(g)
        got = out.numpy()
    pre_ref = 2 * xv
    ref = pre_ref * 0.5 / (1 + np.exp(-pre_ref * 0.5)) + pre_ref
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # the device's silu vs numpy: float32 rounding
    backend_name, on_host, name = seen[0]
    assert backend_name == dev.name and not on_host  # the executor got its input in the device's memory
    if BACKEND == "CUDA":
        # a copy of the host tensor (on Vulkan0 the executor was handed "pre" itself, in device memory)
        assert name != "pre"


def test_plan_asks_the_gpu_for_its_memory(model_path):
    free = next(d.memory_free for d in gh.devices() if d.name == GPU)
    res = CliRunner().invoke(main, ["plan", str(model_path), "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(next(ln for ln in res.output.splitlines() if ln.startswith("{")))
    assert list(plan["devices"]) == [GPU] and plan["devices"][GPU]["vram"] == free


def test_a_cached_prompt_graph_runs_again_after_a_decode_and_a_reset(model_path):
    """eval 4 tokens, eval 1, reset, eval 4 again (what a second request of a session does), in a child process: an
    abort inside GGML must not take the test run with it. It aborted on Vulkan0 (GGML's scheduler left the graph's
    sources replaced by copies in a context the next split freed; patch 0001)."""
    code = ("import sys\nfrom ggml_hybrid.options import SessionOptions\n"
            "from ggml_hybrid.runtime.moe_model import MoEModel\n"
            f"with MoEModel(sys.argv[1], SessionOptions.parse(['devices={GPU}'])) as m:\n"
            "    a = m.eval([7, 8, 9, 10]); m.eval([11]); m.reset(); b = m.eval([7, 8, 9, 10])\n"
            "    assert (a == b).all()\nprint('ok')\n")
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    res = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("items", [[], ["disk_experts=1", "expert_cache_slots=2"]], ids=["resident", "cache"])
def test_several_sequences_in_one_decode_step_against_their_lone_runs(model_path, items):
    """Three sequences decoded together (``MoEModel.decode``), each against itself run alone on the device, by
    tools/parity.py's "alone" rule. On the CPU they are bit-identical (row-wise products, patch 0005); GGML's
    Vulkan kernels give a row among up to 8 others other last bits (lavapipe: 2e-7), and from 9 rows a tiled kernel
    (1e-3), which the step's limit on Vulkan keeps out (``decode_rows``). The cache at share 0 only: with a CPU
    share, which misses the CPU takes depends on the step's other sequences, so an expert of a sequence may be
    computed by the CPU in one run and by the device in the other (the "cpu" rule's difference)."""
    n, steps = 3, 2
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 300, 3 + i).tolist() for i in range(n)]
    toks = rng.integers(4, 300, (steps, n)).tolist()
    opts = SessionOptions.parse([*items, f"devices={GPU}", f"n_parallel={n}"])
    with MoEModel(model_path, opts) as m:
        if BACKEND == "Vulkan":
            assert m.decode_rows == 8  # the mat-vec limit (a cache's rounds run the call's graph: the same kernels)
        firsts = [m.eval(p, seq=i)[-1] for i, p in enumerate(prompts)]
        together = np.stack([np.stack(firsts)] + [m.decode([(i, t[i]) for i in range(n)]) for t in toks], axis=1)
    rule = _rule(model_path, "alone")
    with MoEModel(model_path, SessionOptions.parse([*items, f"devices={GPU}"])) as m:
        for i in range(n):
            m.reset()
            alone = np.stack([m.eval(prompts[i])[-1]] + [m.eval([t[i]])[-1] for t in toks])
            np.testing.assert_array_equal(together[i, 0], alone[0])  # the prompt ran alone in both
            ok, rel = rule.check(together[i, 1:], alone[1:], [0], [0])
            assert ok and (together[i, 1:].argmax(-1) == alone[1:].argmax(-1)).all(), \
                f"sequence {i}: relative diff {rel:.3g}; rule {rule.text} ({rule.why})"


@pytest.fixture(scope="module")
def gptoss_path(tmp_path_factory):
    # tests/test_gptoss_tier.py's gpt-oss: MXFP4 experts with biases, the clamped SwiGLU
    return write_model(tmp_path_factory.mktemp("gpu") / "gptoss.gguf", arch="gpt-oss", n_layer=2, head_dim=32,
                       expert_type="mxfp4", weight_type="q8_0", rope_scaling="yarn", rope_factor=8.0,
                       rope_orig_ctx=256, n_swa=4, seed=17)


@pytest.mark.parametrize("items", [[], ["host_tier_bytes=1M"], ["host_tier_bytes=1M", "moe_prefetch=1"]],
                         ids=["slots", "tier", "tier-prefetch"])
def test_gpt_oss_from_the_slots_and_the_tier_is_bit_identical_to_resident(gptoss_path, items):
    """gpt-oss's expert biases loaded into device slots (staged or queued uploads, from the mapping or the tier's
    pinned frames) and its clamped SwiGLU built by the native executor: the resident device run bit for bit (share
    0: a CPU share's rows come from the CPU's kernels)."""
    ref_tokens, ref_logits, _, _ = _run(gptoss_path)
    with MoEModel(gptoss_path, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2", f"devices={GPU}",
                                                     *items])) as m:
        tokens, logits = greedy_run(m, PROMPT, N_PREDICT)
        modes = {e.mode for e in m.experts.executors if e is not None}
        total, tier = m.counters.total, m.experts.tier
        assert modes == ({"tier"} if items else {"slots"}) and total.misses > 0
        assert tier is None or tier.counters.misses > 0
    assert tokens == ref_tokens
    np.testing.assert_array_equal(logits, ref_logits)
