"""Every graph op of OpsMixin against a float64 numpy oracle.

Tolerances are derived from the magnitudes involved, never picked to pass:

* float32 arithmetic (u = 2**-24): an elementwise op rounds once, so
  |err| <= u |ref| (a few u where GGML does a few roundings); a k-term dot
  product or sum, in any order, is within (k + 2) u sum|a_i b_i|.
* float16 (u16 = 2**-11): F16 results round once more, u16 |ref|; an F32
  activation that GGML converts to F16 for an F16 weight costs u16 sum|a_i b_i|.
* quantized weights: the oracle uses the *dequantized* weights (gh.dequantize),
  so the weight error is out of the comparison; GGML also quantizes the
  activation b to Q8_0 (32-blocks, fp16 scale) or Q8_K (256-blocks) before the
  integer dot product. Bounding that by sum_j |w_j| amax_block/254 is too loose
  to catch anything at k = 768 (see mm_oracle), so the oracle applies the same
  activation quantization and the tolerance is float rounding relative to
  sum|w_j b~_j|.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    EPS16,
    EPS32,
    F16_TINY,
    Raw,
    block_amax,
    canon,
    check_close,
    dot_tol,
    pad_shape,
    q8_err,
    quantized,
    run_isolated,
    tile_to,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh

T = gh.GGMLType
SEEDS = st.integers(0, 2**31 - 1)
QTYPES = [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]
WTYPES = [T.F32, T.F16] + QTYPES


def rng_of(seed):
    return np.random.default_rng(seed)


def f16_tol(ref):
    """One rounding to float16 of a value computed in float32."""
    return EPS16 * np.abs(ref) * (1 + 1e-3) + F16_TINY


# --------------------------------------------------------------------------------------------------------------
# weights (F32 / F16 / quantized): the weight tensor spec, its exact float64 values and the matmul tolerance
# --------------------------------------------------------------------------------------------------------------

def make_weight(rng, wtype: T, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    if wtype == T.F32:
        return x, x.astype(np.float64)
    if wtype == T.F16:
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    return quantized(x, wtype)


def emulate_q8_0(x: np.ndarray) -> np.ndarray:
    """The activation as GGML's CPU quantize_row_q8_0 leaves it (x86 SIMD path): per 32-block, float32
    d = amax/127 stored as fp16, q = rint(x * (127/amax)) (ties to even). Returns q * d16 in float64."""
    xb = x.astype(np.float32).reshape(x.shape[:-1] + (-1, 32))
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d16 = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv).astype(np.float32)).astype(np.float64)
    return (q * d16).reshape(x.shape)


def emulate_q8_k(x: np.ndarray) -> np.ndarray:
    """The activation as quantize_row_q8_K_ref leaves it (the CPU uses the reference): per 256-block, with max the
    first element of largest |x|, iscale = -127/max, q = min(127, rint(iscale x)), d = 1/iscale (float32)."""
    xb = x.astype(np.float32).reshape(x.shape[:-1] + (-1, 256))
    mx = np.take_along_axis(xb, np.argmax(np.abs(xb), axis=-1)[..., None], axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(iscale != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float64)
    q = np.minimum(127, np.rint((iscale * xb).astype(np.float32))).astype(np.float64)
    return (q * d).reshape(x.shape)


def mm_oracle(w64: np.ndarray, x: np.ndarray, wtype: T):
    """Reference and tolerance of out[.., m, n] = sum_j w[.., n, j] x[.., m, j] as GGML's CPU computes it.

    GGML first converts the activation x to the weight's vec_dot_type: F16 for F16 weights, Q8_0 for Q8_0/Q4_0,
    Q8_K for K-quants. The worst-case bound for that step, sum_j |w_j| amax_block/254, is so loose at k = 768
    that it can exceed |out| (a kernel returning zeros would pass), so the oracle applies the same conversion
    to x (emulate_q8_0/emulate_q8_k: the same float32 operations) and the tolerance covers float rounding
    only: the k-term dot product in float32, twice over (the per-block scale products d_w d_x), and 4 u
    amax_block(w) |x~_j| per element for the K-quant kernels' separate scale and min sums, which cancel
    (and one rounding flip, below).
    """
    if wtype == T.F32:
        xq = x.astype(np.float64)
    elif wtype == T.F16:
        xq = x.astype(np.float16).astype(np.float64)
    elif wtype.block_size == 256:
        xq = emulate_q8_k(x)
    else:
        xq = emulate_q8_0(x)
    wt = np.swapaxes(w64, -1, -2)
    ref = xq @ wt
    absprod = np.abs(xq) @ np.abs(wt)
    k = w64.shape[-1]
    if not wtype.is_quantized:
        return ref, dot_tol(absprod, k)
    sub = 32 if wtype.block_size == 32 else 16  # scale sub-blocks (16 is the finest among the K-quants)
    cancel = 4 * EPS32 * (np.abs(xq) @ np.swapaxes(block_amax(w64, sub), -1, -2))
    # portability: another CPU's quantizer (e.g. roundf instead of rint) may put one element on the other side
    # of a .5 tie, one quantum amax/127 of x times |w_j|
    flip = (np.abs(x).max(axis=-1) / 127)[..., :, None] * np.abs(w64).max(axis=-1)[..., None, :]
    return ref, 2 * dot_tol(absprod, k) + cancel + flip


@st.composite
def weight_case(draw):
    wtype = draw(st.sampled_from(WTYPES))
    blk = wtype.block_size
    k = blk * draw(st.integers(1, 3)) if blk > 1 else draw(st.integers(1, 48))
    return wtype, k


# --------------------------------------------------------------------------------------------------------------
# matrix products and gathers
# --------------------------------------------------------------------------------------------------------------

@given(case=weight_case(), n=st.integers(1, 5), m=st.integers(1, 4), batch=st.sampled_from([0, 1, 2]),
       rep=st.integers(1, 2), x_as_input=st.booleans(), seed=SEEDS)
def test_mul_mat(run, case, n, m, batch, rep, x_as_input, seed):
    wtype, k = case
    rng = rng_of(seed)
    # batched: a [Ba, n, k], b [Ba*rep, m, k]; GGML maps b batch i to a batch i // rep
    a_shape = (batch, n, k) if batch else (n, k)
    b_shape = (batch * rep, m, k) if batch else (m, k)
    w, w64 = make_weight(rng, wtype, a_shape)
    x = rng.standard_normal(b_shape).astype(np.float32)
    consts, inputs = {"w": w}, {}
    (inputs if x_as_input else consts)["x"] = x
    got = run(lambda c, t: c.mul_mat(t["w"], t["x"]), consts=consts, inputs=inputs)
    wr = np.repeat(w64, rep, axis=0) if batch else w64
    ref, tol = mm_oracle(wr, x, wtype)
    check_close(got, ref, tol, f"mul_mat {wtype.name} a{a_shape} b{b_shape}")


@given(case=weight_case(), n_expert=st.integers(1, 4), n=st.integers(1, 4), tokens=st.integers(1, 4),
       used=st.integers(1, 3), b_shared=st.booleans(), ids_as_input=st.booleans(), seed=SEEDS)
def test_mul_mat_id(run, case, n_expert, n, tokens, used, b_shared, ids_as_input, seed):
    wtype, k = case
    rng = rng_of(seed)
    u = 1 if b_shared else used
    experts, e64 = make_weight(rng, wtype, (n_expert, n, k))
    x = rng.standard_normal((tokens, u, k)).astype(np.float32)
    ids = rng.integers(0, n_expert, size=(tokens, used), dtype=np.int32)
    consts = {"e": experts, "x": x}
    inputs = {}
    (inputs if ids_as_input else consts)["ids"] = ids
    got = run(lambda c, t: c.mul_mat_id(t["e"], t["x"], t["ids"]), consts=consts, inputs=inputs)
    ref = np.empty((tokens, used, n))
    tol = np.empty_like(ref)
    for ti in range(tokens):
        for j in range(used):
            r, tl = mm_oracle(e64[ids[ti, j]], x[ti, j % u][None, :], wtype)
            ref[ti, j], tol[ti, j] = r[0], tl[0]
    check_close(got, ref, tol, f"mul_mat_id {wtype.name}")


@given(wtype=st.sampled_from(WTYPES), n_rows=st.integers(1, 6), m=st.integers(1, 8), batch=st.integers(0, 2),
       rows_as_input=st.booleans(), seed=SEEDS)
def test_get_rows(run, wtype, n_rows, m, batch, rows_as_input, seed):
    rng = rng_of(seed)
    n = wtype.block_size * 2 if wtype.is_quantized else 7
    a_shape = (batch, n_rows, n) if batch else (n_rows, n)
    a, a64 = make_weight(rng, wtype, a_shape)
    rows = rng.integers(0, n_rows, size=(batch, m) if batch else (m,), dtype=np.int32)
    consts, inputs = {"a": a}, {}
    (inputs if rows_as_input else consts)["rows"] = rows
    got = run(lambda c, t: c.get_rows(t["a"], t["rows"]), consts=consts, inputs=inputs)
    ref = np.stack([a64[b][rows[b]] for b in range(batch)]) if batch else a64[rows]
    # get_rows dequantizes with the same to_float routine as gh.dequantize (and F16 -> F32 is exact): no error
    check_close(got, ref, 0.0, f"get_rows {wtype.name}")


# --------------------------------------------------------------------------------------------------------------
# elementwise
# --------------------------------------------------------------------------------------------------------------

@st.composite
def broadcast_shapes(draw, max_dims=4):
    nd = draw(st.integers(1, max_dims))
    a_shape = tuple(draw(st.lists(st.integers(1, 6), min_size=nd, max_size=nd)))
    nb = draw(st.integers(1, nd))
    b_shape = []
    for s in a_shape[nd - nb:]:
        divisors = [d for d in range(1, s + 1) if s % d == 0]
        b_shape.append(draw(st.sampled_from(divisors)))
    return a_shape, tuple(b_shape)


BINARY = {"add": np.add, "mul": np.multiply, "div": np.divide}


@pytest.mark.parametrize("op", sorted(BINARY))
@given(shapes=broadcast_shapes(),
       types=st.sampled_from([("float32", "float32"), ("float16", "float16"), ("float16", "float32")]),
       seed=SEEDS)
def test_binary(run, op, shapes, types, seed):
    a_shape, b_shape = shapes
    rng = rng_of(seed)
    a = rng.standard_normal(a_shape).astype(types[0])
    if op == "div":  # keep the divisor away from 0 so that its rounding stays relative
        b = (rng.choice([-1.0, 1.0], b_shape) * rng.uniform(0.5, 2.0, b_shape)).astype(types[1])
    else:
        b = rng.standard_normal(b_shape).astype(types[1])
    got = run(lambda c, t: getattr(c, op)(t["a"], t["b"]), consts={"a": a, "b": b})
    ref = BINARY[op](a.astype(np.float64), tile_to(b.astype(np.float64), a_shape))
    assert got.dtype == a.dtype  # the result has a's type
    # inputs are exact; the single op result is rounded once to a's type
    tol = f16_tol(ref) if types[0] == "float16" else EPS32 * np.abs(ref) + 1e-38
    check_close(got, ref, tol, f"{op} {types} a{a_shape} b{b_shape}")


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), dtype=st.sampled_from(["float32"]),
       s=st.floats(-4, 4, allow_nan=False), seed=SEEDS)
def test_scale(run, shape, dtype, s, seed):
    a = rng_of(seed).standard_normal(shape).astype(dtype)
    got = run(lambda c, t: c.scale(t["a"], s), consts={"a": a})
    s32 = float(np.float32(s))  # GGML keeps the factor as a float32 op parameter
    ref = a.astype(np.float64) * s32
    tol = f16_tol(ref) if dtype == "float16" else EPS32 * np.abs(ref) + 1e-38
    check_close(got, ref, tol, f"scale {dtype}")


def test_scale_f16_does_not_kill_the_process():
    p = run_isolated("""
        a = np.array([[1.0, -2.0, 0.5]], np.float16)
        try:
            out = compute(cpu, lambda c, t: c.scale(t["a"], 2.0), consts={"a": a})
            assert np.array_equal(out.reshape(a.shape), a * 2), out
            print("OK computed")
        except gh.errors.DTypeError:
            print("OK rejected")
    """)
    assert p.returncode == 0 and "OK" in p.stdout, f"exit {p.returncode}: {p.stderr[-800:]}"


# float32 transcendental kernels (SIMD expf within ~2 ulp, then a division and a product): 8 u |ref|
TRANSC_F32 = 8 * EPS32


def silu64(x):
    return x / (1 + np.exp(-x))


def sigmoid64(x):
    return 1 / (1 + np.exp(-x))


def gelu64(x):
    """GGML's gelu is the tanh approximation, not the erf form."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


