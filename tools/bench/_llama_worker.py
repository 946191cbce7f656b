#!/usr/bin/env python3
"""llama.cpp side of bench_vs_llama.py: loads a model once, then answers timing requests on stdin.

    python _llama_worker.py MODEL THREADS N_CTX [--cpu-moe] [--no-repack] [--threads-batch N]

Runs under a Python with llama-cpp-python==0.3.36 (it does not import ggml_hybrid).
Request (one JSON line): {"tokens": [...], "n": N} (optionally "force": N-1 tokens decoded instead of the
greedy ones). Reply: {"prompt_s", "decode_s", "prompt_cpu", "decode_cpu",
"tokens", "decode_c"}: the prompt is evaluated in one call, then N-1 greedy tokens one eval each, as the
ggml-hybrid side does; wall seconds and this process's CPU seconds of each, and the wall seconds of the decode
spent inside ``llama_decode`` (the rest is llama-cpp-python's own per-step Python).

``--cpu-moe`` is llama.cpp's ``-cmoe``: the routed experts' tensors overridden to the CPU buffer type
(``LLM_FFN_EXPS_REGEX``), which llama.cpp resolves over the CPU's extra buffer types first (so they are
repacked where the type allows). llama-cpp-python has no parameter for tensor overrides; the worker sets
``llama_model_params.tensor_buft_overrides`` itself. ``--no-repack`` is llama.cpp's ``-nr``
(``use_extra_bufts = false``; llama.cpp repacks by default, as ggml-hybrid does).
"""

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import llama_cpp
import llama_cpp._internals
import numpy as np
from llama_cpp import Llama

CPU_MOE_PATTERN = rb"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's common.h LLM_FFN_EXPS_REGEX


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_moe_overrides():
    """A NULL-terminated override array putting the routed experts on the CPU buffer type (kept alive by the caller)."""
    # the CPU backend's own library: llama.cpp compares the override's buffer type with its
    # ggml_backend_cpu_buffer_type() to resolve it over the extra (repacked) types, as -cmoe does
    cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    arr = (_Override * 2)()
    arr[0].pattern = CPU_MOE_PATTERN
    arr[0].buft = cpu.ggml_backend_cpu_buffer_type()
    return arr


def last_logits(llm):
    """The logits of the last evaluated token (llama-cpp-python keeps scores only with logits_all)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("threads", type=int)
    ap.add_argument("n_ctx", type=int)
    ap.add_argument("--cpu-moe", action="store_true")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--threads-batch", type=int)
    ns = ap.parse_args()
    keep = cpu_moe_overrides() if ns.cpu_moe else None
    # Llama() calls the binding module's llama_model_default_params (llama.py imports llama_cpp.llama_cpp as
    # llama_cpp), so that is the name to replace; the package's re-export is not what it calls
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def with_settings():
        p = default_params()
        if keep is not None:
            p.tensor_buft_overrides = ctypes.addressof(keep)
        p.use_extra_bufts = not ns.no_repack
        return p

    llama_cpp.llama_cpp.llama_model_default_params = with_settings
    inside = [0.0]  # seconds in llama_decode since the last reset
    binding = llama_cpp._internals.llama_cpp  # the name llama-cpp-python's context calls llama_decode through
    real_decode = binding.llama_decode

    def timed_decode(ctx, batch):
        t = time.perf_counter()
        try:
            return real_decode(ctx, batch)
        finally:
            inside[0] += time.perf_counter() - t

    binding.llama_decode = timed_decode
    llm = Llama(ns.model, n_ctx=ns.n_ctx, n_batch=512, n_ubatch=512, n_threads=ns.threads,
                n_threads_batch=ns.threads_batch or ns.threads, logits_all=False, flash_attn=False, verbose=False,
                n_gpu_layers=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        llm.eval(req["tokens"])
        t1, c1 = time.perf_counter(), time.process_time()
        inside[0] = 0.0
        out = [int(np.argmax(last_logits(llm)))]
        # "force": the tokens to decode instead of the greedy ones (a varied sequence routes like real text would
        # more than a random model's greedy loop, which repeats one token); the greedy picks are still returned
        force = req.get("force")
        for i in range(req["n"] - 1):
            llm.eval([force[i] if force else out[-1]])
            out.append(int(np.argmax(last_logits(llm))))
        t2, c2 = time.perf_counter(), time.process_time()
        print(json.dumps({"prompt_s": t1 - t0, "decode_s": t2 - t1, "prompt_cpu": c1 - c0, "decode_cpu": c2 - c1,
                          "tokens": out, "decode_c": inside[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
