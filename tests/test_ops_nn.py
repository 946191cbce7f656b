"""Normalisations, softmax and rope gradients, vision and diffusion helpers, convolutions, pooling and resampling
against float64 numpy (tests/oracles.py).

Bounds: a sum of k products in float32 (or float16 inputs summed in float32) is within (k + 2) u sum|a b|
(helpers.dot_tol); F16 operands are rounded first and the oracle uses the rounded values, so their rounding is out
of the comparison; the normalisations chain a few float32 operations after double-precision sums: 8 u of each part.
"""

from __future__ import annotations

import math

import numpy as np
import oracles as O
import pytest
from helpers import check_close, dot_tol, tile_to
from hypothesis import given
from hypothesis import strategies as st
from test_ops import rope64

SEEDS = st.integers(0, 2**31 - 1)
U = O.EPS32


def rng_of(seed):
    return np.random.default_rng(seed)


# -- normalisation and softmax -------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 20), min_size=1, max_size=3), eps=st.sampled_from([0.0, 1e-5, 0.1]),
       scale=st.sampled_from([1e-2, 1.0, 1e2]), seed=SEEDS)
def test_norm_and_l2_norm(run, shape, eps, scale, seed):
    x = (rng_of(seed).standard_normal(shape) * scale + 0.5 * scale).astype(np.float32)
    if shape[-1] == 1 and eps == 0.0:
        eps = 1e-5  # a one-element row has no variance: with eps 0 both are 0/0
    got_n, got_l = run(lambda c, t: (c.norm(t["x"], eps), c.l2_norm(t["x"], eps)), consts={"x": x})
    x64, e32 = x.astype(np.float64), float(np.float32(eps))
    ref_n = O.norm(x64, e32)
    sd = np.sqrt(((x64 - x64.mean(axis=-1, keepdims=True)) ** 2).mean(axis=-1, keepdims=True) + e32)
    # x - mean in float32 (u |x| each), the variance from those, 1/sqrtf and the product: 8 u of |ref| and |x|/sd
    check_close(got_n, ref_n, 8 * U * (np.abs(ref_n) + np.abs(x64) / sd) + 1e-30, f"norm eps={eps}")
    ref_l = O.l2_norm(x64, e32)
    check_close(got_l, ref_l, 8 * U * np.abs(ref_l) + 1e-30, f"l2_norm eps={eps}")


@given(n=st.integers(1, 3), c=st.integers(1, 6), hw=st.tuples(st.integers(1, 4), st.integers(1, 5)),
       data=st.data(), eps=st.sampled_from([1e-6, 1e-3]), seed=SEEDS)
def test_group_norm(run, n, c, hw, data, eps, seed):
    groups = data.draw(st.integers(1, c), label="groups")
    x = rng_of(seed).standard_normal((n, c, *hw)).astype(np.float32)
    got = run(lambda cc, t: cc.group_norm(t["x"], groups, eps), consts={"x": x})
    x64 = x.astype(np.float64)
    e = float(np.float32(eps))
    ref = O.group_norm(x64, groups, e)
    # as norm: x - mean rounded in float32 (u |x|), then scaled by 1/sd: 8 u (|ref| + |x| / sd), sd per group
    per = -(-c // groups)
    sd = np.empty_like(x64)
    for g0 in range(0, c, per):
        blk = x64[:, g0:g0 + per]
        sd[:, g0:g0 + per] = np.sqrt(blk.var(axis=(1, 2, 3), keepdims=True) + e)
    check_close(got, ref, 8 * U * (np.abs(ref) + np.abs(x64) / sd) + 1e-30, f"group_norm groups={groups}")


@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=3), eps=st.sampled_from([1e-6, 1e-2]), seed=SEEDS)
def test_rms_norm_back(run, shape, eps, seed):
    rng = rng_of(seed)
    x, dz = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    got = run(lambda c, t: c.rms_norm_back(t["dz"], t["x"], eps), consts={"dz": dz, "x": x})
    x64, dz64, e = x.astype(np.float64), dz.astype(np.float64), float(np.float32(eps))
    n = shape[-1]
    r = np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + e)
    sxd = (x64 * dz64).sum(axis=-1, keepdims=True)
    ref = dz64 / r - x64 * sxd / (n * r ** 3)
    # the derivative of x / r, as finite differences of the forward oracle would give; 8 u of each term, and the
    # double-precision sums
    tol = 8 * U * (np.abs(dz64) / r + np.abs(x64 * sxd) / (n * r ** 3)) + \
        np.abs(x64) * dot_tol(np.abs(x64 * dz64).sum(axis=-1, keepdims=True), n) / (n * r ** 3)
    check_close(got, ref, tol, "rms_norm_back")