def gelu_f32_err(x):
    """The table entries are GGML's float32 0.5 x (1 + tanhf(..)): for x << 0, 1 + tanhf cancels, leaving
    tanhf's absolute error (<= 1 ulp of 1, 2 u) times 0.5 |x|, so |err| <= 2 u |x| plus a few u relative."""
    return 2 * EPS32 * np.abs(x) + TRANSC_F32 * np.abs(gelu64(x))


def gelu_table_err(x):
    """GGML computes F32 gelu through an fp16 lookup table for |x| < 10 (GGML_GELU_FP16): x is rounded to
    fp16 (|dx| <= u16 |x|, and |gelu'| <= 1.13) and the table value is the fp16 rounding (u16 |gelu|, or half an
    fp16 subnormal step) of the float32 formula (gelu_f32_err); beyond +-10 it returns x or 0 (the tanh form
    differs from those by < 1e-20)."""
    return EPS16 * (1.13 * np.abs(x) + np.abs(gelu64(x))) * (1 + 1e-3) + F16_TINY + gelu_f32_err(x) + 1e-20



UNARY = {"silu": silu64, "sigmoid": sigmoid64, "gelu": gelu64}


@pytest.mark.parametrize("op", sorted(UNARY))
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "float16"]),
       seed=SEEDS)
def test_unary(run, op, shape, dtype, seed):
    a = rng_of(seed).uniform(-12, 12, shape).astype(dtype)
    got = run(lambda c, t: getattr(c, op)(t["a"]), consts={"a": a})
    x = a.astype(np.float64)
    ref = UNARY[op](x)
    if dtype == "float16":
        # computed in f32 from the exact f16 input, rounded to f16 (the gelu f16 table is the same rounding)
        tol = f16_tol(ref) + (gelu_f32_err(x) if op == "gelu" else TRANSC_F32 * np.abs(ref))
    elif op == "gelu":
        tol = gelu_table_err(x)  # loose on purpose: fp16 lookup table, see gelu_table_err
    else:
        tol = TRANSC_F32 * np.abs(ref) + 1e-38
    check_close(got, ref, tol, f"{op} {dtype}")


GLU_ACT = {"swiglu": silu64, "geglu": gelu64}


@pytest.mark.parametrize("kind", sorted(GLU_ACT))
@given(rows=st.lists(st.integers(1, 4), min_size=1, max_size=2), half=st.integers(1, 24),
       dtype=st.sampled_from(["float32", "float16"]), form=st.sampled_from(["fused", "fused_swapped", "split"]),
       seed=SEEDS)
