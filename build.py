#!/usr/bin/env python3
"""Build the native part of ggml-hybrid: the pinned GGML and the cffi module.

Steps, each cached:
1. fetch the registry archive named in ``vendor/pin.json`` with pip and check its sha256;
2. extract GGML from it and apply ``vendor/patches/*.patch`` in order;
3. build GGML with CMake through ``vendor/CMakeLists.txt``: ggml-base, ggml (the backend registry) and the CPU
   backend as shared libraries. The CPU backend is built for this CPU (``-march=native``) or, with
   ``GGML_HYBRID_PORTABLE=1``, once per x86-64 feature level, GGML loading the best one for the CPU it runs on
   (``GGML_CPU_ALL_VARIANTS``, as llama.cpp's release builds do);
4. build each optional backend asked for (``BACKENDS``: CUDA with ``GGML_HYBRID_CUDA=1``,
   Vulkan with ``GGML_HYBRID_VULKAN=1``) in a tree of its own,
   as a library that GGML loads at run time (``GGML_BACKEND_DL``): an install with it still imports and runs
   on a machine without the GPU, its driver or its runtime. It is built from the pin and its own patches only,
   once per pin, as long as the ABI probe (``_native/abiprobe.py``: struct layouts, enum values, signatures,
   inline code and macros of ggml-base's headers, the pin's against the patched ones) finds the patch series
   keeps what a backend takes from ggml-base; otherwise with ggml-base's patches too;
5. compile the cffi extension (API mode, out-of-line) against the patched headers, linked to ggml-base and ggml;
6. copy the module into ``ggml_hybrid/_native``, the GGML libraries into ``_native/lib`` and the optional
   backends into ``_native/backends``.

Each GGML build lives in a cache folder keyed by the pin, the patch series, the wrapper CMake file and its
options, so reinstalling with nothing changed reuses it. ``python build.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENDOR = ROOT / "vendor"
PACKAGE = ROOT / "ggml_hybrid"
NATIVE = PACKAGE / "_native"
# The unpatched pin's CPU backend library, for the test that loads it into our ggml-base (--pin-cpu)
PIN_CPU_DIR = ROOT / "build" / "pin-cpu"
# The unpatched pin's own RPC server (llama.cpp's rpc-server), for the interop tests and benchmarks (--pin-rpc-server)
PIN_RPC_DIR = ROOT / "build" / "pin-rpc-server"
PIN_RPC_SOURCE = "tools/rpc/rpc-server.cpp"  # in the llama.cpp folder that holds the pin's GGML
# Bump when the way GGML is configured or linked changes, to invalidate caches.
BUILD_SCHEME = "4"


def _load_native(name: str):
    # loaded by path: the package itself cannot be imported before it is built
    spec = importlib.util.spec_from_file_location(f"_ggml_hybrid_{name}", NATIVE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


info = _load_native("buildinfo")
abiprobe = _load_native("abiprobe")


def log(msg: str) -> None:
    print(f"[ggml-hybrid build] {msg}", file=sys.stderr, flush=True)


# -- progress on the user's terminal -----------------------------------------------------------------------
# pip runs this build with its output captured (shown only with -v), so a first install would be silent for
# minutes: the stages, and the compile's progress, also go to the terminal (/dev/tty) when there is one.

_NINJA_STATUS = re.compile(rb"^\[(\d+)/(\d+)\] ")
_T0 = time.monotonic()


def terminal():
    """The controlling terminal to write progress to, when stderr is not already it (pip captures stderr);
    None without one (CI, a pipe)."""
    if sys.stderr.isatty():
        return None
    try:
        return open("/dev/tty", "w", encoding="utf-8", errors="replace")
    except OSError:
        return None


def stage(msg: str, tty=None) -> None:
    """A step a user waits on: logged, and shown on the terminal with the time since the build began."""
    log(msg)
    own = tty is None
    tty = terminal() if own else tty
    if tty is not None:
        with contextlib.suppress(OSError):
            tty.write(f"[ggml-hybrid build {_elapsed()}] {msg}\n")
            tty.flush()
        if own:
            tty.close()


def _elapsed() -> str:
    s = int(time.monotonic() - _T0)
    return f"{s // 60}:{s % 60:02d}"


def run_with_progress(cmd: list[str], what: str, tty=None) -> None:
    """``run(cmd)`` for a Ninja/Make build, its ``[done/total]`` lines counted on the terminal as one line."""
    own = tty is None
    tty = terminal() if own else tty
    if tty is None:
        run(cmd)
        return
    log("$ " + " ".join(str(c) for c in cmd))
    shown = 0.0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.buffer.write(line)  # the full output stays where pip -v shows it
            m = _NINJA_STATUS.match(line)
            now = time.monotonic()
            if m and (now - shown > 0.5 or m.group(1) == m.group(2)):
                done, total = int(m.group(1)), int(m.group(2))
                with contextlib.suppress(OSError):
                    tty.write(f"\r[ggml-hybrid build {_elapsed()}] {what}: {done}/{total} files "
                              f"({100 * done // total}%)\x1b[K")
                    tty.flush()
                shown = now
    with contextlib.suppress(OSError):
        tty.write("\n" if shown else "")
        tty.flush()
    if own:
        tty.close()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def cache_root() -> Path:
    env = os.environ.get("GGML_HYBRID_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-hybrid"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Options:
    backends: tuple[str, ...] = ()  # optional backends, names in BACKENDS
    portable: bool = False  # every x86-64 CPU variant, the best chosen at run time (instead of -march=native)
    cuda_arch: str = "90"
    patched: bool = True  # False builds upstream GGML, static, for the overhead benchmark
    build_type: str = "Release"
    jobs: int = os.cpu_count() or 2

    def common_args(self, abi: str | None = None) -> list[str]:
        abi = abi or (abi_stamp() if self.patched else "upstream")
        return [f"-DCMAKE_BUILD_TYPE={self.build_type}", "-DGGML_CCACHE=OFF", f"-DGGML_HYBRID_ABI={abi}"]

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
        return self.common_args(info.pin_abi_stamp(VENDOR)) + [
            "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON",
            "-DGGML_NATIVE=OFF", "-DCMAKE_C_FLAGS=-march=native", "-DCMAKE_CXX_FLAGS=-march=native",
            *(f"-DGGML_{f}=OFF" for f in features)]

    def pin_rpc_server_args(self) -> list[str]:
        """The pin's own RPC server, unpatched, over GGML's CPU backend built as the core's is (for this CPU,
        llamafile's kernels, no OpenMP), statically linked: what a llama.cpp user's worker runs."""
        return self.common_args(info.pin_abi_stamp(VENDOR)) + [
            "-DGGML_OPENMP=OFF", "-DGGML_LLAMAFILE=ON", "-DGGML_NATIVE=ON", "-DGGML_BACKEND_DL=OFF"]

    def backend_args(self, name: str) -> list[str]:
        """One optional backend alone, as a library GGML loads at run time (no CPU backend in its tree)."""
        return self.common_args(abi_stamp_of(backend_patches(name), VENDOR)) + [
            "-DBUILD_SHARED_LIBS=ON", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU=OFF",
                                     "-DGGML_NATIVE=OFF", *BACKENDS[name].cmake_args(self)]


@dataclass(frozen=True)
class BackendSpec:
    """An optional GGML backend: its switch and its CMake options; built by ``build_backend``."""

    switch: str  # the environment variable that asks for it (also ``python build.py --NAME``)
    cmake_args: Callable[[Options], list[str]] = field(repr=False)


def _cuda_args(opts: Options) -> list[str]:
    home = cuda_home()
    version = nvcc_version(home / "bin" / "nvcc")
    args = [f"-DCMAKE_CUDA_COMPILER={home / 'bin' / 'nvcc'}", f"-DCUDAToolkit_ROOT={home}", "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={opts.cuda_arch}",
            # only the kernels the project uses: no FA for every head size and quant pair
            "-DGGML_CUDA_FA_ALL_QUANTS=OFF", "-DGGML_CUDA_NCCL=OFF",
            # no link to the driver library (libcuda.so.1): the library then loads where the driver is missing
            # (the CUDA runtime reports "no device" instead), and a toolkit without its stubs can build it
            "-DGGML_CUDA_NO_VMM=ON"]
    if not (home / "include" / "cublas_v2.h").exists():
        args += cublas_from_wheel(version)
    return args


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


def ggml_key(args: list[str], patches: list[Path] | None) -> str:
    """The cache key of a build tree: the pin, the CMake wrapper, the patches its source was made with (None: the
    unpatched upstream build of the overhead benchmark) and its options (the ABI stamp among them)."""
    h = hashlib.sha256()
    h.update((VENDOR / "pin.json").read_bytes())
    h.update((VENDOR / "CMakeLists.txt").read_bytes())
    if patches is None:
        h.update(b"unpatched")
    else:
        h.update(info.patches_hash(patches).encode())
    h.update(" ".join(args).encode())
    h.update(BUILD_SCHEME.encode())
    return h.hexdigest()[:16]


# -- the binary interface a backend library sees ------------------------------------------------------------------
# A backend library is built once per pin: from the pin's source and its own patches only, stamped with the pin's
# ABI, as long as the patch series leaves what a backend takes from ggml-base's headers as the pin has it (the
# probe: ggml_hybrid/_native/abiprobe.py). A patch that changes it (a struct's layout, an enum member's value, a
# function's signature, an inline function) gives ggml-base the series' stamp, and each backend is then built
# with ggml-base's patches too.

def header_sections(patch_text: str, keep) -> str:
    """The parts of a unified diff (``git diff``'s or plain) whose file, relative to GGML's folder, ``keep`` accepts."""
    lines = patch_text.splitlines(keepends=True)
    git = any(line.startswith("diff --git ") for line in lines)
    out, take = [], False
    for i, line in enumerate(lines):
        if git and line.startswith("diff --git "):
            take = keep(line.split()[-1].split("/", 1)[-1])  # b/PATH
        elif not git and line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            take = keep(path.split("/", 1)[-1])
        if take:
            out.append(line)
    return "".join(out)


def _probed_header(path: str) -> bool:
    return bool(re.fullmatch(r"(include|src)/[^/]+\.h", path))


def header_tree(vendor: Path, patches: list[Path], dest: Path) -> None:
    """GGML's headers (include/*.h, src/*.h) of the pin in dest, with the header parts of ``patches`` applied."""
    pin = info.load_pin(vendor)
    prefix = pin["ggml_path"].rstrip("/") + "/"
    with tarfile.open(fetch_archive(pin)) as tar:
        members = []
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(prefix) and _probed_header(m.name[len(prefix):]):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    patch_headers(dest, patches)


def pin_headers(vendor: Path | None = None) -> Path:
    """The pin's headers, unpatched, extracted once into the cache (reading the archive takes seconds)."""
    pin = info.load_pin(vendor or VENDOR)
    where = cache_root() / "abi" / f"headers-{pin['ggml_version']}-{pin['sha256'][:16]}"
    with _locked(where):
        if not (where / "DONE").exists():
            shutil.rmtree(where, ignore_errors=True)
            header_tree(vendor or VENDOR, [], where)
            (where / "DONE").write_text(pin["archive"] + "\n")
    return where


def patch_headers(tree: Path, patches: list[Path]) -> None:
    """Apply the header parts of ``patches`` to a tree of GGML's headers."""
    for p in patches:
        part = header_sections(p.read_text(errors="replace"), _probed_header)
        if part:
            run(["patch", "-p1", "--forward", "--batch", "-s", "-d", str(tree)], input=part.encode())


def abi_verdict(vendor: Path | None = None, fresh: bool = False) -> dict:
    """Whether the patch series keeps the interface a backend library takes from ggml-base's headers as the pin has
    it: ``abiprobe.compare`` of the pin's headers and the patched ones. Cached by the pin, the series' patches of
    ggml-base and the probe, so a build with nothing new only reads a file. Returns {"compatible", "differences",
    "checked" (items), "seconds" (the probe's time when it ran)}."""
    vendor = vendor or VENDOR
    base = [p for p in info.patch_files(vendor) if info.touches_ggml_base(p)]
    h = hashlib.sha256((vendor / "pin.json").read_bytes())
    h.update(info.patches_hash(base).encode())
    h.update((NATIVE / "abiprobe.py").read_bytes())
    cached = cache_root() / "abi" / f"{h.hexdigest()[:16]}.json"
    if cached.exists() and not fresh:
        return json.loads(cached.read_text())
    with _locked(cached):
        if cached.exists() and not fresh:
            return json.loads(cached.read_text())
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            pin_tree, patched_tree = pin_headers(vendor), Path(tmp) / "patched"
            shutil.copytree(pin_tree, patched_tree)
            patch_headers(patched_tree, base)
            try:
                verdict = abiprobe.compare(pin_tree, patched_tree)
            except abiprobe.ProbeError as e:  # the safe side: backends built with ggml-base's patches, as before
                verdict = abiprobe.Verdict([f"the ABI probe could not run: {e}"], 0, 0.0)
        result = {"compatible": verdict.compatible, "differences": verdict.differences, "checked": verdict.checked,
                  "seconds": round(time.monotonic() - t0, 3), "probe_seconds": round(verdict.seconds, 3),
                  "patches": [p.name for p in base]}
        if verdict.compatible:
            log(f"ABI probe: the patch series keeps the interface of the pin's headers ({verdict.checked} items, "
                f"{result['seconds']:.1f} s): backend libraries are built from the pin")
        else:
            log("ABI probe: the patch series changes the interface of the pin's headers, so backend libraries are "
                "built with ggml-base's patches:\n  " + "\n  ".join(verdict.differences[:20]))
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(result, indent=1) + "\n")
    return result


