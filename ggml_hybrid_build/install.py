"""The build's result put into the package: the cffi module, GGML's libraries in ``_native/lib``, the optional
backends in ``_native/backends`` and the module's type stub; and the whole build, step by step."""

from __future__ import annotations

import shutil
from pathlib import Path

from . import backend_libs, cffi_module, cmake, paths, progress, stub
from .options import Options


def replace_file(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src``: copied then renamed, so a running interpreter never maps a half-written
    file."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copy2(src, tmp)
    tmp.replace(dst)


def _sync_dir(files: list[Path], dest: Path) -> None:
    """dest holds exactly ``files`` among GGML's libraries (libggml*), nothing else of ours."""
    dest.mkdir(parents=True, exist_ok=True)
    names = {f.name for f in files}
    for old in dest.glob("libggml*"):
        if old.name not in names:
            old.unlink()
    for f in files:
        replace_file(f, dest / f.name)


def install(module: Path, core: Path, backends: list[Path], out_dir: Path, patched: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    if patched:
        _sync_dir(sorted((core / "out").iterdir()), out_dir / "lib")
        _sync_dir(backends, out_dir / "backends")
    target = out_dir / module.name
    replace_file(module, target)
    stub.write_stub(target, cffi_module.cdef_source(patched), out_dir / f"{module.name.split('.')[0]}.pyi")
    progress.log(f"installed {target}" + "".join(f", {b.name}" for b in backends))
    return target


def build(opts: Options, out_dir: Path | None = None) -> Path:
    """The whole build: GGML's core, the optional backends, the cffi module, installed into ``out_dir`` (the package's
    ``_native`` folder by default)."""
    core = cmake.build_core(opts)
    backends = [backend_libs.build_backend(name, opts) for name in opts.backends]
    module = cffi_module.build_cffi(core, opts)
    return install(module, core, backends, out_dir or paths.NATIVE, opts.patched)
