#!/usr/bin/env python3
"""llama.cpp's next-token-prediction (MTP) draft head on a GGUF model, through llama-cpp-python 0.3.36's C API.

Runs in any environment with ``llama-cpp-python==0.3.36`` and numpy; it does not import ggml_hybrid:

    python tools/llama_mtp_reference.py MODEL --tokens 1,2,3 --draft 3 --out mtp.npz

It does what ``common/speculative.cpp``'s ``draft-mtp`` does with a target context and an MTP context
(``LLAMA_CONTEXT_TYPE_MTP``, ``ctx_other`` = the target), with every logit it computes kept:

1. the target context (the model loaded with ``load_mtp``, ``llama_set_embeddings_nextn(ctx, true, false)``)
   evaluates ``--tokens`` in one batch: its logits and its hidden state ``h_nextn`` of every position;
2. the MTP context evaluates the same positions in one batch, position p pairing token x_p with the target's
   h_{p-1} (zeros at p = 0), as ``process`` does, here with the logits of every position kept;
3. ``--draft`` draft steps follow, one token each, as ``draft`` runs them: the first pairs the greedy token after
   the prompt (the target's argmax) with the target's last h at the next position, each next one pairs the head's
   argmax with the head's own h.

Written to ``--out`` (npz): ``target_logits`` [T, V], ``target_h`` [T, E], ``mtp_logits`` [T, V], ``mtp_h`` [T, E],
``draft_tokens`` [D], ``draft_logits`` [D, V], ``draft_h`` [D, E]; one JSON line on stdout. Settings as
``tools/llama_reference.py`` (ggml-hybrid's defaults: no flash attention, F16 KV cache, n_batch = n_ubatch = 512,
``--threads``, CPU weights repacked unless ``--no-repack``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # enum ggml_type


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--draft", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--no-repack", action="store_true")
    ns = ap.parse_args()
    import llama_cpp as L
    from llama_cpp import __version__

    lib = L.llama_cpp._lib
    # the staging API of src/llama-ext.h: exported with C++ linkage (the header has no extern "C"), not bound by
    # llama-cpp-python
    set_nextn = lib._Z26llama_set_embeddings_nextnP13llama_contextbb
    set_nextn.argtypes, set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    get_nextn_ith = lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
    get_nextn_ith.argtypes, get_nextn_ith.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_mmap = True
    mp.use_extra_bufts = not ns.no_repack
    mp.load_mtp = True
    model = L.llama_model_load_from_file(ns.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {ns.model}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    n_embd = L.llama_model_n_embd(model)
    if L.llama_model_n_layer_nextn(model) != 1:
        raise SystemExit(f"{ns.model}: {L.llama_model_n_layer_nextn(model)} next-token-prediction layers, not 1")

    def context(mtp: bool, other):
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = ns.n_ctx, 512, 512
        cp.n_threads = cp.n_threads_batch = ns.threads
        cp.flash_attn_type = 1 if ns.flash_attn else 0  # enabled / disabled
        cp.type_k = cp.type_v = GGML_TYPES["f16"]
        cp.n_seq_max = 1
        if mtp:
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            cp.ctx_other = other
            cp.n_rs_seq = 0
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit("llama.cpp could not create the context")
        return ctx

    tgt = context(False, None)
    set_nextn(tgt, True, False)
    dft = context(True, tgt)
    set_nextn(dft, True, True)

    def run(ctx, rows: list[tuple[int, int, np.ndarray | None]]) -> None:
        """One batch: (token, position, h or None) rows, every row an output."""
        batch = L.llama_batch_ext_init(ctx)
        keep = []
        for tok, pos, h in rows:
            idx = L.llama_batch_ext_add_token(batch, 0, tok)
            if idx < 0:
                raise SystemExit(f"llama_batch_ext_add_token: {idx}")
            p = (L.llama_pos * 4)(pos, 0, 0, 0)
            keep.append(p)
            L.llama_batch_ext_set_pos(batch, idx, p)
            if h is not None:
                arr = np.ascontiguousarray(h, np.float32)
                keep.append(arr)
                e = L.llama_embd(arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
                if not L.llama_batch_ext_set_embd_token(batch, idx, e):
                    raise SystemExit("llama_batch_ext_set_embd_token failed")
            L.llama_batch_ext_set_output_logits(batch, idx, True)
        rc = L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch)
        L.llama_batch_ext_free(batch)
        if rc != 0:
            raise SystemExit(f"llama_process: {rc}")

    def logits(ctx, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).astype(np.float32)

    def hidden(ctx, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(get_nextn_ith(ctx, i), shape=(n_embd,)).astype(np.float32)

    toks = [int(t) for t in ns.tokens.split(",")]
    T = len(toks)
    run(tgt, [(t, p, None) for p, t in enumerate(toks)])
    target_logits = np.stack([logits(tgt, i) for i in range(T)])
    target_h = np.stack([hidden(tgt, i) for i in range(T)])
    zero = np.zeros(n_embd, np.float32)
    run(dft, [(t, p, target_h[p - 1] if p else zero) for p, t in enumerate(toks)])
    mtp_logits = np.stack([logits(dft, i) for i in range(T)])
    mtp_h = np.stack([hidden(dft, i) for i in range(T)])
    tok, h = int(np.argmax(target_logits[-1])), target_h[-1]
    draft_tokens, draft_logits, draft_h = [], [], []
    for i in range(ns.draft):
        run(dft, [(tok, T + i, h)])
        draft_tokens.append(tok)
        draft_logits.append(logits(dft, 0))
        h = hidden(dft, 0)
        draft_h.append(h)
        tok = int(np.argmax(draft_logits[-1]))
    np.savez(ns.out, target_logits=target_logits, target_h=target_h, mtp_logits=mtp_logits, mtp_h=mtp_h,
             draft_tokens=np.asarray(draft_tokens, np.int32), draft_logits=np.stack(draft_logits),
             draft_h=np.stack(draft_h))
    L.llama_free(dft)
    L.llama_free(tgt)
    L.llama_model_free(model)
    print(json.dumps({"llama_cpp_python": __version__, "positions": T, "draft": ns.draft}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
