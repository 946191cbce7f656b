"""The elementwise ops beyond tests/test_ops.py against float64 numpy (tests/oracles.py), over F32, F16 and BF16.

Bounds, from the float32 formulas of ggml-cpu (unary-ops.cpp, vec.h) and one rounding of the result:

* the result type: F32 u = 2**-24, F16 u16 = 2**-11 (+ half its smallest subnormal), BF16 2**-8, times |ref|;
* exact ops (abs, sgn, neg, step, relu, floor, ceil, round, trunc): 0 in every type (their results are
  representable);
* one correctly rounded float32 op (sqr, sqrt): u |ref|; libm's expf/logf/sinf/cosf/tanhf/expm1f/erff within
  2 ulp (one ulp is at most 2 u |ref|): 4 u |ref|, more where the formula chains them (sigmoid 6 u); the SIMD
  expf of silu 8 u; expm1 is expf(x) - 1: 2 u e^x absolute; softplus logf(1 + expf(x)): 3 u absolute + 2 u |ref|;
* F32 gelu and gelu_quick read an fp16 table (x rounded to fp16): u16 (|f'| |x| + |f|) plus the table's own f32
  error, as tests/test_ops.py's gelu_table_err.
"""

from __future__ import annotations

import numpy as np
import oracles as O
import pytest
from helpers import Raw, check_close, tile_to
from hypothesis import given
from hypothesis import strategies as st
from test_ops import gelu_table_err

import ggml_hybrid as gh

T = gh.GGMLType
SEEDS = st.integers(0, 2**31 - 1)
DTYPES = ["float32", "float16", "bfloat16"]
U = O.EPS32


def spec(x: np.ndarray, dtype: str):
    """(what run() takes, the exact float64 values GGML reads) of float32 data ``x`` stored as ``dtype``."""
    if dtype == "bfloat16":
        bits = O.to_bf16(x)
        return Raw(T.BF16, x.shape, bits), O.from_bf16(bits).astype(np.float64)
    v = x.astype(dtype)
    return v, v.astype(np.float64)


def values(got: np.ndarray, dtype: str) -> np.ndarray:
    return O.from_bf16(got).astype(np.float64) if dtype == "bfloat16" else got.astype(np.float64)


def rounding(ref: np.ndarray, dtype: str) -> np.ndarray:
    """One rounding of a float32 result to ``dtype`` (none for float32)."""
    if dtype == "float32":
        return np.zeros_like(ref)
    return O.unit(dtype) * np.abs(ref) * (1 + 1e-3) + O.floor_of(dtype)


EXACT = {"abs", "sgn", "neg", "step", "relu", "floor", "ceil", "round", "trunc"}