def abi_stamp(vendor: Path | None = None) -> str:
    """ggml-base's ABI stamp: the pin's while the series keeps the pin's interface (a backend library built from
    the pin loads), else the pin's and the series' patches of ggml-base."""
    vendor = vendor or VENDOR
    return info.pin_abi_stamp(vendor) if abi_verdict(vendor)["compatible"] else info.series_abi_stamp(vendor)


def backend_patches(name: str, vendor: Path | None = None) -> list[Path]:
    """The patches an optional backend's source gets: its own (src/ggml-NAME/, include/ggml-NAME.h), and those of
    ggml-base only when the series changes the pin's interface (or one of its own reaches ggml-base too). A patch
    of the CPU backend or another backend never reaches it."""
    vendor = vendor or VENDOR
    series = info.patch_files(vendor)
    own = [p for p in series if info.touches_backend(p, name)]
    if abi_verdict(vendor)["compatible"] and not any(info.touches_ggml_base(p) for p in own):
        return own
    return [p for p in series if p in own or info.touches_ggml_base(p)]


def abi_stamp_of(patches: list[Path], vendor: Path | None = None) -> str:
    """The stamp of a backend built from the pin with ``patches``: the pin's when they leave ggml-base as the pin
    has it, else ggml-base's."""
    vendor = vendor or VENDOR
    return info.pin_abi_stamp(vendor) if not any(info.touches_ggml_base(p) for p in patches) else abi_stamp(vendor)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def fetch_archive(pin: dict) -> Path:
    """The pinned sdist, downloaded once and checked against its sha256."""
    downloads = cache_root() / "downloads"
    archive = downloads / pin["archive"]
    with _locked(archive):
        return _fetch_archive(pin, archive)


