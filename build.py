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
# Bump when the way GGML is configured or linked changes, to invalidate caches.
BUILD_SCHEME = "3"


def _load_buildinfo():
    # loaded by path: the package itself cannot be imported before it is built
    spec = importlib.util.spec_from_file_location("_ggml_hybrid_buildinfo", PACKAGE / "_buildinfo.py")
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
    names = ["libggml.a"] + (["libggml-cuda.a"] if opts.cuda else []) + ["libggml-cpu.a", "libggml-base.a"]
    found = {p.name: p for p in (ggml_dir / "build").rglob("*.a")}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"GGML build in {ggml_dir} lacks {missing}; delete that folder and rebuild")
    return [str(found[n]) for n in names]


def cdef_source(patched: bool) -> str:
    return "\n".join(f"/* {p.name} */\n" + p.read_text() for p in info.cdef_files(patched))


def module_name(opts: Options) -> str:
    return "_native" if opts.patched else "_native_upstream"


def build_cffi(ggml_dir: Path, opts: Options, out_dir: Path) -> Path:
    """Compile the cffi extension; cached next to the GGML build it links."""
    import cffi

    pin = info.load_pin()
    name = module_name(opts)
    patch_hash = info.patch_series_hash() if opts.patched else "unpatched"
    cdef = cdef_source(opts.patched)
    includes = ["ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h"] + (["ggml-cuda.h"] if opts.cuda else [])
    preamble = "\n".join(f'#include "{h}"' for h in includes) + f"""
#include <stdbool.h>
#include "ggml-impl.h"
/* graph internals that ggml.h does not expose but overflow checks need */
static int ggml_hybrid_graph_n_leafs(struct ggml_cgraph * g) {{ return g->n_leafs; }}
static struct ggml_tensor * ggml_hybrid_graph_leaf(struct ggml_cgraph * g, int i) {{ return g->leafs[i]; }}
static bool ggml_hybrid_graph_contains(struct ggml_cgraph * g, struct ggml_tensor * t) {{
    return ggml_hash_contains(&g->visited_hash_set, t);
}}
/* forget the memory a scheduler gave the graph's tensors (it may be freed by now), keeping
   tensors in the buffers listed: only pointer values are compared. Only tensor structs inside
   the live context pools listed ([start, end) pairs) are touched: a tensor of a freed context
   is never read or written. */
static int ggml_hybrid_graph_unalloc(struct ggml_cgraph * g, ggml_backend_buffer_t * keep, int n_keep,
                                     const uintptr_t * pools, int n_pools) {{
    int dangling = 0; /* tensors outside every live pool: their context was freed */
    for (int pass = 0; pass < 2; pass++) {{
        const int n = pass == 0 ? g->n_nodes : g->n_leafs;
        struct ggml_tensor ** ts = pass == 0 ? g->nodes : g->leafs;
        for (int i = 0; i < n; i++) {{
            struct ggml_tensor * t = ts[i];
            const uintptr_t a = (uintptr_t) t;
            bool live = false;
            for (int k = 0; k < n_pools && !live; k++) live = a >= pools[2*k] && a < pools[2*k + 1];
            dangling += !live;
            if (!live || t->buffer == NULL) continue;
            bool user = false;
            for (int k = 0; k < n_keep && !user; k++) user = t->buffer == keep[k];
            if (!user) {{ t->buffer = NULL; t->data = NULL; }}
        }}
    }}
    return dangling;
}}
/* CPU backend instances that stand in for separate devices: each gets its own copy of the CPU
   device and buffer type (same functions, distinct identity), so that the scheduler treats their
   buffers as different memories, as it does for two GPUs, instead of moving every node onto the
   first instance (it merges backends whose buffer types are the same object). */
#include "ggml-backend-impl.h"
#define GGML_HYBRID_MAX_INSTANCES 16
static struct ggml_backend_device ggml_hybrid_inst_dev[GGML_HYBRID_MAX_INSTANCES];
static struct ggml_backend_buffer_type ggml_hybrid_inst_buft[GGML_HYBRID_MAX_INSTANCES];
static ggml_backend_buffer_type_t ggml_hybrid_inst_get_buft(ggml_backend_dev_t dev) {{
    return &ggml_hybrid_inst_buft[dev - ggml_hybrid_inst_dev];
}}
static ggml_backend_t ggml_hybrid_cpu_instance(int index) {{
    if (index < 0 || index >= GGML_HYBRID_MAX_INSTANCES) return NULL;
    ggml_backend_t b = ggml_backend_cpu_init();
    if (b == NULL) return NULL;
    ggml_hybrid_inst_dev[index] = *b->device;
    ggml_hybrid_inst_dev[index].iface.get_buffer_type = ggml_hybrid_inst_get_buft;
    ggml_hybrid_inst_buft[index] = *ggml_backend_cpu_buffer_type();
    ggml_hybrid_inst_buft[index].device = &ggml_hybrid_inst_dev[index];
    b->device = &ggml_hybrid_inst_dev[index];
    return b;
}}
#define GGML_HYBRID_HAS_CUDA {1 if opts.cuda else 0}
static const char * ggml_hybrid_ggml_version(void) {{ return "{pin['ggml_version']}"; }}
static const char * ggml_hybrid_patch_hash(void) {{ return "{patch_hash}"; }}
static const char * ggml_hybrid_cdef_hash(void) {{ return "{info.cdef_hash(opts.patched)}"; }}
static int ggml_hybrid_has_cuda(void) {{ return GGML_HYBRID_HAS_CUDA; }}
"""
    if opts.cuda:
        preamble += "static ggml_backend_t ggml_hybrid_cuda_init(int dev) { return ggml_backend_cuda_init(dev); }\n"
        preamble += "static int ggml_hybrid_cuda_device_count(void) { return ggml_backend_cuda_get_device_count(); }\n"
    else:
        preamble += "static ggml_backend_t ggml_hybrid_cuda_init(int dev) { (void) dev; return NULL; }\n"
        preamble += "static int ggml_hybrid_cuda_device_count(void) { return 0; }\n"
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256((cdef + preamble + ggml_dir.name + ext).encode()).hexdigest()[:16]
    cached = ggml_dir / "cffi" / key / f"{name}{ext}"
    if not cached.exists():
        ffi = cffi.FFI()
        ffi.cdef(cdef)
        libs = static_libs(ggml_dir, opts)
        extra_link = ["-Wl,--exclude-libs,ALL", "-lstdc++", "-lm", "-lpthread"]
        if opts.cuda:
            extra_link += _cuda_link_args()
        ffi.set_source(
            f"ggml_hybrid.{name}",
            preamble,
            include_dirs=[str(ggml_dir / "ggml" / "include"), str(ggml_dir / "ggml" / "src")],
            extra_objects=libs,
            extra_link_args=extra_link,
            extra_compile_args=["-O2", "-Wno-unused-function", "-Werror=incompatible-pointer-types", "-Werror=int-conversion"],
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
    log(f"installed {target}")
    return target


def _cuda_link_args() -> list[str]:
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    return [f"-L{cuda_home / 'lib64'}", "-lcudart", "-lcublas", "-lcublasLt", "-lcuda"]


@contextlib.contextmanager
def _cache_lock():
    """One build at a time per cache: a second one waits, then finds the first one's result."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(opts: Options, out_dir: Path = PACKAGE) -> Path:
    with _cache_lock():
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
    out = ns.out or (ROOT / "build" / "upstream" / "ggml_hybrid" if ns.upstream else PACKAGE)
    build(opts, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
