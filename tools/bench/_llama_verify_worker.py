#!/usr/bin/env python3
"""llama.cpp side of ``bench_speculative.py --part verify``: a batch of n tokens of one sequence against one token.

    python _llama_verify_worker.py MODEL THREADS PROMPT ROUNDS

Runs under a Python with llama-cpp-python==0.3.36 (it does not import ggml_hybrid), through its low-level API:
in ROUNDS rounds (the sizes in order, then reversed, alternating), PROMPT random tokens are prefilled (untimed;
anew each time: a recurrent model's memory cannot drop positions) and a batch of n = 1, 2, 3, 4 tokens (every logit,
as a verify step asks) is decoded after them, timed. Prints {"median_s": {n: seconds}}. No flash attention, F16 KV
cache, ubatch 512, the file memory-mapped: ggml-hybrid's resident settings.
"""

import json
import statistics
import sys
import time

import llama_cpp as L
import numpy as np


@L.llama_log_callback
def _quiet(level, text, user_data) -> None:
    """llama.cpp's load log would bury the benchmark's table."""


def main() -> int:
    path, threads, prompt, rounds = sys.argv[1], *map(int, sys.argv[2:5])
    L.llama_log_set(_quiet, None)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 512, 512, 512, 1
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)
    mem = L.llama_get_memory(ctx)
    rng = np.random.default_rng(1)

    def decode(tokens, pos0: int, all_logits: bool) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(t), pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    head = rng.integers(0, vocab, prompt)
    sizes = [1, 2, 3, 4]
    times = {n: [] for n in sizes}
    for r in range(rounds + 1):  # the first round warms up
        for n in sizes if r % 2 == 0 else sizes[::-1]:
            # a recurrent model's memory cannot drop positions: each measurement starts from the prompt again
            L.llama_memory_clear(mem, True)
            decode(head, 0, False)
            toks = rng.integers(0, vocab, n)
            t0 = time.perf_counter()
            decode(toks, prompt, True)
            dt = time.perf_counter() - t0
            if r:
                times[n].append(dt)
    print(json.dumps({"median_s": {n: statistics.median(v) for n, v in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