@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=3), scale=st.sampled_from([1.0, 0.5, 2.0]),
       seed=SEEDS)
def test_soft_max_back(run, shape, scale, seed):
    rng = rng_of(seed)
    z = rng.uniform(-3, 3, shape)
    y = O.softmax(z * float(np.float32(scale))).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    got = run(lambda c, t: c.soft_max_back(t["dy"], t["y"], scale), consts={"dy": dy, "y": y})
    y64, dy64, s = y.astype(np.float64), dy.astype(np.float64), float(np.float32(scale))
    dot = (dy64 * y64).sum(axis=-1, keepdims=True)
    ref = s * y64 * (dy64 - dot)
    n = shape[-1]
    tol = s * y64 * (dot_tol(np.abs(dy64 * y64).sum(axis=-1, keepdims=True), n) + 4 * U * (np.abs(dy64)
                                                                                           + np.abs(dot)))
    check_close(got, ref, tol + 1e-30, "soft_max_back")


# -- positions -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["normal", "neox"])
@given(tokens=st.integers(1, 4), heads=st.integers(1, 3), half=st.integers(1, 8), seed=SEEDS)
def test_rope_back_is_the_inverse_rotation(run, mode, tokens, heads, half, seed):
    rng = rng_of(seed)
    d = 2 * half
    g = rng.standard_normal((tokens, heads, d)).astype(np.float32)
    pos = rng.integers(0, 300, tokens).astype(np.int32)
    got = run(lambda c, t: c.rope_back(t["g"], c.rope(t["g"], t["pos"], d, mode=mode)), consts={"g": g, "pos": pos})
    ref, _ = rope64(g, -pos.astype(np.int64), d, mode, 10000.0)  # the rotation by the opposite angles
    _, tol = rope64(g, pos, d, mode, 10000.0)  # the same angles' error bound
    check_close(got, ref, tol + 1e-30, f"rope_back {mode}")


@given(n=st.integers(1, 6), dim=st.integers(1, 17), max_period=st.sampled_from([10000, 100]), seed=SEEDS)
def test_timestep_embedding(run, n, dim, max_period, seed):
    t = (rng_of(seed).uniform(0, 50, n)).astype(np.float32)
    got = run(lambda c, tt: c.timestep_embedding(tt["t"], dim, max_period), consts={"t": t})
    half = dim // 2
    j = np.arange(half)
    freq = np.exp(-math.log(max_period) * j / max(half, 1))
    arg = t.astype(np.float64)[:, None] * freq[None, :]
    ref = np.zeros((n, dim))
    ref[:, :half], ref[:, half:2 * half] = np.cos(arg), np.sin(arg)
    # freq from logf, a product, a division and expf (6 u relative), then t * freq (u): the angle is off by 8 u
    # |arg|; cosf/sinf add 2 u
    err = 8 * U * np.abs(arg) + 2 * U
    tol = np.zeros_like(ref)
    tol[:, :half], tol[:, half:2 * half] = err, err
    check_close(got, ref, tol, f"timestep_embedding dim={dim}")


@given(k=st.integers(1, 5), ch=st.integers(1, 4), seed=SEEDS)
def test_get_rel_pos(run, k, ch, seed):
    a = rng_of(seed).standard_normal((2 * k - 1, ch)).astype(np.float16)
    got = run(lambda c, t: c.get_rel_pos(t["a"], k, k), consts={"a": a})
    i, j = np.arange(k)[:, None], np.arange(k)[None, :]
    assert got.dtype == np.float16 and np.array_equal(got.reshape(k, k, ch), a[k - 1 + i - j])


