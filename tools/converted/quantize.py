#!/usr/bin/env python3
"""llama.cpp's own quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) through llama-cpp-python:

    python tools/converted/quantize.py IN.gguf OUT.gguf Q4_K_M [--threads 1]

Runs in an environment with ``llama-cpp-python==0.3.36``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("ftype", help="a llama_ftype name without LLAMA_FTYPE_MOSTLY_, e.g. Q4_K_M")
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ns.ftype}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = ns.threads
    rc = llama_cpp.llama_model_quantize(ns.src.encode(), ns.dst.encode(), params)
    print(json.dumps({"rc": rc, "ftype": ns.ftype, "llama_cpp_python": llama_cpp.__version__}))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
