#!/usr/bin/env python3
"""Build the native part of ggml-hybrid: the pinned GGML and the cffi module.

Steps, each cached:
1. fetch the registry archive named in ``vendor/pin.json`` with pip and check its sha256;
2. extract GGML from it and apply ``vendor/patches/*.patch`` in order;
3. build GGML with CMake (static, position independent) through ``vendor/CMakeLists.txt``;
4. compile the cffi extension (API mode, out-of-line) against the patched headers.

The GGML build lives in a cache folder keyed by the pin, the patch series, the
wrapper CMake file and the build options, so reinstalling with nothing changed
reuses it. ``python build.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENDOR = ROOT / "vendor"
PACKAGE = ROOT / "ggml_hybrid"
NATIVE = PACKAGE / "_native"
# Bump when the way GGML is configured or linked changes, to invalidate caches.
BUILD_SCHEME = "3"


def _load_buildinfo():
    # loaded by path: the package itself cannot be imported before it is built
    spec = importlib.util.spec_from_file_location("_ggml_hybrid_buildinfo", NATIVE / "buildinfo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


info = _load_buildinfo()


def log(msg: str) -> None:
    print(f"[ggml-hybrid build] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    env = os.environ.get("GGML_HYBRID_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-hybrid"


@dataclass(frozen=True)
class Options:
    cuda: bool = False
    cuda_arch: str = "90"
    patched: bool = True  # False builds upstream GGML, for the overhead benchmark
    build_type: str = "Release"
    jobs: int = os.cpu_count() or 2

    def cmake_args(self) -> list[str]:
        args = [
            f"-DCMAKE_BUILD_TYPE={self.build_type}",
            # a persistent CPU worker needs its own threadpool; OpenMP would ignore it
            "-DGGML_OPENMP=OFF",
            # llama.cpp's default, so our CPU kernels match the reference
            "-DGGML_LLAMAFILE=ON",
            "-DGGML_BACKEND_DL=OFF",
            "-DGGML_NATIVE=ON",
            "-DGGML_CCACHE=OFF",
            f"-DGGML_CUDA={'ON' if self.cuda else 'OFF'}",
        ]
        if self.cuda:
            args += [
                f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_arch}",
                # only the kernels the project uses: no FA for every head size
                "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
            ]
        return args


def ggml_key(opts: Options) -> str:
    h = hashlib.sha256()
    h.update((VENDOR / "pin.json").read_bytes())
    h.update((VENDOR / "CMakeLists.txt").read_bytes())
    h.update(info.patch_series_hash().encode() if opts.patched else b"unpatched")
    h.update(" ".join(opts.cmake_args()).encode())
    h.update(BUILD_SCHEME.encode())
    return h.hexdigest()[:16]


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def fetch_archive(pin: dict) -> Path:
    """The pinned sdist, downloaded once and checked against its sha256."""
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archive = downloads / pin["archive"]
    if not archive.exists() or _sha256(archive) != pin["sha256"]:
        with tempfile.TemporaryDirectory() as tmp:
            # `--no-binary NAME` rather than `:all:`: with `:all:` pip would also
            # build the sdist's build requirements (cmake) from source.
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin["package"],
                 f"{pin['package']}=={pin['version']}", "-d", tmp])
            got = Path(tmp) / pin["archive"]
            if not got.exists():
                raise SystemExit(f"pip did not produce {pin['archive']} (got {os.listdir(tmp)})")
            shutil.move(str(got), archive)
    digest = _sha256(archive)
    if digest != pin["sha256"]:
        archive.unlink()
        raise SystemExit(f"sha256 mismatch for {pin['archive']}: expected {pin['sha256']}, got {digest}")
    return archive


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_source(pin: dict, dest: Path, patched: bool) -> None:
    """Extract GGML from the archive into dest and apply the patch series."""
    archive = fetch_archive(pin)
    prefix = pin["ggml_path"].rstrip("/") + "/"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    if patched:
        for p in info.patch_files():
            log(f"applying {p.name}")
            run(["patch", "-p1", "--forward", "--batch", "-s", "-d", str(tmp), "-i", str(p)])
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def build_ggml(opts: Options) -> Path:
    """Build (or reuse) GGML; returns its cache folder."""
    pin = info.load_pin()
    where = cache_root() / f"ggml-{pin['ggml_version']}-{ggml_key(opts)}"
    stamp = where / "DONE"
    if stamp.exists():
        log(f"GGML up to date in {where}")
        return where
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    prepare_source(pin, where / "ggml", opts.patched)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(VENDOR), "-B", str(where / "build"), *generator,
         f"-DGGML_HYBRID_SOURCE={where / 'ggml'}", *opts.cmake_args()])
    run(["cmake", "--build", str(where / "build"), "--parallel", str(opts.jobs)])
    stamp.write_text(" ".join(opts.cmake_args()) + "\n")
    return where


def static_libs(ggml_dir: Path, opts: Options) -> list[str]:
    # order matters for the static linker: users before what they use
    names = ["libggml.a"] + (["libggml-cuda.a"] if opts.cuda else []) + ["libggml-rpc.a", "libggml-cpu.a",
                                                                         "libggml-base.a"]
    found = {p.name: p for p in (ggml_dir / "build").rglob("*.a")}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"GGML build in {ggml_dir} lacks {missing}; delete that folder and rebuild")
    return [str(found[n]) for n in names]


def cdef_source(patched: bool) -> str:
    return "\n".join(f"/* {p.name} */\n" + p.read_text() for p in info.cdef_files(patched))


def module_name(opts: Options) -> str:
    return info.MODULE if opts.patched else info.UPSTREAM_MODULE


def build_cffi(ggml_dir: Path, opts: Options, out_dir: Path) -> Path:
    """Compile the cffi extension (our C in ``_native/src`` plus GGML); cached next to the GGML build it links."""
    import cffi

    pin = info.load_pin()
    name = module_name(opts)
    patch_hash = info.patch_series_hash() if opts.patched else "unpatched"
    source_hash = info.source_hash(opts.patched)
    cdef = cdef_source(opts.patched)
    includes = ["math.h", "ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h"]  # math.h: libm's logf
    includes += [p.name for p in info.c_sources() if p.suffix == ".h"]  # ours: the cdef declares from them
    preamble = "\n".join(f'#include "{h}"' for h in includes) + "\n"
    macros = [("GGML_HYBRID_GGML_VERSION", f'"{pin["ggml_version"]}"'), ("GGML_HYBRID_PATCH_HASH", f'"{patch_hash}"'),
              ("GGML_HYBRID_SOURCE_HASH", f'"{source_hash}"')]
    if opts.cuda:
        macros.append(("GGML_HYBRID_CUDA", "1"))
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256((cdef + preamble + repr(macros) + ggml_dir.name + ext).encode()).hexdigest()[:16]
    cached = ggml_dir / "cffi" / key / f"{name}{ext}"
    if not cached.exists():
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        libs = static_libs(ggml_dir, opts)
        extra_link = ["-Wl,--exclude-libs,ALL", "-lstdc++", "-lm", "-lpthread"]
        if opts.cuda:
            extra_link += _cuda_link_args()
        ffi.set_source(
            f"ggml_hybrid._native.{name}",
            preamble,
            sources=[str(p) for p in info.c_sources() if p.suffix == ".c"],
            include_dirs=[str(info.SRC_DIR), str(ggml_dir / "ggml" / "include"), str(ggml_dir / "ggml" / "src")],
            define_macros=macros,
            extra_objects=libs,
            extra_link_args=extra_link,
            extra_compile_args=["-O2", "-Wall", "-Wno-unused-function", "-Werror=incompatible-pointer-types",
                                "-Werror=int-conversion", "-Werror=implicit-function-declaration"],
        )
        with tempfile.TemporaryDirectory() as tmp:
            log(f"compiling cffi module {name}")
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, cached)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}{ext}"
    # copy then rename, so a running interpreter never maps a half-written file
    tmp_target = target.with_suffix(".tmp")
    shutil.copy2(cached, tmp_target)
    tmp_target.replace(target)
    write_stub(cached, out_dir / f"{name}.pyi")
    log(f"installed {target}")
    return target


def write_stub(module: Path, out: Path) -> None:
    """A type stub of the compiled module, from what it exports: mypy then checks every ``lib.name``."""
    spec = importlib.util.spec_from_file_location(module.name.split(".")[0], module)  # PyInit_<name>
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = ['"""Generated by build.py from the compiled cffi module; do not edit."""', "",
             "from typing import Any", "", "import cffi", "", "ffi: cffi.FFI", "", "class _Lib:"]
    for n in sorted(x for x in dir(mod.lib) if not x.startswith("__")):
        v = getattr(mod.lib, n)
        lines.append(f"    {n}: int" if isinstance(v, int) else f"    def {n}(self, *args: Any) -> Any: ...")
    lines += ["", "lib: _Lib", ""]
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(out)


def _cuda_link_args() -> list[str]:
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    return [f"-L{cuda_home / 'lib64'}", "-lcudart", "-lcublas", "-lcublasLt", "-lcuda"]


@contextlib.contextmanager
def _lock(path: Path):
    """One build of a given thing at a time: a second one waits, then finds the first one's result.

    Keyed by what is built (one GGML configuration): builds of different configurations, e.g. a long
    CUDA build and a CPU one, never wait for each other.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(opts: Options, out_dir: Path = NATIVE) -> Path:
    pin = info.load_pin()
    with _lock(cache_root() / f"ggml-{pin['ggml_version']}-{ggml_key(opts)}.lock"):
        ggml_dir = build_ggml(opts)
        return build_cffi(ggml_dir, opts, out_dir)


def options_from_env() -> Options:
    cuda = os.environ.get("GGML_HYBRID_CUDA", "0") not in ("", "0", "false", "no")
    return Options(cuda=cuda, cuda_arch=os.environ.get("GGML_HYBRID_CUDA_ARCH", "90"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="add the CUDA backend (also: GGML_HYBRID_CUDA=1)")
    ap.add_argument("--cuda-arch", default=None, help="CMAKE_CUDA_ARCHITECTURES (default 90)")
    ap.add_argument("--upstream", action="store_true",
                    help="build GGML without the patch series into --out (for benchmarks)")
    ap.add_argument("--out", type=Path, default=None, help="where to put the extension module")
    ap.add_argument("--print-cache", action="store_true", help="print the cache folder and exit")
    ns = ap.parse_args(argv)
    if ns.print_cache:
        print(cache_root())
        return 0
    env = options_from_env()
    opts = Options(cuda=ns.cuda or env.cuda, cuda_arch=ns.cuda_arch or env.cuda_arch, patched=not ns.upstream)
    out = ns.out or (ROOT / "build" / "upstream" / "ggml_hybrid" / "_native" if ns.upstream else NATIVE)
    build(opts, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
