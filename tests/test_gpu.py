"""Checks that need an accelerator; skipped on CPU-only machines (CI never has one)."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_hybrid as gh

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gh.cuda_available(), reason="no CUDA device in this build")]


def test_region_on_the_device_gets_copies_of_host_inputs():
    dev, cpu = gh.cuda(0), gh.cpu(2)
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
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)  # CUDA silu vs numpy: float32 rounding
    backend_name, on_host, name = seen[0]
    assert backend_name == dev.name and not on_host and name != "pre"  # the executor got the device copy
