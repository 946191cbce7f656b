"""GGML built with CMake through ``vendor/CMakeLists.txt``, each tree in a cache folder keyed by what it is made
from."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

from . import patches as series
from . import paths, progress
from .options import BUILD_SCHEME, Options


def ggml_key(args: list[str], patches: list[Path] | None) -> str:
    """The cache key of a build tree: the pin, the CMake wrapper, the patches its source was made with (None: the
    unpatched upstream build of the overhead benchmark) and its options (the ABI stamp among them)."""
    h = hashlib.sha256()
    h.update((paths.VENDOR / "pin.json").read_bytes())
    h.update((paths.VENDOR / "CMakeLists.txt").read_bytes())
    if patches is None:
        h.update(b"unpatched")
    else:
        h.update(paths.info.patches_hash(patches).encode())
    h.update(" ".join(args).encode())
    h.update(BUILD_SCHEME.encode())
    return h.hexdigest()[:16]


def tree_folder(kind: str, args: list[str], patches: list[Path] | None) -> Path:
    """The cache folder of the tree ``kind`` built with ``args`` from the pin and ``patches``."""
    pin = paths.info.load_pin()
    return paths.cache_root() / f"{kind}-{pin['ggml_version']}-{ggml_key(args, patches)}"


def build_tree(kind: str, args: list[str], opts: Options, patches: list[Path] | None,
               targets: tuple[str, ...] = ()) -> Path:
    """Configure and build GGML with ``args`` (or reuse that build); returns its cache folder, whose
    ``out/`` holds the shared libraries it made, stripped."""
    where = tree_folder(kind, args, patches)
    with paths.locked(where):
        _build_tree(where, paths.info.load_pin(), args, opts, patches, targets)
    return where


def _build_tree(where: Path, pin: dict[str, Any], args: list[str], opts: Options, patches: list[Path] | None,
                targets: tuple[str, ...]) -> None:
    stamp = where / "DONE"
    if stamp.exists():
        progress.log(f"GGML up to date in {where}")
        return
    # an interrupted build resumes: the source is extracted whole or not at all, CMake and Ninja are incremental
    if not (where / "ggml").is_dir():
        where.mkdir(parents=True, exist_ok=True)
        progress.stage(f"fetching GGML {pin['ggml_version']} (the pinned source) and applying the patch series")
        series.prepare_source(pin, where / "ggml", patches)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    progress.stage("configuring GGML with CMake")
    progress.run(["cmake", "-S", str(paths.VENDOR), "-B", str(where / "build"), *generator,
                  f"-DGGML_HYBRID_SOURCE={where / 'ggml'}", *args])
    only = [a for t in targets for a in ("--target", t)]
    progress.stage(f"compiling GGML on {opts.jobs} cores (the first build only; later installs reuse it from "
                   f"{paths.cache_root()})")
    progress.run_with_progress(["cmake", "--build", str(where / "build"), "--parallel", str(opts.jobs), *only],
                               "compiling GGML")
    collect_libraries(where / "build" / "bin", where / "out")
    stamp.write_text(" ".join(args) + "\n")
    progress.stage("GGML built")


def strip_into(src: Path, dest: Path) -> None:
    """A shared library copied without its symbols for debugging (a plain copy where there is no ``strip``)."""
    strip = shutil.which("strip")
    if strip:
        progress.run([strip, "--strip-unneeded", "-o", str(dest), str(src)])
    else:
        shutil.copy2(src, dest)


def collect_libraries(bin_dir: Path, out: Path) -> None:
    """The shared libraries of a build, each under the name the loader looks for (its soname), stripped."""
    out.mkdir(parents=True, exist_ok=True)
    if not bin_dir.is_dir():
        return  # a static build
    for p in sorted(bin_dir.iterdir()):
        # libggml-base.so.0 -> libggml-base.so.0.25.3 (a versioned shared library); libggml-cuda.so (a module)
        versioned = p.is_symlink() and re.fullmatch(r"lib.+\.so\.\d+", p.name)
        module = not p.is_symlink() and p.name.endswith(".so")
        if versioned or module:
            strip_into(p.resolve(), out / p.name)


def build_core(opts: Options) -> Path:
    """ggml-base, ggml and the CPU backend (and the RPC backend), patched; or upstream's, static, unpatched."""
    if not opts.patched:
        return build_tree("ggml-upstream", opts.core_args(), opts, None)
    return build_tree("ggml", opts.core_args(), opts, paths.info.patch_files())


def build_pin_cpu(opts: Options) -> Path:
    """The CPU backend library of the unpatched pin (``libggml-cpu.so``, loadable), cached like the other builds:
    tests/test_pin_backend.py loads it into our ggml-base and runs the op tests through it."""
    where = build_tree("pin-cpu", opts.pin_cpu_args(), opts, [], targets=("ggml-cpu",))
    lib = where / "out" / "libggml-cpu.so"
    if not lib.exists():
        raise SystemExit(f"the pin's CPU build in {where} made no {lib.name}; delete that folder and rebuild")
    return lib
