"""The compiled cffi module (GGML, the patch series, our C), loaded once and checked against its sources.

A build made from other cdef headers, C sources, GGML version or patch series
refuses to import with :class:`~ggml_hybrid.errors.StaleBuildError`: a stale
build must fail loudly, not run old code.
"""

from __future__ import annotations

from typing import Any

from ..errors import StaleBuildError
from . import buildinfo

#: a cffi pointer or other native value (cdata): cffi ships no type information
CData = Any

_REBUILD = "rebuild it with `python build.py` (or `pip install -e .`) from the repository root"

try:
    from ._ggml import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise StaleBuildError(f"the native module ggml_hybrid._native._ggml is missing or broken ({exc}); "
                          f"{_REBUILD}") from exc


def cstr(p: CData) -> str:
    """A C string as text ('' for NULL)."""
    return ffi.string(p).decode() if p != ffi.NULL else ""


def _check_build() -> None:
    built = cstr(lib.ggml_hybrid_source_hash())
    if built != buildinfo.source_hash():
        raise StaleBuildError(
            f"ggml_hybrid._native._ggml was compiled from other cdef headers or C sources (hash {built[:12]}, "
            f"sources {buildinfo.source_hash()[:12]}); {_REBUILD}")
    # the pin and the patch series live in the source checkout, not in a wheel
    if buildinfo.VENDOR_DIR.is_dir():
        pin_version = buildinfo.load_pin()["ggml_version"]
        built_version = cstr(lib.ggml_hybrid_ggml_version())
        if built_version != pin_version:
            raise StaleBuildError(f"ggml_hybrid._native._ggml links GGML {built_version} but vendor/pin.json pins "
                                  f"{pin_version}; {_REBUILD}")
        built_patches = cstr(lib.ggml_hybrid_patch_hash())
        if built_patches != buildinfo.patch_series_hash():
            raise StaleBuildError(
                f"ggml_hybrid._native._ggml was built with another patch series (hash {built_patches[:12]}, "
                f"vendor/patches {buildinfo.patch_series_hash()[:12]}); {_REBUILD}")


_check_build()
lib.ggml_cpu_init()
lib.ggml_hybrid_log_quiet()

GGML_VERSION = cstr(lib.ggml_hybrid_ggml_version())

__all__ = ["GGML_VERSION", "CData", "cstr", "ffi", "lib"]
