"""The MoE families ggml-hybrid runs, one module each, registered by ``general.architecture``.

Each module says what llama.cpp (``src/models/<name>.cpp``) does for its architecture: the
metadata keys it reads, the tensors it needs and its layer graph. :func:`family_of` refuses
any other architecture with one error naming it.
"""

from __future__ import annotations

from ...errors import ModelFileError
from ...gguf.metadata import architecture
from ...gguf.store import GGUFStore
from ..hparams import HParams, check_tensors, read_common
from . import deepseek2, glm4moe, gpt_oss, llama, olmoe, qwen2moe, qwen3moe, qwen3next, qwen35moe
from .base import Family

FAMILIES: dict[str, Family] = {f.arch: f for f in (qwen3moe.FAMILY, qwen2moe.FAMILY, llama.FAMILY, olmoe.FAMILY,
                                                   glm4moe.FAMILY, deepseek2.FAMILY, gpt_oss.FAMILY,
                                                   qwen3next.FAMILY, qwen35moe.FAMILY)}


def family_of(store: GGUFStore, arch: str) -> Family:
    fam = FAMILIES.get(arch)
    if fam is None:
        raise ModelFileError(f"{store.path!r}: general.architecture = {arch!r} is not supported; supported: "
                             f"{', '.join(sorted(FAMILIES))}")
    return fam


def read_hparams(store: GGUFStore, require_moe: bool = True) -> HParams:
    fam = family_of(store, architecture(store))
    hp = fam.read(store, read_common(store, fam.arch, require_moe))
    check_tensors(store, hp, fam.tensors(hp))
    return hp


def tensor_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, with its numpy-order shape."""
    return FAMILIES[hp.arch].tensors(hp)


__all__ = ["FAMILIES", "Family", "family_of", "read_hparams", "tensor_shapes"]
