"""What a tensor is, from its name alone: llama.cpp's tensor-name rules, written once for every layer above.

The routed experts' rule decides what ``cpu_moe``, ``n_cpu_moe`` and the expert cache place; the op that uses a
weight decides whether a CPU extra buffer type may repack it; the class of a tensor is what ``inspect`` and
``plan`` add bytes up by.
"""

from __future__ import annotations

import re

# the routed experts' tensors (llama.cpp's LLM_FFN_EXPS_REGEX, anchored): matrices and their biases
_EXPERT_WEIGHT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.(weight|bias)$")
LAYER = re.compile(r"^blk\.(\d+)\.")

# what inspect and plan add bytes up by
CLASSES = ("dense", "routed_experts", "shared_experts", "embeddings", "output")


def is_expert_tensor(name: str) -> bool:
    """Whether ``name`` is a routed expert's tensor (what the expert modes place), as opposed to a dense one."""
    return _EXPERT_WEIGHT.match(name) is not None


def layer_of(name: str) -> int | None:
    """The block index of ``blk.N.*`` tensors, ``None`` for the others (embeddings, output, ...)."""
    m = LAYER.match(name)
    return int(m.group(1)) if m else None


def tensor_class(name: str) -> str:
    """One of :data:`CLASSES` for tensor ``name``."""
    if is_expert_tensor(name):
        return "routed_experts"
    if "_shexp." in name:
        return "shared_experts"
    if name.startswith("token_embd."):
        return "embeddings"
    if name.startswith("output."):
        return "output"
    return "dense"


def weight_op(name: str, n_dims: int) -> str | None:
    """The GGML op that uses weight ``name`` (of ``n_dims`` dimensions) in the decoder graph, as llama.cpp
    declares one per tensor: the routed experts' matrices ``mul_mat_id``, the token embeddings ``get_rows``,
    other matrices ``mul_mat``; norms, biases and other vectors ``None``. It decides whether a CPU extra
    buffer type may hold the weight (:func:`ggml_hybrid.ggml.repack.repack_buffer_type`); a tied output head
    uses ``token_embd.weight`` through ``get_rows`` too, and so is never repacked on the CPU.
    """
    if not name.endswith(".weight"):
        return None
    if is_expert_tensor(name):
        return "mul_mat_id" if n_dims == 3 else None
    if name == "token_embd.weight":
        return "get_rows"
    return "mul_mat" if n_dims == 2 else None


__all__ = ["CLASSES", "LAYER", "is_expert_tensor", "layer_of", "tensor_class", "weight_op"]
