"""GGML element types and their numpy counterparts."""

from __future__ import annotations

import enum
from typing import TypeAlias, cast

import numpy as np
import numpy.typing as npt

from .._native import cstr, lib
from ..errors import DTypeError


class GGMLType(enum.IntEnum):
    """Every GGML tensor type this build knows; values come from the compiled headers."""

    F32 = lib.GGML_TYPE_F32
    F16 = lib.GGML_TYPE_F16
    BF16 = lib.GGML_TYPE_BF16
    F64 = lib.GGML_TYPE_F64
    I8 = lib.GGML_TYPE_I8
    I16 = lib.GGML_TYPE_I16
    I32 = lib.GGML_TYPE_I32
    I64 = lib.GGML_TYPE_I64
    Q4_0 = lib.GGML_TYPE_Q4_0
    Q4_1 = lib.GGML_TYPE_Q4_1
    Q5_0 = lib.GGML_TYPE_Q5_0
    Q5_1 = lib.GGML_TYPE_Q5_1
    Q8_0 = lib.GGML_TYPE_Q8_0
    Q8_1 = lib.GGML_TYPE_Q8_1
    Q2_K = lib.GGML_TYPE_Q2_K
    Q3_K = lib.GGML_TYPE_Q3_K
    Q4_K = lib.GGML_TYPE_Q4_K
    Q5_K = lib.GGML_TYPE_Q5_K
    Q6_K = lib.GGML_TYPE_Q6_K
    Q8_K = lib.GGML_TYPE_Q8_K
    IQ2_XXS = lib.GGML_TYPE_IQ2_XXS
    IQ2_XS = lib.GGML_TYPE_IQ2_XS
    IQ3_XXS = lib.GGML_TYPE_IQ3_XXS
    IQ1_S = lib.GGML_TYPE_IQ1_S
    IQ4_NL = lib.GGML_TYPE_IQ4_NL
    IQ3_S = lib.GGML_TYPE_IQ3_S
    IQ2_S = lib.GGML_TYPE_IQ2_S
    IQ4_XS = lib.GGML_TYPE_IQ4_XS
    IQ1_M = lib.GGML_TYPE_IQ1_M
    TQ1_0 = lib.GGML_TYPE_TQ1_0
    TQ2_0 = lib.GGML_TYPE_TQ2_0
    MXFP4 = lib.GGML_TYPE_MXFP4

    def __str__(self) -> str:
        """GGML's own name, as llama.cpp and GGUF tools print it: 'f32', 'q4_K'."""
        return cstr(lib.ggml_type_name(self))

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for plain types)."""
        return int(lib.ggml_blck_size(self))

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return int(lib.ggml_type_size(self))

    @property
    def is_quantized(self) -> bool:
        return bool(lib.ggml_is_quantized(self))

    def row_size(self, n: int) -> int:
        """Bytes taken by a row of n elements (n must be a multiple of the block size)."""
        return int(lib.ggml_row_size(self, n))

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of one element; quantized types have none."""
        try:
            return _TO_NUMPY[self]
        except KeyError:
            raise DTypeError(f"GGML type {self.name} has no numpy element type; quantized data is exchanged "
                             "as raw uint8 bytes or through quantize()/dequantize()") from None


_TO_NUMPY: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32),
    GGMLType.F16: np.dtype(np.float16),
    GGMLType.F64: np.dtype(np.float64),
    GGMLType.I8: np.dtype(np.int8),
    GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32),
    GGMLType.I64: np.dtype(np.int64),
    # bf16 has no numpy dtype; its bits travel as uint16
    GGMLType.BF16: np.dtype(np.uint16),
}
_FROM_NUMPY = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16,
               np.dtype(np.float64): GGMLType.F64, np.dtype(np.int8): GGMLType.I8,
               np.dtype(np.int16): GGMLType.I16, np.dtype(np.int32): GGMLType.I32,
               np.dtype(np.int64): GGMLType.I64}


#: what :func:`as_ggml_type` accepts: a GGMLType, its name or id, or a numpy dtype
GGMLTypeLike: TypeAlias = "GGMLType | str | int | npt.DTypeLike"


def as_ggml_type(value: GGMLTypeLike) -> GGMLType:
    """Accept a GGMLType, its name ("q4_K", "F32"), or a numpy dtype."""
    if isinstance(value, GGMLType):
        return value
    if isinstance(value, str):
        key = value.upper()
        if key in GGMLType.__members__:
            return GGMLType[key]
        raise DTypeError(f"unknown GGML type name {value!r}; known: {', '.join(GGMLType.__members__)}")
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return GGMLType(value)
        except ValueError:
            raise DTypeError(f"unknown GGML type id {value}") from None
    try:
        dt = np.dtype(cast("npt.DTypeLike", value))  # a bool left here: numpy raises TypeError
    except TypeError:
        raise DTypeError(f"cannot interpret {value!r} as a GGML type") from None
    if dt in _FROM_NUMPY:
        return _FROM_NUMPY[dt]
    raise DTypeError(f"numpy dtype {dt} has no GGML counterpart; use one of {[str(d) for d in _FROM_NUMPY]}")
