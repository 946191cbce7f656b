"""The optional backends' libraries (``libggml-NAME.so``, loaded by GGML at run time): each built in a tree of its own,
or adopted into that tree from a library built elsewhere (``GGML_HYBRID_NAME_LIB``)."""

from __future__ import annotations

import os
from pathlib import Path

from . import abi, cmake, paths, progress
from .options import BACKENDS, Options


def build_backend(name: str, opts: Options) -> Path:
    """The backend's library (``libggml-NAME.so``), built in a tree of its own, or adopted into that tree from a
    library built elsewhere (``GGML_HYBRID_NAME_LIB``)."""
    args = opts.backend_args(name)
    prebuilt = os.environ.get(f"{BACKENDS[name].switch}_LIB")
    if prebuilt:
        where = adopt_backend(name, Path(prebuilt), args)
    else:
        where = cmake.build_tree(f"backend-{name}", args, opts, abi.backend_patches(name), targets=(f"ggml-{name}",))
    lib = where / "out" / f"libggml-{name}.so"
    if not lib.exists():
        raise SystemExit(f"the {name} build in {where} made no {lib.name}; delete that folder and rebuild")
    return lib


def adopt_backend(name: str, lib: Path, args: list[str]) -> Path:
    """Put a backend library built elsewhere (another machine, or an earlier tree whose folder name no longer
    matches) into the cache folder a build with ``args`` would use, so that later builds (a wheel from the
    sdist, a rebuild) take it from there. It must carry this checkout's ABI stamp; the folder's own build, if
    finished, is kept."""
    where = cmake.tree_folder(f"backend-{name}", args, abi.backend_patches(name))
    with paths.locked(where):
        if (where / "DONE").exists():
            progress.log(f"the {name} backend is already built in {where}; {lib} is not adopted")
            return where
        check_backend_library(name, lib)
        out = where / "out"
        out.mkdir(parents=True, exist_ok=True)
        cmake.strip_into(lib, out / f"libggml-{name}.so")
        (where / "DONE").write_text(" ".join(args) + f"\nadopted from {lib.resolve()}\n")
        progress.log(f"adopted {lib} as the {name} backend of {where}")
    return where


def check_backend_library(name: str, lib: Path) -> None:
    """A shared library that exports the stamp function with this checkout's ABI stamp in it (the loader checks
    the stamp again by calling it, before GGML sees the library)."""
    try:
        data = lib.read_bytes()
    except OSError as e:
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: cannot read it ({e.strerror})") from None
    stamp = abi.abi_stamp()
    if not data.startswith(b"\x7fELF"):
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: not a shared library (no ELF header)")
    if b"ggml_hybrid_backend_abi" not in data or stamp.encode() not in data:
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: not built against this checkout's ggml-base "
                         f"(ABI stamp {stamp} not in it); build it with `python -m ggml_hybrid_build --{name}`")
