"""Resident logits on Vulkan0 against llama.cpp's own Vulkan build on the same device and driver (fixtures made by
``tools/make_reference_fixtures.py --vulkan`` with llama-cpp-python 0.3.36 built with ``-DGGML_VULKAN=on``, every
layer offloaded, on Mesa's lavapipe), and the expert cache on Vulkan0 against all-resident on Vulkan0.

Skipped without a Vulkan device (CI: lavapipe with ``GGML_VK_VISIBLE_DEVICES=0``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = sorted(glob.glob(os.path.join(HERE, "fixtures", "llama_ref_vulkan", "*.npz")))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gh.vulkan_available(), reason="no Vulkan device (lavapipe "
                                                                                    "needs GGML_VK_VISIBLE_DEVICES=0)")]


def _load(path):
    z = np.load(path)
    return {"spec": ModelSpec(**json.loads(str(z["spec"]))), "sha256": str(z["sha256"]), "tokens": z["tokens"],
            "logits": z["logits"], "last": z["last_logits"], "ubatch": int(z["ubatch"]),
            "options": json.loads(str(z["options"])), "device": str(z["device"]),
            "decode_from": int(z["decode_from"]) if "decode_from" in z else 0,
            "decode": z["decode_logits"] if "decode_logits" in z else None}


def test_fixtures_cover_the_types_and_families():
    if not FIXTURES:
        pytest.skip("no fixtures recorded yet: tools/make_reference_fixtures.py --vulkan with a llama-cpp-python built "
                    "with -DGGML_VULKAN=on (docs/vulkan.md)")
    fx = [_load(f) for f in FIXTURES]
    assert {f["spec"].weight_type for f in fx} >= {"f32", "q8_0", "q4_0", "q4_K"}
    archs = {f["spec"].arch for f in fx}
    assert len(archs) >= 3 and "qwen35moe" in archs
    assert len({f["device"] for f in fx}) == 1 and "CPU" not in {f["device"] for f in fx}


def _vulkan0() -> str:
    return next(d.description for d in gh.devices() if d.name == "Vulkan0")


# Cases whose logits on lavapipe are NOT bit-identical to llama.cpp's Vulkan build: the max relative difference of the
# first comparison that differs (token-by-token decode; every position of the prompt and its last position are
# bit-identical). The cause: GGML's Vulkan backend fuses the gated attention layers' output mul_mat with the residual
# add after it (MUL_MAT_ADD) in ggml-hybrid's decode graph and not in llama.cpp's, where the pair is adjacent too: the
# backend refuses a fusion for reasons that depend on where GGML's allocator put the tensors (an output over an input
# the fused kernel still reads, a misaligned operand), and the two graphs place them differently (they read and write
# the recurrent states differently: llama.cpp with get_rows through s_copy and cpy, ggml-hybrid with views and
# set_rows). With GGML_VK_DISABLE_FUSION=1 on both sides they are bit-identical (docs/vulkan.md). Strict: a case that
# becomes bit-identical fails here until it is taken off the list.
NOT_BIT_IDENTICAL = {"qwen35moe_f32": 3.80e-06, "qwen35moe_q8_0_ubatch7": 2.06e-07}


def _param(path):
    name = os.path.basename(path)[:-4]
    why = (f"decode differs from llama.cpp on Vulkan0 by {NOT_BIT_IDENTICAL.get(name, 0):.3g} (relative): a Vulkan "
           "fusion one graph gets and the other does not")
    marks = [pytest.mark.xfail(strict=True, reason=why)] if name in NOT_BIT_IDENTICAL else []
    return pytest.param(path, id=name, marks=marks)


@pytest.fixture(scope="module", params=[_param(f) for f in FIXTURES])
def case(request, tmp_path_factory):
    fx = _load(request.param)
    if fx["device"] != _vulkan0():
        pytest.skip(f"recorded on {fx['device']}; this Vulkan0 is {_vulkan0()} (other kernels, other roundings)")
    path = write_model(tmp_path_factory.mktemp("vkref") / "model.gguf", fx["spec"])
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == fx["sha256"], "generator output changed; remake the fixtures"
    return path, fx


def _same(got, ref):
    assert got.shape == ref.shape
    rel = float(np.max(np.abs(got.astype(np.float64) - ref)) / np.max(np.abs(ref)))
    assert np.array_equal(got, ref), f"not bit-identical to llama.cpp on Vulkan0: max relative difference {rel:.3g}"


def test_resident_logits_on_vulkan_equal_llama_cpp_on_vulkan(case):
    path, fx = case
    opts = SessionOptions(n_threads=1, n_ctx=512, ubatch_size=fx["ubatch"], devices="Vulkan0", **fx["options"])
    with MoEModel(path, opts) as m:
        assert set(m.layout.layer_device) == {"Vulkan0"}
        _same(m.eval(fx["tokens"], "all"), fx["logits"])
        m.reset()
        _same(m.eval(fx["tokens"], "last"), fx["last"])
        if fx["decode"] is not None:
            m.reset()
            n = fx["decode_from"]
            rows = [m.eval(fx["tokens"][:n], "all")] + [m.eval(fx["tokens"][i:i + 1], "all")
                                                         for i in range(n, len(fx["tokens"]))]
            _same(np.concatenate(rows), fx["decode"])