def test_glu(run, kind, rows, half, dtype, form, seed):
    rng = rng_of(seed)
    x = rng.uniform(-6, 6, tuple(rows) + (half,)).astype(dtype)
    g = rng.uniform(-3, 3, tuple(rows) + (half,)).astype(dtype)
    if form == "split":
        got = run(lambda c, t: getattr(c, kind)(t["x"], t["g"]), consts={"x": x, "g": g})
    else:
        # fused: the activation applies to the first half of each row, unless swapped
        fused = np.concatenate([g, x] if form == "fused_swapped" else [x, g], axis=-1)
        got = run(lambda c, t: c.glu(t["a"], kind=kind, swapped=form == "fused_swapped"), consts={"a": fused})
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    act = GLU_ACT[kind](x64)
    ref = act * g64
    if kind == "geglu" and dtype == "float32":
        tol = gelu_table_err(x64) * np.abs(g64) + EPS32 * np.abs(ref)  # fp16 gelu table, then one f32 product
    else:
        tol = TRANSC_F32 * np.abs(ref) + 1e-38
        if kind == "geglu":
            # f16 kernel reads the f16 gelu table
            tol = tol + (EPS16 * np.abs(act) + F16_TINY + gelu_f32_err(x64)) * np.abs(g64)
    if dtype == "float16":
        tol = tol + f16_tol(ref)
    check_close(got, ref, tol, f"{kind} {form} {dtype}")


# --------------------------------------------------------------------------------------------------------------
# normalisation, softmax, rope, attention
# --------------------------------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 33), min_size=1, max_size=3), eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.1]),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=SEEDS)
def test_rms_norm(run, shape, eps, scale, seed):
    a = (rng_of(seed).standard_normal(shape) * scale).astype(np.float32)
    got = run(lambda c, t: c.rms_norm(t["a"], eps), consts={"a": a})
    x = a.astype(np.float64)
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    # sum of squares in double, then mean, sqrtf, 1/x and the product in f32: a handful of roundings
    check_close(got, ref, 8 * EPS32 * np.abs(ref) + 1e-38, f"rms_norm eps={eps}")


@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), rows=st.integers(1, 5), n=st.integers(1, 24),
       mask_kind=st.sampled_from([None, "float32", "float16"]), extra_rows=st.integers(0, 2), mask_outer=st.booleans(),
       scale=st.sampled_from([1.0, 0.125, 3.0]), seed=SEEDS)
def test_soft_max(run, lead, rows, n, mask_kind, extra_rows, mask_outer, scale, seed):
    rng = rng_of(seed)
    a_shape = tuple(lead) + (rows, n)
    a = rng.uniform(-4, 4, a_shape).astype(np.float32)
    consts = {"a": a}
    z = a.astype(np.float64) * np.float32(scale)
    if mask_kind is not None:
        # the mask may have more rows than a; its outer dims (if any) must divide a's
        m_outer = tuple(lead[-1:]) if mask_outer and lead else ()
        m = rng.uniform(-2, 2, m_outer + (rows + extra_rows, n))
        m[rng.random(m.shape) < 0.3] = -np.inf
        m[..., 0] = np.where(np.isfinite(m[..., 0]), m[..., 0], 0.0)  # keep one finite entry per row
        mask = m.astype(mask_kind)
        consts["mask"] = mask
        m64 = mask.astype(np.float64)[..., :rows, :]
        z = z + tile_to(m64, a_shape)
    got = run(lambda c, t: c.soft_max(t["a"], t.get("mask"), scale=scale), consts=consts)
    zmax = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - zmax)
    ref = e / e.sum(axis=-1, keepdims=True)
    # relative error of each probability: rounding of z (a few u |z|) moves exp by that much, SIMD expf
    # ~2 ulp, then the normalisation (sum in double, 1/sum, product): p (8 max|z| + 16) u
    zabs = np.max(np.where(np.isfinite(z), np.abs(z), 0), axis=-1, keepdims=True)
    check_close(got, ref, ref * (8 * zabs + 16) * EPS32 + 1e-38, f"soft_max mask={mask_kind}")


