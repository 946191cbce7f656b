"""The sdist and the wheel, each installed into a fresh virtual environment and run from another directory.

Slow (each builds in pip's isolated environment and installs the dependencies): ``python -m pytest --slow
tests/test_packaging.py``. The GGML build itself comes from the cache that the checkout's own build filled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
PARITY = "parity: every configuration's logits are bit-identical to the resident run"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    # the switches of the checkout's own build must not leak into these builds
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_HYBRID_") or k == "GGML_HYBRID_CACHE"}
    env.pop("VIRTUAL_ENV", None)
    return env | extra


def _run(args: list, cwd: Path, timeout: int = 1500, **env: str) -> subprocess.CompletedProcess:
    res = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{args}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res


def _fresh_venv(where: Path) -> Path:
    _run([sys.executable, "-m", "venv", where], cwd=where.parent)
    return where / "bin"


def _demo(bin_dir: Path, cwd: Path) -> str:
    out = _run([bin_dir / "ggml-hybrid", "demo"], cwd=cwd, timeout=600).stdout
    assert PARITY in out
    return out


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    # from another directory, pointing at the checkout
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT], cwd=out)
    (archive,) = out.glob("ggml_hybrid-*.tar.gz")
    return archive


def test_sdist_holds_what_a_build_needs_and_no_build_output(sdist):
    import tarfile

    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    # every source the build reads, as the checkout has them (our C and the cdef: their file names change)
    sources = [p for top in ("ggml_hybrid/_native/src", "ggml_hybrid/_native/cdef", "ggml_hybrid_build", "vendor")
               for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".c", ".h", ".py", ".patch", ".json")]
    assert len(sources) > 40
    for need in ["build_backend.py", "setup.py", "pyproject.toml", "vendor/CMakeLists.txt",
                 *(p.relative_to(ROOT).as_posix() for p in sources)]:
        assert need in names, need
    assert any(n.startswith("vendor/patches/") and n.endswith(".patch") for n in names)
    assert not [n for n in names if ".so" in n or n.endswith(".pyi")]


def test_sdist_installs_from_another_directory_and_runs(sdist, tmp_path):
    bin_dir = _fresh_venv(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([bin_dir / "python", "-m", "pip", "install", "-q", sdist], cwd=elsewhere)
    _demo(bin_dir, elsewhere)


def test_wheel_is_tagged_for_this_interpreter_and_runs(sdist, tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, sdist], cwd=tmp_path)
    (wheel,) = wheels.glob("ggml_hybrid-*.whl")
    assert wheel.name.endswith(f"-{TAG}-{TAG}-linux_x86_64.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    assert [n for n in names if "/_ggml." in n and n.endswith(".so")] == [f"ggml_hybrid/_native/_ggml{ext}"]
    for lib in ("libggml-base.so.0", "libggml.so.0", "libggml-cpu.so.0"):
        assert f"ggml_hybrid/_native/lib/{lib}" in names
    assert not [n for n in names if n.startswith("ggml_hybrid_build/")]  # the build is no part of what runs
    bin_dir = _fresh_venv(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([bin_dir / "python", "-m", "pip", "install", "-q", wheel], cwd=elsewhere)
    _demo(bin_dir, elsewhere)
    devices = _run([bin_dir / "ggml-hybrid", "devices"], cwd=elsewhere).stdout
    assert "libggml-cpu.so.0" in devices


def test_portable_wheel_runs_with_the_baseline_cpu_variant(sdist, tmp_path):
    """GGML_HYBRID_PORTABLE=1: one CPU library per x86-64 level, GGML loads the best; with only the baseline
    (x64: SSE2, which every x86-64 CPU has) left, as on the oldest CPU, the install still runs."""
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, sdist], cwd=tmp_path,
         timeout=3600, GGML_HYBRID_PORTABLE="1")
    (wheel,) = wheels.glob("ggml_hybrid-*.whl")
    with zipfile.ZipFile(wheel) as z:
        variants = sorted(Path(n).name for n in z.namelist() if "/lib/libggml-cpu" in n)
    assert "libggml-cpu-x64.so" in variants and "libggml-cpu-haswell.so" in variants and len(variants) >= 8
    assert "libggml-cpu.so.0" not in variants
    bin_dir = _fresh_venv(tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _run([bin_dir / "python", "-m", "pip", "install", "-q", wheel], cwd=elsewhere)
    which = [bin_dir / "python", "-c", "from ggml_hybrid.ggml.backend import cpu_library; print(cpu_library())"]
    best = Path(_run(which, cwd=elsewhere).stdout.strip())
    assert best.name in variants and best.name != "libggml-cpu-x64.so"  # this machine has at least SSE4.2
    for v in best.parent.glob("libggml-cpu-*.so"):
        if v.name != "libggml-cpu-x64.so":
            v.unlink()
    assert Path(_run(which, cwd=elsewhere).stdout.strip()).name == "libggml-cpu-x64.so"
    _demo(bin_dir, elsewhere)
