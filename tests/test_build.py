"""The build is cached, and a stale build refuses to import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ggml_hybrid

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(ggml_hybrid.__file__).resolve().parent


def _installed_build_flags() -> list[str]:
    """build.py's flags for what this checkout has installed, so the rebuild below keeps it as it is."""
    native = PKG / "_native"
    return ((["--cuda"] if (native / "backends" / "libggml-cuda.so").exists() else [])
            + (["--portable"] if any((native / "lib").glob("libggml-cpu-*.so")) else []))


def test_second_build_reuses_the_cached_ggml():
    res = subprocess.run([sys.executable, str(ROOT / "build.py"), *_installed_build_flags()], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "GGML up to date" in res.stderr
    # neither CMake nor a compiler ran: the GGML build and the cffi module came from the cache
    assert "$ cmake" not in res.stderr and "compiling cffi module" not in res.stderr


def _copy_package(tmp_path: Path, with_vendor: bool) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(PKG, root / "ggml_hybrid", ignore=shutil.ignore_patterns("__pycache__"))
    if with_vendor:
        shutil.copytree(ROOT / "vendor", root / "vendor")
    return root


def _import_in(root: Path) -> subprocess.CompletedProcess:
    code = "import ggml_hybrid"
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_copied_package_imports(tmp_path):
    res = _import_in(_copy_package(tmp_path, with_vendor=True))
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("what", ["cdef", "patch", "pin"])
def test_stale_build_refuses_to_import(tmp_path, what):
    root = _copy_package(tmp_path, with_vendor=True)
    if what == "cdef":
        target = root / "ggml_hybrid" / "_native" / "cdef" / "10_ggml.h"
        target.write_text(target.read_text() + "\nint ggml_hybrid_new_declaration(void);\n")
    elif what == "patch":
        target = sorted((root / "vendor" / "patches").glob("*.patch"))[0]
        target.write_text(target.read_text() + "\n")
    else:
        target = root / "vendor" / "pin.json"
        target.write_text(target.read_text().replace('"ggml_version": "0.25.3"', '"ggml_version": "0.26.0"'))
    res = _import_in(root)
    assert res.returncode != 0
    assert "StaleBuildError" in res.stderr and "python build.py" in res.stderr


def test_python_m_build_in_the_checkout_runs_pypa_build():
    """``python -m build`` from the repository root finds build.py first; it hands over to PyPA's build."""
    res = subprocess.run([sys.executable, "-m", "build", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("build ") and "ggml-hybrid" not in res.stdout + res.stderr
