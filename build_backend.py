"""PEP 517 backend: build the native part with ggml_hybrid_build, then package with setuptools.

Kept tiny on purpose; all build logic lives in the ggml_hybrid_build package, so that `python -m ggml_hybrid_build`
and `pip install` do exactly the same thing. (setuptools stays the packaging backend: the native build is GGML's own
CMake tree, cached across checkouts and keyed by the patch series, plus a cffi module that cffi compiles itself; a
CMake-driven backend such as scikit-build-core would take over only the generic part, packaging, and not the pin,
the patches, the cache, the ABI probe or the cffi module.)
"""

from __future__ import annotations

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
           "get_requires_for_build_sdist", "get_requires_for_build_wheel", "prepare_metadata_for_build_editable",
           "prepare_metadata_for_build_wheel"]


def _build_native() -> None:
    # imported here: the sdist's own hooks (get_requires_*, build_sdist) need no build tools
    from ggml_hybrid_build import build, options_from_env

    build(options_from_env())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_native()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_native()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools.build_sdist(sdist_directory, config_settings)