@given(b=st.integers(1, 2), h=st.integers(1, 3), w=st.integers(1, 3), seed=SEEDS)
def test_add_rel_pos(run, b, h, w, seed):
    rng = rng_of(seed)
    a = rng.standard_normal((b, h * w, w * w)).astype(np.float32)
    pw, ph = (rng.standard_normal((b, h, w, w)).astype(np.float32) for _ in range(2))
    got = run(lambda c, t: c.add_rel_pos(t["a"], t["pw"], t["ph"]), consts={"a": a, "pw": pw, "ph": ph})
    # out[b, r, (j1, j0)] = a + ph[b, r, j1] + pw[b, r, j0], r the query (i1, i0)
    ref = a.astype(np.float64).reshape(b, h * w, w, w) + ph.reshape(b, h * w, w)[:, :, :, None] \
        + pw.reshape(b, h * w, w)[:, :, None, :]
    parts = np.abs(a.astype(np.float64).reshape(ref.shape)) + np.abs(ph.reshape(b, h * w, w)[:, :, :, None]) \
        + np.abs(pw.reshape(b, h * w, w)[:, :, None, :])
    # two float32 additions into the copy of a: u of each partial sum
    check_close(got.reshape(ref.shape), ref, U * (parts + np.abs(ref)) * 1.01, "add_rel_pos")


@given(s=st.integers(1, 2), t=st.integers(1, 3), h=st.integers(1, 3), d=st.sampled_from([4, 32]),
       n_kv=st.integers(1, 6), k_type=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_lightning_indexer(run, s, t, h, d, n_kv, k_type, seed):
    rng = rng_of(seed)
    q = rng.standard_normal((s, t, h, d)).astype(np.float32)
    k = rng.standard_normal((s, n_kv, 1, d)).astype(k_type)
    w = rng.standard_normal((s, 1, t, h)).astype(np.float32)
    m = rng.uniform(-1, 1, (1, 1, t, n_kv)).astype(np.float16)
    got = run(lambda c, tt: c.lightning_indexer(tt["q"], tt["k"], tt["w"], tt["m"]),
              consts={"q": q, "k": k, "w": w, "m": m})
    q64, k64, w64 = q.astype(np.float64), k.astype(np.float64)[:, :, 0], w.astype(np.float64)[:, 0]
    qk = np.einsum("sthd,sjd->sthj", q64, k64)
    ref = np.einsum("sthj,sth->stj", np.maximum(qk, 0), w64) + m.astype(np.float64)[0, 0][None]
    absqk = np.einsum("sthd,sjd->sthj", np.abs(q64), np.abs(k64))
    tol = np.einsum("sthj,sth->stj", dot_tol(absqk, d) + U * absqk, np.abs(w64)) \
        + (h + 2) * U * (np.einsum("sthj,sth->stj", np.abs(qk), np.abs(w64)) + np.abs(ref))
    check_close(got.reshape(ref.shape), ref, tol, "lightning_indexer")


# -- convolutions --------------------------------------------------------------------------------------------------

@st.composite
def conv2d_case(draw, max_k=3):
    n, c, oc = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, max_k)), draw(st.integers(1, max_k))
    s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    p = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    d = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    h = draw(st.integers(max(1, d[0] * (kh - 1) + 1 - 2 * p[0]), 7))
    w = draw(st.integers(max(1, d[1] * (kw - 1) + 1 - 2 * p[1]), 7))
    return (n, c, h, w), (oc, c, kh, kw), s, p, d


@given(case=conv2d_case(), dtype=st.sampled_from(["f32", "f16"]), seed=SEEDS)
def test_im2col_2d(run, case, dtype, seed):
    xs, ks, s, p, d = case
    x = rng_of(seed).standard_normal(xs).astype(np.float32)
    k = np.zeros(ks, np.float32)
    got = run(lambda c, t: c.im2col(t["k"], t["x"], s, p, d, dtype=dtype), consts={"k": k, "x": x})
    ref = O.im2col2d(x.astype(np.float64), ks[2], ks[3], s, p, d)
    if dtype == "f16":
        ref = ref.astype(np.float16).astype(np.float64)
    check_close(got.reshape(ref.shape), ref, 0.0, f"im2col {case}")


@given(n=st.integers(1, 2), c=st.integers(1, 3), length=st.integers(3, 9), kk=st.integers(1, 3),
       s=st.integers(1, 2), p=st.integers(0, 2), d=st.integers(1, 2), seed=SEEDS)
