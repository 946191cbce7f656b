"""The CUDA backend library, when this install has one (``GGML_HYBRID_CUDA=1``): it loads into this ggml-base,
registers its devices or says in one line why there are none, and the package runs on the CPU either way.

Skipped without ``_native/backends/libggml-cuda.so`` (CI builds none: the CUDA compile takes hours on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ggml_hybrid as gh
from ggml_hybrid._native import buildinfo
from ggml_hybrid._native.backends import optional_backends
from ggml_hybrid.cli import main
from ggml_hybrid.errors import BackendError

ROOT = Path(__file__).resolve().parents[1]
CUDA_LIB = buildinfo.BACKEND_DIR / "libggml-cuda.so"

pytestmark = pytest.mark.skipif(not CUDA_LIB.exists(), reason="this install has no CUDA backend")


def test_cuda_backend_gives_devices_or_one_reason():
    st = optional_backends()["CUDA"]
    assert st.path == str(CUDA_LIB)
    lines = [ln for ln in CliRunner().invoke(main, ["devices"]).output.splitlines() if "CUDA" in ln]
    if st.devices:
        assert gh.cuda_available() and gh.cuda(0).name == "CUDA0"
        assert lines[0].startswith("CUDA0")
        return
    assert not gh.cuda_available()
    assert st.detail  # why: a missing runtime library, or GGML's reason for finding no device
    with pytest.raises(BackendError) as exc:
        gh.cuda(0)
    assert str(exc.value) == st.summary()
    assert lines == [st.summary()]  # `devices`: exactly one line about CUDA
    # and the package runs on the CPU
    assert [d.name for d in gh.devices()][-1] == "CPU"


def _cublas_dirs() -> list[str]:
    cache = subprocess.run([sys.executable, "-m", "ggml_hybrid_build", "--print-cache"], capture_output=True,
                           text=True, check=True, cwd=ROOT).stdout.strip()
    return [str(p) for p in sorted(Path(cache).glob("cublas-*/nvidia/*/lib"))]


def test_with_its_runtime_the_library_loads_into_this_ggml_base():
    """With the CUDA runtime and cuBLAS on the loader's path, the library loads (every symbol resolves against
    the package's ggml-base) and GGML registers its devices, or reports why it has none (no GPU, no driver)."""
    if not (ROOT / "ggml_hybrid_build").is_dir():
        pytest.skip("needs the checkout's build cache (the cuBLAS the backend was linked against)")
    dirs = _cublas_dirs() + [d for d in ("/usr/local/cuda/lib64",) if os.path.isdir(d)]
    if not dirs:
        pytest.skip("no cuBLAS from the build cache and no CUDA toolkit here")
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(dirs + [os.environ.get("LD_LIBRARY_PATH", "")]))
    code = ("from ggml_hybrid._native.backends import optional_backends; st = optional_backends()['CUDA']; "
            "print(st.loaded, st.devices); print(st.summary())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    loaded, devices = res.stdout.splitlines()[0].split()
    summary = res.stdout.splitlines()[1]
    assert loaded == "True", summary
    assert int(devices) > 0 or "no device" in summary and "CUDA" in summary
