"""Gradients: every op GGML differentiates against central finite differences of its float64 oracle, and every op it
cannot refused by name before GGML would abort.

Each check builds ``loss = sum(op(x) * R)`` (R a fixed random tensor of op's output shape), marks the inputs under
test as parameters, runs GGML's backward pass (Graph.backward) and compares each parameter's gradient with
``(L(x + h e_i) - L(x - h e_i)) / 2h`` of the same loss in float64 (tests/oracles.py). Bound: GGML computes the
gradient ``g_i = sum_k R_k d out_k / d x_i`` in float32 through at most ~8 chained operations and sums of at most 64
terms for the sizes drawn here, so within (64 + 8 + 2) u < 128 u of its absolute terms ``S_i = sum_k |R_k d out_k /
d x_i|``; doubled (256 u S_i), plus 32 u of the largest S (terms shared between elements: a row's sum in rms_norm and
softmax), plus the finite difference's own error (measured as |FD(h) - FD(2h)|, about 1e-9 at h = 1e-4).
"""

from __future__ import annotations

import re
import tarfile

import numpy as np
import oracles as O
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops import rope64

import ggml_hybrid as gh
from ggml_hybrid._native import buildinfo
from ggml_hybrid.errors import GradientError
from ggml_hybrid.ggml import autograd
from ggml_hybrid_build.pin import fetch_archive as pin_archive

U = O.EPS32
SEEDS = st.integers(0, 2**31 - 1)


@pytest.fixture(scope="module")
def cpu():
    backend = gh.cpu(2)
    yield backend
    backend.close()


def ggml_grads(cpu, build, inputs: dict[str, np.ndarray], params: list[str], R: np.ndarray):
    """GGML's gradient of sum(build(c, t) * R) for each of ``params`` (zeros where the loss does not depend on it)."""
    with gh.Context(n_tensors=len(inputs) + 2) as wc, gh.Context(n_tensors=4096, graph_size=2048, grads=True) as c, \
            gh.Scheduler([cpu], graph_size=2048) as sched:
        t = {n: wc.new_tensor(a.dtype, a.shape or (1,), n) for n, a in inputs.items()}
        t["R"] = wc.new_tensor("f32", R.shape, "R")
        wc.allocate(cpu, "weights")
        for n, a in inputs.items():
            t[n].set(a)
        t["R"].set(R)
        for n in params:
            t[n].set_param()
        out = build(c, t)
        loss = c.sum(c.mul(out, t["R"]))
        graph = c.new_graph().expand(loss).backward(loss)
        sched.alloc(graph)
        graph.seed()
        sched.compute(graph)
        grads = {}
        for n in params:
            g = graph.grad(t[n])
            grads[n] = np.zeros(inputs[n].shape) if g is None else g.numpy().reshape(inputs[n].shape)
        return grads, float(loss.numpy().reshape(()))


def fd_grads(oracle, inputs: dict[str, np.ndarray], params: list[str], R: np.ndarray, h: float = 1e-4):
    """Central differences of sum(oracle(x64) * R) in float64 per parameter element; with each element's sum of
    absolute chain-rule terms S_i = sum_k |R_k d out_k / d x_i| (the scale float32 rounds the gradient at) and an
    estimate of the differences' own error (|FD(h) - FD(2h)|)."""
    x64 = {n: a.astype(np.float64) for n, a in inputs.items()}
    R64 = R.astype(np.float64).reshape(-1)

    def out(xs):
        return np.asarray(oracle(xs), np.float64).reshape(-1)

    grads, scale, err = {}, {}, {}
    for n in params:
        g, s_, e = (np.zeros(inputs[n].shape) for _ in range(3))
        for i in np.ndindex(inputs[n].shape):
            cols = []
            for step in (h, 2 * h):
                plus, minus = dict(x64), dict(x64)
                plus[n], minus[n] = x64[n].copy(), x64[n].copy()
                plus[n][i] += step
                minus[n][i] -= step
                cols.append((out(plus) - out(minus)) / (2 * step))
            g[i] = cols[0] @ R64
            s_[i] = np.abs(cols[0]) @ np.abs(R64)
            e[i] = abs(g[i] - cols[1] @ R64)
        grads[n], scale[n], err[n] = g, s_, e
    return grads, scale, err, float(out(x64) @ R64)


