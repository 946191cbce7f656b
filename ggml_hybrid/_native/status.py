"""GGML status codes as exceptions: the one place a ``enum ggml_status`` becomes text."""

from __future__ import annotations

from ..errors import BackendError, ComputeError
from . import cstr, lib


def status_text(status: int) -> str:
    """GGML's name for a status ('success', 'failed', 'alloc failed', 'aborted')."""
    return cstr(lib.ggml_status_to_string(status))


def check_status(status: int, what: str, error: type[BackendError] = ComputeError) -> None:
    """Raise ``error`` naming ``what`` unless ``status`` is GGML_STATUS_SUCCESS."""
    if status != lib.GGML_STATUS_SUCCESS:
        raise error(f"{what} failed: {status_text(status)}")


__all__ = ["check_status", "status_text"]
