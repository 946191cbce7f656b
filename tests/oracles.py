"""float64 numpy references of GGML's operations, shared by the op tests, the gradient checks (finite differences of
these functions) and the random-graph test.

Each reference states the math the op's docstring states, in numpy order, computed in float64 from the exact values
GGML reads (F16 and BF16 inputs widened exactly). BF16 tensors travel as their uint16 bits; :func:`to_bf16` rounds
float32 to them as GGML does (round to nearest even).
"""

from __future__ import annotations

import math

import numpy as np

EPS32 = 2.0 ** -24
EPS16 = 2.0 ** -11
EPSBF16 = 2.0 ** -8
F16_TINY = 2.0 ** -25
TINY32 = 1e-37  # below float32's smallest normal: an absolute floor where a result rounds to (almost) zero


# -- BF16 ---------------------------------------------------------------------------------------------------------

def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values as BF16 bits (uint16), rounded to nearest even (GGML_FP32_TO_BF16; no NaNs here)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) as float32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def unit(dtype: str) -> float:
    """The unit roundoff of a result stored in ``dtype``."""
    return {"float32": EPS32, "float16": EPS16, "bfloat16": EPSBF16}[dtype]


def floor_of(dtype: str) -> float:
    """The absolute rounding floor of a result stored in ``dtype`` (half its smallest subnormal step, or tiny)."""
    return F16_TINY if dtype == "float16" else TINY32


# -- elementwise ---------------------------------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def sigmoid(x):
    return 0.5 * (1 + np.tanh(0.5 * x))  # overflow-free


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


# GGML's float32 constants (ggml-cpu/vec.h), exactly as float32 holds them
SQRT_2_OVER_PI = float(np.float32(0.79788456080286535587989211986876))
GELU_COEF_A = float(np.float32(0.044715))
GELU_QUICK_COEF = float(np.float32(1.702))
SQRT_2_INV = float(np.float32(0.70710678118654752440084436210484))


def gelu(x):
    return 0.5 * x * (1 + np.tanh(SQRT_2_OVER_PI * x * (1 + GELU_COEF_A * x * x)))


def gelu_quick(x):
    return x * sigmoid(GELU_QUICK_COEF * x)


def gelu_erf(x):
    return 0.5 * x * (1 + _erf(x * SQRT_2_INV))


def round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


UNARY = {
    "abs": np.abs, "sgn": np.sign, "neg": np.negative, "step": lambda x: (x > 0).astype(np.float64),
    "tanh": np.tanh, "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))),
    "relu": lambda x: np.maximum(x, 0), "sigmoid": sigmoid, "gelu": gelu, "gelu_quick": gelu_quick,
    "silu": lambda x: x * sigmoid(x), "hardswish": lambda x: x * np.clip((x + 3) / 6, 0, 1),
    "hardsigmoid": lambda x: np.clip((x + 3) / 6, 0, 1), "exp": np.exp, "expm1": np.expm1, "softplus": softplus,
    "gelu_erf": gelu_erf, "floor": np.floor, "ceil": np.ceil, "round": round_half_away, "trunc": np.trunc,
    "sqr": np.square, "sqrt": np.sqrt, "log": np.log, "sin": np.sin, "cos": np.cos,
}


def xielu(x, alpha_n, alpha_p, beta, eps):
    """xIELU with GGML's float32 precomputed coefficients: an = beta + softplus(alpha_n), ap = softplus(alpha_p)."""
    f32 = np.float32
    an = float(f32(f32(beta) + f32(softplus(np.float64(f32(alpha_n))))))
    ap = float(f32(softplus(np.float64(f32(alpha_p)))))
    b, e = float(f32(beta)), float(f32(eps))
    return np.where(x > 0, ap * x * x + b * x, (np.expm1(np.minimum(x, e)) - x) * an + b * x)