def f32_error(kind: str, x: np.ndarray, ref: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 formula's error bound for ``kind`` at x (before the result's rounding to dtype)."""
    a = np.abs(ref)
    if kind in EXACT:
        return np.zeros_like(ref)
    if kind in ("sqr", "sqrt"):
        return U * a
    if kind in ("exp", "log", "sin", "cos", "tanh", "elu"):
        return 4 * U * a + O.TINY32
    if kind == "expm1":
        return 2 * U * np.exp(x) + U * a
    if kind == "softplus":
        return 3 * U + 2 * U * a
    if kind == "sigmoid":
        return 6 * U * a + O.TINY32
    if kind == "silu":
        return 8 * U * a + O.TINY32
    if kind in ("hardsigmoid", "hardswish"):
        hs = 2 * U * (np.abs(x) + 3) / 6
        return (hs * np.abs(x) + U * a if kind == "hardswish" else hs) + O.TINY32
    if kind == "gelu_erf":
        return 2 * U * np.abs(x) + 8 * U * a
    if kind in ("gelu", "gelu_quick"):
        formula = 2 * U * np.abs(x) + 8 * U * a  # tanhf/expf and the cancellation of 1 + tanh for x << 0
        if dtype != "float32":
            return formula  # F16 reads a table of the fp16-rounded formula (the rounding is added by the caller);
            # BF16 computes the formula
        if kind == "gelu":
            return gelu_table_err(x)
        return O.EPS16 * (1.11 * np.abs(x) + a) * (1 + 1e-3) + O.F16_TINY + formula
    raise AssertionError(kind)


KINDS = sorted(set(O.UNARY) - {"sqr", "sqrt", "log", "sin", "cos"}) + ["sqr", "sqrt", "log", "sin", "cos"]


@pytest.mark.parametrize("kind", KINDS)
@given(shape=st.lists(st.integers(1, 12), min_size=1, max_size=3), dtype=st.sampled_from(DTYPES), seed=SEEDS)
def test_unary_kinds(run, kind, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    lo = 0.05 if kind in ("sqrt", "log") else -8.0
    x = rng.uniform(lo, 8.0, shape).astype(np.float32)
    if kind in ("round", "floor", "ceil", "trunc"):
        halves = rng.random(shape) < 0.3  # exact halves and integers: the ties
        x[halves] = np.round(x[halves] * 2) / 2
    a, x64 = spec(x, dtype)
    got = run(lambda c, t: getattr(c, kind)(t["a"]), consts={"a": a})
    ref = O.UNARY[kind](x64)
    tol = f32_error(kind, x64, ref, dtype) + rounding(ref, dtype)
    if kind in EXACT:
        tol = np.zeros_like(ref)
    check_close(values(got, dtype), ref, tol, f"{kind} {dtype}")


@given(shape=st.lists(st.integers(1, 10), min_size=1, max_size=3), dtype=st.sampled_from(DTYPES),
       params=st.tuples(st.floats(0.1, 1.5), st.floats(0.1, 1.5), st.floats(0.1, 1.0), st.sampled_from([-1e-6, 0.0])),
       seed=SEEDS)
def test_xielu(run, shape, dtype, params, seed):
    x = np.random.default_rng(seed).uniform(-6, 3, shape).astype(np.float32)
    a, x64 = spec(x, dtype)
    got = run(lambda c, t: c.xielu(t["a"], *params), consts={"a": a})
    ref = O.xielu(x64, *params)
    an, ap, b = params[2] + O.softplus(params[0]), O.softplus(params[1]), params[2]
    # the negative branch subtracts expm1 and x (each ~|x|) before scaling: a few u of the parts
    parts = np.abs(np.expm1(np.minimum(x64, 0)) - x64) * an + np.abs(b * x64) + ap * x64 * x64
    check_close(values(got, dtype), ref, 8 * U * parts + O.TINY32 + rounding(ref, dtype), f"xielu {dtype}")


@given(shape=st.lists(st.integers(1, 10), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "float16"]),
       slope=st.sampled_from([0.01, 0.2, -0.5]), seed=SEEDS)
def test_leaky_relu(run, shape, dtype, slope, seed):
    x = np.random.default_rng(seed).uniform(-5, 5, shape).astype(np.float32)
    a, x64 = spec(x, dtype)
    got = run(lambda c, t: c.leaky_relu(t["a"], slope), consts={"a": a})
    ref = np.where(x64 > 0, x64, float(np.float32(slope)) * x64)
    check_close(values(got, dtype), ref, U * np.abs(ref) + rounding(ref, dtype), f"leaky_relu {dtype}")


# -- arithmetic ----------------------------------------------------------------------------------------------------

@st.composite
def broadcast_shapes(draw):
    nd = draw(st.integers(1, 4))
    a_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd)))
    b_shape = tuple(draw(st.sampled_from([d for d in range(1, s + 1) if s % d == 0])) for s in a_shape)
    return a_shape, b_shape[draw(st.integers(0, nd - 1)):]


BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
PAIRS = [("float32", "float32"), ("float16", "float16"), ("float16", "float32"), ("bfloat16", "bfloat16"),
         ("bfloat16", "float32")]


@pytest.mark.parametrize("op", sorted(BINARY))
@given(shapes=broadcast_shapes(), types=st.sampled_from(PAIRS), seed=SEEDS)
def test_binary_all_type_pairs(run, op, shapes, types, seed):
    """a op b with b tiled to a's shape, in every type pair the CPU kernels take: one float32 operation, rounded
    once to a's type."""
    (a_shape, b_shape), rng = shapes, np.random.default_rng(seed)
    x = rng.standard_normal(a_shape).astype(np.float32)
    y = (rng.choice([-1.0, 1.0], b_shape) * rng.uniform(0.5, 2, b_shape)).astype(np.float32)
    (a, a64), (b, b64) = spec(x, types[0]), spec(y, types[1])
    got = run(lambda c, t: getattr(c, op)(t["a"], t["b"]), consts={"a": a, "b": b})
    ref = BINARY[op](a64, tile_to(b64, a_shape))
    check_close(values(got, types[0]), ref, U * np.abs(ref) + O.TINY32 + rounding(ref, types[0]),
                f"{op} {types} {a_shape} {b_shape}")


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), types=st.sampled_from(
    [("float32", "float32"), ("float16", "float16"), ("float16", "float32"), ("bfloat16", "float32"),
     ("bfloat16", "bfloat16")]), seed=SEEDS)