def test_im2col_1d_and_conv_1d(run, n, c, length, kk, s, p, d, seed):
    rng = rng_of(seed)
    x = rng.standard_normal((n, c, length)).astype(np.float32)
    oc = 2
    w = rng.standard_normal((oc, c, kk)).astype(np.float16)
    if O.conv_out(length, kk, 1, p, d) < 1:
        return
    cols, out = run(lambda cc, t: (cc.im2col(t["w"], t["x"], (1, s), (0, p), (1, d), is_2d=False),
                                   cc.conv_1d(t["w"], t["x"], s, p, d)), consts={"w": w, "x": x})
    ref_cols = O.im2col2d(x.astype(np.float64)[:, :, None, :], 1, kk, (1, s), (0, p), (1, d))[:, 0]
    check_close(cols.reshape(ref_cols.shape), ref_cols, 0.0, "im2col 1d")
    x16 = x.astype(np.float16).astype(np.float64)
    w64 = w.astype(np.float64)
    ref = O.conv2d(x16[:, :, None, :], w64[:, :, None, :], (1, s), (0, p), (1, d))[:, :, 0]
    absr = O.conv2d(np.abs(x16)[:, :, None, :], np.abs(w64)[:, :, None, :], (1, s), (0, p), (1, d))[:, :, 0]
    check_close(out.reshape(ref.shape), ref, dot_tol(absr, c * kk), "conv_1d")


@pytest.mark.parametrize("how", ["im2col", "direct"])
@given(case=conv2d_case(), k_type=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_conv_2d(run, how, case, k_type, seed):
    xs, ks, s, p, d = case
    rng = rng_of(seed)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ks).astype(k_type)
    fn = "conv_2d" if how == "im2col" else "conv_2d_direct"
    got = run(lambda c, t: getattr(c, fn)(t["w"], t["x"], s, p, d), consts={"w": w, "x": x})
    # the im2col form multiplies F16 patches; the direct form rounds the data only for an F16 kernel
    to16 = how == "im2col" or k_type == "float16"
    x64 = x.astype(np.float16 if to16 else np.float32).astype(np.float64)
    w64 = w.astype(np.float16 if how == "im2col" else w.dtype).astype(np.float64)
    ref = O.conv2d(x64, w64, s, p, d)
    absr = O.conv2d(np.abs(x64), np.abs(w64), s, p, d)
    check_close(got.reshape(ref.shape), ref, dot_tol(absr, ks[1] * ks[2] * ks[3]), f"{fn} {case}")


