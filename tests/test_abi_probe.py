"""The ABI probe (``ggml_hybrid_build/abiprobe.py``, run by the build) against synthetic changes of the pin's headers.

A backend library (Vulkan, CUDA) is built once per pin while the patch series keeps what a backend takes from
ggml-base's headers. These tests change the pin's own headers as a patch would and check the probe's verdict both
ways (a member appended to an enum, a function or struct added: the same interface; a struct's layout, an enum
member's value, a signature, a macro, an inline function, a removed member: not, each named), then that the build
stamps ggml-base and keys a backend's build by that verdict, with synthetic patches in a copy of vendor/: an
appended enum member leaves the backend's build where it was, a layout change rebuilds it.
"""

from __future__ import annotations

import difflib
import re
import shutil
from pathlib import Path

import pytest

from ggml_hybrid._native import buildinfo
from ggml_hybrid_build import abi, abiprobe, cmake, options, paths
from ggml_hybrid_build import patches as series

pytestmark = [
    pytest.mark.skipif(not buildinfo.VENDOR_DIR.is_dir(), reason="needs the source checkout's vendor/"),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]


@pytest.fixture(scope="module")
def scratch_cache(tmp_path_factory):
    """The build with a scratch cache for the verdicts (the pin's archive is read from the real cache)."""
    real = paths.cache_root()
    scratch = tmp_path_factory.mktemp("cache")
    (scratch / "downloads").symlink_to(real / "downloads", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "cache_root", lambda: scratch)
        yield scratch


@pytest.fixture(scope="module")
def pin(scratch_cache) -> Path:
    """The pin's headers, unpatched."""
    return abi.pin_headers()


def _edit(src: Path, dest: Path, rel: str, old: str, new: str) -> Path:
    shutil.copytree(src, dest)
    path = dest / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {rel}"
    path.write_text(text.replace(old, new))
    return dest