def test_add1(run, shape, types, seed):
    rng = np.random.default_rng(seed)
    (a, a64), (b, b64) = spec(rng.standard_normal(shape).astype(np.float32), types[0]), \
        spec(rng.standard_normal(1).astype(np.float32), types[1])
    got = run(lambda c, t: c.add1(t["a"], t["b"]), consts={"a": a, "b": b})
    ref = a64 + b64[0]
    check_close(values(got, types[0]), ref, U * np.abs(ref) + O.TINY32 + rounding(ref, types[0]), f"add1 {types}")


@given(shapes=broadcast_shapes(), a_type=st.sampled_from(["float16", "bfloat16"]),
       to=st.sampled_from(["same", "f32"]), seed=SEEDS)
def test_add_cast(run, shapes, a_type, to, seed):
    (a_shape, b_shape), rng = shapes, np.random.default_rng(seed)
    b_shape = b_shape[:-1] + a_shape[-1:] if b_shape else a_shape[-1:]
    (a, a64), (b, b64) = spec(rng.standard_normal(a_shape).astype(np.float32), a_type), \
        spec(rng.standard_normal(b_shape).astype(np.float32), "float32")
    dtype = "f32" if to == "f32" else ("f16" if a_type == "float16" else "bf16")
    got = run(lambda c, t: c.add_cast(t["a"], t["b"], dtype), consts={"a": a, "b": b})
    ref = a64 + tile_to(b64, a_shape)
    out_type = "float32" if to == "f32" else a_type
    assert got.dtype == (np.float32 if to == "f32" else (np.float16 if a_type == "float16" else np.uint16))
    check_close(values(got, out_type), ref, U * np.abs(ref) + O.TINY32 + rounding(ref, out_type), f"add_cast {a_type}")


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4), dtype=st.sampled_from(["float32", "bfloat16"]),
       s=st.floats(-4, 4), b=st.floats(-4, 4), seed=SEEDS)
def test_scale_bias(run, shape, dtype, s, b, seed):
    a, x64 = spec(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)
    got = run(lambda c, t: c.scale_bias(t["a"], s, b), consts={"a": a})
    s32, b32 = float(np.float32(s)), float(np.float32(b))
    ref = x64 * s32 + b32
    check_close(values(got, dtype), ref, 2 * U * (np.abs(x64 * s32) + np.abs(ref)) + O.TINY32 + rounding(ref, dtype),
                f"scale_bias {dtype}")


@given(rows=st.integers(1, 4), blocks=st.integers(1, 3), qtype=st.sampled_from([T.Q8_0, T.Q4_0]), seed=SEEDS)
def test_add_to_a_quantized_tensor(run, rows, blocks, qtype, seed):
    """A quantized a plus F32 b: dequantized, added in float32, quantized again: within the result type's
    quantization error of the exact sum (Q8_0: amax/254 per block and its fp16 scale; Q4_0: one step amax/8)."""
    from helpers import q8_err, quantized

    rng = np.random.default_rng(seed)
    n = 32 * blocks
    w, w64 = quantized(rng.standard_normal((rows, n)).astype(np.float32), qtype)
    y = rng.standard_normal((rows, n)).astype(np.float32)
    got = run(lambda c, t: c.add(t["a"], t["b"]), consts={"a": w, "b": y})
    deq = gh.dequantize(got.reshape(rows, -1), qtype, n).astype(np.float64)
    ref = w64 + y
    amax = np.repeat(np.abs(ref).reshape(rows, blocks, 32).max(axis=-1), 32, axis=-1)
    step = q8_err(amax) if qtype == T.Q8_0 else amax / 8 * (1 + 2 * O.EPS16) + 8 * O.F16_TINY
    check_close(deq, ref, step + 2 * U * np.abs(ref), f"add {qtype.name}")