@given(case=conv2d_case(), k_type=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_conv_2d_dw_direct(run, case, k_type, seed):
    (n, c, h, w_), (_, _, kh, kw), s, p, d = case
    rng = rng_of(seed)
    x = rng.standard_normal((n, c, h, w_)).astype(np.float32)
    w = rng.standard_normal((c, 1, kh, kw)).astype(k_type)
    got = run(lambda cc, t: cc.conv_2d_dw_direct(t["w"], t["x"], s, p, d), consts={"w": w, "x": x})
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = np.concatenate([O.conv2d(x64[:, i:i + 1], w64[i:i + 1], s, p, d) for i in range(c)], axis=1)
    absr = np.concatenate([O.conv2d(np.abs(x64[:, i:i + 1]), np.abs(w64[i:i + 1]), s, p, d) for i in range(c)],
                          axis=1)
    check_close(got.reshape(ref.shape), ref, dot_tol(absr, kh * kw), "conv_2d_dw_direct")


def conv3d(x, w, s, p, d):
    """x [N, C, D, H, W], w [O, C, KD, KH, KW] -> [N, O, OD, OH, OW] (cross-correlation, zero padding)."""
    out_d = O.conv_out(x.shape[2], w.shape[2], s[0], p[0], d[0])
    xp = np.pad(x, [(0, 0), (0, 0), (p[0], p[0]), (0, 0), (0, 0)])
    planes = []
    for od in range(out_d):
        acc = 0
        for kz in range(w.shape[2]):
            acc = acc + O.conv2d(xp[:, :, od * s[0] + kz * d[0]], w[:, :, kz], s[1:], p[1:], d[1:])
        planes.append(acc)
    return np.stack(planes, axis=2)


@given(n=st.integers(1, 2), ic=st.integers(1, 2), oc=st.integers(1, 2), k=st.integers(1, 2), size=st.integers(2, 4),
       s=st.integers(1, 2), p=st.integers(0, 1), k_type=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_conv_3d_direct_and_im2col_3d(run, n, ic, oc, k, size, s, p, k_type, seed):
    rng = rng_of(seed)
    x = rng.standard_normal((n * ic, size, size + 1, size)).astype(np.float32)
    w = rng.standard_normal((oc * ic, k, k, k)).astype(k_type)
    out, cols = run(lambda c, t: (c.conv_3d_direct(t["w"], t["x"], (n, ic, oc), s, p),
                                  c.im2col_3d(t["w"], t["x"], ic, s, p)), consts={"w": w, "x": x})
    x5 = x.astype(np.float16 if k_type == "float16" else np.float32).astype(np.float64).reshape(n, ic, *x.shape[1:])
    w5 = w.astype(np.float64).reshape(oc, ic, k, k, k)
    ref = conv3d(x5, w5, (s,) * 3, (p,) * 3, (1,) * 3)
    absr = conv3d(np.abs(x5), np.abs(w5), (s,) * 3, (p,) * 3, (1,) * 3)
    check_close(out.reshape(ref.shape), ref, dot_tol(absr, ic * k ** 3), "conv_3d_direct")
    # im2col_3d: [N OD, OH, OW, IC KD KH KW], channel outermost in a patch, zero outside the data
    x_exact = x.astype(np.float64).reshape(n, ic, *x.shape[1:])
    xp = np.pad(x_exact, [(0, 0), (0, 0), (p, p), (p, p), (p, p)])
    dims = [O.conv_out(x.shape[i], k, s, p, 1) for i in (1, 2, 3)]
    ref_cols = np.zeros((n, *dims, ic, k, k, k))
    for z, y, xx in np.ndindex(*dims):
        ref_cols[:, z, y, xx] = xp[:, :, z * s: z * s + k, y * s: y * s + k, xx * s: xx * s + k]
    check_close(cols.reshape(-1), ref_cols.reshape(-1), 0.0, "im2col_3d")


@given(t_in=st.integers(1, 6), k=st.integers(1, 4), oc=st.integers(1, 3), s=st.integers(1, 3), data=st.data(),
       seed=SEEDS)
def test_col2im_1d(run, t_in, k, oc, s, data, seed):
    p = data.draw(st.integers(0, max(0, ((t_in - 1) * s + k - 1) // 2)), label="padding")
    cols = rng_of(seed).standard_normal((t_in, k * oc)).astype(np.float32)
    got = run(lambda c, t: c.col2im_1d(t["cols"], s, oc, p), consts={"cols": cols})
    t_out = (t_in - 1) * s + k - 2 * p
    ref, absr = np.zeros((oc, t_out)), np.zeros((oc, t_out))
    for ti in range(t_in):
        for o in range(oc):
            for kk in range(k):
                j = ti * s + kk - p
                if 0 <= j < t_out:
                    ref[o, j] += cols[ti, o * k + kk]
                    absr[o, j] += abs(cols[ti, o * k + kk])
    check_close(got.reshape(ref.shape), ref, dot_tol(absr, k), "col2im_1d")


@given(ic=st.integers(1, 3), oc=st.integers(1, 3), k=st.integers(1, 4), length=st.integers(1, 6),
       s=st.integers(1, 3), k_type=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_conv_transpose_1d(run, ic, oc, k, length, s, k_type, seed):
    rng = rng_of(seed)
    w = rng.standard_normal((ic, oc, k)).astype(k_type)
    x = rng.standard_normal((ic, length)).astype(np.float32)
    got = run(lambda c, t: c.conv_transpose_1d(t["w"], t["x"], s), consts={"w": w, "x": x})
    x64 = x.astype(np.float16 if k_type == "float16" else np.float32).astype(np.float64)
    w64 = w.astype(np.float64)
    ref, absr = np.zeros((oc, (length - 1) * s + k)), np.zeros((oc, (length - 1) * s + k))
    for i in range(length):
        ref[:, i * s: i * s + k] += np.einsum("c,cok->ok", x64[:, i], w64)
        absr[:, i * s: i * s + k] += np.einsum("c,cok->ok", np.abs(x64[:, i]), np.abs(w64))
    check_close(got.reshape(ref.shape), ref, dot_tol(absr, ic * k), "conv_transpose_1d")


@given(n=st.integers(1, 2), ic=st.integers(1, 2), oc=st.integers(1, 2), kh=st.integers(1, 3), kw=st.integers(1, 3),
       h=st.integers(1, 4), w_=st.integers(1, 4), s=st.integers(1, 3), k_type=st.sampled_from(["float32", "float16"]),
       seed=SEEDS)
def test_conv_transpose_2d(run, n, ic, oc, kh, kw, h, w_, s, k_type, seed):
    rng = rng_of(seed)
    w = rng.standard_normal((ic, oc, kh, kw)).astype(k_type)
    x = rng.standard_normal((n, ic, h, w_)).astype(np.float32)
    got = run(lambda c, t: c.conv_transpose_2d(t["w"], t["x"], s), consts={"w": w, "x": x})
    x64 = x.astype(np.float16 if k_type == "float16" else np.float32).astype(np.float64)
    w64 = w.astype(np.float64)
    shape = (n, oc, (h - 1) * s + kh, (w_ - 1) * s + kw)
    ref, absr = np.zeros(shape), np.zeros(shape)
    for i in range(h):
        for j in range(w_):
            ref[:, :, i * s: i * s + kh, j * s: j * s + kw] += np.einsum("nc,cokl->nokl", x64[:, :, i, j], w64)
            absr[:, :, i * s: i * s + kh, j * s: j * s + kw] += np.einsum("nc,cokl->nokl", np.abs(x64[:, :, i, j]),
                                                                        np.abs(w64))
    check_close(got.reshape(shape), ref, dot_tol(absr, ic * kh * kw), "conv_transpose_2d")


def im2col_back64(grad, xs, kh, kw, s, p, d):
    """The adjoint of im2col2d: each patch element summed back into the position it was read from."""
    n, c, h, w = xs
    oh, ow = O.conv_out(h, kh, s[0], p[0], d[0]), O.conv_out(w, kw, s[1], p[1], d[1])
    g = grad.reshape(n, oh, ow, c, kh, kw)
    out = np.zeros((n, c, h + 2 * p[0], w + 2 * p[1]))
    for i in range(kh):
        for j in range(kw):
            out[:, :, i * d[0]: i * d[0] + s[0] * (oh - 1) + 1: s[0], j * d[1]: j * d[1] + s[1] * (ow - 1) + 1: s[1]] \
                += g[:, :, :, :, i, j].transpose(0, 3, 1, 2)
    return out[:, :, p[0]:p[0] + h, p[1]:p[1] + w]


@given(case=conv2d_case(), seed=SEEDS)
def test_im2col_back(run, case, seed):
    xs, ks, s, p, d = case
    k = np.zeros(ks, np.float32)
    ref_cols_shape = O.im2col2d(np.zeros(xs), ks[2], ks[3], s, p, d).shape
    g = rng_of(seed).standard_normal(ref_cols_shape).astype(np.float32)
    got = run(lambda c, t: c.im2col_back(t["g"], t["k"], xs, s, p, d), consts={"g": g, "k": k})
    ref = im2col_back64(g.astype(np.float64), xs, ks[2], ks[3], s, p, d)
    absr = im2col_back64(np.abs(g.astype(np.float64)), xs, ks[2], ks[3], s, p, d)
    check_close(got.reshape(ref.shape), ref, dot_tol(absr, ks[2] * ks[3]), "im2col_back")


# -- pooling and resampling ----------------------------------------------------------------------------------------

def pool1d64(x, kind, k, s, p):
    n = x.shape[-1]
    out_n = (n + 2 * p - k) // s + 1
    out = np.empty(x.shape[:-1] + (out_n,))
    for o in range(out_n):
        lo, hi = max(o * s - p, 0), min(o * s - p + k, n)
        win = x[..., lo:hi]
        out[..., o] = win.max(axis=-1) if kind == "max" else win.mean(axis=-1)
    return out


@pytest.mark.parametrize("kind", ["max", "avg"])
@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=2), n=st.integers(2, 12), data=st.data(),
       dtype=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_pool_1d(run, kind, shape, n, data, dtype, seed):
    k = data.draw(st.integers(1, n), label="kernel")
    s = data.draw(st.integers(1, 3), label="stride")
    p = data.draw(st.integers(0, k // 2), label="padding")
    x = rng_of(seed).standard_normal((*shape, n)).astype(dtype)
    got = run(lambda c, t: c.pool_1d(t["x"], kind, k, s, p), consts={"x": x})
    x64 = x.astype(np.float64)
    ref = pool1d64(x64, kind, k, s, p)
    tol = 0.0 if kind == "max" else dot_tol(pool1d64(np.abs(x64), "avg", k, s, p) * k, k) / 1 + U * np.abs(ref)
    check_close(got.reshape(ref.shape), ref, tol, f"pool_1d {kind} k={k} s={s} p={p}")


def pool2d64(x, kind, k, s, p):
    h, w = x.shape[-2:]
    oh, ow = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    out = np.empty(x.shape[:-2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * s[0] - p[0], j * s[1] - p[1]
            win = x[..., max(r0, 0):min(r0 + k[0], h), max(c0, 0):min(c0 + k[1], w)]
            out[..., i, j] = win.max(axis=(-2, -1)) if kind == "max" else win.sum(axis=(-2, -1)) / (k[0] * k[1])
    return out


@pytest.mark.parametrize("kind", ["max", "avg"])
@given(lead=st.lists(st.integers(1, 3), max_size=2), h=st.integers(2, 7), w=st.integers(2, 7), data=st.data(),
       seed=SEEDS)
def test_pool_2d_and_back(run, kind, lead, h, w, data, seed):
    k = (data.draw(st.integers(1, h)), data.draw(st.integers(1, w)))
    s = (data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)))
    p = (data.draw(st.integers(0, k[0] // 2)), data.draw(st.integers(0, k[1] // 2)))
    rng = rng_of(seed)
    x = rng.standard_normal((*lead, h, w)).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = pool2d64(x64, kind, k, s, p)
    g = rng.standard_normal(ref.shape).astype(np.float32)
    got, back = run(lambda c, t: (c.pool_2d(t["x"], kind, k, s, p), c.pool_2d_back(t["g"], t["x"], kind, k, s, p)),
                    consts={"x": x, "g": g})
    tol = 0.0 if kind == "max" else dot_tol(pool2d64(np.abs(x64), "avg", k, s, p) * k[0] * k[1], k[0] * k[1]) \
        / (k[0] * k[1]) + U * np.abs(ref)
    check_close(got.reshape(ref.shape), ref, tol, f"pool_2d {kind}")
    # the gradient: max sends each output's gradient to its window's first largest element, avg spreads it
    x4 = x64.reshape(-1, h, w)
    g4 = g.astype(np.float64).reshape(-1, *ref.shape[-2:])
    want, absw = np.zeros_like(x4), np.zeros_like(x4)
    for b in range(x4.shape[0]):
        for i in range(ref.shape[-2]):
            for j in range(ref.shape[-1]):
                r0, c0 = i * s[0] - p[0], j * s[1] - p[1]
                rs, cs = slice(max(r0, 0), min(r0 + k[0], h)), slice(max(c0, 0), min(c0 + k[1], w))
                if kind == "max":
                    win = x4[b, rs, cs]
                    r, cc = np.unravel_index(np.argmax(win), win.shape)
                    want[b, rs.start + r, cs.start + cc] += g4[b, i, j]
                    absw[b, rs.start + r, cs.start + cc] += abs(g4[b, i, j])
                else:
                    want[b, rs, cs] += g4[b, i, j] / (k[0] * k[1])
                    absw[b, rs, cs] += abs(g4[b, i, j]) / (k[0] * k[1])
    check_close(back.reshape(want.shape), want, dot_tol(absw, ref.shape[-1] * ref.shape[-2]), f"pool_2d_back {kind}")


def nearest_index(n_out: int, n_in: int) -> np.ndarray:
    """GGML's nearest source index: int(i / (n_out / n_in)) in float32."""
    sf = np.float32(n_out) / np.float32(n_in)
    return (np.arange(n_out, dtype=np.float32) / sf).astype(np.int64)


@given(lead=st.lists(st.integers(1, 3), max_size=2), h=st.integers(1, 5), w=st.integers(1, 5),
       oh=st.integers(1, 9), ow=st.integers(1, 9), seed=SEEDS)
def test_interpolate_nearest_and_bilinear(run, lead, h, w, oh, ow, seed):
    x = rng_of(seed).standard_normal((*lead, h, w)).astype(np.float32)
    near, bil = run(lambda c, t: (c.interpolate(t["x"], (*lead, oh, ow), "nearest"),
                                  c.interpolate(t["x"], (*lead, oh, ow), "bilinear")), consts={"x": x})
    ref = x[..., nearest_index(oh, h)[:, None], nearest_index(ow, w)[None, :]]
    assert np.array_equal(near.reshape(ref.shape), ref)

    def coords(n_out, n_in):  # GGML's half-pixel source coordinate, clamped neighbours and weight (float32)
        sf = np.float32(n_out) / np.float32(n_in)
        pos = (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) / sf - np.float32(0.5)
        i0 = np.floor(pos).astype(np.int64)
        frac = np.clip(pos - i0.astype(np.float32), 0, 1).astype(np.float64)
        return np.clip(i0, 0, n_in - 1), np.clip(i0 + 1, 0, n_in - 1), frac

    y0, y1, dy = coords(oh, h)
    x0, x1, dx = coords(ow, w)
    x64 = x.astype(np.float64)
    a, b = x64[..., y0[:, None], x0[None, :]], x64[..., y0[:, None], x1[None, :]]
    c, d = x64[..., y1[:, None], x0[None, :]], x64[..., y1[:, None], x1[None, :]]
    wy, wx = dy[:, None], dx[None, :]
    want = a * (1 - wx) * (1 - wy) + b * wx * (1 - wy) + c * (1 - wx) * wy + d * wx * wy
    # four products of three factors and three sums in float32: 8 u of the absolute terms
    tol = 8 * U * (np.abs(a) + np.abs(b) + np.abs(c) + np.abs(d))
    check_close(bil.reshape(want.shape), want, tol + 1e-30, "interpolate bilinear")


def test_tile_helper_is_numpys_tile():
    """tests/oracles.tile_to and helpers.tile_to are one rule (the references and the older tests agree)."""
    b = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(O.tile_to(b, (4, 6)), tile_to(b, (4, 6)))


def _cubic(x, a=-0.75):
    """The cubic convolution kernel's weights for offset x in [0, 1) (PyTorch's and GGML's, alpha -0.75)."""
    w1 = lambda t: ((a + 2) * t - (a + 3)) * t * t + 1
    w2 = lambda t: ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.stack([w2(x + 1), w1(x), w1(1 - x), w2(2 - x)], axis=-1)


@given(lead=st.lists(st.integers(1, 2), max_size=1), h=st.integers(1, 5), w=st.integers(1, 5), oh=st.integers(1, 8),
       ow=st.integers(1, 8), align=st.booleans(), seed=SEEDS)
def test_interpolate_bicubic(run, lead, h, w, oh, ow, align, seed):
    x = rng_of(seed).standard_normal((*lead, h, w)).astype(np.float32)
    got = run(lambda c, t: c.interpolate(t["x"], (*lead, oh, ow), "bicubic", align_corners=align), consts={"x": x})
    f32 = np.float32

    def coords(n_out, n_in):  # GGML's source coordinate in float32, its floor and fraction
        sf = f32(n_out) / f32(n_in)
        off = f32(0.5)
        if align:
            off = f32(0)
            if n_out > 1 and n_in > 1:
                sf = f32(n_out - 1) / f32(n_in - 1)
        pos = (np.arange(n_out, dtype=np.float32) + off) / sf - off
        i0 = np.floor(pos).astype(np.int64)
        return i0, (pos - i0.astype(np.float32)).astype(np.float64)

    y0, dy = coords(oh, h)
    x0, dx = coords(ow, w)
    wy, wx = _cubic(dy), _cubic(dx)  # [oh, 4], [ow, 4]
    ry = np.clip(y0[:, None] + np.arange(-1, 3)[None, :], 0, h - 1)  # [oh, 4]
    rx = np.clip(x0[:, None] + np.arange(-1, 3)[None, :], 0, w - 1)
    x64 = x.astype(np.float64)
    patch = x64[..., ry[:, None, :, None], rx[None, :, None, :]]  # [.., oh, ow, 4, 4]
    ref = np.einsum("...ijab,ia,jb->...ij", patch, wy, wx)
    # the weights are cubic polynomials of the float32 fraction, the sums nested: 32 u of the absolute terms
    tol = 32 * U * np.einsum("...ijab,ia,jb->...ij", np.abs(patch), np.abs(wy), np.abs(wx))
    check_close(got.reshape(ref.shape), ref, tol + 1e-30, f"bicubic align={align}")


@given(h=st.integers(1, 4), w=st.integers(1, 4), factor=st.integers(2, 3), seed=SEEDS)
def test_upscale_repeats_each_pixel(run, h, w, factor, seed):
    x = rng_of(seed).standard_normal((2, h, w)).astype(np.float32)
    got = run(lambda c, t: c.upscale(t["x"], factor), consts={"x": x})
    assert np.array_equal(got.reshape(2, h * factor, w * factor), np.repeat(np.repeat(x, factor, 1), factor, 2))
