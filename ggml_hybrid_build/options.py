"""What a build is asked for (backends, portability, CUDA architectures) and the CMake options of each tree it makes:
the core (ggml-base, ggml, the CPU backend), the pin's CPU backend alone, and each optional backend."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import abi, cuda, paths

# Bump when the way GGML is configured or linked changes, to invalidate caches.
BUILD_SCHEME = "4"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Options:
    backends: tuple[str, ...] = ()  # optional backends, names in BACKENDS
    portable: bool = False  # every x86-64 CPU variant, the best chosen at run time (instead of -march=native)
    cuda_arch: str = "90"
    patched: bool = True  # False builds upstream GGML, static, for the overhead benchmark
    build_type: str = "Release"
    jobs: int = os.cpu_count() or 2

    def common_args(self, abi_stamp: str | None = None) -> list[str]:
        abi_stamp = abi_stamp or (abi.abi_stamp() if self.patched else "upstream")
        return [f"-DCMAKE_BUILD_TYPE={self.build_type}", "-DGGML_CCACHE=OFF", f"-DGGML_HYBRID_ABI={abi_stamp}"]

    def core_args(self) -> list[str]:
        """ggml-base, ggml and the CPU backend."""
        args = self.common_args() + [
            # a persistent CPU worker needs its own threadpool; OpenMP would ignore it
            "-DGGML_OPENMP=OFF",
            # llama.cpp's default, so our CPU kernels match the reference
            "-DGGML_LLAMAFILE=ON",
        ]
        if not self.patched:
            # linked into its own module, so that it loads next to the patched build in one process
            return args + ["-DBUILD_SHARED_LIBS=OFF", "-DGGML_BACKEND_DL=OFF", "-DGGML_NATIVE=ON"]
        if self.portable:
            return args + ["-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_NATIVE=OFF",
                           "-DGGML_CPU_ALL_VARIANTS=ON"]
        # GGML refuses -march=native with dynamically loaded CPU backends: this one is linked to ggml
        return args + ["-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=OFF", "-DGGML_NATIVE=ON"]

    def pin_cpu_args(self) -> list[str]:
        """The CPU backend of the unpatched pin as a library GGML loads at run time, for this CPU as the core's is
        (``-march=native``, which GGML refuses to set itself for a loadable CPU backend; its x86 feature options off,
        so nothing else is added), stamped with the pin's ABI: it loads into our ggml-base only while the patch
        series keeps the interface the pin's headers give a backend (tests/test_pin_backend.py)."""
        features = ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX_VNNI", "AVX512")
        return self.common_args(paths.info.pin_abi_stamp(paths.VENDOR)) + [
            "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON",
            "-DGGML_NATIVE=OFF", "-DCMAKE_C_FLAGS=-march=native", "-DCMAKE_CXX_FLAGS=-march=native",
            *(f"-DGGML_{f}=OFF" for f in features)]

    def backend_args(self, name: str) -> list[str]:
        """One optional backend alone, as a library GGML loads at run time (no CPU backend in its tree)."""
        return self.common_args(abi.abi_stamp_of(abi.backend_patches(name), paths.VENDOR)) + [
            "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU=OFF",
                                     "-DGGML_NATIVE=OFF", *BACKENDS[name].cmake_args(self)]


@dataclass(frozen=True)
class BackendSpec:
    """An optional GGML backend: its switch and its CMake options; built by ``backend_libs.build_backend``."""

    switch: str  # the environment variable that asks for it (also ``python -m ggml_hybrid_build --NAME``)
    cmake_args: Callable[[Options], list[str]] = field(repr=False)


def _cuda_args(opts: Options) -> list[str]:
    return cuda.cmake_args(opts.cuda_arch)


def _vulkan_args(opts: Options) -> list[str]:
    # Debian: libvulkan-dev (headers, loader), glslc (shaders to SPIR-V) and spirv-headers; the library links
    # only the Vulkan loader (libvulkan.so.1), so it loads where no driver is installed (no device then)
    missing = [what for what, found in (("glslc", shutil.which("glslc")),
                                        ("vulkan/vulkan.hpp", _header("vulkan/vulkan.hpp")),
                                        ("spirv/unified1/spirv.hpp", _header("spirv/unified1/spirv.hpp")))
               if not found]
    if missing:
        raise SystemExit(f"the Vulkan backend needs {', '.join(missing)}: on Debian/Ubuntu "
                         "`apt-get install libvulkan-dev glslc spirv-headers`")
    return ["-DGGML_VULKAN=ON"]


def _header(name: str) -> bool:
    return any((Path(d) / name).exists() for d in ("/usr/include", "/usr/local/include",
                                                    *os.environ.get("CPATH", "").split(os.pathsep)) if d)


# Optional backends by name. Adding one is one line: its switch and its CMake options.
BACKENDS: dict[str, BackendSpec] = {
    "cuda": BackendSpec("GGML_HYBRID_CUDA", _cuda_args),
    "vulkan": BackendSpec("GGML_HYBRID_VULKAN", _vulkan_args),
}


def options_from_env() -> Options:
    return Options(backends=tuple(n for n, spec in BACKENDS.items() if env_flag(spec.switch)),
                   portable=env_flag("GGML_HYBRID_PORTABLE"),
                   cuda_arch=os.environ.get("GGML_HYBRID_CUDA_ARCH", "90"))
