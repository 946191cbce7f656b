"""PEP 517 backend: build the native part with build.py, then package with setuptools.

Kept tiny on purpose; all build logic lives in build.py so that `python build.py`
and `pip install` do exactly the same thing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
    spec = importlib.util.spec_from_file_location("_ggml_hybrid_build", Path(__file__).with_name("build.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    mod.build(mod.options_from_env())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _build_native()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_native()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools.build_sdist(sdist_directory, config_settings)
