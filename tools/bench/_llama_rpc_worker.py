#!/usr/bin/env python3
"""llama.cpp side of bench_hosts.py: llama-cpp-python 0.3.36 (built with GGML_RPC=on) over RPC workers, every layer
offloaded, split 1:1; a prompt in one call, then greedy tokens one call each. Prints one JSON line:
{"prompt_s": [...], "decode_s": [...], "tokens": [...]}. Runs under the reference interpreter (it does not import
ggml_hybrid).

    python _llama_rpc_worker.py MODEL --rpc HOST:PORT,HOST:PORT --prompt 64 --decode 17 --reps 3
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def _add_rpc_devices():
    """tools/llama_reference.py's add_rpc_devices, its module loaded by file (no sys.path edit)."""
    spec = importlib.util.spec_from_file_location("llama_reference", Path(__file__).resolve().parents[1] /
                                                  "llama_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.add_rpc_devices


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rpc", required=True)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=17)
    ap.add_argument("--reps", type=int, default=3)
    ns = ap.parse_args()
    _add_rpc_devices()(ns.rpc)
    n = ns.rpc.count(",") + 1
    llm = Llama(ns.model, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, n_threads_batch=1, n_gpu_layers=-1,
                tensor_split=[1.0] * n, flash_attn=False, verbose=False)  # ggml-hybrid's defaults

    def last() -> int:  # the last position's logits (logits_all off: llm.scores is not filled)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    prompt = list(range(10, 10 + ns.prompt))
    out = {"prompt_s": [], "decode_s": [], "tokens": []}
    for _ in range(ns.reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        # the prompt's time ends when its logits are read, as ours (whose eval returns them): over RPC llama_decode
        # returns before the last worker's graph is done (~5 ms of a 64-token prompt here), get_logits waits for it
        toks = [last()]
        out["prompt_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(ns.decode - 1):
            llm.eval([toks[-1]])
            toks.append(last())
        out["decode_s"].append(time.perf_counter() - t0)
        out["tokens"] = toks
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