def _fetch_archive(pin: dict, archive: Path) -> Path:
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


def prepare_source(pin: dict, dest: Path, patches: list[Path] | None) -> None:
    """Extract GGML from the archive into dest and apply ``patches`` (None or []: none)."""
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
    for p in patches or []:
        log(f"applying {p.name}")
        run(["patch", "-p1", "--forward", "--batch", "-s", "-d", str(tmp), "-i", str(p)])
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def build_tree(kind: str, args: list[str], opts: Options, patches: list[Path] | None,
               targets: tuple[str, ...] = (), wrapper: Path = VENDOR) -> Path:
    """Configure and build GGML with ``args`` through the CMake ``wrapper`` folder (or reuse that build); returns its
    cache folder, whose ``out/`` holds the shared libraries it made, stripped."""
    pin = info.load_pin()
    extra = [] if wrapper == VENDOR else [f"wrapper={_sha256(wrapper / 'CMakeLists.txt')}"]
    key = ggml_key(args + extra, patches)
    where = cache_root() / f"{kind}-{pin['ggml_version']}-{key}"
    with _locked(where):
        _build_tree(where, pin, args, opts, patches, targets, wrapper)
    return where


def _build_tree(where: Path, pin: dict, args: list[str], opts: Options, patches: list[Path] | None,
                targets: tuple[str, ...], wrapper: Path) -> None:
    stamp = where / "DONE"
    if stamp.exists():
        log(f"GGML up to date in {where}")
        return
    # an interrupted build resumes: the source is extracted whole or not at all, CMake and Ninja are incremental
    if not (where / "ggml").is_dir():
        where.mkdir(parents=True, exist_ok=True)
        stage(f"fetching GGML {pin['ggml_version']} (the pinned source) and applying the patch series")
        prepare_source(pin, where / "ggml", patches)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    stage("configuring GGML with CMake")
    run(["cmake", "-S", str(wrapper), "-B", str(where / "build"), *generator,
         f"-DGGML_HYBRID_SOURCE={where / 'ggml'}", *args])
    only = [a for t in targets for a in ("--target", t)]
    stage(f"compiling GGML on {opts.jobs} cores (the first build only; later installs reuse it from {cache_root()})")
    run_with_progress(["cmake", "--build", str(where / "build"), "--parallel", str(opts.jobs), *only], "compiling GGML")
    collect_libraries(where / "build" / "bin", where / "out")
    stamp.write_text(" ".join(args) + "\n")
    stage("GGML built")