def rope64(x, pos, n_dims, mode, base):
    """x [T, H, D]; GGML: theta_i = pos * base^(-2i/n_dims); dims >= n_dims pass through."""
    x = x.astype(np.float64)
    out = x.copy()
    i = np.arange(n_dims // 2)
    theta = pos.astype(np.float64)[:, None, None] * base ** (-2.0 * i / n_dims)
    c, s = np.cos(theta), np.sin(theta)
    if mode == "normal":
        lo, hi = np.s_[..., 0:n_dims:2], np.s_[..., 1:n_dims:2]  # adjacent pairs (x[2i], x[2i+1])
    else:
        lo, hi = np.s_[..., : n_dims // 2], np.s_[..., n_dims // 2: n_dims]  # (x[i], x[i + n_dims/2])
    x0, x1 = x[lo], x[hi]
    out[lo] = x0 * c - x1 * s
    out[hi] = x0 * s + x1 * c
    # error bound: GGML builds theta_i by i float32 products with base^(-2/n_dims) (itself rounded), so
    # |dtheta| <= (2i + 2) u theta; cosf/sinf and the rotation add ~4 u; |d out| <= (|x0| + |x1|) that
    tol = np.zeros_like(x)
    pair = (np.abs(x0) + np.abs(x1)) * (theta * (2 * i + 2) * EPS32 + 4 * EPS32)
    tol[lo] = pair
    tol[hi] = pair
    return out, tol


@pytest.mark.parametrize("mode", ["normal", "neox"])
@given(tokens=st.integers(1, 4), heads=st.integers(1, 3), half_dim=st.integers(1, 12), data=st.data(),
       base=st.sampled_from([10000.0, 500.0, 1e6]), dtype=st.sampled_from(["float32", "float16"]),
       pos_as_input=st.booleans(), seed=SEEDS)
def test_rope(run, mode, tokens, heads, half_dim, data, base, dtype, pos_as_input, seed):
    rng = rng_of(seed)
    d = 2 * half_dim
    n_dims = 2 * data.draw(st.integers(1, half_dim), label="n_dims/2")
    x = rng.standard_normal((tokens, heads, d)).astype(dtype)
    pos = rng.integers(0, 512, tokens, dtype=np.int32)
    consts, inputs = {"x": x}, {}
    (inputs if pos_as_input else consts)["pos"] = pos
    got = run(lambda c, t: c.rope(t["x"], t["pos"], n_dims, mode=mode, freq_base=base), consts=consts,
              inputs=inputs)
    ref, tol = rope64(x, pos, n_dims, mode, base)
    if dtype == "float16":
        tol = tol + f16_tol(ref)
    check_close(got, ref, tol, f"rope {mode} n_dims={n_dims}/{d} {dtype}")
    # dims beyond n_dims are copied unchanged
    assert np.array_equal(got.reshape(ref.shape)[..., n_dims:], x[..., n_dims:])


@given(kv_heads=st.integers(1, 2), group=st.integers(1, 2), tokens=st.integers(1, 5), kv_len=st.integers(1, 16),
       d=st.sampled_from([8, 16, 32, 64]), dv=st.sampled_from([None, 16]), mask_kind=st.sampled_from(
           [None, "causal", "random"]), mask_pad=st.integers(0, 3), kv_type=st.sampled_from(["float16", "float32"]),
       scale_mul=st.sampled_from([1.0, 4.0]), seed=SEEDS)
def test_flash_attn(run, kv_heads, group, tokens, kv_len, d, dv, mask_kind, mask_pad, kv_type, scale_mul, seed):
    """q [H, T, d] F32, k/v [Hkv, S, d] F16 (or F32), mask [T_pad, S] F16 -> result [T, H, dv] (permuted!).

    This GGML has no GGML_KQ_MASK_PAD any more (ggml.h: mask [n_kv, n_batch, ...]); the mask only needs at least
    T rows, so extra (padding) rows are drawn too and must be ignored.
    """
    rng = rng_of(seed)
    heads = kv_heads * group
    dv = dv or d
    q = rng.standard_normal((heads, tokens, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, kv_len, d)).astype(kv_type)
    v = rng.standard_normal((kv_heads, kv_len, dv)).astype(kv_type)
    scale = scale_mul / math.sqrt(d)
    consts = {"q": q, "k": k, "v": v}
    m64 = np.zeros((tokens, kv_len))
    if mask_kind is not None:
        m = np.zeros((tokens + mask_pad, kv_len))
        if mask_kind == "causal":  # query t sees keys 0..(kv_len - tokens + t)
            for t_ in range(tokens + mask_pad):
                m[t_, max(kv_len - tokens + t_ + 1, 1):] = -np.inf
        else:
            m = rng.uniform(-1, 1, m.shape)
            m[rng.random(m.shape) < 0.3] = -np.inf
            m[:, 0] = 0.0
        mask = m.astype(np.float16)
        consts["mask"] = mask
        m64 = mask.astype(np.float64)[:tokens]
    got = run(lambda c, t: c.flash_attn(t["q"], t["k"], t["v"], t.get("mask"), scale=scale), consts=consts)
    q64, k64, v64 = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    ref = np.empty((tokens, heads, dv))
    tol = np.empty_like(ref)
    for h in range(heads):
        hk = h // group  # GGML: kv head = q head / (H / Hkv)
        s = q64[h] @ k64[hk].T * scale + m64
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        ref[:, h, :] = p @ v64[hk]
        # scores: with F16 k, q is rounded to F16 (u16 sum|q k|) and summed in F32; a score error ds changes
        # the softmax weights by a factor within e^(+-2 ds), so sum|dp| <= expm1(2 ds)
        absqk = np.abs(q64[h]) @ np.abs(k64[hk]).T * scale
        q_round = EPS16 if kv_type == "float16" else 0.0
        ds = ((q_round + (d + 2) * EPS32) * absqk + 4 * EPS32 * np.abs(s)).max(axis=-1)
        # V is accumulated in F16 for F16 v (F32 for F32 v), one rounding per kv step for the product and one
        # for the rescale, each relative to the running sum <= max|v| * S: 2 (S + 1) u max|v|
        acc_u = EPS16 if kv_type == "float16" else EPS32
        vmax = np.abs(v64[hk]).max()
        tol[:, h, :] = (vmax * (np.expm1(2 * ds) + 2 * (kv_len + 1) * acc_u))[:, None]
    check_close(got, ref, tol, f"flash_attn H={heads} Hkv={kv_heads} T={tokens} S={kv_len} mask={mask_kind}")


# --------------------------------------------------------------------------------------------------------------
# selection and reduction
# --------------------------------------------------------------------------------------------------------------

def distinct_rows(rng, shape):
    """Rows of pairwise distinct float32 values (no ties, so that the order is unique)."""
    n = shape[-1]
    rows = int(np.prod(shape[:-1]))
    vals = np.stack([rng.permutation(n) for _ in range(rows)]).astype(np.float64)
    vals = vals * 0.5 + rng.uniform(-0.2, 0.2, vals.shape)  # spacing >= 0.1: distinct in float32
    return (vals - n / 4).astype(np.float32).reshape(shape)


@pytest.mark.parametrize("descending", [False, True])
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=SEEDS)
def test_argsort_distinct(run, descending, shape, seed):
    a = distinct_rows(rng_of(seed), shape)
    got = run(lambda c, t: c.argsort(t["a"], descending=descending), consts={"a": a})
    ref = np.argsort(-a if descending else a, axis=-1)
    assert got.dtype == np.int32
    assert canon(got.shape) == canon(ref.shape)
    assert np.array_equal(got.reshape(ref.shape), ref)


@pytest.mark.parametrize("descending", [False, True])
@given(shape=st.lists(st.integers(1, 30), min_size=1, max_size=2), seed=SEEDS)
def test_argsort_ties(run, descending, shape, seed):
    """With ties the index order is not unique: check the gathered values are sorted and idx is a permutation."""
    a = rng_of(seed).integers(-3, 3, shape).astype(np.float32)
    got = run(lambda c, t: c.argsort(t["a"], descending=descending), consts={"a": a}).reshape(a.shape)
    assert np.array_equal(np.sort(got, axis=-1), np.broadcast_to(np.arange(a.shape[-1]), a.shape))
    vals = np.take_along_axis(a, got.astype(np.int64), axis=-1)
    expect = np.sort(a, axis=-1)
    assert np.array_equal(vals, expect[..., ::-1] if descending else expect)


@given(rows=st.integers(1, 4), n=st.integers(1, 40), data=st.data(), seed=SEEDS)
def test_top_k(run, rows, n, data, seed):
    k = data.draw(st.integers(1, n), label="k")
    a = distinct_rows(rng_of(seed), (rows, n))
    got = run(lambda c, t: c.top_k(t["a"], k), consts={"a": a})
    got = got.reshape(rows, k)  # the order among the k is unspecified: compare sets per row
    ref = np.argsort(-a, axis=-1)[:, :k]
    for r in range(rows):
        assert set(got[r].tolist()) == set(ref[r].tolist()), f"row {r}: {sorted(got[r])} != {sorted(ref[r])}"


@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=SEEDS)
def test_sum_rows(run, shape, seed):
    a = rng_of(seed).standard_normal(shape).astype(np.float32)
    got = run(lambda c, t: c.sum_rows(t["a"]), consts={"a": a})
    x = a.astype(np.float64)
    ref = x.sum(axis=-1, keepdims=True)
    check_close(got, ref, dot_tol(np.abs(x).sum(axis=-1, keepdims=True), shape[-1]), "sum_rows")


# --------------------------------------------------------------------------------------------------------------
# layout: exact (no arithmetic), so the comparisons are exact
# --------------------------------------------------------------------------------------------------------------

@given(nd=st.integers(1, 3), dims=st.lists(st.integers(1, 5), min_size=3, max_size=3),
       pads=st.lists(st.integers(0, 3), min_size=2, max_size=2), offset=st.integers(0, 7), slack=st.integers(0, 5),
       via_cont=st.booleans(), seed=SEEDS)
def test_view(run, nd, dims, pads, offset, slack, via_cont, seed):
    shape = tuple(dims[:nd])
    ne = tuple(reversed(shape))
    item = 4
    nb = [item]  # GGML byte strides, innermost first
    nb.append(ne[0] * item + pads[0] * item)
    nb.append((ne[1] if nd > 1 else 1) * nb[1] + pads[1] * item)
    strides_np = tuple(reversed(nb[1:nd]))  # numpy-order outer strides
    extent = offset * item + sum((n - 1) * s for n, s in zip(ne, nb)) + item
    size = extent // item + slack
    base = rng_of(seed).standard_normal(size).astype(np.float32)
    got = run(lambda c, t: (lambda v: c.cont(v) if via_cont else v)(
        c.view(t["a"], shape, strides_np if nd > 1 else None, offset * item)), consts={"a": base})
    ref = np.lib.stride_tricks.as_strided(base[offset:], shape=shape, strides=tuple(reversed(nb[:nd])))
    assert canon(got.shape) == canon(ref.shape)
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data(), seed=SEEDS)
def test_reshape(run, shape, data, seed):
    a = rng_of(seed).standard_normal(shape).astype(np.float32)
    n = a.size
    # a new shape of 1..4 dims with the same number of elements
    nd = data.draw(st.integers(1, 4), label="nd")
    new, rest = [], n
    for _ in range(nd - 1):
        d = data.draw(st.sampled_from([x for x in range(1, rest + 1) if rest % x == 0]))
        new.append(d)
        rest //= d
    new.append(rest)
    got = run(lambda c, t: c.reshape(c.scale(t["a"], 1.0), new), consts={"a": a})
    assert canon(got.shape) == canon(new)
    assert np.array_equal(got.reshape(new), a.reshape(new))


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), extra=st.integers(0, 2), data=st.data(),
       seed=SEEDS)
