"""Reductions, copies, writes and shape ops beyond tests/test_ops.py, against numpy.

Copies, shape ops and selections are exact (they move values or convert them with one correctly rounded
conversion, as numpy's astype); sums accumulate in float (F32) or double: a k-term sum in any order is within
(k + 2) u sum|x_i| (helpers.dot_tol), and a mean adds one division.
"""

from __future__ import annotations

import math

import numpy as np
import oracles as O
import pytest
from helpers import Raw, check_close, dot_tol, quantized
from hypothesis import given
from hypothesis import strategies as st
from test_ops_elementwise import rounding, spec, values

import ggml_hybrid as gh

T = gh.GGMLType
SEEDS = st.integers(0, 2**31 - 1)
SHAPES = st.lists(st.integers(1, 7), min_size=1, max_size=4)
U = O.EPS32


def rng_of(seed):
    return np.random.default_rng(seed)


# -- reductions ----------------------------------------------------------------------------------------------------

@given(shape=SHAPES, dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=SEEDS)
def test_sum(run, shape, dtype, seed):
    a, x64 = spec(rng_of(seed).standard_normal(shape).astype(np.float32), dtype)
    got = values(run(lambda c, t: c.sum(t["a"]), consts={"a": a}), dtype)
    ref = x64.sum()
    check_close(got.reshape(()), ref, dot_tol(np.abs(x64).sum(), x64.size) + rounding(np.asarray(ref), dtype), "sum")


@given(shape=SHAPES, seed=SEEDS)
def test_mean_and_cumsum(run, shape, seed):
    x = rng_of(seed).standard_normal(shape).astype(np.float32)
    mean, cs = run(lambda c, t: (c.mean(t["a"]), c.cumsum(t["a"])), consts={"a": x})
    x64 = x.astype(np.float64)
    n = shape[-1]
    ref = x64.mean(axis=-1, keepdims=True)
    check_close(mean, ref, dot_tol(np.abs(x64).sum(axis=-1, keepdims=True), n) / n + U * np.abs(ref), "mean")
    ref_cs = np.cumsum(x64, axis=-1)
    check_close(cs, ref_cs, dot_tol(np.cumsum(np.abs(x64), axis=-1), n), "cumsum")


@given(rows=st.integers(1, 6), n=st.integers(1, 30), seed=SEEDS)
def test_argmax_and_count_equal(run, rows, n, seed):
    rng = rng_of(seed)
    x = rng.integers(-3, 4, (rows, n)).astype(np.float32)  # ties: GGML's argmax takes the last maximum
    lab = rng.integers(0, n, rows).astype(np.int32)
    am, eq = run(lambda c, t: (c.argmax(t["x"]), c.count_equal(c.argmax(t["x"]), t["lab"])),
                 consts={"x": x, "lab": lab})
    last = n - 1 - np.argmax(x[:, ::-1], axis=-1)
    assert am.dtype == np.int32 and np.array_equal(am.reshape(rows), last)
    assert eq.dtype == np.int64 and int(eq.reshape(())) == int(np.sum(last == lab))


# -- copies --------------------------------------------------------------------------------------------------------

CASTS = [("float32", "f16"), ("float32", "bf16"), ("float16", "f32"), ("float16", "bf16"), ("bfloat16", "f32"),
         ("bfloat16", "f16"), ("float32", "i32"), ("int32", "f32"), ("float32", "f32")]


@pytest.mark.parametrize("src, to", CASTS)
@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=3), transposed=st.booleans(), seed=SEEDS)
def test_cast_between_plain_types(run, src, to, shape, transposed, seed):
    """One correctly rounded conversion (numpy's astype; BF16 and F32 -> I32 toward zero, as C's cast)."""
    x = (rng_of(seed).standard_normal(shape) * 40).astype(np.float32)
    if src == "int32":
        a, x64 = x.astype(np.int32), x.astype(np.int32).astype(np.float64)
    else:
        a, x64 = spec(x, src)
    got = run(lambda c, t: c.cast(c.transpose(t["a"]) if transposed else t["a"], to), consts={"a": a})
    x64 = np.swapaxes(x64, -1, -2) if transposed else x64
    if to == "i32":
        ref = np.trunc(x64)
    elif to == "bf16":
        ref = O.from_bf16(O.to_bf16(x64.astype(np.float32))).astype(np.float64)
    else:
        ref = x64.astype({"f16": np.float16, "f32": np.float32}[to]).astype(np.float64)
    out = values(got, "bfloat16") if to == "bf16" else got.astype(np.float64)
    check_close(out, ref, 0.0, f"cast {src} -> {to}")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K])
