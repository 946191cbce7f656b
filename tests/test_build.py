"""The build is cached, and a stale build refuses to import."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ggml_hybrid
from ggml_hybrid_build import abi, backend_libs, options, progress

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(ggml_hybrid.__file__).resolve().parent


def _installed_build_flags() -> list[str]:
    """The build's flags for what this checkout has installed, so that the build below finds all of it cached."""
    native = PKG / "_native"
    return ((["--cuda"] if (native / "backends" / "libggml-cuda.so").exists() else [])
            + (["--vulkan"] if (native / "backends" / "libggml-vulkan.so").exists() else [])
            + (["--portable"] if any((native / "lib").glob("libggml-cpu-*.so")) else []))


def test_second_build_reuses_the_cached_ggml(tmp_path):
    """A build of a copy of the checkout (never the checkout itself: a build installs into the tree it runs in, and
    one without the checkout's backend flags would take its backends out) comes whole from the cache."""
    root = tmp_path / "checkout"
    shutil.copytree(PKG, root / "ggml_hybrid", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.so.*"))
    shutil.copytree(ROOT / "vendor", root / "vendor")
    shutil.copytree(ROOT / "ggml_hybrid_build", root / "ggml_hybrid_build",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_HYBRID_")}  # the flags say it all
    res = subprocess.run([sys.executable, "-m", "ggml_hybrid_build", *_installed_build_flags()], capture_output=True,
                         text=True, timeout=600, cwd=root, env=env)
    assert res.returncode == 0, res.stderr
    assert "GGML up to date" in res.stderr
    # neither CMake nor a compiler ran: the GGML build and the cffi module came from the cache
    assert "$ cmake" not in res.stderr and "compiling the cffi module" not in res.stderr
    assert f"installed {root / 'ggml_hybrid' / '_native'}" in res.stderr  # the copy's build ran, not the checkout's
    # and the copy, which held no compiled file, now holds what the checkout holds, byte for byte
    built = root / "ggml_hybrid" / "_native"
    for lib in [*(PKG / "_native").glob("*.so"), *(PKG / "_native" / "lib").glob("*.so*"),
                *(PKG / "_native" / "backends").glob("*.so")]:
        copy = built / lib.relative_to(PKG / "_native")
        assert copy.read_bytes() == lib.read_bytes(), f"{copy} differs from the checkout's"


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
    assert "StaleBuildError" in res.stderr and "python -m ggml_hybrid_build" in res.stderr


def test_python_m_build_in_the_checkout_runs_pypa_build():
    """``python -m build`` from the repository root is PyPA's build: nothing in the checkout is named ``build``."""
    res = subprocess.run([sys.executable, "-m", "build", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    # PyPA's build names its version and where it lives (its own package, not the checkout)
    assert re.match(r"build \d", res.stdout), res.stdout
    assert str(ROOT) + "/build" not in res.stdout + res.stderr and "unrecognized arguments" not in res.stderr


@pytest.fixture
def adopting(tmp_path, monkeypatch):
    """The build with a stand-in backend ("fake": no compiler needed for its arguments) and a scratch cache."""
    monkeypatch.setitem(options.BACKENDS, "fake", options.BackendSpec("GGML_HYBRID_FAKE", lambda opts: ["-DFAKE=ON"]))
    verdict = abi.abi_verdict()  # from the real cache, where the pin's archive is: the scratch one has none
    monkeypatch.setattr(abi, "abi_verdict", lambda vendor=None, fresh=False: verdict)
    monkeypatch.setenv("GGML_HYBRID_CACHE", str(tmp_path / "cache"))


def _library(tmp_path: Path, stamp: str | None) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"fake_{stamp}.c"
    src.write_text("int ggml_backend_init(void) { return 0; }\n" + (
        "" if stamp is None else f'const char * ggml_hybrid_backend_abi(void) {{ return "{stamp}"; }}\n'))
    out = tmp_path / f"libfake_{stamp}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


def test_a_backend_built_elsewhere_is_adopted_into_the_cache(adopting, tmp_path, monkeypatch):
    lib = _library(tmp_path, abi.abi_stamp())
    monkeypatch.setenv("GGML_HYBRID_FAKE_LIB", str(lib))
    got = backend_libs.build_backend("fake", options.Options())
    tree = got.parent.parent
    assert got == tree / "out" / "libggml-fake.so" and got.exists()
    assert tree.parent == tmp_path / "cache" and tree.name.startswith("backend-fake-")
    assert "adopted from" in (tree / "DONE").read_text()
    # a later build with the same options finds it there, with no library named
    monkeypatch.delenv("GGML_HYBRID_FAKE_LIB")
    logged = []
    monkeypatch.setattr(progress, "run", lambda cmd, **kw: logged.append(cmd))  # no CMake may run
    assert backend_libs.build_backend("fake", options.Options()) == got
    assert logged == []


@pytest.mark.parametrize("stamp", [None, "0123456789abcdef"])
def test_a_backend_of_another_ggml_base_is_not_adopted(adopting, tmp_path, monkeypatch, stamp):
    monkeypatch.setenv("GGML_HYBRID_FAKE_LIB", str(_library(tmp_path, stamp)))
    with pytest.raises(SystemExit) as exc:
        backend_libs.build_backend("fake", options.Options())
    assert "not built against this checkout's ggml-base" in str(exc.value)
    assert abi.abi_stamp() in str(exc.value)
    assert not list((tmp_path / "cache").glob("backend-fake-*/DONE"))


def test_a_file_that_is_no_library_is_not_adopted(adopting, tmp_path, monkeypatch):
    text = tmp_path / "libggml-fake.so"
    text.write_text(abi.abi_stamp())
    monkeypatch.setenv("GGML_HYBRID_FAKE_LIB", str(text))
    with pytest.raises(SystemExit, match="no ELF header"):
        backend_libs.build_backend("fake", options.Options())
    monkeypatch.setenv("GGML_HYBRID_FAKE_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(SystemExit, match="cannot read it"):
        backend_libs.build_backend("fake", options.Options())
