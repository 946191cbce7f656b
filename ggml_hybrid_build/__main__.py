"""``python -m ggml_hybrid_build``: build the native part in place (what ``pip install -e .`` runs), or ask the build
about itself (its cache folder, the ABI probe's verdict)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import __doc__ as overview
from . import abi, cmake, paths, progress
from .install import build, replace_file
from .options import BACKENDS, Options, options_from_env


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ggml_hybrid_build", description=overview,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--abi", action="store_true",
                    help="run the ABI probe (the pin's headers against the patched ones), print its verdict and exit")
    ap.add_argument("--print-cache", action="store_true", help="print the cache folder and exit")
    return ap


def _options(ns: argparse.Namespace) -> Options:
    """The build the flags and the environment ask for (a flag adds to what the environment asks)."""
    for name, spec in BACKENDS.items():
        prebuilt = getattr(ns, f"{name}_lib")
        if prebuilt is not None:
            os.environ[f"{spec.switch}_LIB"] = str(prebuilt.resolve())
    env = options_from_env()
    backends = tuple(n for n in BACKENDS if getattr(ns, n) or getattr(ns, f"{n}_lib") or n in env.backends)
    if ns.upstream:
        return Options(patched=False)
    return Options(backends=backends, portable=ns.portable or env.portable, cuda_arch=ns.cuda_arch or env.cuda_arch)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.print_cache:
        print(paths.cache_root())
        return 0
    if ns.abi:
        verdict = abi.abi_verdict(fresh=True)
        print(json.dumps({**verdict, "stamp": abi.abi_stamp(), "pin_stamp": paths.info.pin_abi_stamp()}, indent=1))
        return 0
    opts = _options(ns)
    out = ns.out or (paths.ROOT / "build" / "upstream" / "ggml_hybrid" / "_native" if ns.upstream else paths.NATIVE)
    build(opts, out)
    if ns.pin_cpu:
        dest = paths.PIN_CPU_DIR / "libggml-cpu.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        replace_file(cmake.build_pin_cpu(opts), dest)
        progress.log(f"installed the pin's CPU backend as {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