@given(rows=st.integers(1, 3), seed=SEEDS)
def test_cast_quantizes_and_dequantizes(run, qtype, rows, seed):
    """cast(F32 -> q) gives the bytes of the CPU's quantizer (gh.quantize's reference quantizer within its own
    quantization error), and cast(q -> F32) dequantizes exactly as gh.dequantize."""
    rng = rng_of(seed)
    n = qtype.block_size * 2
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w, w64 = quantized(x, qtype)
    deq = run(lambda c, t: c.cast(t["w"], "f32"), consts={"w": w})
    check_close(deq, w64, 0.0, f"dequantize {qtype.name}")
    q = run(lambda c, t: c.cast(t["x"], qtype), consts={"x": x})
    mine = gh.dequantize(q.reshape(rows, -1), qtype, n).astype(np.float64)
    theirs = gh.dequantize(gh.quantize(x, qtype), qtype, n).astype(np.float64)
    # the CPU's quantizer may differ from the reference in the last bit of a rounding tie: compare both with x
    err_ref = np.abs(theirs - x).max(axis=-1, keepdims=True)
    assert np.all(np.abs(mine - x) <= 2 * err_ref + 1e-6), f"{qtype.name}: quantizing cast far from the reference"


@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=3), flat=st.booleans(), seed=SEEDS)
def test_dup_and_cont_with_a_shape(run, shape, flat, seed):
    """dup copies as is; cont of a transposed view gives numpy's element order, in the shape asked for."""
    x = rng_of(seed).standard_normal(shape).astype(np.float32)
    target = (-1,) if flat else (shape[-1], -1)
    dup, cont = run(lambda c, t: (c.dup(t["x"]), c.cont(c.transpose(t["x"]), target)), consts={"x": x})
    assert np.array_equal(dup.reshape(x.shape), x)
    assert np.array_equal(cont.reshape(-1), np.swapaxes(x, -1, -2).reshape(-1))


@given(rows=st.integers(1, 5), n=st.integers(2, 9), data=st.data(), seed=SEEDS)
def test_set_and_acc_write_into_a_view(run, rows, n, data, seed):
    rng = rng_of(seed)
    a = rng.standard_normal((rows, n)).astype(np.float32)
    br = data.draw(st.integers(1, rows), label="b rows")
    bn = data.draw(st.integers(1, n), label="b cols")
    r0 = data.draw(st.integers(0, rows - br), label="row offset")
    c0 = data.draw(st.integers(0, n - bn), label="col offset")
    b = rng.standard_normal((br, bn)).astype(np.float32)
    off = (r0 * n + c0) * 4
    s, ac = run(lambda c, t: (c.set(t["a"], t["b"], off), c.acc(t["a"], t["b"], off)), consts={"a": a, "b": b})
    ref_s, ref_a = a.copy(), a.astype(np.float64)
    ref_s[r0:r0 + br, c0:c0 + bn] = b
    ref_a[r0:r0 + br, c0:c0 + bn] += b
    assert np.array_equal(s.reshape(a.shape), ref_s)
    check_close(ac, ref_a, U * np.abs(ref_a), "acc")


# -- shape ops -----------------------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), reps=st.lists(st.integers(1, 3), min_size=3,
                                                                                 max_size=3), seed=SEEDS)