def glu(kind: str, gate, up):
    act = {"reglu": lambda g: np.maximum(g, 0), "geglu": gelu, "swiglu": lambda g: g * sigmoid(g),
           "geglu_erf": gelu_erf, "geglu_quick": gelu_quick}[kind]
    return act(gate) * up


# -- reductions and layout -----------------------------------------------------------------------------------------

def tile_to(b: np.ndarray, shape) -> np.ndarray:
    """GGML broadcasting of b onto a of ``shape``: b is repeated (tiled) along each dim it divides."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    return np.tile(b, tuple(s // bs for s, bs in zip(shape, b.shape)))


def repeat_back(a: np.ndarray, shape) -> np.ndarray:
    """The tiles of ``a`` summed into ``shape`` (the adjoint of tile_to)."""
    shape = (1,) * (a.ndim - len(shape)) + tuple(shape)
    split = []
    for n, s in zip(a.shape, shape):
        split += [n // s, s]
    return a.reshape(split).sum(axis=tuple(range(0, 2 * a.ndim, 2)))


def softmax(z, axis=-1):
    z = z - np.max(z, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(z, axis=-1):
    z = z - np.max(z, axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def norm(x, eps):
    m = x.mean(axis=-1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps)


def rms_norm(x, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def l2_norm(x, eps):
    return x / np.maximum(np.sqrt((x * x).sum(axis=-1, keepdims=True)), eps)


def group_norm(x, n_groups, eps):
    """x [N, C, H, W] (numpy order; fewer dims padded in front): channels in runs of ceil(C / n_groups)."""
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    c = x4.shape[1]
    per = -(-c // n_groups)
    out = np.empty_like(x4)
    for g0 in range(0, c, per):
        blk = x4[:, g0:g0 + per]
        m = blk.mean(axis=(1, 2, 3), keepdims=True)
        v = ((blk - m) ** 2).mean(axis=(1, 2, 3), keepdims=True)
        out[:, g0:g0 + per] = (blk - m) / np.sqrt(v + eps)
    return out.reshape(x.shape)


def cross_entropy(logits, labels):
    """The mean over rows of -sum(labels * log_softmax(logits))."""
    rows = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(rows.shape)
    return -(lab * log_softmax(rows)).sum() / rows.shape[0]


def conv_out(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def conv2d(x, w, s=(1, 1), p=(0, 0), d=(1, 1)):
    """Cross-correlation: x [N, C, H, W], w [O, C, KH, KW] -> [N, O, OH, OW], zero padding."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    oh, ow = conv_out(h, kh, s[0], p[0], d[0]), conv_out(wd, kw, s[1], p[1], d[1])
    xp = np.zeros((n, c, h + 2 * p[0], wd + 2 * p[1]))
    xp[:, :, p[0]:p[0] + h, p[1]:p[1] + wd] = x
    out = np.zeros((n, o, oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * d[0]: i * d[0] + s[0] * (oh - 1) + 1: s[0], j * d[1]: j * d[1] + s[1] * (ow - 1) + 1:
                       s[1]]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out


def im2col2d(x, kh, kw, s=(1, 1), p=(0, 0), d=(1, 1)):
    """[N, C, H, W] -> [N, OH, OW, C KH KW] (GGML's im2col: channel outermost in each patch row)."""
    n, c, h, wd = x.shape
    oh, ow = conv_out(h, kh, s[0], p[0], d[0]), conv_out(wd, kw, s[1], p[1], d[1])
    xp = np.zeros((n, c, h + 2 * p[0], wd + 2 * p[1]))
    xp[:, :, p[0]:p[0] + h, p[1]:p[1] + wd] = x
    out = np.zeros((n, oh, ow, c, kh, kw))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * d[0]: i * d[0] + s[0] * (oh - 1) + 1: s[0], j * d[1]: j * d[1] + s[1] * (ow - 1) + 1:
                       s[1]]
            out[:, :, :, :, i, j] = patch.transpose(0, 2, 3, 1)
    return out.reshape(n, oh, ow, c * kh * kw)
