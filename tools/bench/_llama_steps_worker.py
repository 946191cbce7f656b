#!/usr/bin/env python3
"""llama.cpp side of ``bench_serve.py --part steps``: decode steps of S sequences in one ``llama_batch``.

    python _llama_steps_worker.py MODEL THREADS N_SEQ N_CTX_PER_SEQ PROMPT

Runs under a Python with llama-cpp-python==0.3.36 (it does not import ggml_hybrid), through its low-level
API, as llama.cpp's server batches its slots: every sequence (``n_seq_max`` = N_SEQ, one KV stream each)
is prefilled with PROMPT random tokens once; a request {"level": S, "n": n, "seed": k} runs n steps of one
token for each of sequences 0..S-1 (all logits), then removes those cells again, and answers {"tok_s": S * n
/ wall seconds}. No flash attention, F16 KV cache, ubatch 512: the ggml-hybrid side's settings.
"""

import json
import sys
import time

import llama_cpp as L
import numpy as np


@L.llama_log_callback
def _quiet(level, text, user_data) -> None:
    """llama.cpp's load log would bury the benchmark's table (the worker's stderr is the benchmark's)."""


def main() -> int:
    path, threads, n_seq, n_ctx_seq, prompt = sys.argv[1], *map(int, sys.argv[2:6])
    L.llama_log_set(_quiet, None)
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx_seq * n_seq, 512, 512, n_seq
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, n_seq)
    mem = L.llama_get_memory(ctx)

    def submit(items) -> None:  # (seq, pos, token, logits?) rows of one batch
        batch.n_tokens = len(items)
        for i, (s, p, t, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, out
            batch.seq_id[i][0] = s
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    rng = np.random.default_rng(1)
    for s in range(n_seq):
        submit([(s, p, int(t), p == prompt - 1) for p, t in enumerate(rng.integers(0, vocab, prompt))])
    print(json.dumps({"ready": True, "vocab": vocab}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        lvl, n = req["level"], req["n"]
        toks = np.random.default_rng(req["seed"]).integers(0, vocab, (n, lvl))
        t0 = time.perf_counter()
        for step in range(n):
            submit([(s, prompt + step, int(toks[step, s]), True) for s in range(lvl)])
        dt = time.perf_counter() - t0
        for s in range(lvl):
            L.llama_memory_seq_rm(mem, s, prompt, -1)
        print(json.dumps({"tok_s": lvl * n / dt}), flush=True)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