def test_permute(run, shape, extra, data, seed):
    """numpy.transpose semantics; axes may be longer than a.ndim (a is padded with leading 1s, up to 4-D)."""
    nd = min(len(shape) + extra, 4)
    axes = tuple(data.draw(st.permutations(range(nd)), label="axes"))
    a = rng_of(seed).standard_normal(shape).astype(np.float32)
    got = run(lambda c, t: c.cont(c.permute(t["a"], axes)), consts={"a": a})
    ref = np.transpose(a.reshape(pad_shape(a.shape, nd)), axes)
    assert canon(got.shape) == canon(ref.shape), f"axes {axes}: {got.shape} vs {ref.shape}"
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), seed=SEEDS)
def test_transpose(run, shape, seed):
    a = rng_of(seed).standard_normal(shape).astype(np.float32)
    got = run(lambda c, t: c.cont(c.transpose(t["a"])), consts={"a": a})
    ref = np.swapaxes(a, -1, -2)
    assert canon(got.shape) == canon(ref.shape)
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=3),
       dtype=st.sampled_from(["float32", "float16", "int32"]),
       seed=SEEDS)
def test_cont_of_transposed_view(run, shape, dtype, seed):
    a = (rng_of(seed).standard_normal(shape) * 100).astype(dtype)
    seen = {}

    def build(c, t):
        tr = c.transpose(t["a"])
        out = c.cont(tr)
        seen["out_contiguous"] = out.is_contiguous
        return out

    got = run(build, consts={"a": a})
    assert seen["out_contiguous"]
    ref = np.swapaxes(a, -1, -2)
    assert got.dtype == a.dtype
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), seed=SEEDS)
def test_cpy_f32_to_f16(run, shape, seed):
    a = (rng_of(seed).standard_normal(shape) * 10).astype(np.float32)
    got = run(lambda c, t: c.cpy(t["a"], t["b"]), consts={"a": a, "b": np.zeros(shape, np.float16)})
    assert got.dtype == np.float16
    # F32 -> F16 is one round-to-nearest-even conversion, as numpy's
    assert np.array_equal(got.reshape(a.shape), a.astype(np.float16))


@given(rows=st.integers(1, 3), blocks=st.integers(1, 3), scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=SEEDS)
def test_cpy_f32_to_q8_0(run, rows, blocks, scale, seed):
    n = 32 * blocks
    a = (rng_of(seed).standard_normal((rows, n)) * scale).astype(np.float32)
    dst = Raw(T.Q8_0, (rows, n), np.zeros(rows * T.Q8_0.row_size(n), np.uint8))
    got = run(lambda c, t: c.cpy(t["a"], t["b"]), consts={"a": a, "b": dst})
    assert got.dtype == np.uint8 and got.size == rows * T.Q8_0.row_size(n)
    deq = gh.dequantize(got.reshape(rows, -1), T.Q8_0, n).astype(np.float64)
    # Q8_0: d = amax/127 stored as fp16, q = round(x/d): |err| <= d/2 + 127 |d - d16| (see q8_err)
    bound = q8_err(block_amax(a.astype(np.float64), 32))
    check_close(deq, a, bound, "cpy F32->Q8_0")


@given(nd=st.integers(1, 4), data=st.data(), dtype=st.sampled_from(["float32", "float16", "int32"]), seed=SEEDS)
def test_concat(run, nd, data, dtype, seed):
    """Every axis; the outermost dim is >= 2 in both inputs (see test_concat_leading_size_one for why)."""
    axis = data.draw(st.integers(0, nd - 1), label="axis")
    shape_a = [data.draw(st.integers(2, 4), label="outer")]
    shape_a += data.draw(st.lists(st.integers(1, 4), min_size=nd - 1, max_size=nd - 1), label="inner")
    shape_b = list(shape_a)
    shape_b[axis] = data.draw(st.integers(2 if axis == 0 else 1, 4), label="len_b")
    rng = rng_of(seed)
    a = (rng.standard_normal(shape_a) * 100).astype(dtype)
    b = (rng.standard_normal(shape_b) * 100).astype(dtype)
    got = run(lambda c, t: c.concat(t["a"], t["b"], axis), consts={"a": a, "b": b})
    ref = np.concatenate([a, b], axis=axis)
    assert canon(got.shape) == canon(ref.shape), f"axis {axis}: {got.shape} vs {ref.shape}"
    assert np.array_equal(got.reshape(ref.shape), ref)


def test_concat_leading_size_one(run):
    """GGML does not record leading size-1 dims: ndim=2 (or a negative axis) says which axis is meant."""
    a = np.arange(3, dtype=np.float32).reshape(1, 3)
    b = np.arange(3, 6, dtype=np.float32).reshape(1, 3)
    got = run(lambda c, t: c.concat(t["a"], t["b"], 0, ndim=2), consts={"a": a, "b": b})
    joined = run(lambda c, t: c.concat(t["a"], t["b"], -1), consts={"a": a, "b": b})
    assert np.array_equal(joined.ravel(), np.concatenate([a, b], axis=-1).ravel())
    assert got.shape == (2, 3)
    assert np.array_equal(got, np.concatenate([a, b], axis=0))


# --------------------------------------------------------------------------------------------------------------
# KV cache writes and llama.cpp's expert selection
# --------------------------------------------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(n_rows=st.integers(2, 12), n=st.sampled_from([4, 32, 64]), seed=st.integers(0, 2 ** 16),
       dst=st.sampled_from(["f32", "f16"]), idx=st.sampled_from(["i32", "i64"]))
def test_set_rows_writes_rows_at_indices(cpu_backend, n_rows, n, seed, dst, idx):
    rng = rng_of(seed)
    m = int(rng.integers(1, n_rows + 1))
    rows = rng.permutation(n_rows)[:m].astype(np.int64 if idx == "i64" else np.int32)
    src = rng.standard_normal((m, n)).astype(np.float32)
    base = rng.standard_normal((n_rows, n)).astype(np.float32)
    with gh.Context(n_tensors=2) as wctx, gh.Context(n_tensors=16, graph_size=16) as ctx, \
            gh.Scheduler([cpu_backend], graph_size=16) as sched:
        a = wctx.new_tensor(dst, (n_rows, n), "cache")
        wctx.allocate(cpu_backend)
        a.set(base.astype(np.float16) if dst == "f16" else base)
        b = ctx.new_tensor("f32", (m, n), "b").set_input()
        r = ctx.new_tensor(idx, (m,), "rows").set_input()
        g = ctx.new_graph(16).expand(ctx.set_rows(a, b, r))
        sched.alloc(g)
        b.set(src)
        r.set(rows)
        sched.compute(g)
        got = a.numpy().astype(np.float64)
    ref = base.astype(np.float16 if dst == "f16" else np.float32).astype(np.float64)
    ref[rows] = src.astype(np.float16 if dst == "f16" else np.float32)
    assert np.array_equal(got, ref)


