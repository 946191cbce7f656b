#!/usr/bin/env python3
"""The reproduction of vendor patch 0001 (``sched : restore replaced sources``), which upstream can take alone.

Builds GGML twice with its CPU and RPC backends, static, through the build package's cached CMake trees: the pin as
it is (the tree ``python -m ggml_hybrid_build --upstream`` makes) and the pin with patch 0001 alone; compiles
``tools/repro/sched_replaced_sources.c`` against each and runs it. On the pin the program fails (a graph computed
again after the scheduler split another one reads the other graph's tensors: an abort in the split, or wrong
numbers); with the patch all three results are right.

    python tools/repro_sched_replaced_sources.py            # both; exit 0 when the pin fails and the fix passes
    python tools/repro_sched_replaced_sources.py --only fixed

Each GGML build takes minutes the first time (cached in the build's cache folder, like the package's own).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import click

ROOT = Path(__file__).resolve().parents[1]


def _build_package() -> ModuleType:
    """The checkout's build package, loaded by its folder (it is no part of the install; sys.path stays as it is)."""
    pkg = ROOT / "ggml_hybrid_build"
    spec = importlib.util.spec_from_file_location("ggml_hybrid_build", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


_build_package()
from ggml_hybrid_build import cffi_module, cmake, paths  # noqa: E402
from ggml_hybrid_build.options import Options  # noqa: E402

SOURCE = ROOT / "tools" / "repro" / "sched_replaced_sources.c"
FIX = "0001-sched-restore-replaced-sources.patch"


def ggml_tree(fixed: bool) -> Path:
    """The cache folder of the static GGML build: the pin, or the pin with the fix alone."""
    opts = Options(patched=False)
    patches = [paths.VENDOR / "patches" / FIX] if fixed else None
    return cmake.build_tree("repro-0001" if fixed else "ggml-upstream", opts.core_args(), opts, patches)


def build_program(tree: Path, out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler")
    exe = out / "sched_replaced_sources"
    subprocess.run([cc, "-O1", "-g", str(SOURCE), f"-I{tree / 'ggml' / 'include'}", "-o", str(exe),
                    *cffi_module.static_libs(tree), "-lstdc++", "-lm", "-lpthread", "-ldl"], check=True)
    return exe


def run(fixed: bool) -> subprocess.CompletedProcess[str]:
    """The program built against one tree, run (at most 120 s); its exit status and output."""
    tree = ggml_tree(fixed)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_program(tree, Path(tmp))
        return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                              env={"GGML_NO_BACKTRACE": "1", "PATH": "/usr/bin:/bin"})


def _report(name: str, res: subprocess.CompletedProcess[str]) -> None:
    status = "exit 0" if res.returncode == 0 else f"exit {res.returncode}" if res.returncode > 0 \
        else f"signal {-res.returncode}"
    print(f"== {name}: {status}")
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip() and "Accepted client" not in ln]
    print("\n".join("   " + ln for ln in lines[-8:]))


@click.command(help=__doc__)
@click.option("--only", type=click.Choice(["pin", "fixed"]), default=None, help="run against one tree only")
def main(only: str | None) -> None:
    ok = True
    if only in (None, "pin"):
        res = run(False)
        _report("the pin", res)
        ok &= res.returncode != 0
    if only in (None, "fixed"):
        res = run(True)
        _report(f"the pin with {FIX}", res)
        ok &= res.returncode == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
