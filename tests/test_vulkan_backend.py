"""The Vulkan backend library, when this install has one (``GGML_HYBRID_VULKAN=1``; CI builds it and runs it on Mesa's
lavapipe): it loads into this ggml-base and registers its devices, or says in one line why there are none (no
Vulkan driver, or only a CPU driver GGML was not told to use); the package runs on the CPU either way. Its kernels
are checked against numpy here; tests/test_gpu.py runs the models on it.

Skipped without ``_native/backends/libggml-vulkan.so``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import EPS16, block_amax, check_close, dot_tol, q8_err, quantized

import ggml_hybrid as gh
from ggml_hybrid._native import buildinfo
from ggml_hybrid._native.backends import optional_backends
from ggml_hybrid.cli import main
from ggml_hybrid.errors import BackendError

VULKAN_LIB = buildinfo.BACKEND_DIR / "libggml-vulkan.so"

pytestmark = pytest.mark.skipif(not VULKAN_LIB.exists(), reason="this install has no Vulkan backend")

_STATUS = ("import sys; from ggml_hybrid._native.backends import optional_backends; "
           "st = optional_backends()['Vulkan']; print(st.loaded, st.devices); print(st.summary())")


def _in_a_process(env_changes: dict[str, str | None], code: str = _STATUS) -> list[str]:
    env = dict(os.environ)
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_vulkan_backend_gives_devices_or_one_reason():
    st = optional_backends()["Vulkan"]
    assert st.path == str(VULKAN_LIB)
    lines = [ln for ln in CliRunner().invoke(main, ["devices"]).output.splitlines() if "Vulkan" in ln]
    if st.devices:
        assert gh.vulkan_available() and gh.vulkan(0).name == "Vulkan0"
        assert lines[0].split()[:2] == ["Vulkan0", "gpu"]
        return
    assert not gh.vulkan_available()
    assert st.detail
    with pytest.raises(BackendError) as exc:
        gh.vulkan(0)
    assert str(exc.value) == st.summary()
    assert lines == [st.summary()]  # `devices`: exactly one line about Vulkan
    assert [d.name for d in gh.devices()][-1] == "CPU"


def test_without_a_vulkan_driver_the_package_runs_on_the_cpu():
    """No driver file (the Vulkan loader finds no ICD): the library loads, finds no device, and says why in one
    line; `devices` lists the CPU and that line; a graph computes on the CPU."""
    code = ("import numpy as np, ggml_hybrid as gh\n"
            "from click.testing import CliRunner\nfrom ggml_hybrid.cli import main\n"
            "from ggml_hybrid._native.backends import optional_backends\n"
            "st = optional_backends()['Vulkan']; print(st.loaded, st.devices); print(st.summary())\n"
            "print(CliRunner().invoke(main, ['devices']).output.replace('\\n', '|'))\n"
            "be = gh.cpu(1); c = gh.Context(n_tensors=4); x = c.new_tensor('f32', (2, 3), 'x'); c.allocate(be)\n"
            "x.set(np.arange(6, dtype=np.float32).reshape(2, 3)); print(float(x.numpy().sum()))\n")
    out = _in_a_process({"VK_DRIVER_FILES": "/nonexistent/icd.json", "VK_ICD_FILENAMES": "/nonexistent/icd.json"},
                        code)
    loaded, n = out[0].split()
    assert n == "0" and "running on the CPU" in out[1] and "Vulkan" in out[1]
    devices = out[2].split("|")
    assert [ln for ln in devices if "Vulkan" in ln] == [out[1]]
    assert any(ln.startswith("CPU") for ln in devices)
    assert out[3] == "15.0"


def test_a_cpu_vulkan_driver_is_used_only_when_named():
    """GGML skips a driver of device type CPU (lavapipe) unless GGML_VK_VISIBLE_DEVICES names it: the reason says
    how to use it. Only meaningful where the one driver is a CPU one (this CI machine)."""
    if not _lavapipe_only():
        pytest.skip("this machine has a Vulkan GPU driver (or none): GGML picks it without being told")
    out = _in_a_process({"GGML_VK_VISIBLE_DEVICES": None})
    assert out[0].split() == ["True", "0"], out
    assert "GGML_VK_VISIBLE_DEVICES=0" in out[1]
    out = _in_a_process({"GGML_VK_VISIBLE_DEVICES": "0"})
    assert out[0].split() == ["True", "1"], out
    assert out[1].startswith("Vulkan: 1 device(s)")


def _lavapipe_only() -> bool:
    try:
        res = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    types = [ln.split("=")[1].strip() for ln in res.stdout.splitlines() if "deviceType" in ln]
    return types == ["PHYSICAL_DEVICE_TYPE_CPU"]


needs_device = pytest.mark.skipif(not gh.vulkan_available(), reason="no Vulkan device (lavapipe needs "
                                                                    "GGML_VK_VISIBLE_DEVICES=0)")


@pytest.fixture(scope="module")
def vk0():
    dev = gh.vulkan(0)
    yield dev
    dev.close()


def _on_device(dev, wtype, w, x):
    """mul_mat(w, x) with w in a buffer of ``dev`` and x an input: the scheduler [dev, CPU] runs it on ``dev``."""
    cpu = gh.cpu(1)
    with gh.Context(n_tensors=1) as wctx, gh.Context(n_tensors=8, graph_size=16) as ctx, \
            gh.Scheduler([dev, cpu], graph_size=16) as sched:
        W = wctx.new_tensor(wtype, (64, 256), "w")
        wctx.allocate(dev, "weights")
        W.set(w)
        X = ctx.new_tensor("f32", x.shape, "x").set_input()
        Y = ctx.mul_mat(W, X).set_output()
        graph = ctx.new_graph(16).expand(Y)
        sched.alloc(graph)
        assert sched.tensor_backend(Y).name == dev.name  # computed on the device, not on the CPU
        X.set(x)
        sched.compute(graph)
        got = Y.numpy()
    cpu.close()
    return got


@needs_device
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0", "q4_0", "q4_k"])
def test_vulkan_matmul_matches_numpy(vk0, wtype):
    """mul_mat on Vulkan0 against numpy float64 over the dequantized weights. Bound: float32 rounding of a 256-term
    dot product, plus the rounding of the activations where the device's kernel converts them (to F16 for F16
    weights; to Q8_1, amax/127 per 32, for quantized weights when it uses integer dot products)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    if wtype == "f32":
        spec, wd = w, w.astype(np.float64)
    elif wtype == "f16":
        spec, wd = w.astype(np.float16), w.astype(np.float16).astype(np.float64)
    else:
        raw, wd = quantized(w, wtype)
        spec = raw.data
    got = _on_device(vk0, wtype, spec, x)
    x64 = x.astype(np.float64)
    ref = x64 @ wd.T
    x_err = {"f32": 0 * x64, "f16": EPS16 * np.abs(x64)}.get(wtype, q8_err(block_amax(x64, 32)))
    check_close(got, ref, dot_tol(np.abs(x64) @ np.abs(wd).T, 256) + x_err @ np.abs(wd).T, f"Vulkan mul_mat {wtype}")


