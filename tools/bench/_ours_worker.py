#!/usr/bin/env python3
"""One checkout's ggml-hybrid, for bench_commits.py: loads a model once, then answers timing requests on stdin.

    PYTHONPATH=CHECKOUT python _ours_worker.py MODEL THREADS N_CTX

It imports only ``ggml_hybrid``'s public names (``gh.MoEModel``, ``gh.SessionOptions``), which every commit
compared has, so the same worker runs against any checkout whose native module is built. Request (one JSON
line): {"tokens": [...], "n": N}; reply: {"prompt_s", "decode_s", "prompt_cpu", "decode_cpu", "tokens",
"where"}: the prompt in one eval, then N-1 greedy tokens one eval each (as bench_vs_llama's sides run); wall and
this process's CPU seconds of each; ``where`` is the package's folder, so the caller can check which checkout
answered.
"""

import json
import sys
import time

import click
import numpy as np

import ggml_hybrid as gh


@click.command(help=__doc__)
@click.argument("model_path")
@click.argument("threads", type=int)
@click.argument("n_ctx", type=int)
def main(model_path: str, threads: int, n_ctx: int) -> None:
    model = gh.MoEModel(model_path, gh.SessionOptions(n_threads=threads, n_ctx=n_ctx))
    print(json.dumps({"ready": True, "where": gh.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        model.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        out = [int(np.argmax(model.eval(req["tokens"])[-1]))]
        t1, c1 = time.perf_counter(), time.process_time()
        for _ in range(req["n"] - 1):
            out.append(int(np.argmax(model.eval([out[-1]])[-1])))
        t2, c2 = time.perf_counter(), time.process_time()
        print(json.dumps({"prompt_s": t1 - t0, "decode_s": t2 - t1, "prompt_cpu": c1 - c0, "decode_cpu": c2 - c1,
                          "tokens": out}), flush=True)
    model.close()


if __name__ == "__main__":
    main()
