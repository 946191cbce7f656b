"""The CUDA toolkit a CUDA backend is built with, and cuBLAS from its wheel when the toolkit has none."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from . import paths, progress


def cmake_args(arch: str) -> list[str]:
    """The CMake options of a CUDA backend for ``CMAKE_CUDA_ARCHITECTURES=arch``."""
    home = cuda_home()
    version = nvcc_version(home / "bin" / "nvcc")
    args = [f"-DCMAKE_CUDA_COMPILER={home / 'bin' / 'nvcc'}", f"-DCUDAToolkit_ROOT={home}", "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            # only the kernels the project uses: no FA for every head size and quant pair
            "-DGGML_CUDA_FA_ALL_QUANTS=OFF", "-DGGML_CUDA_NCCL=OFF",
            # no link to the driver library (libcuda.so.1): the library then loads where the driver is missing
            # (the CUDA runtime reports "no device" instead), and a toolkit without its stubs can build it
            "-DGGML_CUDA_NO_VMM=ON"]
    if not (home / "include" / "cublas_v2.h").exists():
        args += cublas_from_wheel(version)
    return args


def cuda_home() -> Path:
    """The CUDA toolkit: $CUDA_HOME or $CUDA_PATH, else /usr/local/cuda, else the one of the nvcc on PATH."""
    candidates = [Path(os.environ[e]) for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    nvcc = shutil.which("nvcc")
    candidates += [Path("/usr/local/cuda")] + ([Path(nvcc).resolve().parent.parent] if nvcc else [])
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return home.resolve()
    raise SystemExit("the CUDA backend needs the CUDA toolkit (nvcc and its headers): set CUDA_HOME")


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise SystemExit(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def cublas_from_wheel(version: tuple[int, int]) -> list[str]:
    """cuBLAS headers and libraries from the nvidia-cublas wheel of the toolkit's release (a toolkit
    installed without cuBLAS); downloaded once into the cache. Returns the CMake options that point to it."""
    major, minor = version
    dest = paths.cache_root() / f"cublas-{major}.{minor}"
    with paths.locked(dest):
        _fetch_cublas(major, minor, dest)
    include = next(dest.glob("nvidia/*/include"))
    libdir = include.parent / "lib"
    return [f"-DGGML_HYBRID_CUBLAS_INCLUDE={include}", f"-DCUDA_cublas_LIBRARY={libdir / f'libcublas.so.{major}'}",
            f"-DCUDA_cublasLt_LIBRARY={libdir / f'libcublasLt.so.{major}'}"]


def _fetch_cublas(major: int, minor: int, dest: Path) -> None:
    if not (dest / "DONE").exists():
        downloads = paths.cache_root() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        wheels = sorted(downloads.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
        if not wheels:
            progress.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                          f"nvidia-cublas=={major}.{minor}.*", "-d", str(downloads)])
            wheels = sorted(downloads.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
        if not wheels:
            raise SystemExit(f"pip found no nvidia-cublas {major}.{minor} wheel for this CUDA toolkit")
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(dest, [n for n in z.namelist() if "/include/" in n or "/lib/libcublas" in n])
        (dest / "DONE").write_text(wheels[-1].name + "\n")
