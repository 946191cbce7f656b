#!/usr/bin/env python3
"""llama.cpp's view of a GGUF model, through llama-cpp-python 0.3.36 (the oracle for parity tests).

Runs in any environment with ``llama-cpp-python==0.3.36`` and numpy; it does not
import ggml_hybrid. For each request it prints one JSON line:

    python tools/llama_reference.py MODEL --tokens 1,2,3 [--texts-json '["a b", ...]'] --out logits.npy

- the logits of every position of ``--tokens`` (float32 [positions, vocab]) to ``--out``;
- the token ids llama.cpp gives each of ``--texts-json`` (no special-token parsing, BOS per the file).

Settings mirror ggml-hybrid's defaults: no flash attention, F16 KV cache,
``n_batch`` 512, ``n_ubatch`` as given (512), the thread count given (default 1).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="")
    ap.add_argument("--texts-json", default="[]")
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--ubatch", type=int, default=512)
    ns = ap.parse_args()
    from llama_cpp import Llama, __version__

    llm = Llama(ns.model, n_ctx=ns.n_ctx, n_batch=512, n_ubatch=ns.ubatch, n_threads=ns.threads,
                n_threads_batch=ns.threads, logits_all=True, flash_attn=ns.flash_attn, verbose=False,
                n_gpu_layers=0, use_mmap=True)
    out = {"llama_cpp_python": __version__, "tokenized": []}
    for text in json.loads(ns.texts_json):
        out["tokenized"].append({"text": text, "ids": llm.tokenize(text.encode(), add_bos=True, special=False)})
    if ns.tokens:
        toks = [int(t) for t in ns.tokens.split(",")]
        llm.eval(toks)
        logits = np.asarray(llm.scores[:len(toks)], dtype=np.float32)
        np.save(ns.out, logits)
        out["positions"] = len(toks)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