def collect_libraries(bin_dir: Path, out: Path) -> None:
    """The shared libraries of a build, each under the name the loader looks for (its soname), stripped."""
    out.mkdir(parents=True, exist_ok=True)
    if not bin_dir.is_dir():
        return  # a static build
    strip = shutil.which("strip")
    for p in sorted(bin_dir.iterdir()):
        # libggml-base.so.0 -> libggml-base.so.0.25.3 (a versioned shared library); libggml-cuda.so (a module)
        versioned = p.is_symlink() and re.fullmatch(r"lib.+\.so\.\d+", p.name)
        module = not p.is_symlink() and p.name.endswith(".so")
        if versioned or module:
            if strip:
                run([strip, "--strip-unneeded", "-o", str(out / p.name), str(p.resolve())])
            else:
                shutil.copy2(p.resolve(), out / p.name)


def build_core(opts: Options) -> Path:
    if not opts.patched:
        return build_tree("ggml-upstream", opts.core_args(), opts, None)
    return build_tree("ggml", opts.core_args(), opts, info.patch_files())


def build_pin_cpu(opts: Options) -> Path:
    """The CPU backend library of the unpatched pin (``libggml-cpu.so``, loadable), cached like the other builds:
    tests/test_pin_backend.py loads it into our ggml-base and runs the op tests through it."""
    where = build_tree("pin-cpu", opts.pin_cpu_args(), opts, [], targets=("ggml-cpu",))
    lib = where / "out" / "libggml-cpu.so"
    if not lib.exists():
        raise SystemExit(f"the pin's CPU build in {where} made no {lib.name}; delete that folder and rebuild")
    return lib


