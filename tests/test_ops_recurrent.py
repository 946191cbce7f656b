"""Recurrent layers, the triangular solve, DeepSeek V4's hyper-connections, the loss and the optimizer steps against
float64 numpy.

The recurrences are run token by token in float64 with the ops' own formulas; GGML runs them in float32 with SIMD
(fused multiply-adds), so each output is within a few u of the magnitudes it sums, carried through the tokens: the
bound is 8 (S + 2) u times the sum of the absolute terms, from the same recurrence run on |x|.
"""

from __future__ import annotations

import numpy as np
import oracles as O
import pytest
from helpers import check_close, dot_tol
from hypothesis import given
from hypothesis import strategies as st

import ggml_hybrid as gh

SEEDS = st.integers(0, 2**31 - 1)
U = O.EPS32


def rng_of(seed):
    return np.random.default_rng(seed)


def split(out: np.ndarray, T: int, H: int, S: int, n_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """A linear-attention result [T + S n_seqs, H S] as (outputs [T, H, S], states [n_seqs, H, S, S])."""
    flat = out.reshape(-1)
    return flat[:T * H * S].reshape(T, H, S), flat[T * H * S:].reshape(n_seqs, H, S, S)


def wkv6_64(k, v, r, tf, td, s0, n_seqs):
    T, H, S = k.shape
    out = np.zeros((T, H, S))
    states = s0.reshape(n_seqs, H, S, S).copy()  # [seq, h, i (key), j (value)]
    per = T // n_seqs
    for t in range(T):
        M = states[t // per]
        kv = k[t][:, :, None] * v[t][:, None, :]
        out[t] = np.einsum("hij,hi->hj", tf[:, :, None] * kv + M, r[t])
        M *= td[t][:, :, None]
        M += kv
    return out, states


def gla64(k, v, q, g, s0, n_seqs, scale):
    T, H, S = k.shape
    out = np.zeros((T, H, S))
    states = s0.reshape(n_seqs, H, S, S).copy()
    per = T // n_seqs
    for t in range(T):
        M = states[t // per]
        M *= g[t][:, :, None]
        M += k[t][:, :, None] * v[t][:, None, :]
        out[t] = np.einsum("hij,hi->hj", M, q[t] * scale)
    return out, states


def wkv7_64(r, w, k, v, a, b, s0, n_seqs):
    T, H, S = k.shape
    out = np.zeros((T, H, S))
    states = s0.reshape(n_seqs, H, S, S).copy()  # [seq, h, i (value), j (key)]
    per = T // n_seqs
    for t in range(T):
        M = states[t // per]
        sa = np.einsum("hij,hj->hi", M, a[t])
        M[:] = M * w[t][:, None, :] + v[t][:, :, None] * k[t][:, None, :] + sa[:, :, None] * b[t][:, None, :]
        out[t] = np.einsum("hij,hj->hi", M, r[t])
    return out, states


@st.composite
def tokens(draw, s_values=(1, 2, 4, 8)):
    n_seqs = draw(st.integers(1, 2))
    return n_seqs * draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from(s_values)), n_seqs


@pytest.mark.parametrize("op", ["rwkv_wkv6", "gated_linear_attn", "rwkv_wkv7"])
@given(case=st.data(), seed=SEEDS)
def test_linear_attention(run, op, case, seed):
    T, H, S, n_seqs = case.draw(tokens((64,) if op == "rwkv_wkv7" else (1, 2, 4, 8)), label="T, H, S, seqs")
    rng = rng_of(seed)

    def x(lo=-1.0, hi=1.0, shape=(T, H, S)):
        return rng.uniform(lo, hi, shape).astype(np.float32)

    s0 = x(shape=(n_seqs, H * S * S)) * 0.5
    if op == "rwkv_wkv6":
        ins = {"k": x(), "v": x(), "r": x(), "tf": x(shape=(H, S)), "td": x(0.5, 1.0), "s": s0}
        got = run(lambda c, t: c.rwkv_wkv6(*(t[n] for n in ("k", "v", "r", "tf", "td", "s"))), consts=ins)
        f = lambda d: wkv6_64(d["k"], d["v"], d["r"], d["tf"], d["td"], d["s"], n_seqs)
    elif op == "gated_linear_attn":
        ins = {"k": x(), "v": x(), "q": x(), "g": x(0.5, 1.0), "s": s0}
        got = run(lambda c, t: c.gated_linear_attn(*(t[n] for n in ("k", "v", "q", "g", "s")), 0.5), consts=ins)
        f = lambda d: gla64(d["k"], d["v"], d["q"], d["g"], d["s"], n_seqs, 0.5)
    else:
        ins = {"r": x(), "w": x(0.5, 1.0), "k": x() / 8, "v": x(), "a": x() / 8, "b": x() / 8, "s": s0}
        got = run(lambda c, t: c.rwkv_wkv7(*(t[n] for n in ("r", "w", "k", "v", "a", "b", "s"))), consts=ins)
        f = lambda d: wkv7_64(d["r"], d["w"], d["k"], d["v"], d["a"], d["b"], d["s"], n_seqs)
    ref_out, ref_state = f({n: a.astype(np.float64) for n, a in ins.items()})
    abs_out, abs_state = f({n: np.abs(a.astype(np.float64)) for n, a in ins.items()})
    out, state = split(got, T, H, S, n_seqs)
    check_close(out, ref_out, 8 * (S + 2) * U * abs_out * T + 1e-30, f"{op} outputs")
    check_close(state, ref_state, 8 * (S + 2) * U * abs_state * T + 1e-30, f"{op} states")


def test_rwkv_wkv7_refuses_head_sizes_its_simd_kernel_overruns():
    with gh.Context() as c:
        ts = [c.new_tensor("f32", (2, 1, 16), n) for n in "rwkvab"]
        with pytest.raises(gh.errors.ShapeError, match="multiple of 64"):
            c.rwkv_wkv7(*ts, c.new_tensor("f32", (1, 256), "s"))


def ssm_scan64(s, x, dt, A, B, C, ids):
    """Mamba's scan: s [states, H, dim, N], x [seqs, T, H, dim], dt [seqs, T, H], A [H, N] or [H, 1], B/C [seqs, T,
    G, N], ids [seqs] -> (y [seqs, T, H, dim], final states [seqs, H, dim, N])."""
    seqs, T, H, dim = x.shape
    G = B.shape[2]
    y = np.zeros(x.shape)
    finals = np.zeros((seqs, *s.shape[1:]))
    for q in range(seqs):
        st_ = s[ids[q]].copy()
        for t in range(T):
            for h in range(H):
                d = O.softplus(dt[q, t, h])
                g = h // (H // G)
                dA = np.exp(d * A[h])  # [N] or [1]
                st_[h] = st_[h] * dA + B[q, t, g][None, :] * (x[q, t, h] * d)[:, None]
                y[q, t, h] = st_[h] @ C[q, t, g]
        finals[q] = st_
    return y, finals


@given(seqs=st.integers(1, 2), T=st.integers(1, 3), H=st.sampled_from([1, 2, 4]), dim=st.integers(1, 4),
       N=st.sampled_from([4, 16]), mamba2=st.booleans(), groups=st.sampled_from([1, 2]), seed=SEEDS)
def test_ssm_scan(run, seqs, T, H, dim, N, mamba2, groups, seed):
    if H % groups:
        groups = 1
    rng = rng_of(seed)
    n_states = seqs + 1
    s = rng.standard_normal((n_states, H, dim, N)).astype(np.float32)
    x = rng.standard_normal((seqs, T, H, dim)).astype(np.float32)
    dt = rng.uniform(-2, 1, (seqs, T, H)).astype(np.float32)
    A = -rng.uniform(0.1, 1, (H, 1 if mamba2 else N)).astype(np.float32)
    B, C = (rng.standard_normal((seqs, T, groups, N)).astype(np.float32) for _ in range(2))
    ids = rng.permutation(n_states)[:seqs].astype(np.int32)
    got = run(lambda c, t: c.ssm_scan(t["s"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["ids"]),
              consts={"s": s, "x": x, "dt": dt, "A": A, "B": B, "C": C, "ids": ids})
    f64 = [a.astype(np.float64) for a in (s, x, dt, A, B, C)]
    y, finals = ssm_scan64(*f64, ids)
    ay, afinals = ssm_scan64(*(np.abs(a) for a in f64[:3]), f64[3], *(np.abs(a) for a in f64[4:]), ids)
    flat = got.reshape(-1)
    n_y = x.size
    check_close(flat[:n_y].reshape(y.shape), y, 16 * (N + 2) * U * ay * T + 1e-30, "ssm_scan y")
    check_close(flat[n_y:].reshape(finals.shape), finals, 16 * U * afinals * T + 1e-30, "ssm_scan states")


@given(n=st.integers(1, 6), m=st.integers(1, 4), batch=st.sampled_from([(), (2,), (2, 2)]), seed=SEEDS)
def test_solve_tri(run, n, m, batch, seed):
    rng = rng_of(seed)
    a = np.tril(rng.uniform(-1, 1, (*batch, n, n))) + np.eye(n) * 2  # diagonally dominant: well conditioned
    a = a.astype(np.float32)
    b = rng.standard_normal((*batch, n, m)).astype(np.float32)
    got = run(lambda c, t: c.solve_tri(t["a"], t["b"]), consts={"a": a, "b": b})
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    ref = np.linalg.solve(a64, b64)
    # forward substitution is backward stable: (a + da) x~ = b with |da| <= (n + 2) u |a| (Higham 8.2), so
    # |x~ - x| <= (n + 2) u |a^-1| |a| |x~| elementwise
    inv = np.abs(np.linalg.inv(a64))
    bound = (n + 2) * U * (inv @ (np.abs(a64) @ (np.abs(ref) * 1.01)))
    check_close(got.reshape(ref.shape), ref, bound + 1e-30, "solve_tri")


def hc_comb64(mixes, scale, base, eps, n_iter):
    T = mixes.shape[0]
    out = np.empty((T, 4, 4))
    for t in range(T):
        logits = (mixes[t, 8:] * scale[2] + base[8:]).reshape(4, 4)  # [src, dst]
        c = O.softmax(logits, axis=-1) + eps
        c = c / (c.sum(axis=0, keepdims=True) + eps)
        for _ in range(n_iter - 1):
            c = c / (c.sum(axis=1, keepdims=True) + eps)
            c = c / (c.sum(axis=0, keepdims=True) + eps)
        out[t] = c
    return out


@given(T=st.integers(1, 4), n_iter=st.integers(1, 5), eps=st.sampled_from([1e-6, 1e-3]), seed=SEEDS)
def test_dsv4_hyper_connections(run, T, n_iter, eps, seed):
    rng = rng_of(seed)
    mixes = rng.standard_normal((T, 24)).astype(np.float32)
    scale = rng.uniform(0.5, 2, 3).astype(np.float32)
    base = rng.standard_normal(24).astype(np.float32)
    n = 8
    x = rng.standard_normal((T, n)).astype(np.float32)
    xs = rng.standard_normal((T, 4, n)).astype(np.float32)
    w = rng.standard_normal((T, 4)).astype(np.float32)
    post = rng.standard_normal((T, 4)).astype(np.float32)
    comb_in = rng.standard_normal((T, 4, 4)).astype(np.float32)
    consts = {"mixes": mixes, "scale": scale, "base": base, "x": x, "xs": xs, "w": w, "post": post, "comb": comb_in}
    comb, pre, gated, post_out, post_id = run(lambda c, t: (
        c.dsv4_hc_comb(t["mixes"], t["scale"], t["base"], eps, n_iter), c.dsv4_hc_pre(t["xs"], t["w"]),
        c.dsv4_hc_pre_gated(t["xs"], t["xs"], 0.5), c.dsv4_hc_post(t["x"], t["xs"], t["post"], t["comb"]),
        c.dsv4_hc_post(t["x"], t["xs"], t["post"])), consts=consts)
    m64 = {k: v.astype(np.float64) for k, v in consts.items()}
    e = float(np.float32(eps))
    ref = hc_comb64(m64["mixes"], m64["scale"], m64["base"], e, n_iter)
    # each normalisation is a few float32 operations on values in [0, 1]: 16 u per round
    check_close(comb, ref, 16 * U * (2 * n_iter + 2), "dsv4_hc_comb")
    ref_pre = np.einsum("thi,th->ti", m64["xs"], m64["w"])
    check_close(pre, ref_pre, dot_tol(np.einsum("thi,th->ti", np.abs(m64["xs"]), np.abs(m64["w"])), 4), "hc_pre")
    ref_g = 0.5 * np.einsum("thi,thi->ti", m64["xs"], O.sigmoid(m64["xs"]))
    check_close(gated, ref_g, 0.5 * dot_tol(np.einsum("thi,thi->ti", np.abs(m64["xs"]), O.sigmoid(m64["xs"])), 4)
                + 8 * U * np.abs(ref_g), "hc_pre_gated")
    ref_post = m64["x"][:, None, :] * m64["post"][:, :, None] + np.einsum("tsd,tsi->tdi", m64["comb"], m64["xs"])
    abs_post = np.abs(m64["x"][:, None, :] * m64["post"][:, :, None]) + \
        np.einsum("tsd,tsi->tdi", np.abs(m64["comb"]), np.abs(m64["xs"]))
    check_close(post_out, ref_post, dot_tol(abs_post, 5), "hc_post")
    ref_id = m64["x"][:, None, :] * m64["post"][:, :, None] + m64["xs"]
    check_close(post_id, ref_id, 2 * U * (np.abs(m64["xs"]) + np.abs(ref_id)), "hc_post (identity comb)")


# -- losses and optimizer steps ------------------------------------------------------------------------------------

@given(rows=st.integers(1, 6), n=st.integers(2, 12), seed=SEEDS)
def test_cross_entropy_loss_and_back(run, rows, n, seed):
    rng = rng_of(seed)
    logits = rng.standard_normal((rows, n)).astype(np.float32) * 3
    labels = O.softmax(rng.standard_normal((rows, n)) * 2).astype(np.float32)
    g = np.array([1.7], np.float32)
    loss, back = run(lambda c, t: (c.cross_entropy_loss(t["z"], t["y"]), c.cross_entropy_loss_back(t["g"], t["z"],
                                                                                                     t["y"])),
                     consts={"z": logits, "y": labels, "g": g})
    z, y = logits.astype(np.float64), labels.astype(np.float64)
    ref = O.cross_entropy(z, y)
    # log_softmax: the max, exp and a double sum, a log (a few u of |z| per term), then the weighted row sums
    terms = np.abs(y * O.log_softmax(z))
    check_close(loss.reshape(()), ref, (n + 8) * U * (terms.sum() + (np.abs(y) * np.abs(z)).sum()) / rows, "loss")
    ref_b = (O.softmax(z) - y) * 1.7 / rows
    check_close(back, ref_b, 8 * U * (O.softmax(z) + np.abs(y)) * 1.7 / rows, "cross_entropy_loss_back")


def _param_step(c, t, adamw: bool):
    t["w"].set_param()
    h = t["h"]
    if adamw:
        out = c.opt_step_adamw(t["w"], t["g"], t["m"], t["v"], h)
        return out, c.view(t["m"], t["m"].shape), c.view(t["v"], t["v"].shape)
    return (c.opt_step_sgd(t["w"], t["g"], h),)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=2), step=st.integers(1, 50),
       wd=st.sampled_from([0.0, 0.01]), seed=SEEDS)
def test_opt_step_adamw(run, shape, step, wd, seed):
    rng = rng_of(seed)
    w, g = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    m, v = rng.standard_normal(shape).astype(np.float32) * 0.1, rng.uniform(0, 0.1, shape).astype(np.float32)
    alpha, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    b1h, b2h = 1 / (1 - np.float32(b1) ** step), 1 / (1 - np.float32(b2) ** step)
    h = np.array([alpha, b1, b2, eps, wd, b1h, b2h], np.float32)
    new_w, new_m, new_v = run(lambda c, t: _param_step(c, t, True), consts={"w": w, "g": g, "m": m, "v": v, "h": h})
    p = h.astype(np.float64)
    w64, g64, m64, v64 = (a.astype(np.float64) for a in (w, g, m, v))
    rm = m64 * p[1] + g64 * (1 - p[1])
    rv = v64 * p[2] + g64 * g64 * (1 - p[2])
    mh, vh = rm * p[5], np.sqrt(rv * p[6]) + p[3]
    rw = w64 * (1 - p[0] * p[4]) - p[0] * mh / vh
    check_close(new_m, rm, 3 * U * (np.abs(m64 * p[1]) + np.abs(g64 * (1 - p[1]))), "adamw m")
    check_close(new_v, rv, 4 * U * (np.abs(v64 * p[2]) + g64 * g64 * (1 - p[2])), "adamw v")
    check_close(new_w, rw, 3 * U * np.abs(w64) + 10 * U * p[0] * np.abs(mh / vh), "adamw param")


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=2), wd=st.sampled_from([0.0, 0.1]), seed=SEEDS)
def test_opt_step_sgd(run, shape, wd, seed):
    rng = rng_of(seed)
    w, g = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    h = np.array([0.05, wd], np.float32)
    (new_w,) = run(lambda c, t: _param_step(c, t, False), consts={"w": w, "g": g, "h": h})
    a, d = float(h[0]), float(h[1])
    rw = w.astype(np.float64) * (1 - a * d) - a * g.astype(np.float64)
    check_close(new_w, rw, 3 * U * (np.abs(w) + a * np.abs(g)), "sgd param")


def test_an_optimizer_step_needs_a_parameter():
    with gh.Context() as c:
        w, g = c.new_tensor("f32", (4,), "w"), c.new_tensor("f32", (4,), "g")
        with pytest.raises(gh.errors.ShapeError, match="marked as a parameter"):
            c.opt_step_sgd(w, g, c.new_tensor("f32", (2,), "h"))