def test_set_rows_checks_before_ggml(cpu_backend):
    with gh.Context(n_tensors=8, graph_size=8) as ctx:
        a = ctx.new_tensor("f16", (4, 8), "a")
        with pytest.raises(gh.errors.ShapeError, match="one index per row"):
            ctx.set_rows(a, ctx.new_tensor("f32", (3, 8)), ctx.new_tensor("i64", (2,)))
        with pytest.raises(gh.errors.ShapeError, match="every dim but the row count"):
            ctx.set_rows(a, ctx.new_tensor("f32", (2, 7)), ctx.new_tensor("i64", (2,)))
        with pytest.raises(gh.errors.DTypeError, match="rows"):
            ctx.set_rows(a, ctx.new_tensor("f32", (2, 8)), ctx.new_tensor("f32", (2,)))
    # an index outside the destination is refused when the data is set, before GGML reads it
    with gh.Context(n_tensors=2) as wctx, gh.Context(n_tensors=8, graph_size=8) as ctx, \
            gh.Scheduler([cpu_backend], graph_size=8) as sched:
        a = wctx.new_tensor("f32", (4, 8), "a")
        wctx.allocate(cpu_backend)
        r = ctx.new_tensor("i64", (2,), "rows").set_input()
        b = ctx.new_tensor("f32", (2, 8), "b").set_input()
        g = ctx.new_graph(8).expand(ctx.set_rows(a, b, r))
        sched.alloc(g)
        with pytest.raises(gh.errors.IndexRangeError, match="outside 0..3"):
            r.set(np.array([1, 4], np.int64))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 40), k=st.integers(1, 8), rows=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_argsort_top_k_is_largest_first(run, n, k, rows, seed):
    k = min(k, n)
    x = rng_of(seed).permutation(rows * n).reshape(rows, n).astype(np.float32)  # distinct values
    got = run(lambda c, t: c.cont(c.argsort_top_k(t["x"], k)), inputs={"x": x})
    assert np.array_equal(got.reshape(rows, k), np.argsort(-x, axis=1)[:, :k])


# --------------------------------------------------------------------------------------------------------------
# the ops of the MoE families: clamp and fill (routing), cast (flash attention over an F32 cache), add_id and
# swiglu_oai (gpt-oss experts), attention sinks, and the Hadamard rotation of quantized KV caches
# --------------------------------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "float16"]),
       lo=st.sampled_from([-np.inf, -1.0, 6.103515625e-5]), hi=st.sampled_from([np.inf, 0.5, 2.0]), seed=SEEDS)
def test_clamp(run, shape, dtype, lo, hi, seed):
    a = (rng_of(seed).standard_normal(shape) * 2).astype(dtype)
    got = run(lambda c, t: c.clamp(t["a"], lo, hi), consts={"a": a})
    # min/max select one of the inputs or a bound: exact (the bounds are exact in float32 and float16 here)
    ref = np.minimum(np.maximum(a.astype(np.float64), np.float32(lo)), np.float32(hi)).astype(dtype)
    assert got.dtype == a.dtype
    assert np.array_equal(got.reshape(a.shape), ref)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), dtype=st.sampled_from(["float32", "float16"]),
       value=st.sampled_from([-np.inf, 0.0, -2.5, 7.0]))
def test_fill(run, shape, dtype, value):
    a = np.full(shape, 3.0, dtype)
    got = run(lambda c, t: c.fill(t["a"], value), consts={"a": a})
    assert np.array_equal(got.reshape(a.shape), np.full(shape, value, dtype))


@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=3), transposed=st.booleans(),
       to=st.sampled_from(["f16", "f32"]), seed=SEEDS)
def test_cast(run, shape, transposed, to, seed):
    a = (rng_of(seed).standard_normal(shape) * 50).astype(np.float32)
    got = run(lambda c, t: c.cast(c.transpose(t["a"]) if transposed else t["a"], to), consts={"a": a})
    src = np.swapaxes(a, -1, -2) if transposed else a
    # F32 -> F16 is one round-to-nearest-even conversion, as numpy's; the result is contiguous
    ref = src.astype(np.float16 if to == "f16" else np.float32)
    assert got.dtype == ref.dtype
    assert np.array_equal(got.reshape(ref.shape), ref)


@given(tokens=st.integers(1, 5), k=st.integers(1, 4), n=st.integers(1, 24), rows=st.integers(1, 6),
       ids_as_input=st.booleans(), seed=SEEDS)
def test_add_id(run, tokens, k, n, rows, ids_as_input, seed):
    rng = rng_of(seed)
    a = rng.standard_normal((tokens, k, n)).astype(np.float32)
    b = rng.standard_normal((rows, n)).astype(np.float32)
    ids = rng.integers(0, rows, (tokens, k), dtype=np.int32)
    consts, inputs = {"a": a, "b": b}, {}
    (inputs if ids_as_input else consts)["ids"] = ids
    got = run(lambda c, t: c.add_id(t["a"], t["b"], t["ids"]), consts=consts, inputs=inputs)
    # one float32 addition per element: numpy's float32 add is the same correctly rounded operation
    assert np.array_equal(got.reshape(a.shape), a + b[ids])


def swiglu_oai64(g, u, alpha, limit):
    x = np.minimum(g, limit)
    y = np.clip(u, -limit, limit)
    return x / (1 + np.exp(-alpha * x)) * (y + 1)


@given(rows=st.lists(st.integers(1, 4), min_size=1, max_size=3), n=st.integers(1, 40),
       alpha=st.sampled_from([1.702, 1.0]), limit=st.sampled_from([7.0, 2.0]), seed=SEEDS)
def test_swiglu_oai(run, rows, n, alpha, limit, seed):
    rng = rng_of(seed)
    g = rng.uniform(-10, 10, tuple(rows) + (n,)).astype(np.float32)
    u = rng.uniform(-10, 10, tuple(rows) + (n,)).astype(np.float32)
    got = run(lambda c, t: c.swiglu_oai(t["g"], t["u"], alpha, limit), consts={"g": g, "u": u})
    a32, l32 = float(np.float32(alpha)), float(np.float32(limit))  # op parameters are float32
    ref = swiglu_oai64(g.astype(np.float64), u.astype(np.float64), a32, l32)
    # the rounded product alpha*x moves expf by |alpha x| u relative, expf within a few ulp, a division, two
    # products and a sum: (|alpha x| + 8) u relative, and |y + 1| may cancel
    xg = np.minimum(g.astype(np.float64), l32)
    gated = np.abs(swiglu_oai64(g, np.zeros_like(u), a32, l32))
    tol = (np.abs(a32 * xg) * EPS32 + TRANSC_F32) * np.abs(ref) + 2 * EPS32 * gated * (
        np.abs(np.clip(u, -l32, l32)) + 1) + 1e-38
    check_close(got, ref, tol, f"swiglu_oai alpha={alpha} limit={limit}")


def softmax_sinks64(s, sink):
    """Rows of s [H, T, n] with head h's sink logit as one more column that takes mass but has no value."""
    m = np.maximum(s.max(axis=-1, keepdims=True), sink[:, None, None])
    e = np.exp(s - m)
    return e / (e.sum(axis=-1, keepdims=True) + np.exp(sink[:, None, None] - m))


@given(heads=st.integers(1, 4), tokens=st.integers(1, 4), n=st.integers(1, 16), masked=st.booleans(),
       scale=st.sampled_from([1.0, 0.125]), seed=SEEDS)
def test_soft_max_with_sinks(run, heads, tokens, n, masked, scale, seed):
    rng = rng_of(seed)
    a = rng.uniform(-4, 4, (heads, tokens, n)).astype(np.float32)
    sinks = rng.uniform(-3, 3, heads).astype(np.float32)
    consts = {"a": a, "s": sinks}
    z = a.astype(np.float64) * np.float32(scale)
    if masked:
        m = np.where(rng.random((tokens, n)) < 0.3, -np.inf, 0.0)
        m[:, 0] = 0.0
        consts["m"] = m.astype(np.float32)
        z = z + m
    got = run(lambda c, t: c.soft_max(t["a"], t.get("m"), scale=scale, sinks=t["s"]), consts=consts)
    ref = softmax_sinks64(z, sinks.astype(np.float64))
    zabs = np.max(np.where(np.isfinite(z), np.abs(z), 0), axis=-1, keepdims=True) + np.abs(sinks)[:, None, None]
    check_close(got, ref, ref * (8 * zabs + 16) * EPS32 + 1e-38, "soft_max sinks")
    # the sink takes probability mass: rows sum to less than 1
    assert (got.reshape(ref.shape).sum(axis=-1) < 1).all()


