"""Loads the patched module and an unpatched (upstream) build of the same pin side by side."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# where `python -m ggml_hybrid_build --upstream` puts it
UPSTREAM_DIR = ROOT / "build" / "upstream" / "ggml_hybrid" / "_native"


def load_upstream():
    """(ffi, lib) of GGML built without our patch series; built on first use (about a minute)."""
    path = UPSTREAM_DIR / f"_ggml_upstream{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "ggml_hybrid_build", "--upstream"], check=True, cwd=ROOT)
    spec = importlib.util.spec_from_file_location("_ggml_upstream", path)  # its PyInit name
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.lib.hy_load_cpu(b"")  # static: the CPU backend is registered at start-up
    return mod.ffi, mod.lib


def load_patched():
    from ggml_hybrid._native import ffi, lib
    return ffi, lib