def check_grads(cpu, build, oracle, inputs, params, seed):
    rng = np.random.default_rng(seed)
    shape = np.asarray(oracle({n: a.astype(np.float64) for n, a in inputs.items()})).shape
    R = rng.standard_normal(shape or (1,)).astype(np.float32)
    got, loss = ggml_grads(cpu, build, inputs, params, R)
    want, scale, fd_err, ref_loss = fd_grads(oracle, inputs, params, R)
    for n in params:
        tol = 256 * U * scale[n] + 32 * U * (scale[n].max() if scale[n].size else 0.0) + 4 * fd_err[n] + 1e-12
        bad = np.abs(got[n] - want[n]) > tol
        assert not bad.any(), (f"d loss / d {n}: {int(bad.sum())} of {bad.size} off; first at "
                               f"{np.argwhere(bad)[0].tolist()}: ggml {got[n][bad][0]!r}, finite differences "
                               f"{want[n][bad][0]!r} (tol {tol[bad][0]:.3g}); loss {loss} vs {ref_loss}")


def away_from_zero(rng, shape, lo=0.2, hi=2.0):
    """Values with |x| in [lo, hi]: no finite difference step crosses a kink at 0."""
    return (rng.choice([-1.0, 1.0], shape) * rng.uniform(lo, hi, shape)).astype(np.float32)


# -- the ops GGML differentiates, one check each ------------------------------------------------------------------