@given(kv_heads=st.integers(1, 2), group=st.integers(1, 2), tokens=st.integers(1, 4), kv_len=st.integers(1, 12),
       d=st.sampled_from([16, 64]), seed=SEEDS)
def test_flash_attn_with_sinks(run, kv_heads, group, tokens, kv_len, d, seed):
    rng = rng_of(seed)
    heads = kv_heads * group
    q = rng.standard_normal((heads, tokens, d)).astype(np.float32)
    k = rng.standard_normal((kv_heads, kv_len, d)).astype(np.float16)
    v = rng.standard_normal((kv_heads, kv_len, d)).astype(np.float16)
    sinks = rng.uniform(-2, 2, heads).astype(np.float32)
    scale = 1 / math.sqrt(d)
    got = run(lambda c, t: c.flash_attn(t["q"], t["k"], t["v"], None, scale=scale, sinks=t["s"]),
              consts={"q": q, "k": k, "v": v, "s": sinks})
    q64, k64, v64 = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    ref = np.empty((tokens, heads, d))
    tol = np.empty_like(ref)
    for h in range(heads):
        hk = h // group
        s = q64[h] @ k64[hk].T * scale
        p = softmax_sinks64(s[None], sinks[h:h + 1].astype(np.float64))[0]
        ref[:, h, :] = p @ v64[hk]
        # as test_flash_attn: q rounded to F16 for the scores, V accumulated in F16
        absqk = np.abs(q64[h]) @ np.abs(k64[hk]).T * scale
        ds = ((EPS16 + (d + 2) * EPS32) * absqk + 4 * EPS32 * np.abs(s)).max(axis=-1)
        tol[:, h, :] = (np.abs(v64[hk]).max() * (np.expm1(2 * ds) + 2 * (kv_len + 1) * EPS16))[:, None]
    check_close(got, ref, tol, f"flash_attn sinks H={heads} Hkv={kv_heads}")


def hadamard64(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Walsh-Hadamard matrix of size n (llama.cpp's ggml_gen_hadamard)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


@given(n=st.sampled_from([2, 8, 64, 128]), rows=st.integers(1, 4), runs=st.integers(1, 3),
       dtype=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_mul_mat_hadamard(run, n, rows, runs, dtype, seed):
    rng = rng_of(seed)
    x = rng.standard_normal((rows, runs * n)).astype(dtype)
    # the CPU computes the product as a fast transform and never reads rot: zeros prove it
    rot = np.zeros((n, n), np.float32)
    got = run(lambda c, t: c.mul_mat_hadamard(t["rot"], t["x"]), consts={"rot": rot, "x": x})
    xr = x.astype(np.float64).reshape(-1, n)
    ref = (xr @ hadamard64(n)).reshape(x.shape)
    # scaled by 1/sqrtf(n), then log2(n) butterfly stages of one addition each, in float32
    absx = (np.abs(xr).sum(axis=-1, keepdims=True) / math.sqrt(n)) * np.ones((1, n))
    tol = (math.log2(n) + 2) * EPS32 * absx.reshape(x.shape) + 1e-38
    check_close(got, ref, tol, f"mul_mat_hadamard n={n} {dtype}")


# --------------------------------------------------------------------------------------------------------------
# the ops of gated delta-net (linear attention) models: softplus (the gate), repeat (qwen3next's K-head
# broadcast), rope_multi (qwen35moe's interleaved M-RoPE), ssm_conv (the short convolution) and gated_delta_net
# --------------------------------------------------------------------------------------------------------------

@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), scale=st.sampled_from([1.0, 10.0, 30.0]),
       seed=SEEDS)
def test_softplus(run, shape, scale, seed):
    a = (rng_of(seed).standard_normal(shape) * scale).astype(np.float32)
    got = run(lambda c, t: c.softplus(t["a"]), consts={"a": a})
    x = a.astype(np.float64)
    ref = np.where(x > 20, x, np.log1p(np.exp(x)))
    # logf(1 + expf(x)): expf and logf within a few ulp, 1 + e rounds once (relative to 1 + e, which the
    # log turns into an absolute u); above 20 the input itself
    tol = np.where(x > 20, 0.0, 4 * EPS32 * np.abs(ref) + 2 * EPS32) + 1e-38
    check_close(got, ref, tol, f"softplus scale={scale}")


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from(["float32", "float16"]), seed=SEEDS)
def test_repeat(run, shape, data, dtype, seed):
    reps = data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape)), label="reps")
    a = rng_of(seed).standard_normal(shape).astype(dtype)
    target = tuple(n * r for n, r in zip(shape, reps))
    got = run(lambda c, t: c.repeat(t["a"], target), consts={"a": a})
    assert np.array_equal(got.reshape(target), np.tile(a, reps))  # copies: exact


