"""GGML's CPU "extra" buffer types: weights repacked at load into the layouts GGML's faster CPU kernels read.

llama.cpp puts every weight that lives on the CPU into such a buffer when the CPU's repacked kernels take
its type and shape (on AVX2: Q4_0, Q4_K, IQ4_NL and MXFP4 matrices with a multiple of 8 rows; more types
on ARM and AVX-512), unless ``--no-repack``. Which weights qualify is GGML's decision, asked here the way
llama.cpp asks it (``weight_buft_supported`` in ``llama-model.cpp``): a probe node of the op that uses the
weight, with the weight in a buffer of the extra type, offered to the CPU backend's ``supports_op``.

A repacked tensor is written through ``ggml_backend_tensor_set``: whole, or (our patch 0004) one
``nb[2]`` slice at a time, one expert of a 3-D expert tensor. It cannot be read back.
"""

from __future__ import annotations

import functools

from .._native import CData, cstr, ffi, lib
from ..errors import DTypeError, ShapeError
from .context import Context
from .dtypes import GGMLType, as_ggml_type

#: the ops whose weights GGML's extra buffer types take (the matrix of a product)
REPACK_OPS = ("mul_mat", "mul_mat_id")


def extra_buffer_types() -> list[CData]:
    """GGML's CPU extra buffer types in this build and on this CPU, in llama.cpp's order of preference."""
    out = []
    p = lib.hy_cpu_extra_bufts()
    i = 0
    while p[i] != ffi.NULL:
        out.append(p[i])
        i += 1
    return out


def buffer_type_name(buft: CData) -> str:
    return cstr(lib.ggml_backend_buft_name(buft))


def repack_buffer_type(dtype: GGMLType | str, shape: tuple[int, ...], op: str | None) -> CData | None:
    """The extra buffer type a CPU weight of ``dtype`` and numpy-order ``shape`` goes to when ``op`` (``mul_mat``,
    ``mul_mat_id``; anything else: none) uses it; ``None``: an ordinary buffer.

    Only weights on CPU backends go there (CPU instances playing devices included: their kernels are
    the CPU backend's); the caller decides that.
    """
    if op not in REPACK_OPS:
        return None
    for buft in extra_buffer_types():
        if _supported(int(ffi.cast("uintptr_t", buft)), as_ggml_type(dtype), tuple(shape), op):
            return buft
    return None


@functools.cache
def _supported(buft_addr: int, dtype: GGMLType, shape: tuple[int, ...], op: str) -> bool:
    buft = ffi.cast("ggml_backend_buffer_type_t", buft_addr)
    with Context(n_tensors=8) as ctx:
        try:
            w = ctx.new_tensor(dtype, shape)
            if op == "mul_mat":
                node = ctx.mul_mat(w, ctx.new_tensor("f32", (1, shape[-1])))
            else:
                node = ctx.mul_mat_id(w, ctx.new_tensor("f32", (1, 1, shape[-1])), ctx.new_tensor("i32", (1, 1)))
        except (DTypeError, ShapeError):
            return False  # not a product GGML would build at all
        dummy = lib.ggml_backend_buft_alloc_buffer(buft, 0)  # GGML's own zero-size buffer of that type
        if dummy == ffi.NULL:
            return False
        try:
            w.ptr.buffer = dummy
            cpu_dev = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
            return bool(lib.ggml_backend_dev_supports_op(cpu_dev, node.ptr))
        finally:
            w.ptr.buffer = ffi.NULL
            lib.ggml_backend_buffer_free(dummy)


__all__ = ["REPACK_OPS", "buffer_type_name", "extra_buffer_types", "repack_buffer_type"]
