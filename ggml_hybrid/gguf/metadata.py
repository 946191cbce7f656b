"""Typed reads of GGUF metadata, with llama.cpp's limits: the rules every layer that reads a key uses.

A value of the wrong kind or out of its range is refused with the key, the value and the range.
"""

from __future__ import annotations

from ..errors import ModelFileError
from .store import GGUFStore

MAX_LAYERS = 512   # LLAMA_MAX_LAYERS: also the most entries a per-layer array may hold
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
INT32_MAX = 2**31 - 1  # every other count reaches GGML as an int32

def meta_int(store: GGUFStore, key: str, default=None, lo: int = 1, per_layer: str = "uniform",
             n: int | None = None, hi: int = INT32_MAX) -> int:
    """Integer metadata ``key`` in ``lo..hi`` (``default`` when absent; absent without default is an error).

    Per-layer arrays (``n`` entries when given, llama.cpp's rule; at most :data:`MAX_LAYERS`) are read as
    one value: ``per_layer="uniform"`` requires every layer to agree (what the graphs support), ``"max"``
    takes the largest (for reports).
    """
    v = store.meta(key, default, kind=("int", "ints"))
    if isinstance(v, list):
        if n is not None and len(v) != n:
            raise ModelFileError(f"{store.path!r}: {key} has {len(v)} entries, expected one per layer ({n})")
        if not v or len(v) > MAX_LAYERS:
            raise ModelFileError(f"{store.path!r}: {key} has {len(v)} per-layer entries; 1..{MAX_LAYERS} are "
                                 "allowed (llama.cpp's LLAMA_MAX_LAYERS)")
        if per_layer == "uniform" and any(x != v[0] for x in v):
            shown = v if len(v) <= 16 else f"[{len(v)} values]"
            raise ModelFileError(f"{store.path!r}: {key} = {shown}: per-layer values that differ are not supported")
        v = v[0] if per_layer == "uniform" else max(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be an integer in {lo}..{hi}")
    return v


def meta_float(store: GGUFStore, key: str, default: float | None, lo: float, hi: float) -> float:
    """Real metadata ``key`` in ``[lo, hi]`` (``default`` when absent; absent without default is an error)."""
    v = store.meta(key, default, kind="number")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be a number in [{lo}, {hi}]")
    return float(v)


def meta_bool(store: GGUFStore, key: str, default: bool) -> bool:
    """Boolean metadata ``key``: GGUF BOOL only, as llama.cpp's typed reader requires."""
    v = store.meta(key, default, kind="bool")
    if not isinstance(v, bool):
        raise ModelFileError(f"{store.path!r}: {key} = {v!r} must be a boolean")
    return v


def meta_str(store: GGUFStore, key: str, default: str | None = None) -> str:
    """Text metadata ``key`` (``default`` when absent; absent without default is an error)."""
    return str(store.meta(key, default, kind="str"))


def architecture(store: GGUFStore) -> str:
    """``general.architecture``, which must be a name."""
    return meta_str(store, "general.architecture", "")



__all__ = ["INT32_MAX", "MAX_EXPERTS", "MAX_LAYERS", "architecture", "meta_bool", "meta_float", "meta_int", "meta_str"]
