"""Quantize and dequantize rows with GGML's own reference routines."""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt

from .._native import ffi, lib
from ..errors import ArgumentError, BackendError, DTypeError, ShapeError
from .dtypes import GGMLType, GGMLTypeLike, as_ggml_type


def _rows(op: str, x: np.ndarray, t: GGMLType) -> np.ndarray:
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ShapeError(f"{op}: need rows of at least one element, got shape {x.shape}")
    if x.shape[-1] % t.block_size:
        raise ShapeError(f"{op}: {t.name} rows must be a multiple of {t.block_size} elements, "
                         f"got rows of {x.shape[-1]}")
    return x


def quantize(x: npt.ArrayLike, dtype: GGMLTypeLike, imatrix: npt.ArrayLike | None = None) -> np.ndarray:
    """Quantize float rows (last axis) to GGML type ``dtype``; returns uint8 [..., row_bytes]."""
    t = as_ggml_type(dtype)
    x = np.asarray(x)
    if x.dtype != np.float32:
        if not np.issubdtype(x.dtype, np.floating):
            raise DTypeError(f"quantize: input must be floating point, got {x.dtype}")
        x = x.astype(np.float32)
    _rows("quantize", x, t)
    if t not in _QUANTIZABLE:
        raise DTypeError(f"quantize: GGML cannot quantize to {t.name}; choose one of "
                         f"{', '.join(sorted(q.name for q in _QUANTIZABLE))}")
    n_per_row = x.shape[-1]
    nrows = x.size // n_per_row
    im = ffi.NULL
    if imatrix is not None:
        im_arr = np.ascontiguousarray(imatrix, dtype=np.float32)
        if im_arr.shape != (n_per_row,):
            raise ShapeError(f"quantize: imatrix must have shape ({n_per_row},), got {im_arr.shape}")
        im = ffi.from_buffer("float[]", im_arr)
    elif lib.ggml_quantize_requires_imatrix(t):
        raise DTypeError(f"quantize: {t.name} needs an importance matrix (imatrix=...)")
    if not np.isfinite(x).all():
        raise ArgumentError("quantize: input holds NaN or infinity")
    if t not in (GGMLType.F32, GGMLType.BF16) and x.size and np.abs(x).max() > _FP16_MAX:
        # F16 values, and the fp16 block scales and minima of the quantized types, overflow past this
        raise ArgumentError(f"quantize: {t.name} cannot represent values beyond +-{_FP16_MAX} "
                         f"(got {float(np.abs(x).max()):g}): its {'elements' if t == GGMLType.F16 else 'block scales'} "
                         "are fp16")
    src = np.ascontiguousarray(x)
    row_bytes = t.row_size(n_per_row)
    out = np.empty(x.shape[:-1] + (row_bytes,), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(t, ffi.from_buffer("float[]", src), ffi.from_buffer(out), 0, nrows,
                                      n_per_row, im)
    if written != out.nbytes:  # GGML wrote another size than its own row_size promised
        raise BackendError(f"quantize: GGML wrote {written} bytes for {out.nbytes}")
    return out


def dequantize(data: npt.ArrayLike, dtype: GGMLTypeLike, n_per_row: int) -> np.ndarray:
    """Inverse of :func:`quantize`: uint8 [..., row_bytes] -> float32 [..., n_per_row]."""
    t = as_ggml_type(dtype)
    data = np.ascontiguousarray(data)
    if data.dtype != np.uint8:
        raise DTypeError(f"dequantize: data must be uint8 bytes, got {data.dtype}")
    if isinstance(n_per_row, bool) or not isinstance(n_per_row, (int, np.integer)) or n_per_row <= 0:
        raise ShapeError(f"dequantize: n_per_row must be a positive integer, got {n_per_row!r}")
    if n_per_row % t.block_size:
        raise ShapeError(f"dequantize: {t.name} rows must be a multiple of {t.block_size} elements")
    row_bytes = t.row_size(int(n_per_row))
    if data.ndim < 1 or data.shape[-1] != row_bytes:
        raise ShapeError(f"dequantize: {t.name} rows of {n_per_row} take {row_bytes} bytes, "
                         f"data has shape {data.shape}")
    if t == GGMLType.F32:
        # numpy types copy() as Any
        return cast("np.ndarray", data.view(np.float32).reshape(data.shape[:-1] + (int(n_per_row),)).copy())
    traits = lib.ggml_get_type_traits(t)
    if traits.to_float == ffi.NULL:
        raise DTypeError(f"dequantize: GGML has no conversion from {t.name} to float")
    out = np.empty(data.shape[:-1] + (int(n_per_row),), dtype=np.float32)
    traits.to_float(ffi.from_buffer(data), ffi.from_buffer("float[]", out), out.size)
    return out


_FP16_MAX = 65504.0


def _quantizable() -> frozenset[GGMLType]:
    ok = set()
    for t in GGMLType:
        if t.is_quantized and t not in (GGMLType.Q8_1, GGMLType.Q8_K) and lib.ggml_get_type_traits(t).to_float:
            ok.add(t)
    return frozenset(ok | {GGMLType.F16, GGMLType.BF16, GGMLType.F32})


_QUANTIZABLE = _quantizable()