# -- gated units ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["reglu", "geglu", "swiglu", "geglu_erf", "geglu_quick"])
@given(rows=st.lists(st.integers(1, 3), min_size=1, max_size=2), half=st.integers(1, 16),
       dtype=st.sampled_from(DTYPES), split=st.booleans(), swapped=st.booleans(), seed=SEEDS)
def test_glu_kinds(run, kind, rows, half, dtype, split, swapped, seed):
    rng = np.random.default_rng(seed)
    g32 = rng.uniform(-6, 6, (*rows, half)).astype(np.float32)
    u32 = rng.uniform(-3, 3, (*rows, half)).astype(np.float32)
    (g, g64), (u, u64) = spec(g32, dtype), spec(u32, dtype)
    if split:
        first, second = (u, g) if swapped else (g, u)
        got = run(lambda c, t: c.glu(t["a"], t["b"], kind=kind, swapped=swapped), consts={"a": first, "b": second})
    else:
        fused32 = np.concatenate([u32, g32] if swapped else [g32, u32], axis=-1)
        f, _ = spec(fused32, dtype)
        got = run(lambda c, t: c.glu(t["a"], kind=kind, swapped=swapped), consts={"a": f})
    ref = O.glu(kind, g64, u64)
    act_kind = {"reglu": "relu", "geglu": "gelu", "swiglu": "silu", "geglu_erf": "gelu_erf",
                "geglu_quick": "gelu_quick"}[kind]
    act = O.UNARY[act_kind](g64)
    # the activation's error (its F16 kernels read the fp16 gelu tables: one more fp16 rounding), times |up|,
    # then the product's rounding and the result's
    act_err = f32_error(act_kind, g64, act, "float32" if dtype == "float32" else "float16")
    if dtype != "float32" and kind in ("geglu", "geglu_quick"):
        act_err = act_err + rounding(act, "float16")
    tol = act_err * np.abs(u64) + U * np.abs(ref) + O.TINY32 + rounding(ref, dtype)
    check_close(values(got, dtype), ref, tol, f"{kind} split={split} swapped={swapped} {dtype}")


@given(rows=st.integers(1, 4), n=st.integers(1, 20), dtype=st.sampled_from(["float32", "float16"]),
       limit=st.sampled_from([0.5, 2.0, 7.0]), seed=SEEDS)
def test_swiglu_clamp(run, rows, n, dtype, limit, seed):
    rng = np.random.default_rng(seed)
    (g, g64), (u, u64) = spec(rng.uniform(-6, 6, (rows, n)).astype(np.float32), dtype), \
        spec(rng.uniform(-6, 6, (rows, n)).astype(np.float32), dtype)
    got = run(lambda c, t: c.swiglu_clamp(t["g"], t["u"], limit), consts={"g": g, "u": u})
    x, y = np.minimum(g64, limit), np.clip(u64, -limit, limit)
    ref = x * O.sigmoid(x) * y
    check_close(values(got, dtype), ref, 8 * U * np.abs(ref) + O.TINY32 + rounding(ref, dtype),
                f"swiglu_clamp {dtype}")


@given(shape=st.lists(st.integers(1, 10), min_size=1, max_size=3), dtype=st.sampled_from(["float32", "float16"]),
       seed=SEEDS)
def test_silu_back(run, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    (dy, dy64), (x, x64) = spec(rng.standard_normal(shape).astype(np.float32), dtype), \
        spec(rng.uniform(-8, 8, shape).astype(np.float32), dtype)
    got = run(lambda c, t: c.silu_back(t["dy"], t["x"]), consts={"dy": dy, "x": x})
    s = O.sigmoid(x64)
    ref = dy64 * s * (1 + x64 * (1 - s))
    # s from expf (6 u), 1 - s cancels for x >> 0 (absolute u), the products: a few u of the parts
    parts = np.abs(dy64) * s * (1 + np.abs(x64) * (1 - s) + np.abs(x64) * 4 * U / np.maximum(s, 1e-30))
    check_close(values(got, dtype), ref, 8 * U * parts + O.TINY32 + rounding(ref, dtype), f"silu_back {dtype}")
