"""The graph API as a numpy/PyTorch user writes it: operators, len, ndim, str(dtype), reshape(-1), graph size.

Every result is computed by GGML on the CPU backend and compared with numpy in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import ArgumentError, ShapeError


@pytest.fixture
def ctx():
    with gh.Context(n_tensors=256, mem_size=1 << 22, no_alloc=False, graph_size=256) as c:
        yield c


@pytest.fixture(scope="module")
def cpu():
    with gh.cpu(1) as b:
        yield b


def compute(ctx, cpu, *outs):
    ctx.new_graph().expand(*outs).compute(cpu)
    return [o.numpy().astype(np.float64) for o in outs]


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_arithmetic_operators_match_numpy(ctx, cpu):
    a, b, row = rand((3, 4)), rand((3, 4), 1), rand((4,), 2)
    ta, tb, tr = ctx.tensor(a), ctx.tensor(b), ctx.tensor(row)
    outs = compute(ctx, cpu, ta + tb, ta - tb, ta * tb, -ta, ta + tr, tr + ta, ta * tr, tr * ta, ta - tr, ta * 2.5,
                   0.5 * ta)
    a64, b64, r64 = a.astype(np.float64), b.astype(np.float64), row.astype(np.float64)
    want = [a64 + b64, a64 - b64, a64 * b64, -a64, a64 + r64, r64 + a64, a64 * r64, r64 * a64, a64 - r64,
            a64 * 2.5, 0.5 * a64]
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)


def test_matmul_matches_numpy_with_and_without_a_copy(ctx, cpu):
    x, w, y = rand((5, 8)), rand((6, 8), 1), rand((8, 3), 2)
    tx, tw, ty = ctx.tensor(x), ctx.tensor(w), ctx.tensor(y)
    by_weight = tx @ tw.T  # [5, 8] @ [8, 6]: uses w as stored, no copy
    general = tx @ ty      # [5, 8] @ [8, 3]: y is copied transposed
    got_w, got_y = compute(ctx, cpu, by_weight, general)
    np.testing.assert_allclose(got_w, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_y, x.astype(np.float64) @ y.astype(np.float64), rtol=1e-5, atol=1e-5)
    assert by_weight.shape == (5, 6) and general.shape == (5, 3)
    assert by_weight.src[0] == tw  # the weight itself, not a transposed copy
    assert general.src[0].op == "CONT"
    b3, w3 = rand((2, 4, 8), 3), rand((2, 8, 5), 4)
    (got,) = compute(ctx, cpu, ctx.tensor(b3) @ ctx.tensor(w3))
    np.testing.assert_allclose(got, b3.astype(np.float64) @ w3.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_len_ndim_dtype_name(ctx):
    t = ctx.tensor(rand((3, 4, 5)))
    assert len(t) == 3 and t.ndim == 3 and t.shape == (3, 4, 5)
    assert str(t.dtype) == "f32" and f"{t.dtype}" == "f32" and str(gh.GGMLType.Q4_K) == "q4_K"
    assert gh.as_ggml_type(str(gh.GGMLType.Q8_0)) is gh.GGMLType.Q8_0  # the name round-trips
    assert bool(ctx.new_tensor("f32", (0, 4)))  # an empty tensor is still a tensor


def test_reshape_infers_one_size(ctx, cpu):
    a = rand((4, 6))
    t = ctx.tensor(a)
    assert t.reshape(-1).shape == (24,) and t.reshape(3, -1).shape == (3, 8)
    assert t.reshape((-1, 2, 3)).shape == (4, 2, 3)
    (got,) = compute(ctx, cpu, ctx.cont(t.reshape(8, -1)))
    np.testing.assert_array_equal(got, a.reshape(8, -1))
    with pytest.raises(ShapeError, match="more than one -1"):
        t.reshape(-1, -1)
    with pytest.raises(ShapeError, match=r"shape \(5, -1\).*divide the 24 elements"):
        t.reshape(5, -1)
    with pytest.raises(ShapeError, match="negative size"):
        t.reshape(-2, 12)


def test_errors_name_numpy_order_shapes(ctx):
    a, b = ctx.tensor(rand((3, 4))), ctx.tensor(rand((4, 3)))
    with pytest.raises(ShapeError, match=r"shapes \(3, 4\) and \(4, 3\) do not broadcast"):
        a + b
    with pytest.raises(ShapeError, match=r"shapes \(3, 4\) and \(3, 4\) do not multiply"):
        a @ a
    row = ctx.tensor(rand((4,)))
    with pytest.raises(ShapeError, match="do not broadcast"):
        row - a  # subtraction does not commute: the first operand must be the larger
    with pytest.raises(ShapeError, match=r"\[3, 4\]"):  # op checks print numpy-order shapes too
        ctx.mul_mat(a, ctx.tensor(rand((2, 5))))
    with pytest.raises(ShapeError, match="reverse them all"):
        _ = ctx.tensor(rand((2, 3, 4))).T


def test_operands_must_share_a_context(ctx):
    with gh.Context(n_tensors=8, mem_size=1 << 16, no_alloc=False) as other:
        a, b = ctx.tensor(rand((2, 2))), other.tensor(rand((2, 2)))
        with pytest.raises(ArgumentError, match="different contexts"):
            a + b
        with pytest.raises(TypeError):
            a + 1.0  # no scalar add in GGML: numpy's rule for unsupported operands


def test_graph_size_is_given_once(cpu):
    with gh.Context(n_tensors=8, mem_size=1 << 16, no_alloc=False, graph_size=16) as c:
        g = c.new_graph()
        assert g.size == 16
        x = c.tensor(rand((2,)))
        g.expand(-x)
    with gh.Context(n_tensors=8, mem_size=1 << 16, no_alloc=False) as c:
        with pytest.raises(gh.errors.AllocationError, match="graph_size=2048"):
            c.new_graph()  # without graph_size the default graph does not fit a small pool: the fix is named