def _cases():
    """name -> (builder, oracle, inputs(rng), params)."""
    f32 = np.float32

    def n(rng, *shape):
        return rng.standard_normal(shape).astype(f32)

    def pos(rng, *shape):
        return rng.uniform(0.5, 2.0, shape).astype(f32)

    cases = {
        "dup": (lambda c, t: c.dup(t["a"]), lambda x: x["a"], lambda r: {"a": n(r, 2, 3)}, ["a"]),
        "add (b broadcast)": (lambda c, t: c.add(t["a"], t["b"]), lambda x: x["a"] + O.tile_to(x["b"], (2, 3, 4)),
                              lambda r: {"a": n(r, 2, 3, 4), "b": n(r, 3, 1)}, ["a", "b"]),
        "sub": (lambda c, t: c.sub(t["a"], t["b"]), lambda x: x["a"] - x["b"], lambda r: {"a": n(r, 3, 4),
                                                                                          "b": n(r, 3, 4)},
                ["a", "b"]),
        "mul (b broadcast)": (lambda c, t: c.mul(t["a"], t["b"]), lambda x: x["a"] * O.tile_to(x["b"], (3, 4)),
                              lambda r: {"a": n(r, 3, 4), "b": n(r, 4)}, ["a", "b"]),
        "div": (lambda c, t: c.div(t["a"], t["b"]), lambda x: x["a"] / x["b"],
                lambda r: {"a": n(r, 3, 4), "b": away_from_zero(r, (3, 4), 0.5)}, ["a", "b"]),
        "add1 (a)": (lambda c, t: c.add1(t["a"], t["b"]), lambda x: x["a"] + x["b"][0],
                     lambda r: {"a": n(r, 3, 4), "b": n(r, 1)}, ["a"]),
        "acc": (lambda c, t: c.acc(t["a"], t["b"], 4 * 5), lambda x: _acc(x["a"], x["b"], 5),
                lambda r: {"a": n(r, 3, 4), "b": n(r, 2, 2)}, ["a", "b"]),
        "set": (lambda c, t: c.set(t["a"], t["b"], 4 * 5), lambda x: _set(x["a"], x["b"], 5),
                lambda r: {"a": n(r, 3, 4), "b": n(r, 2, 2)}, ["a", "b"]),
        "sqr": (lambda c, t: c.sqr(t["a"]), lambda x: x["a"] ** 2, lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "sqrt": (lambda c, t: c.sqrt(t["a"]), lambda x: np.sqrt(x["a"]), lambda r: {"a": pos(r, 3, 4)}, ["a"]),
        "log": (lambda c, t: c.log(t["a"]), lambda x: np.log(x["a"]), lambda r: {"a": pos(r, 3, 4)}, ["a"]),
        "sin": (lambda c, t: c.sin(t["a"]), lambda x: np.sin(x["a"]), lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "cos": (lambda c, t: c.cos(t["a"]), lambda x: np.cos(x["a"]), lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "sum": (lambda c, t: c.sum(t["a"]), lambda x: x["a"].sum(keepdims=True).reshape(1),
                lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "sum_rows": (lambda c, t: c.sum_rows(t["a"]), lambda x: x["a"].sum(axis=-1, keepdims=True),
                     lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "mean": (lambda c, t: c.mean(t["a"]), lambda x: x["a"].mean(axis=-1, keepdims=True),
                 lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "repeat": (lambda c, t: c.repeat(t["a"], (2, 3, 4)), lambda x: O.tile_to(x["a"], (2, 3, 4)),
                   lambda r: {"a": n(r, 3, 2)}, ["a"]),
        "repeat_back": (lambda c, t: c.repeat_back(t["a"], (3, 2)), lambda x: O.repeat_back(x["a"], (3, 2)),
                        lambda r: {"a": n(r, 2, 3, 4)}, ["a"]),
        "rms_norm": (lambda c, t: c.rms_norm(t["a"], 1e-5), lambda x: O.rms_norm(x["a"], float(np.float32(1e-5))),
                     lambda r: {"a": n(r, 3, 5)}, ["a"]),
        "mul_mat (batch broadcast)": (lambda c, t: c.mul_mat(t["w"], t["x"]),
                                      lambda x: x["x"] @ np.swapaxes(np.repeat(x["w"], 2, axis=0), -1, -2),
                                      lambda r: {"w": n(r, 2, 3, 4), "x": n(r, 4, 2, 4)}, ["w", "x"]),
        "scale": (lambda c, t: c.scale(t["a"], -1.5), lambda x: -1.5 * x["a"], lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "cpy": (lambda c, t: c.cpy(t["a"], t["b"]), lambda x: x["a"].reshape(4, 3),
                lambda r: {"a": n(r, 3, 4), "b": n(r, 4, 3)}, ["a"]),
        "cont of a transpose": (lambda c, t: c.cont(c.transpose(t["a"])), lambda x: x["a"].T.copy(),
                                lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "reshape": (lambda c, t: c.reshape(t["a"], (4, 3)), lambda x: x["a"].reshape(4, 3),
                    lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "view": (lambda c, t: c.view(t["a"], (2, 2), (16,), 4), lambda x: x["a"][:2, 1:3],
                 lambda r: {"a": n(r, 3, 4)}, ["a"]),
        "permute": (lambda c, t: c.cont(c.permute(t["a"], (2, 0, 1))), lambda x: np.transpose(x["a"], (2, 0, 1)),
                    lambda r: {"a": n(r, 2, 3, 4)}, ["a"]),
        "get_rows": (lambda c, t: c.get_rows(t["a"], t["i"]), lambda x: x["a"][x["i"].astype(int)],
                     lambda r: {"a": n(r, 5, 3), "i": np.array([4, 0, 4, 2], np.int32)}, ["a"]),
        "diag_mask_inf then soft_max": (lambda c, t: c.soft_max(c.diag_mask_inf(t["a"], 1)),
                                        lambda x: O.softmax(np.where(np.arange(5)[None] > 1 + np.arange(4)[:, None],
                                                                     -np.inf, x["a"])),
                                        lambda r: {"a": n(r, 4, 5)}, ["a"]),
        "diag_mask_zero": (lambda c, t: c.diag_mask_zero(t["a"], 0),
                           lambda x: np.where(np.arange(4)[None] > np.arange(4)[:, None], 0, x["a"]),
                           lambda r: {"a": n(r, 4, 4)}, ["a"]),
        "soft_max (mask, scale)": (lambda c, t: c.soft_max(t["a"], t["m"], scale=0.7),
                                   lambda x: O.softmax(x["a"] * float(np.float32(0.7)) + x["m"]),
                                   lambda r: {"a": n(r, 2, 3, 5), "m": n(r, 3, 5)}, ["a"]),
        "rope normal": (lambda c, t: c.rope(t["a"], t["p"], 4, mode="normal"),
                        lambda x: rope64(x["a"], x["p"].astype(int), 4, "normal", 10000.0)[0],
                        lambda r: {"a": n(r, 3, 2, 6), "p": np.array([0, 5, 17], np.int32)}, ["a"]),
        "rope neox": (lambda c, t: c.rope(t["a"], t["p"], 6, mode="neox"),
                      lambda x: rope64(x["a"], x["p"].astype(int), 6, "neox", 10000.0)[0],
                      lambda r: {"a": n(r, 2, 2, 6), "p": np.array([3, 40], np.int32)}, ["a"]),
        "im2col": (lambda c, t: c.im2col(t["k"], t["x"], 1, 1, is_2d=True),
                   lambda x: O.im2col2d(x["x"], 2, 2, (1, 1), (1, 1)),
                   lambda r: {"k": n(r, 1, 2, 2, 2), "x": n(r, 1, 2, 3, 3)}, ["x"]),
        "pool_2d max": (lambda c, t: c.pool_2d(t["x"], "max", 2), lambda x: _pool_max(x["x"]),
                        lambda r: {"x": _distinct(r, (2, 4, 4))}, ["x"]),
        "pool_2d avg": (lambda c, t: c.pool_2d(t["x"], "avg", 2, 1), lambda x: _pool_avg(x["x"]),
                        lambda r: {"x": n(r, 2, 3, 3)}, ["x"]),
        "cross_entropy_loss": (lambda c, t: c.cross_entropy_loss(t["z"], t["y"]),
                               lambda x: np.array([O.cross_entropy(x["z"], x["y"])]),
                               lambda r: {"z": n(r, 3, 5), "y": O.softmax(r.standard_normal((3, 5))).astype(f32)},
                               ["z"]),
        "swiglu (split)": (lambda c, t: c.swiglu(t["g"], t["u"]), lambda x: O.glu("swiglu", x["g"], x["u"]),
                           lambda r: {"g": n(r, 3, 4), "u": n(r, 3, 4)}, ["g", "u"]),
    }
    for kind in sorted(autograd.DIFFERENTIABLE_UNARY):
        k = kind.lower()
        cases[f"unary {k}"] = (lambda c, t, k=k: getattr(c, k)(t["a"]), lambda x, k=k: O.UNARY[k](x["a"]),
                               lambda r: {"a": away_from_zero(r, (3, 4))}, ["a"])
    return cases


def _acc(a, b, off):
    out = a.copy().reshape(-1)
    for i in range(b.shape[0]):
        out[off + i * a.shape[-1]: off + i * a.shape[-1] + b.shape[1]] += b[i]
    return out.reshape(a.shape)


def _set(a, b, off):
    out = a.copy().reshape(-1)
    for i in range(b.shape[0]):
        out[off + i * a.shape[-1]: off + i * a.shape[-1] + b.shape[1]] = b[i]
    return out.reshape(a.shape)


def _distinct(rng, shape):
    """Values 0.1 apart (max pooling is differentiable away from ties)."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1).astype(np.float32)


def _pool_max(x):
    b, h, w = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2).max(axis=(2, 4))


def _pool_avg(x):
    b, h, w = x.shape
    out = np.empty((b, h - 1, w - 1))
    for i in range(h - 1):
        for j in range(w - 1):
            out[:, i, j] = x[:, i:i + 2, j:j + 2].sum(axis=(1, 2)) / 4
    return out


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=3)
@given(seed=SEEDS)
def test_gradient_against_finite_differences(cpu, name, seed):
    build, oracle, make, params = CASES[name]
    check_grads(cpu, build, oracle, make(np.random.default_rng(seed)), params, seed)


def test_every_differentiable_op_and_kind_is_checked():
    """The forward graphs of the cases above hold every op and kind GGML differentiates."""
    seen = set()
    for build, _, make, _ in CASES.values():
        inputs = make(np.random.default_rng(0))
        with gh.Context(n_tensors=len(inputs) + 1) as wc, gh.Context(n_tensors=256, graph_size=256) as c:
            t = {n: wc.new_tensor(a.dtype, a.shape, n) for n, a in inputs.items()}
            graph = c.new_graph().expand(build(c, t))
            seen |= {autograd.op_name(node.ptr) for node in graph.nodes}
    want = {o for o in autograd.DIFFERENTIABLE_OPS - {"NONE", "UNARY", "GLU"}} | \
        {f"UNARY:{k}" for k in autograd.DIFFERENTIABLE_UNARY} | {f"GLU:{k}" for k in autograd.DIFFERENTIABLE_GLU}
    assert want <= seen, sorted(want - seen)


# -- the table against the pin's ggml.c ---------------------------------------------------------------------------

def test_the_differentiable_table_is_ggml_c_s():
    """ggml_compute_backward's cases (ops that abort excluded) are the ops of DIFFERENTIABLE_OPS; its unary and GLU
    cases those of the kind tables."""
    if not buildinfo.VENDOR_DIR.is_dir():
        pytest.skip("needs the source checkout's vendor/ (the pin)")
    pin = buildinfo.load_pin()
    with tarfile.open(pin_archive(pin)) as tar:
        f = tar.extractfile(f"{pin['ggml_path'].rstrip('/')}/src/ggml.c")
        assert f is not None
        src = f.read().decode()
    start = src.index("static void ggml_compute_backward(")
    body = src[start:src.index("\n}\n", start)]
    unary = body[body.index("case GGML_OP_UNARY:"):body.index("case GGML_OP_CROSS_ENTROPY_LOSS:")]
    glu = body[body.index("case GGML_OP_GLU:"):body.index("case GGML_OP_NONE:")]
    ops = set(re.findall(r"case GGML_OP_(\w+):", body)) - {"COUNT", "WIN_PART", "WIN_UNPART"}  # the last two fall
    # into the UNARY case, which asserts the op is UNARY: they abort
    assert ops == set(autograd.DIFFERENTIABLE_OPS)
    assert set(re.findall(r"case GGML_UNARY_OP_(\w+):", unary)) == set(autograd.DIFFERENTIABLE_UNARY)
    assert set(re.findall(r"case GGML_GLU_OP_(\w+):", glu)) == set(autograd.DIFFERENTIABLE_GLU)


# -- refusals ------------------------------------------------------------------------------------------------------

def _refused(build, match: str, params=("a",), shapes=None):
    shapes = shapes or {"a": (3, 4)}
    with gh.Context(n_tensors=64) as wc, gh.Context(n_tensors=512, graph_size=512, grads=True) as c:
        t = {n: wc.new_tensor("f32", s, n) for n, s in shapes.items()}
        for n in params:
            t[n].set_param()
        out = build(c, t)
        loss = c.sum(out) if out.nelements > 1 else out
        graph = c.new_graph().expand(loss)
        with pytest.raises(GradientError, match=match):
            graph.backward(loss)


@pytest.mark.parametrize("build, match", [
    (lambda c, t: c.tanh(t["a"]), "no gradient for unary tanh"),
    (lambda c, t: c.gelu(t["a"]), "no gradient for unary gelu"),
    (lambda c, t: c.norm(t["a"]), "no gradient for norm"),
    (lambda c, t: c.l2_norm(t["a"]), "no gradient for l2_norm"),
    (lambda c, t: c.concat(t["a"], t["a"], axis=0), "no gradient for concat"),
    (lambda c, t: c.pad(t["a"], (1, 1)), "no gradient for pad"),
    (lambda c, t: c.clamp(t["a"], -1.0, 1.0), "no gradient for clamp"),
    (lambda c, t: c.leaky_relu(t["a"]), "no gradient for leaky_relu"),
    (lambda c, t: c.swiglu(t["a"]), "separate gate and up"),
    (lambda c, t: c.add1(t["a"], c.reshape(c.sum(t["a"]), (1,))), "add1's b takes the mean"),
    (lambda c, t: c.soft_max(t["a"], t["a"]), "mask"),
    (lambda c, t: c.cast(c.cast(t["a"], "f16"), "f32"), "F16; gradients flow through F32 nodes only"),
    (lambda c, t: c.win_part(c.reshape(t["a"], (3, 4, 1)), 2), "no gradient for win_part"),
])
def test_ops_without_a_gradient_are_refused_by_name(build, match):
    _refused(build, match)


def test_backward_needs_a_loss_parameters_and_a_graph_with_gradients():
    with gh.Context(n_tensors=16) as wc, gh.Context(n_tensors=64, graph_size=64, grads=True) as c:
        a = wc.new_tensor("f32", (4,), "a")
        loss = c.sum(c.sqr(a))
        with pytest.raises(GradientError, match="no parameter"):
            c.new_graph().expand(loss).backward(loss)
        a.set_param()
        with pytest.raises(GradientError, match="without gradients"):
            c.new_graph(grads=False).expand(loss).backward(loss)
        sq = c.sqr(a)
        with pytest.raises(GradientError, match="one F32 value"):
            c.new_graph().expand(sq).backward(sq)
        other = c.sum(a)
        with pytest.raises(GradientError, match="not a node"):
            c.new_graph().expand(loss).backward(other)
        with pytest.raises(GradientError, match="graph of size"):
            c.new_graph(size=8).expand(loss).backward(loss)
    with gh.Context(n_tensors=4) as wc:
        q = wc.new_tensor("f16", (4,), "q")
        with pytest.raises(gh.errors.DTypeError, match="F32"):
            q.set_param()


def test_a_refused_backward_leaves_the_process_and_graph_usable(cpu):
    """After a refusal the same forward graph still computes (nothing was added to it)."""
    x = np.arange(4, dtype=np.float32)
    with gh.Context(n_tensors=8) as wc, gh.Context(n_tensors=64, graph_size=64, grads=True) as c, \
            gh.Scheduler([cpu], graph_size=64) as sched:
        a = wc.new_tensor("f32", (4,), "a")
        wc.allocate(cpu)
        a.set(x)
        a.set_param()
        loss = c.sum(c.tanh(a))
        graph = c.new_graph().expand(loss)
        n = graph.n_nodes
        with pytest.raises(GradientError):
            graph.backward(loss)
        assert graph.n_nodes == n
        sched.alloc(graph)
        sched.compute(graph)
        assert abs(float(loss.numpy()[0]) - float(np.tanh(x.astype(np.float64)).sum())) < 1e-5


def test_what_is_refused_would_abort_in_ggml():
    """The raw GGML call on a graph the API refuses kills the process (run in a child): the refusal is needed."""
    from helpers import run_isolated

    p = run_isolated("""
        from ggml_hybrid import lib, ffi
        with gh.Context(n_tensors=8) as wc, gh.Context(n_tensors=256, graph_size=256, grads=True) as c:
            a, b = wc.new_tensor("f32", (3, 4), "a"), wc.new_tensor("f32", (1,), "b")
            b.set_param()
            loss = c.sum(c.add1(a, b))
            g = c.new_graph().expand(loss)
            try:
                g.backward(loss)
            except gh.errors.GradientError as e:
                print("REFUSED", e)
            lib.ggml_set_loss(loss.ptr)
            lib.ggml_build_backward_expand(c.ptr, g.ptr, ffi.NULL)
            print("SURVIVED")
    """)
    assert "REFUSED" in p.stdout and "SURVIVED" not in p.stdout and p.returncode != 0, (p.returncode, p.stdout)