def test_repeat_like_and_repeat_back(run, shape, reps, seed):
    x = rng_of(seed).standard_normal(shape).astype(np.float32)
    big = tuple(s * r for s, r in zip(shape, reps[-len(shape):]))
    like = np.zeros(big, np.float32)
    y = rng_of(seed + 1).standard_normal(big).astype(np.float32)
    rep, back = run(lambda c, t: (c.repeat_like(t["x"], t["like"]), c.repeat_back(t["y"], x.shape)),
                    consts={"x": x, "like": like, "y": y})
    assert np.array_equal(rep.reshape(big), O.tile_to(x, big))
    ref = O.repeat_back(y.astype(np.float64), shape)
    tiles = math.prod(reps[-len(shape):])
    check_close(back, ref, dot_tol(O.repeat_back(np.abs(y).astype(np.float64), shape), tiles), "repeat_back")


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data(), circular=st.booleans(), seed=SEEDS)
def test_pad(run, shape, data, circular, seed):
    x = rng_of(seed).standard_normal(shape).astype(np.float32)
    k = data.draw(st.integers(1, len(shape)), label="padded axes")
    before = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k), label="before")
    after = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k), label="after")
    if circular:  # wrap at most one period
        before = [min(b, s) for b, s in zip(before, shape[-k:])]
        after = [min(a, s) for a, s in zip(after, shape[-k:])]
    got = run(lambda c, t: c.pad(t["x"], before, after, circular=circular), consts={"x": x})
    widths = [(0, 0)] * (len(shape) - k) + list(zip(before, after))
    ref = np.pad(x, widths, mode="wrap" if circular else "constant")
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(shape=st.lists(st.integers(2, 8), min_size=1, max_size=3), data=st.data(), seed=SEEDS)
def test_pad_reflect_roll(run, shape, data, seed):
    x = rng_of(seed).standard_normal(shape).astype(np.float32)
    p0, p1 = data.draw(st.integers(0, shape[-1] - 1)), data.draw(st.integers(0, shape[-1] - 1))
    shifts = [data.draw(st.integers(-s + 1, s - 1)) for s in shape]
    refl, rolled = run(lambda c, t: (c.pad_reflect_1d(t["x"], p0, p1), c.roll(t["x"], shifts)), consts={"x": x})
    ref = np.pad(x, [(0, 0)] * (len(shape) - 1) + [(p0, p1)], mode="reflect")
    assert np.array_equal(refl.reshape(ref.shape), ref)
    assert np.array_equal(rolled.reshape(x.shape), np.roll(x, shifts, axis=tuple(range(len(shape)))))


@pytest.mark.parametrize("kind, ref", [("lower_diag", np.tril), ("lower", lambda a: np.tril(a, -1)),
                                       ("upper_diag", np.triu), ("upper", lambda a: np.triu(a, 1))])
@given(n=st.integers(1, 6), batch=st.lists(st.integers(1, 3), max_size=2), seed=SEEDS)
def test_tri(run, kind, ref, n, batch, seed):
    x = rng_of(seed).standard_normal((*batch, n, n)).astype(np.float32)
    got = run(lambda c, t: c.tri(t["x"], kind), consts={"x": x})
    assert np.array_equal(got.reshape(x.shape), ref(x))


@given(n=st.integers(1, 6), batch=st.lists(st.integers(1, 3), max_size=2), n_past=st.integers(0, 3), seed=SEEDS)
def test_diag_and_diag_masks(run, n, batch, n_past, seed):
    rng = rng_of(seed)
    v = rng.standard_normal((*batch, 1, n)).astype(np.float32)
    m = rng.standard_normal((*batch, n, n + 2)).astype(np.float32)
    d, mi, mz = run(lambda c, t: (c.diag(t["v"]), c.diag_mask_inf(t["m"], n_past), c.diag_mask_zero(t["m"], n_past)),
                    consts={"v": v, "m": m})
    eye = np.eye(n, dtype=np.float32)
    assert np.array_equal(d.reshape(*batch, n, n), v * eye)  # row i: v[i] on the diagonal
    cols, rows = np.arange(n + 2)[None, :], np.arange(n)[:, None]
    masked = cols > n_past + rows
    assert np.array_equal(mi.reshape(m.shape), np.where(masked, -np.inf, m))
    assert np.array_equal(mz.reshape(m.shape), np.where(masked, 0, m))