# (header, text in the pin, its replacement, compatible, a difference the probe must name)
CHANGES = {
    "enum member appended (patch 0005's kind)": (
        "include/ggml.h", "GGML_HINT_SRC0_IS_HADAMARD = 1,",
        "GGML_HINT_SRC0_IS_HADAMARD = 1,\n        GGML_HINT_SYNTHETIC = 2,", True, None),
    "op appended before GGML_OP_COUNT": (
        "include/ggml.h", "        GGML_OP_GLU,\n", "        GGML_OP_GLU,\n        GGML_OP_SYNTHETIC,\n", True, None),
    "function and struct added (patch 0002's kind)": (
        "include/ggml-backend.h", "#ifdef  __cplusplus\n}", "struct hy_synthetic { int a; };\n"
        "GGML_API int ggml_backend_synthetic(struct hy_synthetic * s);\n#ifdef  __cplusplus\n}", True, None),
    "member inserted into ggml_tensor's padding": (
        "include/ggml.h", "        enum ggml_type type;\n", "        enum ggml_type type;\n        int synthetic;\n",
        False, r"struct ggml_tensor: members .* \(added: synthetic\)"),
    "member inserted into ggml_tensor": (
        "include/ggml.h", "        enum ggml_type type;\n",
        "        enum ggml_type type;\n        int64_t synthetic;\n",
        False, r"struct ggml_tensor\.buffer offset 8 size 8 type 1 -> struct ggml_tensor\.buffer offset 16"),
    "backend interface callback gains a parameter": (
        "src/ggml-backend-impl.h", "(ggml_backend_t backend, struct ggml_cgraph * cgraph);",
        "(ggml_backend_t backend, struct ggml_cgraph * cgraph, int synthetic);",
        False, r"struct ggml_backend_i\.graph_compute offset \d+ size 8 type 1 -> .* type 0"),
    "enum member inserted in the middle": (
        "include/ggml.h", "        GGML_OP_DUP,\n", "        GGML_OP_SYNTHETIC,\n        GGML_OP_DUP,\n",
        False, r"enum ggml_op: GGML_OP_DUP = 1 -> enum ggml_op: GGML_OP_DUP = 2"),
    "function gains a parameter": (
        "include/ggml.h", "            struct ggml_tensor  * b);\n\n    GGML_API struct ggml_tensor * ggml_add_inplace",
        "            struct ggml_tensor  * b, int synthetic);\n\n    GGML_API struct ggml_tensor * ggml_add_inplace",
        False, r"function ggml_add type 1 -> function ggml_add type 0"),
    "macro changed": (
        "include/ggml.h", "#   define GGML_MAX_NAME        64", "#   define GGML_MAX_NAME        128",
        False, r"macro GGML_MAX_NAME changed: 64 -> 128"),
    "inline function changed": (
        "src/ggml-impl.h", "    return (n + 31) & ~31;", "    return (n + 63) & ~63;",
        False, r"inline function ggml_up32 changed"),
    "member removed": (
        "include/ggml.h", "        enum ggml_type type;\n", "\n", False, r"compiling the ABI probe .* failed"),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_the_probe_tells_a_compatible_header_change_from_an_incompatible_one(pin, tmp_path, case):
    rel, old, new, compatible, named = CHANGES[case]
    verdict = abiprobe.compare(pin, _edit(pin, tmp_path / "cand", rel, old, new))
    assert verdict.compatible is compatible, verdict.differences
    assert verdict.checked > 1000  # every struct member, enum member, function, typedef, macro of the headers
    if named is not None:
        assert any(re.search(named, d, re.S) for d in verdict.differences), verdict.differences


def test_the_pins_own_headers_agree_with_themselves(pin, tmp_path):
    verdict = abiprobe.compare(pin, _edit(pin, tmp_path / "same", "include/ggml.h", "#pragma once", "#pragma once"))
    assert verdict.compatible, verdict.differences


def test_the_probe_program_covers_the_interface_tables(pin):
    """The items a backend library lives by are among those probed."""
    iface = abiprobe.describe(pin)
    members = {m for m, _ in iface.structs["struct ggml_backend_i"]}
    assert {"get_name", "free", "graph_compute", "set_tensor_async"} <= members
    assert {"struct ggml_tensor", "struct ggml_cgraph", "struct ggml_backend_device_i", "struct ggml_backend_reg_i",
            "struct ggml_backend_buffer_i", "struct ggml_backend_buffer_type_i", "block_q4_K"} <= set(iface.structs)
    assert iface.enums["enum ggml_op"][-1] == "GGML_OP_COUNT"
    assert iface.functions["ggml_add"].replace(" ", "") == (
        "structggml_tensor*(*)(structggml_context*,structggml_tensor*,structggml_tensor*)")
    assert iface.macros["GGML_MAX_DIMS"].strip() == "4"


def _series_patch(tree: Path, rel: str, old: str, new: str) -> str:
    """A patch of one header of ``tree`` (the patched pin's headers), as our series' patches are written."""
    text = (tree / rel).read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {rel}"
    diff = difflib.unified_diff(text.splitlines(keepends=True), text.replace(old, new).splitlines(keepends=True),
                                f"a/{rel}", f"b/{rel}")
    return "a synthetic patch\n\n" + "".join(diff)


@pytest.fixture
def vendor(scratch_cache, tmp_path, monkeypatch):
    """A copy of vendor/ that the build reads (and a stand-in backend, "fake", with a patch of its own)."""
    copy = tmp_path / "vendor"
    shutil.copytree(paths.VENDOR, copy)
    monkeypatch.setattr(paths, "VENDOR", copy)
    monkeypatch.setitem(options.BACKENDS, "fake", options.BackendSpec("GGML_HYBRID_FAKE", lambda opts: ["-DFAKE=ON"]))
    (copy / "patches" / "0990-fake.patch").write_text(
        "--- a/src/ggml-fake/fake.cpp\n+++ b/src/ggml-fake/fake.cpp\n@@ -1 +1 @@\n-x\n+y\n")
    return copy


def _backend_build(name: str = "fake") -> tuple[str, str, list[str]]:
    """A backend's cache key, its stamp and the patches its source gets."""
    patches = abi.backend_patches(name)
    try:
        args = options.Options().backend_args(name)
    except SystemExit as e:  # the Vulkan backend's build tools are missing here
        pytest.skip(str(e))
    return cmake.ggml_key(args, patches), abi.abi_stamp_of(patches), [p.name for p in patches]


@pytest.mark.parametrize("name", ["fake", "vulkan"])
@pytest.mark.parametrize("kind", ["appended enum member", "struct layout"])
def test_a_backend_is_rebuilt_only_when_a_patch_changes_the_interface(vendor, tmp_path, kind, name):
    key0, stamp0, patches0 = _backend_build(name)
    assert abi.abi_verdict()["compatible"]
    assert stamp0 == abi.abi_stamp() == buildinfo.pin_abi_stamp(vendor)
    # the pin and its own patches: no patch of ggml-base, none of the CPU's
    assert patches0 == {"fake": ["0990-fake.patch"], "vulkan": ["0007-vulkan-old-headers.patch"]}[name]
    base = [p for p in buildinfo.patch_files(vendor) if buildinfo.touches_ggml_base(p)]
    patched = tmp_path / "patched"
    shutil.copytree(abi.pin_headers(), patched)
    series.patch_headers(patched, base)
    if kind == "appended enum member":
        patch = _series_patch(patched, "include/ggml.h", "        GGML_HINT_ROWWISE          = 2,\n",
                              "        GGML_HINT_ROWWISE          = 2,\n        GGML_HINT_SYNTHETIC        = 3,\n")
    else:
        patch = _series_patch(patched, "include/ggml.h", "        enum ggml_type type;\n",
                              "        enum ggml_type type;\n        int synthetic;\n")
    (vendor / "patches" / "0950-synthetic.patch").write_text(patch)
    verdict = abi.abi_verdict()
    key, stamp, patches = _backend_build(name)
    if kind == "appended enum member":
        assert verdict["compatible"], verdict["differences"]
        # the backend's build is the one before: same key, same stamp, same source; ggml-base keeps the pin's stamp
        assert (key, stamp, patches) == (key0, stamp0, patches0)
        assert abi.abi_stamp() == stamp0
    else:
        assert not verdict["compatible"]
        assert any("struct ggml_tensor" in d for d in verdict["differences"]), verdict["differences"]
        # ggml-base gets the series' stamp, the backend is built again with ggml-base's patches and carries it
        assert abi.abi_stamp() == stamp == buildinfo.series_abi_stamp(vendor) != stamp0
        assert key != key0 and "0950-synthetic.patch" in patches and "0005-cpu-rowwise-matmul.patch" in patches
        assert "0004-cpu-repack-expert-slices.patch" not in patches  # a CPU backend patch never reaches it


def test_patches_of_ggml_base_code_and_of_other_backends_never_reach_a_backend(vendor):
    """Patch 0001's kind (ggml-base's code, no header) and the CPU's, RPC's, CUDA's own: the backend's build stays."""
    before = _backend_build()
    for i, f in enumerate(["src/ggml-backend.cpp", "src/ggml.c", "src/ggml-cpu/ops.cpp", "src/ggml-rpc/ggml-rpc.cpp",
                           "src/ggml-cuda/mmq.cu"]):
        (vendor / "patches" / f"096{i}-other.patch").write_text(f"--- a/{f}\n+++ b/{f}\n@@ -1 +1 @@\n-x\n+y\n")
        assert _backend_build() == before, f
    (vendor / "patches" / "0970-fake.patch").write_text(
        "--- a/src/ggml-fake/b.cpp\n+++ b/src/ggml-fake/b.cpp\n@@ -1 +1 @@\n-x\n+y\n")
    key, stamp, patches = _backend_build()  # its own patch: built again, with the same stamp
    assert key != before[0] and stamp == before[1] and patches == ["0970-fake.patch", *before[2]]


def test_header_sections_keep_only_the_headers_of_a_patch():
    patch = ("a description\n\ndiff --git a/include/ggml.h b/include/ggml.h\nindex 1..2 100644\n--- a/include/ggml.h\n"
             "+++ b/include/ggml.h\n@@ -1 +1 @@\n-x\n+y\ndiff --git a/src/ggml.c b/src/ggml.c\n--- a/src/ggml.c\n"
             "+++ b/src/ggml.c\n@@ -1 +1 @@\n-z\n+w\n")
    part = series.header_sections(patch, lambda p: p.endswith(".h"))
    assert "include/ggml.h" in part and "src/ggml.c" not in part and "+y" in part and "+w" not in part
    plain = ("--- a/src/ggml-impl.h\n+++ b/src/ggml-impl.h\n@@ -1 +1 @@\n-a\n+b\n"
             "--- a/src/x.c\n+++ b/src/x.c\n@@\n-c\n+d\n")
    part = series.header_sections(plain, lambda p: p.endswith(".h"))
    assert part == "--- a/src/ggml-impl.h\n+++ b/src/ggml-impl.h\n@@ -1 +1 @@\n-a\n+b\n"
