"""Random small graphs of many ops, end to end against numpy float64.

Hypothesis draws a program: start from two input matrices, then apply 3 to 14 ops, each to earlier values of
fitting shapes (elementwise activations, arithmetic with broadcasting, a product with a constant weight, softmax,
rms_norm, a transpose, a row sum); GGML computes the program as one graph, numpy computes it in float64.

Bound, carried through the program to first order: each value has an elementwise error bound e; an op f of
local slope |f'| passes on |f'| e of its inputs' error and adds its own rounding (the per-op bounds of
tests/test_ops*.py: a few u of |f| for an activation, (k + 2) u sum|x w| for a k-term product, and so on); the final
value must be within twice the carried bound (the factor covers the second-order terms at these small sizes).
"""

from __future__ import annotations

import numpy as np
import oracles as O
from helpers import check_close
from hypothesis import given
from hypothesis import strategies as st

import ggml_hybrid as gh

U = O.EPS32


def _elementwise(name, f, slope, own):
    """An activation: (ggml builder, numpy value, local slope |f'(x)|, own rounding bound at x)."""
    return name, (lambda c, a: getattr(c, name)(a)), f, slope, own


ACTIVATIONS = [
    _elementwise("neg", np.negative, lambda x: np.ones_like(x), lambda x, y: 0 * y),
    _elementwise("abs", np.abs, lambda x: np.ones_like(x), lambda x, y: 0 * y),
    _elementwise("relu", lambda x: np.maximum(x, 0), lambda x: np.ones_like(x), lambda x, y: 0 * y),
    _elementwise("sigmoid", O.sigmoid, lambda x: np.full_like(x, 0.25), lambda x, y: 6 * U * np.abs(y) + 1e-37),
    _elementwise("tanh", np.tanh, lambda x: np.ones_like(x), lambda x, y: 4 * U * np.abs(y) + 1e-37),
    _elementwise("silu", lambda x: x * O.sigmoid(x), lambda x: np.full_like(x, 1.1),
                 lambda x, y: 8 * U * np.abs(y) + 1e-37),
    _elementwise("sin", np.sin, lambda x: np.ones_like(x), lambda x, y: 4 * U * np.abs(y) + 1e-37),
    _elementwise("cos", np.cos, lambda x: np.ones_like(x), lambda x, y: 4 * U * np.abs(y) + 1e-37),
    _elementwise("sqr", np.square, lambda x: 2 * np.abs(x), lambda x, y: U * np.abs(y)),
    _elementwise("softplus", O.softplus, lambda x: np.ones_like(x), lambda x, y: 3 * U + 2 * U * np.abs(y)),
]


class Value:
    """A program value: its GGML node, its float64 reference and its carried error bound (elementwise)."""

    def __init__(self, node, ref, err):
        self.node, self.ref, self.err = node, ref, err

    @property
    def shape(self):
        return self.ref.shape