def build_pin_rpc_server(opts: Options) -> Path:
    """The unpatched pin's own ``rpc-server`` (llama.cpp's ``tools/rpc/rpc-server.cpp``, from the pinned archive, as
    ``ggml-rpc-server``), cached like the other builds: the interop tests run it as a worker of our leader."""
    pin = info.load_pin()
    source = cache_root() / "downloads" / f"rpc-server-{pin['version']}.cpp"
    member = pin["ggml_path"].rstrip("/").rpartition("/")[0] + "/" + PIN_RPC_SOURCE
    with _locked(source):
        if not source.exists():
            with tarfile.open(fetch_archive(pin)) as tar:
                f = tar.extractfile(member)
                if f is None:
                    raise SystemExit(f"{member} is not in {pin['archive']}")
                source.write_bytes(f.read())
    wrapper = VENDOR / "rpc-server"
    where = build_tree("pin-rpc-server", [*opts.pin_rpc_server_args(), f"-DGGML_HYBRID_RPC_SERVER={source}"], opts,
                       [], targets=("ggml-rpc-server",), wrapper=wrapper)
    exe = where / "build" / "bin" / "ggml-rpc-server"
    if not exe.exists():
        raise SystemExit(f"the pin's rpc-server build in {where} made no {exe.name}; delete that folder and rebuild")
    return exe


def build_backend(name: str, opts: Options) -> Path:
    """The backend's library (``libggml-NAME.so``), built in a tree of its own, or adopted into that tree from a
    library built elsewhere (``GGML_HYBRID_NAME_LIB``)."""
    args = opts.backend_args(name)
    prebuilt = os.environ.get(f"{BACKENDS[name].switch}_LIB")
    if prebuilt:
        where = adopt_backend(name, Path(prebuilt), args, opts)
    else:
        where = build_tree(f"backend-{name}", args, opts, backend_patches(name), targets=(f"ggml-{name}",))
    lib = where / "out" / f"libggml-{name}.so"
    if not lib.exists():
        raise SystemExit(f"the {name} build in {where} made no {lib.name}; delete that folder and rebuild")
    return lib


def adopt_backend(name: str, lib: Path, args: list[str], opts: Options) -> Path:
    """Put a backend library built elsewhere (another machine, or an earlier tree whose folder name no longer
    matches) into the cache folder a build with ``args`` would use, so that later builds (a wheel from the
    sdist, a rebuild) take it from there. It must carry this checkout's ABI stamp; the folder's own build, if
    finished, is kept."""
    pin = info.load_pin()
    where = cache_root() / f"backend-{name}-{pin['ggml_version']}-{ggml_key(args, backend_patches(name))}"
    with _locked(where):
        if (where / "DONE").exists():
            log(f"the {name} backend is already built in {where}; {lib} is not adopted")
            return where
        check_backend_library(name, lib)
        out = where / "out"
        out.mkdir(parents=True, exist_ok=True)
        strip = shutil.which("strip")
        target = out / f"libggml-{name}.so"
        if strip:
            run([strip, "--strip-unneeded", "-o", str(target), str(lib)])
        else:
            shutil.copy2(lib, target)
        (where / "DONE").write_text(" ".join(args) + f"\nadopted from {lib.resolve()}\n")
        log(f"adopted {lib} as the {name} backend of {where}")
    return where


def check_backend_library(name: str, lib: Path) -> None:
    """A shared library that exports the stamp function with this checkout's ABI stamp in it (the loader checks
    the stamp again by calling it, before GGML sees the library)."""
    try:
        data = lib.read_bytes()
    except OSError as e:
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: cannot read it ({e.strerror})") from None
    stamp = abi_stamp()
    if not data.startswith(b"\x7fELF"):
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: not a shared library (no ELF header)")
    if b"ggml_hybrid_backend_abi" not in data or stamp.encode() not in data:
        raise SystemExit(f"{BACKENDS[name].switch}_LIB={lib}: not built against this checkout's ggml-base "
                         f"(ABI stamp {stamp} not in it); build it with `python build.py --{name}`")


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
    dest = cache_root() / f"cublas-{major}.{minor}"
    with _locked(dest):
        _fetch_cublas(major, minor, dest)
    include = next(dest.glob("nvidia/*/include"))
    libdir = include.parent / "lib"
    return [f"-DGGML_HYBRID_CUBLAS_INCLUDE={include}", f"-DCUDA_cublas_LIBRARY={libdir / f'libcublas.so.{major}'}",
            f"-DCUDA_cublasLt_LIBRARY={libdir / f'libcublasLt.so.{major}'}"]


def _fetch_cublas(major: int, minor: int, dest: Path) -> None:
    if not (dest / "DONE").exists():
        downloads = cache_root() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        wheels = sorted(downloads.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
        if not wheels:
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                 f"nvidia-cublas=={major}.{minor}.*", "-d", str(downloads)])
            wheels = sorted(downloads.glob(f"nvidia_cublas-{major}.{minor}.*.whl"))
        if not wheels:
            raise SystemExit(f"pip found no nvidia-cublas {major}.{minor} wheel for this CUDA toolkit")
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extractall(dest, [n for n in z.namelist() if "/include/" in n or "/lib/libcublas" in n])
        (dest / "DONE").write_text(wheels[-1].name + "\n")


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
    return "\n".join(f"/* {p.name} */\n" + p.read_text() for p in info.cdef_files(patched))


def module_name(opts: Options) -> str:
    return info.MODULE if opts.patched else info.UPSTREAM_MODULE