@given(start=st.floats(-50, 50), length=st.floats(0.5, 60), step=st.sampled_from([0.25, 0.5, 1.0, 3.0, 0.1]))
def test_arange(run, start, length, step):
    f32 = np.float32
    s0, s1, st_ = f32(start), f32(start + length), f32(step)
    if not s1 > s0:
        return
    got = run(lambda c, t: c.arange(float(s0), float(s1), float(step)))
    n = math.ceil(float(f32(f32(s1 - s0) / st_)))
    prod = float(st_) * np.arange(n, dtype=np.float64)
    ref = float(s0) + prod
    # start + step * i in float32: one rounding where the compiler fuses it (FMA), two where not
    assert got.shape == (n,)
    check_close(got, ref, U * (np.abs(prod) + np.abs(ref)), f"arange({s0}, {s1}, {st_})")


@given(h=st.integers(1, 7), w=st.integers(1, 7), ch=st.integers(1, 3), win=st.integers(1, 4), seed=SEEDS)
def test_win_part_and_unpart(run, h, w, ch, win, seed):
    x = rng_of(seed).standard_normal((h, w, ch)).astype(np.float32)
    parts, back = run(lambda c, t: (c.win_part(t["x"], win), c.win_unpart(c.win_part(t["x"], win), h, w, win)),
                      consts={"x": x})
    nh, nw = -(-h // win), -(-w // win)
    padded = np.zeros((nh * win, nw * win, ch), np.float32)
    padded[:h, :w] = x
    ref = padded.reshape(nh, win, nw, win, ch).transpose(0, 2, 1, 3, 4).reshape(nh * nw, win, win, ch)
    assert np.array_equal(parts.reshape(ref.shape), ref)
    assert np.array_equal(back.reshape(x.shape), x)


# -- products and gathers ------------------------------------------------------------------------------------------

@given(k=st.integers(1, 9), n=st.integers(1, 6), m=st.integers(1, 6), batch=st.sampled_from([(), (2,), (2, 3)]),
       a_type=st.sampled_from([T.F32, T.F16, T.Q8_0]), seed=SEEDS)
def test_out_prod(run, k, n, m, batch, a_type, seed):
    rng = rng_of(seed)
    if a_type == T.Q8_0:
        n = 32
    x = rng.standard_normal((*batch, k, n)).astype(np.float32)
    if a_type == T.F32:
        a, a64 = x, x.astype(np.float64)
    elif a_type == T.F16:
        a, a64 = x.astype(np.float16), x.astype(np.float16).astype(np.float64)
    else:
        a, a64 = quantized(x, a_type)
    b = rng.standard_normal((*batch, k, m)).astype(np.float32)
    got = run(lambda c, t: c.out_prod(t["a"], t["b"]), consts={"a": a, "b": b})
    b64 = b.astype(np.float64)
    ref = np.swapaxes(b64, -1, -2) @ a64
    check_close(got, ref, dot_tol(np.swapaxes(np.abs(b64), -1, -2) @ np.abs(a64), k), f"out_prod {a_type.name}")


@given(m=st.integers(1, 8), n=st.integers(1, 9), n_rows=st.integers(1, 6), dtype=st.sampled_from(["float32",
                                                                                                   "float16"]),
       seed=SEEDS)
def test_get_rows_back(run, m, n, n_rows, dtype, seed):
    rng = rng_of(seed)
    g = rng.standard_normal((m, n)).astype(dtype)
    rows = rng.integers(0, n_rows, m).astype(np.int32)
    got = run(lambda c, t: c.get_rows_back(t["g"], t["r"], n_rows), consts={"g": g, "r": rows})
    ref = np.zeros((n_rows, n))
    np.add.at(ref, rows, g.astype(np.float64))
    absref = np.zeros((n_rows, n))
    np.add.at(absref, rows, np.abs(g.astype(np.float64)))
    check_close(got, ref, dot_tol(absref, m), "get_rows_back")


def test_bf16_round_trip_helpers_agree_with_ggml(run):
    """The BF16 oracle helpers round as GGML does (a cast to BF16 and back)."""
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    got = run(lambda c, t: c.cast(t["x"], "bf16"), consts={"x": x})
    assert np.array_equal(got, O.to_bf16(x))
    back = run(lambda c, t: c.cast(t["b"], "f32"), consts={"b": Raw(T.BF16, (1000,), O.to_bf16(x))})
    assert np.array_equal(back, O.from_bf16(O.to_bf16(x)))
