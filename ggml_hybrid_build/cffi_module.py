"""The cffi extension (API mode, out-of-line): the cdef headers compiled against the patched GGML headers with our C
(``ggml_hybrid/_native/src``), linked to ggml-base and ggml; cached next to the GGML build it links."""

from __future__ import annotations

import hashlib
import shutil
import sysconfig
import tempfile
from pathlib import Path

from . import abi, paths, progress
from .options import Options


def static_libs(core: Path) -> list[str]:
    # order matters for the static linker: users before what they use
    names = ["libggml.a", "libggml-rpc.a", "libggml-cpu.a", "libggml-base.a"]
    found = {p.name: p for p in (core / "build").rglob("*.a")}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"GGML build in {core} lacks {missing}; delete that folder and rebuild")
    return [str(found[n]) for n in names]


def shared_libs(core: Path) -> list[str]:
    """ggml-base and ggml, which the module links; the CPU and RPC backends are reached through ggml's registry."""
    libs = [p for stem in ("libggml-base", "libggml") for p in sorted((core / "out").glob(f"{stem}.so.*"))]
    if len(libs) != 2:
        raise SystemExit(f"GGML build in {core} lacks libggml-base.so.N or libggml.so.N; delete it and rebuild")
    return [str(p) for p in libs]


def cdef_source(patched: bool) -> str:
    """The cdef headers in their fixed order, each under a comment naming it."""
    return "\n".join(f"/* {p.name} */\n" + p.read_text() for p in paths.info.cdef_files(patched))


def module_name(opts: Options) -> str:
    return str(paths.info.MODULE if opts.patched else paths.info.UPSTREAM_MODULE)


def build_cffi(core: Path, opts: Options) -> Path:
    """Compile the cffi extension (our C in ``_native/src``); cached next to the GGML build it links."""
    info = paths.info
    pin = info.load_pin()
    name = module_name(opts)
    patch_hash = info.patch_series_hash() if opts.patched else "unpatched"
    source_hash = info.source_hash(opts.patched)
    stamp = abi.abi_stamp() if opts.patched else "upstream"
    cdef = cdef_source(opts.patched)
    includes = ["math.h", "ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h", "ggml-opt.h"]  # math.h: logf
    includes += [p.name for p in info.c_sources() if p.suffix == ".h"]  # ours: the cdef declares from them
    preamble = "\n".join(f'#include "{h}"' for h in includes) + "\n"
    macros = [("HY_GGML_VERSION", f'"{pin["ggml_version"]}"'), ("HY_PATCH_HASH", f'"{patch_hash}"'),
              ("HY_SOURCE_HASH", f'"{source_hash}"'), ("GGML_HYBRID_ABI", f'"{stamp}"')]
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256((cdef + preamble + repr(macros) + core.name + ext).encode()).hexdigest()[:16]
    cached = core / "cffi" / key / f"{name}{ext}"
    with paths.locked(cached.parent):
        if not cached.exists():
            _compile_cffi(core, opts, name, cdef, preamble, macros, cached)
    return cached


def _compile_cffi(core: Path, opts: Options, name: str, cdef: str, preamble: str, macros: list[tuple[str, str]],
                  cached: Path) -> None:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    if opts.patched:
        # ggml-base and ggml next to the module, in lib/ (its run path)
        objects, link = shared_libs(core), ["-Wl,-rpath,$ORIGIN/lib", "-ldl"]
    else:
        objects, link = static_libs(core), ["-Wl,--exclude-libs,ALL", "-lstdc++", "-lm", "-lpthread", "-ldl"]
    ffi.set_source(
        f"ggml_hybrid._native.{name}",
        preamble,
        sources=[str(p) for p in paths.info.c_sources() if p.suffix == ".c"],
        include_dirs=[str(paths.info.SRC_DIR), str(core / "ggml" / "include"), str(core / "ggml" / "src")],
        define_macros=macros,
        extra_objects=objects,
        extra_link_args=link,
        extra_compile_args=["-O2", "-Wall", "-Wno-unused-function", "-Werror=incompatible-pointer-types",
                            "-Werror=int-conversion", "-Werror=implicit-function-declaration"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        progress.stage(f"compiling the cffi module {name}")
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, cached)
