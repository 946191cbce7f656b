#!/usr/bin/env python3
"""llama.cpp side of bench_vs_llama.py: loads a model once, then answers timing requests on stdin.

Runs under a Python with llama-cpp-python==0.3.36 (it does not import ggml_hybrid).
Request (one JSON line): {"tokens": [...], "n": N}. Reply: {"prompt_s", "decode_s", "tokens"}:
the prompt is evaluated in one call, then N-1 greedy tokens one eval each, as ggml-hybrid does.
"""

import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def last_logits(llm):
    """The logits of the last evaluated token (llama-cpp-python keeps scores only with logits_all)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def main() -> int:
    model, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = Llama(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                logits_all=False, flash_attn=False, verbose=False, n_gpu_layers=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(req["tokens"])
        t1 = time.perf_counter()
        out = [int(np.argmax(last_logits(llm)))]
        for _ in range(req["n"] - 1):
            llm.eval([out[-1]])
            out.append(int(np.argmax(last_logits(llm))))
        t2 = time.perf_counter()
        print(json.dumps({"prompt_s": t1 - t0, "decode_s": t2 - t1, "tokens": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
