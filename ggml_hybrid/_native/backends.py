"""Optional GGML backends (CUDA, Vulkan): the libraries in ``_native/backends``, loaded on first use.

``python -m ggml_hybrid_build --cuda`` builds the CUDA backend as a library GGML loads at run time (``GGML_BACKEND_DL``)
rather than into the module, so the same install imports and runs everywhere:

- no library (a CPU-only build): the package runs on the CPU;
- the library cannot load (its vendor runtime, e.g. ``libcudart.so.13``, is missing): the CPU, and the
  status says which file is missing. Before giving up, the runtime is looked for where pip's NVIDIA wheels
  (``site-packages/nvidia/*/lib``) and the toolkit (``$CUDA_HOME/lib64``, ``/usr/local/cuda/lib64``) put it;
- the library loads but finds no device (no GPU, no driver): the CPU, and the status carries GGML's reason;
- a library built against another ggml-base (another pin or patch series) is refused, never loaded.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import buildinfo
from ._ggml import ffi, lib

_ERR_BYTES = 2048
_MISSING = re.compile(r"(lib[^\s:/]+\.so[.\d]*): cannot open shared object file")


@dataclass(frozen=True)
class BackendStatus:
    """What became of one optional backend library."""

    name: str  # GGML's registry name ("CUDA"), or the file's ("CUDA" from libggml-cuda.so) when it did not load
    path: str  # the library file
    loaded: bool
    devices: int  # devices it registered (0 when not loaded or none found)
    detail: str  # why it did not load, or why it found no device; "" when it has devices

    def summary(self) -> str:
        """One line: what a user needs to know about this backend."""
        if self.devices:
            return f"{self.name}: {self.devices} device(s) ({self.path})"
        if self.loaded:
            return f"{self.name}: backend loaded, no device ({self.detail}); running on the CPU"
        return f"{self.name}: backend not loaded ({self.detail}); running on the CPU"


_lock = threading.Lock()
_status: dict[str, BackendStatus] | None = None
_preloaded: list[ctypes.CDLL] = []  # vendor runtime libraries loaded for a backend: kept for the process


def optional_backends() -> dict[str, BackendStatus]:
    """Every optional backend library of this install by name, loaded (once, on the first call) if usable."""
    global _status
    with _lock:
        if _status is None:
            found = {}
            for path in sorted(buildinfo.BACKEND_DIR.glob("libggml-*.so")):
                st = load_backend(path)
                found[st.name] = st
            _status = found
        return dict(_status)


# GGML's registry names of the optional backends, by library file (libggml-vulkan.so registers "Vulkan")
REGISTRY_NAMES = {"cuda": "CUDA", "vulkan": "Vulkan"}
# A Vulkan driver of device type CPU (Mesa's lavapipe) is skipped by GGML unless named by index
_VK_CPU_HINT = ("GGML uses a CPU Vulkan driver such as Mesa's lavapipe only when it is named: "
                "GGML_VK_VISIBLE_DEVICES=0")


def load_backend(path: Path) -> BackendStatus:
    """Load one backend library (see the module docstring); never raises for a library that cannot load."""
    return load_backend_reg(path)[0]


def load_backend_reg(path: Path) -> tuple[BackendStatus, Any]:
    """:func:`load_backend`, and the registry GGML made of the library (NULL when it did not load)."""
    stem = path.name[len("libggml-"):-len(".so")]
    name = REGISTRY_NAMES.get(stem, stem.upper())
    err = ffi.new("char[]", _ERR_BYTES)
    tried: set[str] = set()
    while True:
        reg = lib.hy_backend_load(str(path).encode(), err, _ERR_BYTES)
        if reg != ffi.NULL:
            break
        why = ffi.string(err).decode(errors="replace").strip()
        missing = _MISSING.search(why)
        # a vendor library the loader did not find on its own: load it from where pip or the toolkit put it
        if missing is None or missing.group(1) in tried or not _preload(missing.group(1)):
            if name == "Vulkan" and "ggml_backend_init returned NULL" in why:
                # GGML's Vulkan backend gives no registry when it cannot create a Vulkan instance
                why = ("no usable Vulkan driver: the Vulkan loader found none (driver files in "
                       "/usr/share/vulkan/icd.d, or VK_DRIVER_FILES), or none could create an instance")
            return BackendStatus(name, str(path), False, 0, why), ffi.NULL
        tried.add(missing.group(1))
    n = int(lib.ggml_backend_reg_dev_count(reg))
    reg_name = ffi.string(lib.ggml_backend_reg_name(reg)).decode()
    log = ffi.string(lib.hy_backend_load_log()).decode(errors="replace")
    why = "" if n else _reason(log)
    if not n and reg_name == "Vulkan" and "GGML_VK_VISIBLE_DEVICES" not in os.environ:
        why += f"; {_VK_CPU_HINT}"
    return BackendStatus(reg_name, str(path), True, n, why), reg


def _reason(log: str) -> str:
    """GGML's last complaint while loading ("failed to initialize CUDA: no CUDA-capable device is detected")."""
    # GGML's own note that it loaded the library says nothing about devices
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not ln.startswith("load_backend: loaded")]
    errors = [ln for ln in lines if "fail" in ln.lower() or "error" in ln.lower()]
    return (errors or lines or ["no device found"])[-1]


def runtime_dirs() -> list[Path]:
    """Where a vendor runtime may live besides the loader's own path: pip's NVIDIA wheels, then the toolkit."""
    dirs = []
    for entry in sys.path:
        nvidia = Path(entry or os.curdir) / "nvidia"
        if nvidia.is_dir():
            dirs += sorted(nvidia.glob("*/lib"))
    homes = [Path(os.environ[e]) for e in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(e)]
    for home in [*homes, Path("/usr/local/cuda")]:
        dirs += [home / "lib64", home / "lib"]
    return [d for d in dirs if d.is_dir()]


def _preload(soname: str, seen: frozenset[str] = frozenset()) -> bool:
    """Load ``soname`` from :func:`runtime_dirs`, first what it needs in turn (libcublas needs libcublasLt)."""
    if soname in seen:
        return False
    for d in runtime_dirs():
        candidate = d / soname
        while candidate.exists():
            try:
                _preloaded.append(ctypes.CDLL(str(candidate)))
                return True
            except OSError as exc:
                needed = _MISSING.search(str(exc))
                if needed is None or not _preload(needed.group(1), seen | {soname}):
                    break
    return False


__all__ = ["REGISTRY_NAMES", "BackendStatus", "load_backend", "load_backend_reg", "optional_backends", "runtime_dirs"]