def build_cffi(core: Path, opts: Options) -> Path:
    """Compile the cffi extension (our C in ``_native/src``); cached next to the GGML build it links."""
    pin = info.load_pin()
    name = module_name(opts)
    patch_hash = info.patch_series_hash() if opts.patched else "unpatched"
    source_hash = info.source_hash(opts.patched)
    abi = abi_stamp() if opts.patched else "upstream"
    cdef = cdef_source(opts.patched)
    includes = ["math.h", "ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h", "ggml-opt.h"]  # math.h: logf
    includes += [p.name for p in info.c_sources() if p.suffix == ".h"]  # ours: the cdef declares from them
    preamble = "\n".join(f'#include "{h}"' for h in includes) + "\n"
    macros = [("HY_GGML_VERSION", f'"{pin["ggml_version"]}"'), ("HY_PATCH_HASH", f'"{patch_hash}"'),
              ("HY_SOURCE_HASH", f'"{source_hash}"'), ("GGML_HYBRID_ABI", f'"{abi}"')]
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256((cdef + preamble + repr(macros) + core.name + ext).encode()).hexdigest()[:16]
    cached = core / "cffi" / key / f"{name}{ext}"
    with _locked(cached.parent):
        if not cached.exists():
            _compile_cffi(core, opts, name, cdef, preamble, macros, cached)
    return cached


def _compile_cffi(core: Path, opts: Options, name: str, cdef: str, preamble: str, macros: list, cached: Path) -> None:
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
        sources=[str(p) for p in info.c_sources() if p.suffix == ".c"],
        include_dirs=[str(info.SRC_DIR), str(core / "ggml" / "include"), str(core / "ggml" / "src")],
        define_macros=macros,
        extra_objects=objects,
        extra_link_args=link,
        extra_compile_args=["-O2", "-Wall", "-Wno-unused-function", "-Werror=incompatible-pointer-types",
                            "-Werror=int-conversion", "-Werror=implicit-function-declaration"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        stage(f"compiling the cffi module {name}")
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, cached)


def _replace_file(src: Path, dst: Path) -> None:
    # copy then rename, so a running interpreter never maps a half-written file
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
        _replace_file(f, dest / f.name)


