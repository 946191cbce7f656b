"""quantize -> dequantize round trips with per-type error bounds, and quantize's typed errors.

Bounds (A = max |x| over the block, R = max - min of the block, u16 = 2**-11,
TINY = half the smallest fp16 subnormal, the floor of any fp16 rounding):

* F16: one round-to-nearest, u16 |x| (+ TINY below the normal range). BF16: 2**-8 |x|.
* Q8_0: d = A/127, q = round(x/d) costs d/2; d is stored as fp16 and multiplies |q| <= 127:
  A/254 + 127 (u16 d + TINY)  (helpers.q8_err).
* Q4_0: d = max/-8 with max the signed extreme, q - 8 in [-8, 7]: rounding costs |d|/2 = A/16, but a value of
  the opposite sign near -max is clamped at 7|d|, an error up to A/8; fp16 d times |q - 8| <= 8: A u16 + 8 TINY.
* Q5_0: the same with 16 levels a side: A/16 + A u16 + 16 TINY.
* Q4_1 / Q5_1: d = R/15 (R/31), q = round((x - min)/d) costs d/2, no clamping; d and min are fp16:
  R/30 (R/62) + (R + |min|) u16 + 16 (32) TINY.
* K-quants (256-blocks of 16/32-element sub-blocks whose scales and mins are quantized to 4-8 bits and chosen
  by a weighted least-squares search that may clip outliers) have no closed-form worst case. With
  step = 2A/(levels - 1), one quantization step of the super-block's symmetric range, we require
  max error <= 1.25 step and RMS error <= 0.6 step per super-block, plus an absolute term for the fp16
  super-block scales near the subnormal range: (max|q| max|scale| + max|min|) TINY. Measured over ~10^4
  super-blocks of every family generated below (normal, uniform, one-sided, offset, heavy-tailed, sparse,
  spikes, constant, alternating, ramps; magnitudes 1e-3..1e3): max 0.96 step, RMS 0.5 step. A kernel that
  returned zeros or a wrong block would be off by ~A.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import EPS16, EPSBF16, F16_TINY, q8_err
from hypothesis import given
from hypothesis import strategies as st

import ggml_hybrid as gh

T = gh.GGMLType
SEEDS = st.integers(0, 2**31 - 1)

KINDS = ["normal", "uniform", "positive", "negative", "heavy", "offset", "sparse", "spikes", "constant",
         "alternating", "ramp"]


def make_data(seed: int, kind: str, scale: float, shape) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, shape)
    elif kind == "positive":
        x = rng.uniform(0, 1, shape)
    elif kind == "negative":
        x = -rng.uniform(0, 1, shape)
    elif kind == "heavy":
        x = np.clip(rng.standard_t(2, shape), -50, 50)
    elif kind == "offset":
        x = rng.uniform(5, 6, shape)
    elif kind == "sparse":
        x = rng.standard_normal(shape) * (rng.random(shape) < 0.1)
    elif kind == "spikes":
        x = rng.standard_normal(shape) * 1e-3
        x[..., ::37] = rng.standard_normal(x[..., ::37].shape) * 10
    elif kind == "constant":
        x = np.full(shape, rng.standard_normal())
    elif kind == "alternating":
        x = np.where(np.arange(shape[-1]) % 2, 1.0, -1.0) * rng.uniform(0.5, 2) * np.ones(shape)
    else:
        x = np.broadcast_to(np.linspace(-1, 1, shape[-1]), shape).copy()
    return (x * scale).astype(np.float32)


def blocks(a: np.ndarray, size: int) -> np.ndarray:
    return a.reshape(-1, size)


def roundtrip(x: np.ndarray, t: T) -> np.ndarray:
    q = gh.quantize(x, t)
    assert q.dtype == np.uint8 and q.shape == x.shape[:-1] + (t.row_size(x.shape[-1]),)
    out = gh.dequantize(q, t, x.shape[-1])
    assert out.dtype == np.float32 and out.shape == x.shape
    return out.astype(np.float64)


# (levels, max|q| * max|scale| + max|min|) of each K-quant
K_QUANTS = {T.Q2_K: (4, 3 * 15 + 15), T.Q3_K: (8, 4 * 32), T.Q4_K: (16, 15 * 63 + 63), T.Q5_K: (32, 31 * 63 + 63),
            T.Q6_K: (64, 32 * 127)}
LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]


def legacy_bound(t: T, xb: np.ndarray) -> np.ndarray:
    """Max error allowed in each 32-block of xb [blocks, 32] (see the module docstring)."""
    a = np.abs(xb).max(axis=1)
    r = xb.max(axis=1) - xb.min(axis=1)
    mn = np.abs(xb.min(axis=1))
    slack = 1 + 1e-4  # float32 evaluation of the scales themselves
    if t == T.Q8_0:
        return q8_err(a)
    if t == T.Q4_0:
        return (a / 8 + a * EPS16) * slack + 8 * F16_TINY
    if t == T.Q5_0:
        return (a / 16 + a * EPS16) * slack + 16 * F16_TINY
    if t == T.Q4_1:
        return (r / 30 + (r + mn) * EPS16) * slack + 16 * F16_TINY
    if t == T.Q5_1:
        return (r / 62 + (r + mn) * EPS16) * slack + 32 * F16_TINY
    raise AssertionError(t)


@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
@given(rows=st.integers(1, 3), n_blocks=st.integers(1, 4), kind=st.sampled_from(KINDS),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=SEEDS)
def test_legacy_roundtrip(t, rows, n_blocks, kind, scale, seed):
    x = make_data(seed, kind, scale, (rows, 32 * n_blocks))
    err = np.abs(roundtrip(x, t) - x)
    bound = legacy_bound(t, blocks(x.astype(np.float64), 32))
    worst = blocks(err, 32).max(axis=1)
    assert (worst <= bound).all(), (f"{t.name} {kind}: block error {worst.max():.4g} > bound "
                                    f"{bound[np.argmax(worst / bound)]:.4g}")


@pytest.mark.parametrize("t", list(K_QUANTS), ids=lambda t: t.name)
@given(rows=st.integers(1, 2), n_blocks=st.integers(1, 2), kind=st.sampled_from(KINDS),
       scale=st.sampled_from([1e-3, 1e-2, 1.0, 10.0, 1e3]), seed=SEEDS)
def test_k_quant_roundtrip(t, rows, n_blocks, kind, scale, seed):
    levels, tiny_mult = K_QUANTS[t]
    x = make_data(seed, kind, scale, (rows, 256 * n_blocks))
    err = blocks(np.abs(roundtrip(x, t) - x), 256)
    a = np.abs(blocks(x.astype(np.float64), 256)).max(axis=1)
    step = 2 * a / (levels - 1)
    tiny = tiny_mult * F16_TINY
    worst = err.max(axis=1)
    rms = np.sqrt((err ** 2).mean(axis=1))
    assert (worst <= 1.25 * step + tiny).all(), f"{t.name} {kind}: max error {worst.max():.4g} vs step {step.max():.4g}"
    assert (rms <= 0.6 * step + tiny).all(), f"{t.name} {kind}: RMS error {rms.max():.4g} vs step {step.max():.4g}"


@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), kind=st.sampled_from(KINDS),
       scale=st.sampled_from([1e-6, 1e-3, 1.0, 1e3]), seed=SEEDS)
def test_f16_bf16_roundtrip(shape, kind, scale, seed):
    x = make_data(seed, kind, scale, tuple(shape))
    x64 = x.astype(np.float64)
    f16 = roundtrip(x, T.F16)
    assert (np.abs(f16 - x64) <= EPS16 * np.abs(x64) + F16_TINY).all()
    assert np.array_equal(f16, x.astype(np.float16).astype(np.float64))  # both round to nearest even
    bf16 = roundtrip(x, T.BF16)
    assert (np.abs(bf16 - x64) <= EPSBF16 * np.abs(x64)).all()
    # bf16 keeps the top 16 bits of the float32 (after rounding): the low 16 bits of the result are zero
    assert not (bf16.astype(np.float32).view(np.uint32) & 0xFFFF).any()


def test_float64_input_is_accepted_as_float32():
    x = np.linspace(-1, 1, 64).reshape(2, 32)
    assert np.array_equal(gh.quantize(x, T.Q8_0), gh.quantize(x.astype(np.float32), T.Q8_0))


def test_imatrix_types_quantize_with_an_imatrix():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    q = gh.quantize(x, T.IQ2_XXS, imatrix=np.ones(256, np.float32))
    out = gh.dequantize(q, T.IQ2_XXS, 256)
    assert np.isfinite(out).all()
    # 2.06 bits per weight is lossy, but it must still carry the signal (a wrong codebook would not)
    rel = np.linalg.norm(out - x) / np.linalg.norm(x)
    assert rel < 0.6, rel


# -------------------------------------------------------------------------------------------------------------
# typed errors
# -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,n", [(T.Q8_0, 33), (T.Q4_0, 16), (T.Q4_K, 128), (T.Q6_K, 300), (T.Q2_K, 32)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_row_length_not_a_multiple_of_the_block(t, n):
    with pytest.raises(gh.errors.ShapeError, match="multiple of"):
        gh.quantize(np.ones((2, n), np.float32), t)
    with pytest.raises(gh.errors.ShapeError):
        gh.dequantize(np.zeros((2, t.row_size(t.block_size)), np.uint8), t, n)


def test_dequantize_rejects_wrong_byte_count_and_dtype():
    q = gh.quantize(np.ones((2, 64), np.float32), T.Q8_0)
    with pytest.raises(gh.errors.ShapeError):
        gh.dequantize(q[:, :-1], T.Q8_0, 64)
    with pytest.raises(gh.errors.DTypeError):
        gh.dequantize(q.astype(np.int16), T.Q8_0, 64)


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.bool_, np.complex64])
def test_non_float_input(dtype):
    with pytest.raises(gh.errors.DTypeError):
        gh.quantize(np.ones((1, 32), dtype), T.Q8_0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_K, T.F16], ids=lambda t: t.name)
def test_non_finite_input(t, bad):
    x = np.ones((2, 256), np.float32)
    x[1, 100] = bad
    with pytest.raises(ValueError, match="NaN or infinity"):
        gh.quantize(x, t)


@pytest.mark.parametrize("t", [T.IQ2_XXS, T.IQ2_XS, T.IQ1_S])
def test_imatrix_required(t):
    with pytest.raises(gh.errors.DTypeError, match="importance matrix"):
        gh.quantize(np.ones((1, 256), np.float32), t)


@pytest.mark.parametrize("t", [T.I32, T.Q8_K, T.Q8_1, "not_a_type"], ids=str)
def test_not_a_quantization_target(t):
    with pytest.raises(gh.errors.DTypeError):
        gh.quantize(np.ones((1, 256), np.float32), t)


@pytest.mark.parametrize("t,big", [(T.Q8_0, 1e7), (T.Q4_1, 1e6)], ids=["Q8_0", "Q4_1"])
def test_scale_overflow_is_not_silent(t, big):
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = big, 1.0
    try:
        out = gh.dequantize(gh.quantize(x, t), t, 32)
    except ValueError:
        return
    assert np.isfinite(out).all(), out[0, :3]


def test_f32_roundtrip():
    x = np.array([[1.5, -2.25, 3.0]], np.float32)
    assert np.array_equal(gh.dequantize(gh.quantize(x, T.F32), T.F32, 3), x)
