"""Optional backend libraries (GGML_BACKEND_DL): what is loaded, what is refused and why, and what the CPU build says.

Stand-in backend libraries are compiled here with the system C compiler, so the loader's rules are checked on
every machine: a library without ggml-hybrid's ABI stamp or with another one is refused before GGML runs any of
its code; a missing vendor runtime is looked for where pip's NVIDIA wheels put it; GGML's own failure is
reported with its log. The real CUDA backend, when this install has one, is checked in test_cuda_backend.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import ggml_hybrid as gh
from ggml_hybrid import lib
from ggml_hybrid._native import buildinfo, cstr
from ggml_hybrid._native.backends import load_backend, optional_backends
from ggml_hybrid.cli import main
from ggml_hybrid.errors import BackendError
from ggml_hybrid.ggml.backend import cpu_features, cpu_library

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def _shared(tmp: Path, name: str, code: str, *link: str, soname: str | None = None) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(code)
    out = tmp / name
    args = [CC, "-shared", "-fPIC", "-o", str(out), str(src), *link]
    if soname:
        args.append(f"-Wl,-soname,{soname}")
    subprocess.run(args, check=True, capture_output=True)
    return out


def _stamp(value: str) -> str:
    return f'const char * ggml_hybrid_backend_abi(void) {{ return "{value}"; }}\n'


def test_module_and_loaded_ggml_base_share_one_abi():
    assert cstr(lib.hy_abi()) == cstr(lib.ggml_hybrid_base_abi())
    if buildinfo.VENDOR_DIR.is_dir():  # a source checkout: the pin's stamp or the series' (test_pin_backend.py)
        assert cstr(lib.hy_abi()) in (buildinfo.pin_abi_stamp(), buildinfo.series_abi_stamp())



def _diff(*paths: str) -> str:
    return "".join(f"--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-x\n+y\n" for p in paths)


@pytest.mark.parametrize(("paths", "base"), [
    (["include/ggml-rpc.h", "src/ggml-rpc/ggml-rpc.cpp"], False),
    (["src/ggml-cuda/ggml-cuda.cu", "src/ggml-cuda/common.cuh"], False),
    (["include/ggml-backend.h", "src/ggml-backend.cpp"], True),
    (["src/ggml-rpc/ggml-rpc.cpp", "src/ggml.c"], True),  # one file of ggml-base is enough
    (["include/ggml.h"], True), (["include/gguf.h"], True), (["src/ggml-alloc.c"], True),
    (["CMakeLists.txt"], True), ([], True),  # a patch that names no file: assumed to touch it
])
def test_which_patches_touch_ggml_base(tmp_path, paths, base):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("a description\n" + _diff(*paths))
    assert buildinfo.patched_paths(patch) == sorted(paths)
    assert buildinfo.touches_ggml_base(patch) is base


@pytest.mark.skipif(not buildinfo.VENDOR_DIR.is_dir(), reason="needs the source checkout's vendor/")
def test_the_series_stamp_changes_with_ggml_base_patches_only_and_the_pins_with_none(tmp_path):
    vendor = tmp_path / "vendor"
    shutil.copytree(buildinfo.VENDOR_DIR, vendor)
    before, pin = buildinfo.series_abi_stamp(vendor), buildinfo.pin_abi_stamp(vendor)
    assert before == buildinfo.series_abi_stamp() and pin == buildinfo.pin_abi_stamp() and pin != before
    # a patch to one backend: a backend library built before it still loads into this ggml-base
    (vendor / "patches" / "0900-rpc.patch").write_text(_diff("src/ggml-rpc/ggml-rpc.cpp"))
    assert buildinfo.series_abi_stamp(vendor) == before
    (vendor / "patches" / "0901-base.patch").write_text(_diff("src/ggml-backend.cpp"))
    after = buildinfo.series_abi_stamp(vendor)
    assert after != before
    (vendor / "patches" / "0901-base.patch").write_text(_diff("src/ggml-backend.cpp") + "-z\n+w\n")
    assert buildinfo.series_abi_stamp(vendor) not in (before, after)  # its content, not only its name
    assert buildinfo.pin_abi_stamp(vendor) == pin  # the pin's: whatever the series is


@pytest.mark.parametrize(("paths", "backend", "reaches"), [
    (["src/ggml-vulkan/ggml-vulkan.cpp"], "vulkan", True), (["include/ggml-vulkan.h"], "vulkan", True),
    (["src/ggml-vulkan/ggml-vulkan.cpp"], "cuda", False), (["src/ggml-cpu/ops.cpp"], "vulkan", False),
    (["src/ggml-vulkan-x/a.cpp"], "vulkan", False),  # another folder that only starts with the name
])
def test_which_patches_touch_a_backend(tmp_path, paths, backend, reaches):
    patch = tmp_path / "0001-x.patch"
    patch.write_text(_diff(*paths))
    assert buildinfo.touches_backend(patch, backend) is reaches


# GGML's feature names -> the flags /proc/cpuinfo shows for them
_CPUINFO = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
            "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
            "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_cpu_backend_is_a_shipped_library_built_for_this_cpu():
    path = Path(cpu_library())
    assert path.parent.resolve() == buildinfo.LIB_DIR.resolve() and path.name.startswith("libggml-cpu")
    isa = [f for f in cpu_features().split() if f in _CPUINFO]
    flags = _cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    # the library in use was built for no instruction this CPU lacks (a native build, or the variant GGML chose)
    assert [f for f in isa if _CPUINFO[f] not in flags] == []
    if path.name == "libggml-cpu.so.0":  # -march=native: every listed extension this CPU has
        assert [f for f, flag in _CPUINFO.items() if flag in flags and f not in isa] == []


@needs_cc
def test_library_without_stamp_is_refused(tmp_path):
    so = _shared(tmp_path, "libggml-fake.so", "int ggml_hybrid_fake(void) { return 1; }\n")
    st = load_backend(so)
    assert not st.loaded and st.devices == 0
    assert "no ABI stamp" in st.detail and str(so) in st.detail


@needs_cc
def test_library_of_another_ggml_base_is_refused(tmp_path):
    so = _shared(tmp_path, "libggml-fake.so", _stamp("0123456789abcdef"))
    st = load_backend(so)
    assert not st.loaded
    assert "0123456789abcdef" in st.detail and cstr(lib.ggml_hybrid_base_abi()) in st.detail
    assert "rebuild" in st.detail


@needs_cc
def test_missing_runtime_is_named_then_found_in_a_pip_nvidia_folder(tmp_path, monkeypatch):
    soname = f"libggmlhybridtestdep{tmp_path.name.replace('-', '_')}.so.1"  # unique: a loaded one stays loaded
    site = tmp_path / "site"
    dep_dir = site / "nvidia" / "fake" / "lib"
    dep_dir.mkdir(parents=True)
    _shared(dep_dir, soname, "int ggml_hybrid_test_dep(void) { return 7; }\n", soname=soname)
    code = _stamp(cstr(lib.ggml_hybrid_base_abi())) + "int ggml_hybrid_test_dep(void);\n" \
        "int ggml_hybrid_use_dep(void) { return ggml_hybrid_test_dep(); }\n"
    so = _shared(tmp_path, "libggml-fake.so", code, str(dep_dir / soname))

    st = load_backend(so)  # the dependency is on no search path yet
    assert not st.loaded and soname in st.detail and "cannot open shared object file" in st.detail

    monkeypatch.syspath_prepend(str(site))  # where pip puts nvidia-* wheels
    st = load_backend(so)
    # the dependency was found and loaded; the stand-in then fails where a real backend registers itself
    assert not st.loaded
    assert st.detail.startswith("GGML could not initialise") and soname not in st.detail


@needs_cc
def test_loading_a_backend_puts_the_quiet_log_back(tmp_path):
    # GGML's log is captured while a backend loads; afterwards the package's logger (debug lines dropped) is in
    # place again, not GGML's default, which prints every level (one line per repacked tensor)
    code = _stamp(cstr(lib.ggml_hybrid_base_abi())) + "void ggml_log_internal(int level, const char * fmt, ...);\n" \
        'void ggml_hybrid_test_log(void) {\n' \
        '    ggml_log_internal(1, "test-debug\\n");\n' \
        '    ggml_log_internal(3, "test-warn\\n");\n' \
        '}\n'
    so = _shared(tmp_path, "libggml-fake.so", code, str(buildinfo.LIB_DIR / "libggml-base.so.0"))
    script = ("import ctypes, sys\n"
              "from pathlib import Path\n"
              "from ggml_hybrid._native.backends import load_backend\n"
              "st = load_backend(Path(sys.argv[1]))\n"
              "assert st.detail.startswith('GGML could not initialise'), st.detail\n"
              "ctypes.CDLL(sys.argv[1]).ggml_hybrid_test_log()\n")
    res = subprocess.run([sys.executable, "-c", script, str(so)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "test-warn" in res.stderr and "test-debug" not in res.stderr
    assert "ggml_backend_init" not in res.stderr  # GGML's complaint about the stand-in went to the capture


def test_cpu_build_has_no_cuda(monkeypatch):
    if any(buildinfo.BACKEND_DIR.glob("libggml-cuda.so")):
        pytest.skip("this install has the CUDA backend (test_cuda_backend.py checks it)")
    assert "CUDA" not in optional_backends()
    assert not gh.cuda_available()
    with pytest.raises(BackendError, match="no CUDA backend.*ggml_hybrid_build --cuda"):
        gh.cuda(0)
    res = CliRunner().invoke(main, ["devices"])
    assert res.exit_code == 0
    rows = [ln for ln in res.output.splitlines() if ": backend " not in ln]  # other backends' notes come last
    assert "CUDA" not in res.output and rows[-1].startswith("CPU")
