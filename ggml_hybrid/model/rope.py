"""RoPE parameters as llama.cpp derives them from the metadata: scaling type, factor, YaRN.

llama.cpp computes these scalars in C ``float`` arithmetic with the C library's
``logf`` (``llama_model_base::load_hparams`` and the ``llama_context``
constructor), and a one-ulp difference in a factor changes every logit. So
every step here is a float32 operation in the same order, and ``logf`` is the C
library's own (``lib.logf``), not numpy's correctly rounded logarithm, which
differs from it for some inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native import lib
from ..errors import ModelFileError
from ..gguf.metadata import meta_float, meta_int
from ..gguf.store import GGUFStore

f32 = np.float32
SCALING_TYPES = ("none", "linear", "yarn")  # llama.cpp also knows "longrope", which no family here uses


def logf(x: float | np.floating) -> np.float32:
    return f32(lib.logf(float(f32(x))))


@dataclass(frozen=True)
class Rope:
    """The arguments of every ``ggml_rope_ext`` of a model (per-layer overrides aside)."""

    mode: str               # "neox" or "normal"; "imrope" (with sections): interleaved M-RoPE
    n_rot: int              # rotated dimensions of each head (the rest pass through)
    freq_base: float
    freq_scale: float
    n_ctx_orig: int
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    scaling: str = "none"   # the file's rope.scaling.type ("none" when it has neither type nor factor; reports)
    sections: tuple[int, ...] = ()  # M-RoPE: rotated pairs per position axis (t, h, w, e); () plain rope

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :meth:`~ggml_hybrid.ggml.ops.OpsMixin.rope`."""
        return {"n_dims": self.n_rot, "mode": self.mode, "freq_base": self.freq_base,
                "freq_scale": self.freq_scale, "n_ctx_orig": self.n_ctx_orig, "ext_factor": self.ext_factor,
                "attn_factor": self.attn_factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}


def positions(rope: Rope, pos: np.ndarray) -> np.ndarray:
    """The position input of an ubatch: one per token, or for M-RoPE four rows (t, h, w, e), which for
    text are p, p, p and 0 (llama.cpp's ``llm_graph_input_pos::set_input``)."""
    if not rope.sections:
        return pos
    return np.concatenate([pos, pos, pos, np.zeros_like(pos)])


def _mscale(scale: np.float32, mscale: np.float32) -> np.float32:
    """llama.cpp's ``get_mscale``: ``scale <= 1 ? 1 : 0.1f * mscale * logf(scale) + 1.0f``."""
    if scale <= f32(1):
        return f32(1)
    return f32(f32(f32(0.1) * mscale) * logf(scale)) + f32(1)


def read_rope(store: GGUFStore, arch: str, mode: str, n_rot: int, n_ctx_train: int, *,
              yarn_log_mul: float = 0.0, deepseek2: bool = False) -> Rope:
    """The rope of ``arch`` with llama-cpp-python's context defaults (no overrides of the file's values).

    ``yarn_log_mul`` is deepseek2's ``rope.scaling.yarn_log_multiplier`` (already divided by 0.1f).
    """
    p = f"{arch}.rope."
    scaling = store.meta(p + "scaling.type", "linear", kind="str")  # llama.cpp's default
    if not isinstance(scaling, str) or scaling not in SCALING_TYPES:
        raise ModelFileError(f"{store.path!r}: {arch}: {p}scaling.type = {scaling!r} is not supported; supported: "
                             f"{', '.join(SCALING_TYPES)}")
    key = p + "scaling.factor" if store.has(p + "scaling.factor") else p + "scale_linear"
    factor = f32(meta_float(store, key, 0.0, 0.0, 1e6))
    freq_scale = f32(1) if factor == 0 else f32(f32(1) / factor)
    file_factor = meta_float(store, p + "scaling.attn_factor", 1.0, 0.0, 1e6)
    n_ctx_orig = meta_int(store, p + "scaling.original_context_length", n_ctx_train)
    if scaling == "none":
        freq_scale = f32(1)  # "never scale if scaling type is none"
    yarn = scaling == "yarn"
    return Rope(mode=mode, n_rot=n_rot, freq_base=float(f32(meta_float(store, p + "freq_base", 10000.0, 1e-3, 1e12))),
                freq_scale=float(freq_scale), n_ctx_orig=n_ctx_orig, ext_factor=1.0 if yarn else 0.0,
                attn_factor=float(attn_factor(freq_scale, yarn, file_factor, yarn_log_mul, deepseek2)),
                scaling=scaling if store.has(p + "scaling.type") or factor != 0 else "none")


def attn_factor(freq_scale: np.float32, yarn: bool, file_factor: float = 1.0, yarn_log_mul: float = 0.0,
                deepseek2: bool = False) -> np.float32:
    """The ``attn_factor`` of every rope op: the ``llama_context`` constructor's float32 arithmetic."""
    factor = f32(1)  # llama-cpp-python's yarn_attn_factor
    if yarn:
        s = f32(f32(1) / f32(freq_scale))
        if yarn_log_mul != 0:
            all_dims = f32(yarn_log_mul)
            m = all_dims if deepseek2 and all_dims != f32(1) else f32(1)
            factor = f32(_mscale(s, m) / _mscale(s, all_dims))
        else:
            factor = _mscale(s, f32(1))
        # cancels the magnitude GGML's YaRN kernel applies itself
        factor = f32(factor * f32(f32(1) / f32(f32(1) + f32(f32(0.1) * logf(s)))))
    return f32(factor * f32(file_factor))


def kq_scale(head_dim: int) -> float:
    """``1.0f/sqrtf(float(head_dim))``: in float32, which differs from the double for some sizes (96, 112)."""
    return float(f32(1) / np.sqrt(f32(head_dim)))


__all__ = ["Rope", "SCALING_TYPES", "attn_factor", "f32", "kq_scale", "logf", "positions", "read_rope"]