def mrope_positions(pos4: np.ndarray, sections, n_dims: int, interleaved: bool) -> np.ndarray:
    """The position each rotated pair i of each token uses: pos4 [4, T] (t, h, w, e rows) -> [T, n_dims/2]."""
    s0, s1, s2, _ = sections
    total = sum(sections)
    axis = []
    for i in range(n_dims // 2):
        sec = i % total
        if interleaved:  # GGML_ROPE_TYPE_IMROPE: t h w t h w ... while each axis has pairs left, else e
            a = 1 if sec % 3 == 1 and sec < 3 * s1 else 2 if sec % 3 == 2 and sec < 3 * s2 else \
                0 if sec % 3 == 0 and sec < 3 * s0 else 3
        else:             # GGML_ROPE_TYPE_MROPE: runs of s0 t, s1 h, s2 w, then e
            a = 0 if sec < s0 else 1 if sec < s0 + s1 else 2 if sec < s0 + s1 + s2 else 3
        axis.append(a)
    return pos4[np.array(axis)].T


@pytest.mark.parametrize("mode", ["imrope", "mrope"])
@given(tokens=st.integers(1, 4), heads=st.integers(1, 3), half_dim=st.integers(2, 12), data=st.data(),
       base=st.sampled_from([10000.0, 1e7]), seed=SEEDS)
def test_rope_multi(run, mode, tokens, heads, half_dim, data, base, seed):
    rng = rng_of(seed)
    d = 2 * half_dim
    n_dims = 2 * data.draw(st.integers(1, half_dim), label="n_dims/2")
    sections = data.draw(st.lists(st.integers(0, 4), min_size=4, max_size=4).filter(
        lambda s: any(s[:3]) and sum(s) <= d), label="sections")
    x = rng.standard_normal((tokens, heads, d)).astype(np.float32)
    pos4 = rng.integers(0, 512, (4, tokens), dtype=np.int32)
    got = run(lambda c, t: c.rope_multi(t["x"], t["pos"], n_dims, sections, mode=mode, freq_base=base),
              consts={"x": x}, inputs={"pos": pos4.reshape(-1)})
    # each pair is a NEOX rotation at its own axis's position: the plain rope oracle, pair by pair
    pair_pos = mrope_positions(pos4.astype(np.int64), sections, n_dims, mode == "imrope")   # [T, n_dims/2]
    ref, tol = x.astype(np.float64).copy(), np.zeros(x.shape)
    half = n_dims // 2
    for i in range(half):
        one, one_tol = rope64(x, pair_pos[:, i], n_dims, "neox", base)
        ref[..., [i, i + half]] = one[..., [i, i + half]]
        tol[..., [i, i + half]] = one_tol[..., [i, i + half]]
    check_close(got, ref, tol, f"rope_multi {mode} sections={sections} n_dims={n_dims}/{d}")


def ssm_conv64(sx: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sx [S, C, K-1+T], c [C, K] -> [S, T, C] and its float32 rounding bound (a K-term dot product)."""
    K = c.shape[1]
    T = sx.shape[2] - K + 1
    win = np.stack([sx[:, :, t:t + K] for t in range(T)], axis=1).astype(np.float64)   # [S, T, C, K]
    prod = win * c.astype(np.float64)
    return prod.sum(-1), dot_tol(np.abs(prod).sum(-1), K)


@given(seqs=st.integers(1, 3), channels=st.integers(1, 40), d_conv=st.sampled_from([1, 2, 4]),
       tokens=st.integers(1, 6), seed=SEEDS)
def test_ssm_conv(run, seqs, channels, d_conv, tokens, seed):
    rng = rng_of(seed)
    sx = rng.standard_normal((seqs, channels, d_conv - 1 + tokens)).astype(np.float32)
    c = rng.standard_normal((channels, d_conv)).astype(np.float32)
    got = run(lambda ctx, t: ctx.ssm_conv(t["sx"], t["c"]), consts={"sx": sx, "c": c})
    ref, tol = ssm_conv64(sx, c)
    check_close(got, ref, tol, f"ssm_conv K={d_conv}")


def delta_net64(q, k, v, g, beta, state):
    """The gated delta rule in float64, and a float32 rounding bound derived from the magnitudes.

    q, k [n, T, Hk, S] (unit rows), v [n, T, H, S], g, beta [n, T, H], state [n, H, S, S] (transposed:
    ``M[j, i]`` = S[i][j]); value head h reads query/key head h % Hk. Per token the state is scaled by
    exp(g) <= 1 and multiplied by (I - beta k k^T), whose norm is <= 1 for |k| <= 1 and beta in [0, 1]:
    the error already in the state does not grow, and each step adds its own roundings, at most
    (S + 8) u (|M| + |delta|) in Frobenius norm (expf, the scaling, a dot product of S terms, the
    subtraction, the product by beta, the update). The output's bound adds its own dot product.
    """
    n, T, H, S = v.shape
    Hk = q.shape[2]
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    out, tol = np.zeros((n, T, H, S)), np.zeros((n, T, H, S))
    final, final_tol = np.zeros((n, H, S, S)), np.zeros((n, H))
    for s in range(n):
        for h in range(H):
            M, err = state[s, h].astype(np.float64).copy(), 0.0
            for t in range(T):
                kk, qq = k[s, t, h % Hk], q[s, t, h % Hk]
                M *= np.exp(g[s, t, h])
                delta = (v[s, t, h] - M @ kk) * beta[s, t, h]
                err = err + (S + 8) * EPS32 * (np.linalg.norm(M) + np.linalg.norm(delta))
                M += np.outer(delta, kk)
                out[s, t, h] = M @ qq / np.sqrt(S)
                tol[s, t, h] = (err * np.linalg.norm(qq) + dot_tol(np.abs(M) @ np.abs(qq), S)) / np.sqrt(S) \
                    + 2 * EPS32 * np.abs(out[s, t, h])
            final[s, h], final_tol[s, h] = M, err
    return out, tol, final, final_tol


def unit_rows(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@given(seqs=st.integers(1, 2), tokens=st.integers(1, 6), k_heads=st.integers(1, 2), group=st.integers(1, 3),
       S=st.sampled_from([4, 16, 32]), seed=SEEDS)
@settings(max_examples=40)
def test_gated_delta_net(run, seqs, tokens, k_heads, group, S, seed):
    rng = rng_of(seed)
    H = k_heads * group
    q = unit_rows(rng.standard_normal((seqs, tokens, k_heads, S)))
    k = unit_rows(rng.standard_normal((seqs, tokens, k_heads, S)))
    v = rng.standard_normal((seqs, tokens, H, S)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((seqs, tokens, H, 1)))).astype(np.float32)   # <= 0, as softplus * a
    beta = (1 / (1 + np.exp(-rng.standard_normal((seqs, tokens, H, 1))))).astype(np.float32)
    state = (rng.standard_normal((seqs, H, S, S)) * 0.3).astype(np.float32)
    got = run(lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s"]),
              consts={"q": q, "k": k, "v": v, "g": g, "beta": beta, "s": state})
    out, tol, final, final_tol = delta_net64(q, k, v, g[..., 0], beta[..., 0], state)
    assert got.shape == (tokens * seqs + S * seqs, H * S)
    n_out = seqs * tokens * H * S
    flat = got.reshape(-1)
    check_close(flat[:n_out].reshape(out.shape), out, tol, f"gated_delta_net H={H} Hk={k_heads} S={S}")
    check_close(flat[n_out:].reshape(final.shape), final, final_tol[..., None, None],
                "gated_delta_net final state")


def test_gated_delta_net_keeps_the_last_states(run):
    """snapshots=K: the tail holds the last K states, newest first (slot s: s tokens back)."""
    rng = rng_of(3)
    S, H, T = 8, 2, 4
    q, k = unit_rows(rng.standard_normal((1, T, H, S))), unit_rows(rng.standard_normal((1, T, H, S)))
    v = rng.standard_normal((1, T, H, S)).astype(np.float32)
    g = np.full((1, T, H, 1), -0.1, np.float32)
    beta = np.full((1, T, H, 1), 0.5, np.float32)
    s0 = np.zeros((1, H, S, S), np.float32)
    consts = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "s": s0}
    got = run(lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s"], snapshots=2),
              consts=consts).reshape(-1)
    n_out, n_state = T * H * S, H * S * S
    last = run(lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s"]),
               consts=consts).reshape(-1)
    assert np.array_equal(got[:n_out + n_state], last)   # the outputs and the final state: the same op
    # one token back: the final state of the first T - 1 tokens
    short = {n: a[:, :T - 1] if n != "s" else a for n, a in consts.items()}
    prev = run(lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], t["s"]),
               consts=short).reshape(-1)
    assert np.array_equal(got[n_out + n_state:], prev[(T - 1) * H * S:])


@pytest.mark.parametrize("build, match", [
    (lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v3"], t["g"], t["b"], t["s"]), "heads must divide"),
    (lambda c, t: c.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["b"], t["s1"]), "state must be"),
    (lambda c, t: c.gated_delta_net(c.transpose(t["q"]), t["k"], t["v"], t["g"], t["b"], t["s"]), "contiguous"),
    (lambda c, t: c.ssm_conv(t["x"], t["w16"]), "F32"),
    (lambda c, t: c.ssm_conv(c.transpose(t["x"]), t["w"]), "contiguous"),
    (lambda c, t: c.ssm_conv(t["x"], t["w_wide"]), "history"),
    (lambda c, t: c.rope_multi(t["r"], t["p"], 4, [2, 2, 0, 0]), "four positions"),
    (lambda c, t: c.rope_multi(t["r"], t["p4"], 4, [0, 0, 0, 2]), "first three"),
    (lambda c, t: c.rope_multi(t["r"], t["p4"], 4, [8, 2, 0, 0]), "sum to at most"),
    (lambda c, t: c.repeat(t["x"], (3, 3, 3)), "multiple"),
])
def test_recurrent_ops_refuse_what_ggml_would_abort_on(build, match):
    from ggml_hybrid import errors as E

    shapes = {"q": (1, 2, 2, 4), "k": (1, 2, 2, 4), "v": (1, 2, 4, 4), "v3": (1, 2, 3, 4), "g": (1, 2, 4, 1),
              "b": (1, 2, 4, 1), "s": (1, 4, 4, 4), "s1": (1, 4, 4, 2), "x": (2, 6, 5), "w": (6, 4),
              "w_wide": (6, 7), "r": (3, 2, 8), "p": (3,), "p4": (12,)}
    with gh.Context() as c:
        t = {n: c.new_tensor("i32" if n.startswith("p") else "f32", s, n) for n, s in shapes.items()}
        t["w16"] = c.new_tensor("f16", (6, 4), "w16")
        with pytest.raises(E.GgmlHybridError, match=match):
            build(c, t)