def apply(c, op: str, k: int, vals: list[Value], weights: dict[int, gh.Tensor], wvals: dict[int, np.ndarray]):
    """Apply program step ``(op, k)`` to ``vals`` (k picks operands); returns the new Value or None if no operand
    fits."""
    a = vals[k % len(vals)]
    x, e = a.ref, a.err
    if op == "act":
        name, build, f, slope, own = ACTIVATIONS[k % len(ACTIVATIONS)]
        if name == "sqr" and np.abs(x).max() > 1e3:
            return None
        y = f(x)
        return Value(build(c, a.node), y, slope(x) * e + own(x, y))
    if op in ("add", "sub", "mul"):
        fits = [b for b in vals if b.shape == a.shape or b.shape == (a.shape[0], 1) or b.shape == (a.shape[1],)]
        b = fits[(k // 7) % len(fits)]
        bx, be = np.broadcast_to(b.ref.reshape(b.shape if len(b.shape) == 2 else (1, -1)), x.shape), \
            np.broadcast_to(b.err.reshape(b.shape if len(b.shape) == 2 else (1, -1)), x.shape)
        node = getattr(c, op)(a.node, b.node)
        if op == "mul":
            y = x * bx
            return Value(node, y, np.abs(bx) * e + np.abs(x) * be + U * np.abs(y))
        y = x + bx if op == "add" else x - bx
        return Value(node, y, e + be + U * np.abs(y))
    if op == "scale":
        s = float(np.float32([0.5, -2.0, 3.0][k % 3]))
        y = x * s
        return Value(c.scale(a.node, s), y, abs(s) * e + U * np.abs(y))
    if op == "matmul":
        n_out = 1 + k % 4
        key = (x.shape[1], n_out)
        if key not in weights:
            return None
        w = wvals[key]
        y = x @ w.T
        err = e @ np.abs(w).T + (x.shape[1] + 2) * U * (np.abs(x) @ np.abs(w).T)
        return Value(c.mul_mat(weights[key], a.node), y, err)
    if op == "softmax":
        if np.abs(x).max() > 50:
            return None
        y = O.softmax(x)
        zmax = np.abs(x).max(axis=-1, keepdims=True)
        return Value(c.soft_max(a.node), y, 2 * y * e.max(axis=-1, keepdims=True) + y * (8 * zmax + 16) * U)
    if op == "rms_norm":
        r = np.sqrt((x * x).mean(axis=-1, keepdims=True) + float(np.float32(1e-5)))
        y = x / r
        n = x.shape[-1]
        err = e / r + np.abs(x) * (np.abs(x) * e).sum(axis=-1, keepdims=True) / (n * r ** 3) + 8 * U * np.abs(y)
        return Value(c.rms_norm(a.node, 1e-5), y, err)
    if op == "transpose":
        return Value(c.cont(c.transpose(a.node)), x.T.copy(), e.T.copy())
    if op == "sum_rows":
        y = x.sum(axis=-1, keepdims=True)
        n = x.shape[-1]
        return Value(c.sum_rows(a.node), y, e.sum(axis=-1, keepdims=True) + (n + 2) * U * np.abs(x).sum(axis=-1,
                                                                                                          keepdims=True))
    raise AssertionError(op)


OPS = ["act", "act", "act", "add", "sub", "mul", "scale", "matmul", "softmax", "rms_norm", "transpose", "sum_rows"]


@given(m=st.integers(1, 4), n=st.integers(1, 5), program=st.lists(st.tuples(st.sampled_from(OPS),
                                                                             st.integers(0, 1000)),
                                                                   min_size=3, max_size=14),
       seed=st.integers(0, 2**31 - 1))
def test_random_graphs_match_numpy(cpu_backend, m, n, program, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(-2, 2, (m, n)).astype(np.float32) for _ in range(2)]
    dims = sorted({m, n, 1, 2, 3, 4})
    wvals = {(k, o): rng.uniform(-1, 1, (o, k)).astype(np.float32) for k in dims for o in range(1, 5)}
    with gh.Context(n_tensors=len(wvals) + 4) as wc, gh.Context(n_tensors=512, graph_size=512) as c, \
            gh.Scheduler([cpu_backend], graph_size=512) as sched:
        inputs = [wc.new_tensor("f32", (m, n), f"x{i}") for i in range(2)]
        weights = {key: wc.new_tensor("f32", w.shape, f"w{key[0]}x{key[1]}") for key, w in wvals.items()}
        wc.allocate(cpu_backend)
        for t, a in zip(inputs, xs):
            t.set(a)
        for key, t in weights.items():
            t.set(wvals[key])
        vals = [Value(t, a.astype(np.float64), np.zeros((m, n))) for t, a in zip(inputs, xs)]
        steps = []
        for op, k in program:
            v = apply(c, op, k, vals, weights, {key: w.astype(np.float64) for key, w in wvals.items()})
            if v is not None:
                vals.append(v)
                steps.append(op)
        outs = vals[2:] or vals[:1]
        for v in outs:
            v.node.set_output()
        graph = c.new_graph().expand(*(v.node for v in outs))
        sched.alloc(graph)
        sched.compute(graph)
        for i, v in enumerate(outs):
            got = v.node.numpy()
            check_close(got.reshape(v.ref.shape), v.ref, 2 * v.err + 1e-30, f"value {i} after {steps[:i + 1]}")
