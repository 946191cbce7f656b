"""A backend library built from the unpatched pin works in our patched ggml-base: the op tests run through it.

This is what building the Vulkan and CUDA libraries once per pin relies on. ``python -m ggml_hybrid_build --pin-cpu``
builds the CPU backend of the pin without our patches as a library GGML loads at run time (cached like the other builds,
copied to build/pin-cpu/; CI builds it). It carries the pin's ABI stamp, so it loads only while the ABI probe finds
that the patch series keeps the interface the pin's headers give a backend. Every graph of tests/test_ops.py is
then computed on it and on our own CPU backend: the two must agree bit for bit, and with the op tests' numpy oracle.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_bits, compute, quantized

import ggml_hybrid as gh
from ggml_hybrid import lib
from ggml_hybrid._native import buildinfo, cstr
from ggml_hybrid.errors import BackendError
from ggml_hybrid.ggml.backend import backend_from_library, cpu_library
from ggml_hybrid_build import abi

ROOT = Path(__file__).resolve().parents[1]
_ENV = "GGML_HYBRID_PIN_CPU_LIB"


@pytest.fixture(scope="module")
def pin_cpu() -> Path:
    """The pin's CPU backend library: $GGML_HYBRID_PIN_CPU_LIB (which must exist) or build/pin-cpu/."""
    path = Path(os.environ.get(_ENV) or ROOT / "build" / "pin-cpu" / "libggml-cpu.so")
    if not path.exists():
        if os.environ.get(_ENV):
            pytest.fail(f"{_ENV}={path} does not exist")
        pytest.skip("the pin's CPU backend is not built: `python -m ggml_hybrid_build --pin-cpu`")
    return path


@pytest.mark.skipif(not buildinfo.VENDOR_DIR.is_dir(), reason="needs the source checkout's vendor/")
def test_ggml_base_carries_the_stamp_the_abi_probe_gives_it():
    verdict = abi.abi_verdict()
    assert cstr(lib.hy_abi()) == cstr(lib.ggml_hybrid_base_abi()) == abi.abi_stamp()
    # today's series keeps the pin's interface: 0002 adds functions, 0005 appends a member to ggml_op_hint, the rest
    # change code only; the Vulkan and CUDA libraries are then built from the pin and carry its stamp
    assert verdict["compatible"], verdict["differences"]
    assert abi.abi_stamp() == buildinfo.pin_abi_stamp()
    assert abi.backend_patches("vulkan") == [p for p in buildinfo.patch_files() if "vulkan" in p.name]


def test_the_pins_cpu_backend_loads_into_our_ggml_base(pin_cpu):
    n = lib.ggml_backend_dev_count()
    with backend_from_library(pin_cpu, n_threads=2) as twin:
        assert twin.name == "CPU" and lib.ggml_backend_dev_count() == n + 1
        assert cstr(lib.hy_reg_path(lib.ggml_backend_dev_backend_reg(lib.ggml_backend_get_device(twin.ptr)))) \
            == str(pin_cpu)
    assert cpu_library() != str(pin_cpu)  # our own CPU backend stays the one the package uses
    # closed, the library left GGML's registry: the devices are this install's own again
    assert [d.name for d in gh.devices()].count("CPU") == 1


def test_a_library_without_the_stamp_is_named_in_the_error(tmp_path):
    bad = tmp_path / "libggml-nothing.so"
    bad.write_bytes(b"not a library")
    with pytest.raises(BackendError, match="libggml-nothing.so.* did not load"):
        backend_from_library(bad)


def test_same_bits_fails_on_one_ulp():
    a = np.linspace(-1, 1, 64, dtype=np.float32)
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(2))
    assert_same_bits(a, a.copy())
    with pytest.raises(AssertionError, match="1 of 64 values differ; the first at flat index 17"):
        assert_same_bits(a, b)
    with pytest.raises(AssertionError, match="1 of 2 values differ"):
        assert_same_bits(np.array([np.nan, 1], np.float32), np.array([-np.nan, 1], np.float32))


def test_a_quantized_product_and_attention_give_our_bits(pin_cpu, cpu_backend):
    """In this process: the pin's CPU backend and ours on a Q4_K product and flash attention."""
    rng = np.random.default_rng(3)
    w, _ = quantized(rng.standard_normal((64, 256)).astype(np.float32), gh.GGMLType.Q4_K)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    q = rng.standard_normal((4, 3, 64)).astype(np.float32)
    k, v = (rng.standard_normal((4, 32, 64)).astype(np.float16) for _ in range(2))

    def graph(ctx, t):
        return ctx.mul_mat(t["w"], t["x"]), ctx.flash_attn(t["q"], t["k"], t["v"], None, scale=0.125)

    with backend_from_library(pin_cpu, n_threads=2) as twin:
        consts = {"w": w, "x": x, "q": q, "k": k, "v": v}
        ours = compute(cpu_backend, graph, consts)
        assert_same_bits(ours, compute(twin, graph, consts))


def test_the_op_tests_through_the_pins_cpu_backend_are_bit_identical_to_ours(pin_cpu):
    """tests/test_ops.py, whole (CI's hypothesis profile), with every graph computed on both backends (conftest's
    ``run``)."""
    env = {**os.environ, "GGML_HYBRID_OPS_TWIN": str(pin_cpu)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_ops.py")], cwd=ROOT / "tests", env=env, capture_output=True,
                         text=True, timeout=1200)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed is not None and int(passed.group(1)) >= 60, tail
    assert "failed" not in res.stdout.splitlines()[-1], tail
