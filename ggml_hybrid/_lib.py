"""Loads the compiled cffi module and refuses a build that is out of date."""

from __future__ import annotations

from . import _buildinfo
from .errors import StaleBuildError

_REBUILD = "rebuild it with `python build.py` (or `pip install -e .`) from the repository root"

try:
    from ._native import ffi, lib  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise StaleBuildError(f"the native module ggml_hybrid._native is missing or broken ({exc}); {_REBUILD}") from exc


def _check_build() -> None:
    built_cdef = ffi.string(lib.ggml_hybrid_cdef_hash()).decode()
    if built_cdef != _buildinfo.cdef_hash():
        raise StaleBuildError(
            f"ggml_hybrid._native was compiled from other cdef headers (hash {built_cdef[:12]}, "
            f"sources {_buildinfo.cdef_hash()[:12]}); {_REBUILD}")
    # the pin and the patch series live in the source checkout, not in a wheel
    if _buildinfo.VENDOR_DIR.is_dir():
        pin_version = _buildinfo.load_pin()["ggml_version"]
        built_version = ffi.string(lib.ggml_hybrid_ggml_version()).decode()
        if built_version != pin_version:
            raise StaleBuildError(f"ggml_hybrid._native links GGML {built_version} but vendor/pin.json pins "
                                  f"{pin_version}; {_REBUILD}")
        built_patches = ffi.string(lib.ggml_hybrid_patch_hash()).decode()
        if built_patches != _buildinfo.patch_series_hash():
            raise StaleBuildError(
                f"ggml_hybrid._native was built with another patch series (hash {built_patches[:12]}, "
                f"vendor/patches {_buildinfo.patch_series_hash()[:12]}); {_REBUILD}")


_check_build()
lib.ggml_cpu_init()


def cstr(p) -> str:
    return ffi.string(p).decode() if p != ffi.NULL else ""