def _mul_mat_id(dev, w, x, ids):
    cpu = gh.cpu(1)
    with gh.Context(n_tensors=1) as wctx, gh.Context(n_tensors=8, graph_size=16) as ctx, \
            gh.Scheduler([dev, cpu], graph_size=16) as sched:
        W = wctx.new_tensor("f32", w.shape, "w")
        wctx.allocate(dev, "weights")
        W.set(w)
        X = ctx.new_tensor("f32", x.shape, "x").set_input()
        ids_t = ctx.new_tensor("i32", ids.shape, "ids").set_input()
        Y = ctx.mul_mat_id(W, X, ids_t).set_output()
        graph = ctx.new_graph(16).expand(Y)
        sched.alloc(graph)
        X.set(x)
        ids_t.set(ids)
        sched.compute(graph)
        got = Y.numpy()
    cpu.close()
    return got


@needs_device
@pytest.mark.parametrize("n_tokens", [1, 8, 9, 32])
def test_mul_mat_id_over_slots_is_bit_identical_to_the_whole_tensor(vk0, n_tokens):
    """What the expert cache relies on: two experts copied into a 2-slot tensor give, through the device's
    mul_mat_id, the bits they give in the 16-expert tensor (the mat-vec kernel up to 8 tokens, the tiled one above)."""
    rng = np.random.default_rng(n_tokens)
    w = rng.standard_normal((16, 64, 128)).astype(np.float32)
    x = rng.standard_normal((n_tokens, 1, 128)).astype(np.float32)
    ids = np.tile(np.array([3, 11], np.int32), (n_tokens, 1))
    whole = _mul_mat_id(vk0, w, x, ids)
    slots = _mul_mat_id(vk0, w[[3, 11]], x, np.tile(np.array([0, 1], np.int32), (n_tokens, 1)))
    x64, w64 = x[:, 0].astype(np.float64), w[ids].astype(np.float64)
    ref = np.einsum("tk,tenk->ten", x64, w64)
    # above 8 tokens the tiled kernel takes both operands as fp16: one fp16 rounding of each factor
    absprod = np.einsum("tk,tenk->ten", np.abs(x64), np.abs(w64))
    check_close(whole, ref, dot_tol(absprod, 128) + (2 * EPS16 * absprod if n_tokens > 8 else 0), "mul_mat_id")
    np.testing.assert_array_equal(slots, whole)


