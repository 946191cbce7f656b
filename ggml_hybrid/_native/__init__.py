"""The compiled cffi module (our C over GGML's shared libraries), loaded once and checked against its sources.

A build made from other cdef headers, C sources, GGML version or patch series
refuses to import with :class:`~ggml_hybrid.errors.StaleBuildError`: a stale
build must fail loudly, not run old code. So does a module whose ggml-base
library (``lib/``) is not the one it was built against. The CPU backend is
loaded at import; optional backends (CUDA) on first use (``backends.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import StaleBuildError
from . import buildinfo

if TYPE_CHECKING:
    # a cffi pointer or other native value (cdata): a class of the generated stub (_ggml.pyi), which types every
    # ``lib`` function's arguments and result from the cdef
    from ._ggml import CData as CData
else:
    CData = Any

_REBUILD = "rebuild it with `python -m ggml_hybrid_build` (or `pip install -e .`) from the repository root"

try:
    from ._ggml import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise StaleBuildError(f"the native module ggml_hybrid._native._ggml is missing or broken ({exc}); "
                          f"{_REBUILD}") from exc


def cstr(p: CData) -> str:
    """A C string as text ('' for NULL)."""
    return ffi.string(p).decode() if p != ffi.NULL else ""


def _check_build() -> None:
    built = cstr(lib.hy_source_hash())
    if built != buildinfo.source_hash():
        raise StaleBuildError(
            f"ggml_hybrid._native._ggml was compiled from other cdef headers or C sources (hash {built[:12]}, "
            f"sources {buildinfo.source_hash()[:12]}); {_REBUILD}")
    loaded_abi, built_abi = cstr(lib.ggml_hybrid_base_abi()), cstr(lib.hy_abi())
    if loaded_abi != built_abi:
        raise StaleBuildError(f"ggml_hybrid._native._ggml was built for GGML ABI {built_abi}, but the ggml-base "
                              f"library loaded is {loaded_abi} (another libggml-base.so in this process or on "
                              f"LD_LIBRARY_PATH?); {_REBUILD}")
    # the pin and the patch series live in the source checkout, not in a wheel
    if buildinfo.VENDOR_DIR.is_dir():
        pin_version = buildinfo.load_pin()["ggml_version"]
        built_version = cstr(lib.hy_ggml_version())
        if built_version != pin_version:
            raise StaleBuildError(f"ggml_hybrid._native._ggml links GGML {built_version} but vendor/pin.json pins "
                                  f"{pin_version}; {_REBUILD}")
        built_patches = cstr(lib.hy_patch_hash())
        if built_patches != buildinfo.patch_series_hash():
            raise StaleBuildError(
                f"ggml_hybrid._native._ggml was built with another patch series (hash {built_patches[:12]}, "
                f"vendor/patches {buildinfo.patch_series_hash()[:12]}); {_REBUILD}")


_check_build()
lib.hy_log_quiet()
if not lib.hy_load_cpu(str(buildinfo.LIB_DIR).encode()):
    raise StaleBuildError(f"no usable GGML CPU backend in {buildinfo.LIB_DIR} (the libggml-cpu*.so files are missing, "
                          f"or none suits this CPU); {_REBUILD}")

GGML_VERSION = cstr(lib.hy_ggml_version())

__all__ = ["GGML_VERSION", "CData", "cstr", "ffi", "lib"]
