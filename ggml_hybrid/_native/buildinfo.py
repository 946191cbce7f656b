"""Fingerprints of what the native module is built from.

Pure Python and free of imports from the package, so that the build (``ggml_hybrid_build``) can load
it by path before the package exists, and the package can check at import that
the compiled module matches the sources next to it: the cdef headers, our C
sources, the pinned GGML version and the patch series.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
CDEF_DIR = NATIVE_DIR / "cdef"
# Declarations of functions that only exist once our patch series is applied.
CDEF_PATCHED_DIR = CDEF_DIR / "patched"
# ggml-hybrid's own C, compiled into the module next to GGML.
SRC_DIR = NATIVE_DIR / "src"
# Present in a source checkout (editable install), absent from a wheel.
REPO_DIR = NATIVE_DIR.parent.parent
VENDOR_DIR = REPO_DIR / "vendor"
# The compiled cffi module: ggml_hybrid._native.<MODULE>
MODULE = "_ggml"
UPSTREAM_MODULE = "_ggml_upstream"
# GGML's shared libraries next to the module: ggml-base, ggml (the registry) and the CPU backend (one
# library built for this CPU, or one per x86-64 feature level in a portable build, the best loaded).
LIB_DIR = NATIVE_DIR / "lib"
# Optional backends (libggml-cuda.so, ...), loaded at run time when present and usable.
BACKEND_DIR = NATIVE_DIR / "backends"
# Bump when ggml-base's binary interface changes in a way the pin, the patch series and the ABI probe
# (abiprobe.py: layouts, enum values, signatures, inline code and macros of the headers) do not show, such as
# a patch that changes what a function of ggml-base does for a backend library without changing its signature.
ABI_SCHEME = "2"


def _digest(parts: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def patch_files(vendor_dir: Path = VENDOR_DIR) -> list[Path]:
    """The patch series in the order it is applied (numbered file names)."""
    return sorted((vendor_dir / "patches").glob("*.patch"))


def patch_series_hash(vendor_dir: Path = VENDOR_DIR) -> str:
    return _digest([(p.name, p.read_bytes()) for p in patch_files(vendor_dir)])


def cdef_files(patched: bool = True) -> list[Path]:
    """cdef headers in the fixed order they are concatenated in."""
    files = sorted(CDEF_DIR.glob("*.h"))
    if patched:
        files += sorted(CDEF_PATCHED_DIR.glob("*.h"))
    return files


def c_sources() -> list[Path]:
    """Our C files (``.c`` compiled, ``.h`` included), in name order."""
    return sorted(p for p in SRC_DIR.iterdir() if p.suffix in (".c", ".h"))


def source_hash(patched: bool = True) -> str:
    """What the module's interface and our C depend on: the cdef headers and the C sources."""
    files = cdef_files(patched) + c_sources()
    return _digest([(p.relative_to(NATIVE_DIR).as_posix(), p.read_bytes()) for p in files])


# GGML's own headers of ggml-base and the registry; any other include/ggml-NAME.h is a backend's
_BASE_HEADERS = frozenset({"ggml.h", "gguf.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpp.h", "ggml-opt.h"})
_BACKEND_FOLDER = re.compile(r"src/ggml-[a-z0-9_]+/.+")
_HEADER = re.compile(r"include/[^/]+\.h")


def patched_paths(patch: Path) -> list[str]:
    """The files a patch changes, relative to GGML's folder (the patches are applied with -p1)."""
    paths = []
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t")[0].strip()
            if path != "/dev/null":
                paths.append(path.split("/", 1)[1] if "/" in path else path)
    return sorted(set(paths))


def touches_ggml_base(patch: Path) -> bool:
    """False only for a patch confined to backends' own files (src/ggml-NAME/, include/ggml-NAME.h), which
    leaves ggml-base's binary interface as it is; a patch that names no file counts as touching it."""
    paths = patched_paths(patch)
    backend_only = all(_BACKEND_FOLDER.fullmatch(p) or (_HEADER.fullmatch(p) and p[len("include/"):] not in
                                                        _BASE_HEADERS) for p in paths)
    return not (paths and backend_only)


def touches_backend(patch: Path, name: str) -> bool:
    """Whether a patch changes the files of backend ``name`` (src/ggml-NAME/, include/ggml-NAME.h)."""
    return any(p.startswith(f"src/ggml-{name}/") or p == f"include/ggml-{name}.h" for p in patched_paths(patch))


def patches_hash(patches: list[Path]) -> str:
    """The names and contents of ``patches``, in order."""
    return _digest([(p.name, p.read_bytes()) for p in patches])


def pin_abi_stamp(vendor_dir: Path = VENDOR_DIR) -> str:
    """The binary interface of the pin's ggml-base as a backend library sees it. ggml-base carries it while the
    patch series keeps that interface (the build's ABI probe), and so does every backend library built from the
    pin and its own patches: such a library is built once per pin, whatever the series does to ggml-base's code."""
    pin = (vendor_dir / "pin.json").read_bytes()
    return _digest([("pin", pin), ("scheme", ABI_SCHEME.encode())])[:16]


def series_abi_stamp(vendor_dir: Path = VENDOR_DIR) -> str:
    """ggml-base's stamp when the patch series changes the interface the pin's headers give a backend (the build's
    ABI probe found a difference): the pin and the patches that touch ggml-base (a patch confined to one backend,
    such as the RPC client's, leaves it as it is). Every backend library is then built with those patches."""
    pin = (vendor_dir / "pin.json").read_bytes()
    base = [p for p in patch_files(vendor_dir) if touches_ggml_base(p)]
    return _digest([("pin", pin), ("patches", patches_hash(base).encode()), ("scheme", ABI_SCHEME.encode())])[:16]


def load_pin(vendor_dir: Path = VENDOR_DIR) -> dict:
    return json.loads((vendor_dir / "pin.json").read_text())