@needs_device
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_the_host_tier_on_vulkan_uses_its_pinned_host_buffers(tmp_path, share):
    """With a device, the host tier's frames are the device's pinned host buffer type (Vulkan_Host); a call's loads
    upload straight from them, and the CPU worker (share > 0) computes from them. Share 0: bit for bit as every
    expert resident on Vulkan0 (an FFN stack: the region alone); share 0.5: as the same cache without the tier (the
    worker's rows are the CPU's kernels', not Vulkan's, so resident on Vulkan0 is not their oracle; the mapping's
    are).

    Each session gets its own Vulkan0 backend: disk-expert sessions one after another on one Vulkan backend corrupt
    the heap within a few sessions on lavapipe, on main too, with or without the tier (docs/vulkan.md: probably the
    heap corruption of test_device_buffers_freed_between_graphs_of_other_sizes)."""
    from ggml_hybrid.moe.stack_session import MoEStackSession
    from ggml_hybrid.options import SessionOptions
    from ggml_hybrid.synthetic import write_moe_stack

    path = write_moe_stack(tmp_path / "s.gguf", n_layer=2, n_embd=256, n_ff=256, n_expert=8, n_used=2,
                           expert_type="q8_0", seed=2)
    xs = [np.random.default_rng(i).standard_normal((n, 256)).astype(np.float32) for i, n in enumerate((5, 1, 1))]
    items = ["disk_experts=1", "expert_cache_slots=2", f"moe_cpu_share={share}"]
    with gh.vulkan(0) as vk, \
            MoEStackSession(path, SessionOptions.parse(items) if share else SessionOptions(), device=vk) as s:
        refs = [s.forward(x) for x in xs]
    items.append("host_tier_bytes=16M")
    with gh.vulkan(0) as vk, MoEStackSession(path, SessionOptions.parse(items), device=vk) as s:
        assert s.layers.tier.buffer_type == "Vulkan_Host" and not s.layers.executors[0].tier_direct
        assert s.layers.executors[0].load_mode == "staged"
        for x, ref in zip(xs, refs):
            np.testing.assert_array_equal(s.forward(x), ref)
        c, tier = s.counters.total, s.layers.tier.counters
        assert tier.misses > 0 and tier.hits + tier.misses == c.misses + c.cpu_misses
        assert (c.cpu_misses > 0) == (share > 0)
        assert c.bytes_staged == 0  # the call's loads read the pinned frames, not the staging buffers


_FREED_BETWEEN_SIZES = """
import numpy as np, ggml_hybrid as gh
from ggml_hybrid import lib
d = gh.vulkan(0)
rng = np.random.default_rng(0)
w = rng.standard_normal((8, 64, 64)).astype(np.float32)
with gh.Context(n_tensors=3) as wctx:
    W = [wctx.new_tensor("f32", w.shape, f"w{i}") for i in range(3)]
    wctx.allocate(d, "weights")
    for t in W:
        t.set(w)
    for r in range(200):
        n = 2 + r % 2
        with gh.Context(n_tensors=16, graph_size=32) as ctx:
            x = ctx.new_tensor("f32", (n, 1, 64), "x")
            ids = ctx.new_tensor("i32", (n, 1), "ids")
            act = ctx.glu(ctx.mul_mat_id(W[0], x, ids), ctx.mul_mat_id(W[1], x, ids), kind="swiglu")
            y = ctx.mul_mat_id(W[2], act, ids)
            g = ctx.new_graph(32).expand(y)
            ctx.allocate(d)  # a new device buffer for each graph, freed when the context closes
            x.set(rng.standard_normal((n, 1, 64)).astype(np.float32))
            ids.set(np.zeros((n, 1), np.int32))
            assert lib.ggml_backend_graph_compute(d.ptr, g.ptr) == 0
            y.numpy()
print("ok")
"""


@needs_device
@pytest.mark.xfail(strict=True, reason="GGML's Vulkan backend on lavapipe corrupts the heap (glibc aborts: 'corrupted "
                   "double-linked list') when a device buffer is freed and another allocated between graphs of other "
                   "row counts; the package reserves its compute memory once (docs/vulkan.md)")
def test_device_buffers_freed_between_graphs_of_other_sizes():
    """An expert FFN graph (two mul_mat_id of one input, their SwiGLU, a third mul_mat_id) of 2 then 3 token rows,
    alternately, each in a context of its own allocated on Vulkan0 and freed after: no scheduler, no code of ours
    between GGML and the driver. Runs in a child process: the abort must not take the test run with it. The same
    graphs with one row count, or with the contexts kept, run to the end. The corruption shows by chance (every
    child here, yet one CI run's child ran to the end), so up to five children run: all must end well."""
    for _ in range(5):
        res = subprocess.run([sys.executable, "-c", _FREED_BETWEEN_SIZES], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
        assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-500:]