def install(module: Path, core: Path, backends: list[Path], out_dir: Path, patched: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    if patched:
        _sync_dir(sorted((core / "out").iterdir()), out_dir / "lib")
        _sync_dir(backends, out_dir / "backends")
    target = out_dir / module.name
    _replace_file(module, target)
    write_stub(cdef_source(patched), out_dir / f"{module_name_of(target)}.pyi")
    log(f"installed {target}" + "".join(f", {b.name}" for b in backends))
    return target


def module_name_of(path: Path) -> str:
    return path.name.split(".")[0]


# The type stub of the compiled module, read from the cdef with cffi's own parser (pycparser underneath): each
# function gets its real signature, so mypy checks the arity and the kind of every argument of a ``lib`` call.
# Argument types follow what cffi accepts when it calls a C function, narrowed where cffi's rule lets a mistake
# through: bytes (or a list) go only to a const pointer, since C writing into them would change an immutable
# Python object or a temporary array that is thrown away. The head of the stub is written by hand: ``CData`` (cffi
# ships no types) and the part of ``ffi`` the package uses, so that cdata made by ``ffi.new`` or ``ffi.cast`` is
# checked too.

_STUB_HEAD = '''"""Generated by build.py from the cdef headers (ggml_hybrid/_native/cdef); do not edit."""

from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

class CData:
    """A cffi cdata: a pointer, array, struct or function pointer. It exists only for type checking (cffi's
    objects are of ``_cffi_backend._CDataBase``); fields and items read through it are not typed."""
    def __getattr__(self, name: str) -> Any: ...
    def __setattr__(self, name: str, value: Any) -> None: ...
    def __getitem__(self, index: int | slice) -> Any: ...
    def __setitem__(self, index: int | slice, value: Any) -> None: ...
    def __add__(self, offset: int) -> CData: ...
    def __sub__(self, other: int | CData) -> Any: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __bool__(self) -> bool: ...
    def __int__(self) -> int: ...
    def __float__(self) -> float: ...
    def __call__(self, *args: Any) -> Any: ...
    def __enter__(self) -> CData: ...
    def __exit__(self, *exc: object) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __lt__(self, other: CData) -> bool: ...
    def __le__(self, other: CData) -> bool: ...
    def __gt__(self, other: CData) -> bool: ...
    def __ge__(self, other: CData) -> bool: ...
    def __hash__(self) -> int: ...

_F = TypeVar("_F", bound=Callable[..., Any])

class _FFI:
    """The compiled module's ``ffi``: the part of cffi's FFI that makes or reads cdata, typed."""
    NULL: CData
    errno: int
    def new(self, cdecl: str, init: Any = ..., /) -> CData: ...
    def cast(self, cdecl: str, value: CData | int | float, /) -> CData: ...
    # a buffer: any object of the buffer protocol (numpy's arrays are typed as such only for Python 3.12 on)
    @overload
    def from_buffer(self, python_buffer: object, /, require_writable: bool = ...) -> CData: ...
    @overload
    def from_buffer(self, cdecl: str, python_buffer: object, /, require_writable: bool = ...) -> CData: ...
    def buffer(self, cdata: CData, size: int = ..., /) -> Any: ...  # a cffi.buffer
    def memmove(self, dest: object, src: object, n: int, /) -> None: ...
    def string(self, cdata: CData, maxlen: int = ..., /) -> bytes: ...
    def unpack(self, cdata: CData, length: int, /) -> Any: ...
    def new_handle(self, obj: object, /) -> CData: ...
    def from_handle(self, handle: CData, /) -> Any: ...
    def gc(self, cdata: CData, destructor: Callable[[CData], object] | None, size: int = ...) -> CData: ...
    def release(self, cdata: CData, /) -> None: ...
    def addressof(self, cdata: Any, /, *fields_or_indexes: str | int) -> CData: ...
    def typeof(self, cdecl: str | CData | Callable[..., Any], /) -> Any: ...
    def sizeof(self, cdecl: str | CData, /) -> int: ...
    def def_extern(self, name: str = ..., error: Any = ...,
                   onerror: Callable[..., Any] | None = ...) -> Callable[[_F], _F]: ...

ffi: _FFI

class _Lib:
'''

# pointees to which cffi passes a bytes object's own buffer
_BYTES_POINTEES = {"char", "signed char", "unsigned char", "int8_t", "uint8_t"}


def _stub_value(tp) -> str:
    """The Python type of a C value as cffi hands it over (a result, a constant, an array item)."""
    from cffi import model
    if isinstance(tp, model.VoidType):
        return "None"
    if isinstance(tp, (model.EnumType, model.UnknownIntegerType)):
        return "int"
    if isinstance(tp, model.UnknownFloatType):
        return "float"
    if isinstance(tp, model.PrimitiveType):
        if tp.name == "_Bool":
            return "bool"
        if tp.is_char_type():
            return "bytes" if tp.name == "char" else "str"
        return {"i": "int", "f": "float", "j": "complex"}[tp.ALL_PRIMITIVE_TYPES[tp.name]]
    return "CData"  # pointers, arrays, structs, unions, function pointers


def _stub_arg(tp) -> str:
    """What a call accepts for an argument of C type ``tp``."""
    from cffi import model
    if isinstance(tp, model.PointerType):
        target, const = tp.totype, bool(tp.quals & model.Q_CONST)
        if not const:
            return "CData"  # C writes through it: only memory the caller keeps
        if isinstance(target, model.VoidType) or (isinstance(target, model.PrimitiveType)
                                                    and target.name in _BYTES_POINTEES):
            return "CData | bytes"
        item = _stub_value(target)
        if isinstance(target, (model.PrimitiveType, model.EnumType, model.UnknownIntegerType,
                               model.UnknownFloatType, model.PointerType)):
            return f"CData | list[{item}] | tuple[{item}, ...]"  # cffi fills a temporary array
        return "CData"
    if isinstance(tp, model.StructOrUnion):
        return "CData | dict[str, Any]"  # a struct cdata, or its fields by name
    if isinstance(tp, model.FunctionPtrType):
        # a cdata function pointer, or a function of lib itself (cffi passes its address; not a Python function,
        # which cffi refuses but a type checker cannot tell from lib's)
        if tp.ellipsis:
            return "CData | Callable[..., Any]"
        return f"CData | Callable[[{', '.join(_stub_value(a) for a in tp.args)}], {_stub_value(tp.result)}]"
    return _stub_value(tp)


def _param_names(parser, cdef: str) -> dict[str, list[str | None]]:
    """Each function's parameter names, from pycparser's tree (cffi's types keep none)."""
    from pycparser import c_ast
    tree, _, _ = parser._parse(cdef)
    names: dict[str, list[str | None]] = {}
    for node in tree.ext:
        if isinstance(node, c_ast.Decl) and isinstance(node.type, c_ast.FuncDecl):
            params = node.type.args.params if node.type.args is not None else []
            names[node.name] = [getattr(p, "name", None) for p in params]
    return names


def _py_name(name: str | None, i: int, taken: set[str]) -> str:
    import keyword
    n = name or f"arg{i}"
    if keyword.iskeyword(n) or n == "self" or n in taken:
        n = f"{n}_{i}"
    taken.add(n)
    return n


def stub_source(cdef: str) -> str:
    """The text of the compiled module's stub: every function, constant and callback that ``lib`` exports."""
    from cffi import cparser, model
    parser = cparser.Parser()
    parser.parse(cdef)
    names = _param_names(parser, cdef)
    attrs: dict[str, str] = {}
    for key, (tp, _quals) in parser._declarations.items():
        kind, _, name = key.partition(" ")
        if kind == "function":
            params = names.get(name, [])[:len(tp.args)]  # cffi's parser writes a "..." as a last parameter
            if len(params) != len(tp.args):  # (void): one unnamed parameter in the tree, none in cffi's
                params = [None] * len(tp.args)
            taken: set[str] = set()
            args = [f"{_py_name(n, i, taken)}: {_stub_arg(a)}" for i, (n, a) in enumerate(zip(params, tp.args))]
            if args:
                args.append("/")  # cffi's functions take no keywords
            if tp.ellipsis:
                args.append("*varargs: Any")
            attrs[name] = f"    def {name}(self{''.join(', ' + a for a in args)}) -> {_stub_value(tp.result)}: ..."
        elif kind in ("macro", "constant", "variable", "extern_python"):
            attrs[name] = f"    {name}: {'int' if kind == 'macro' else _stub_value(tp)}"
        if isinstance(tp, model.EnumType):  # named, anonymous or typedef'd: each enumerator is a constant
            for e in tp.enumerators:
                attrs[e] = f"    {e}: int"
    return _STUB_HEAD + "\n".join(attrs[n] for n in sorted(attrs)) + "\n\nlib: _Lib\n"


def write_stub(cdef: str, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(stub_source(cdef))
    tmp.replace(out)


@contextlib.contextmanager
def _locked(path: Path):
    """One build of ``path`` at a time: a second one waits, then finds the first one's result. Builds of other
    folders (another option set, the CUDA backend) go on meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(opts: Options, out_dir: Path = NATIVE) -> Path:
    core = build_core(opts)
    backends = [build_backend(name, opts) for name in opts.backends]
    module = build_cffi(core, opts)
    return install(module, core, backends, out_dir, opts.patched)


def options_from_env() -> Options:
    return Options(backends=tuple(n for n, spec in BACKENDS.items() if _env_flag(spec.switch)),
                   portable=_env_flag("GGML_HYBRID_PORTABLE"),
                   cuda_arch=os.environ.get("GGML_HYBRID_CUDA_ARCH", "90"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, spec in BACKENDS.items():
        ap.add_argument(f"--{name}", action="store_true", help=f"add the {name} backend (also: {spec.switch}=1)")
        ap.add_argument(f"--{name}-lib", type=Path, default=None, metavar="PATH",
                        help=f"adopt a {name} backend library built elsewhere instead of building it "
                             f"(also: {spec.switch}_LIB=PATH); implies --{name}")
    ap.add_argument("--cuda-arch", default=None, help="CMAKE_CUDA_ARCHITECTURES (default 90)")
    ap.add_argument("--portable", action="store_true",
                    help="every x86-64 CPU variant, the best loaded at run time (also: GGML_HYBRID_PORTABLE=1)")
    ap.add_argument("--upstream", action="store_true",
                    help="build GGML without the patch series into --out (for benchmarks)")
    ap.add_argument("--out", type=Path, default=None, help="where to put the extension module")
    ap.add_argument("--pin-cpu", action="store_true",
                    help="also build the CPU backend of the unpatched pin as a loadable library, into "
                         "build/pin-cpu/ (tests/test_pin_backend.py runs the op tests through it)")
    ap.add_argument("--pin-rpc-server", action="store_true",
                    help="also build the unpatched pin's own rpc-server (llama.cpp's) into build/pin-rpc-server/ "
                         "(tests/test_rpc_interop.py runs it as a worker of our leader)")
    ap.add_argument("--abi", action="store_true",
                    help="run the ABI probe (the pin's headers against the patched ones), print its verdict and exit")
    ap.add_argument("--print-cache", action="store_true", help="print the cache folder and exit")
    ns = ap.parse_args(argv)
    if ns.print_cache:
        print(cache_root())
        return 0
    if ns.abi:
        verdict = abi_verdict(fresh=True)
        print(json.dumps({**verdict, "stamp": abi_stamp(), "pin_stamp": info.pin_abi_stamp()}, indent=1))
        return 0
    for name, spec in BACKENDS.items():
        prebuilt = getattr(ns, f"{name}_lib")
        if prebuilt is not None:
            os.environ[f"{spec.switch}_LIB"] = str(prebuilt.resolve())
    env = options_from_env()
    backends = tuple(n for n in BACKENDS if getattr(ns, n) or getattr(ns, f"{n}_lib") or n in env.backends)
    if ns.upstream:
        opts = Options(patched=False)
    else:
        opts = Options(backends=backends, portable=ns.portable or env.portable,
                       cuda_arch=ns.cuda_arch or env.cuda_arch)
    out = ns.out or (ROOT / "build" / "upstream" / "ggml_hybrid" / "_native" if ns.upstream else NATIVE)
    build(opts, out)
    if ns.pin_cpu:
        dest = PIN_CPU_DIR / "libggml-cpu.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        _replace_file(build_pin_cpu(opts), dest)
        log(f"installed the pin's CPU backend as {dest}")
    if ns.pin_rpc_server:
        dest = PIN_RPC_DIR / "ggml-rpc-server"
        dest.parent.mkdir(parents=True, exist_ok=True)
        _replace_file(build_pin_rpc_server(opts), dest)
        dest.chmod(0o755)
        log(f"installed the pin's rpc-server as {dest}")
    return 0


def _hand_over_to_pypa_build() -> None:
    """``python -m build`` run here finds this file before PyPA's ``build`` package: run that one instead."""
    import runpy

    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    runpy.run_module("build", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if __spec__ is not None and __spec__.name == "build":
        _hand_over_to_pypa_build()
    else:
        sys.exit(main())
