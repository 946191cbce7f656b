#!/usr/bin/env python3
"""llama.cpp's view of a GGUF model, through llama-cpp-python 0.3.36 (the oracle for parity tests).

Runs in any environment with ``llama-cpp-python==0.3.36`` and numpy; it does not
import ggml_hybrid. For each request it prints one JSON line:

    python tools/llama_reference.py MODEL --tokens 1,2,3 [--texts-json '["a b", ...]'] --out logits.npy

- the logits of every position of ``--tokens`` (float32 [positions, vocab]) to ``--out``, and with
  ``--last-out`` the logits a context that keeps only the last position's computes (its ``out_ids``);
- with ``--decode-from N`` and ``--decode-out``, the logits of every position when the first N tokens are one
  prompt and each later token is its own decode call (what token-by-token generation computes);
- the token ids llama.cpp gives each of ``--texts-json`` (no special-token parsing, BOS per the file),
  and ``llama_detokenize`` of those ids (special tokens neither removed nor rendered).

Settings mirror ggml-hybrid's defaults: no flash attention, F16 KV cache,
``n_batch`` 512, ``n_ubatch`` as given (512), the thread count given (default 1);
CPU weights repacked where GGML's CPU kernels take them repacked (llama.cpp's default, and ggml-hybrid's
``repack=true``; set here explicitly, ``use_extra_bufts``). ``--flash-attn``, ``--type-k/--type-v``
(f32, f16, q8_0) and ``--no-repack`` change them as ggml-hybrid's ``flash_attn``, ``cache_type_k/v`` and
``repack=false`` do. ``--n-gpu-layers -1`` runs every layer and the output on the GPU backend the library was built
with (ggml-hybrid's default on a GPU device: ``devices=Vulkan0``), or with ``--rpc`` on the RPC servers' devices
(``--tensor-split`` as llama.cpp's ``-ts``; llama-cpp-python built with ``GGML_RPC=on``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import numpy as np

GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # enum ggml_type


def detokenize(llm, ids: list[int]) -> str:
    """``llama_detokenize(ids, remove_special=false, unparse_special=false)``, as UTF-8 (invalid bytes replaced)."""
    import llama_cpp

    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 16 * len(ids)
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, size, False, False)
        if n >= 0:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = -n


def add_rpc_devices(servers: str) -> None:
    """llama.cpp's ``--rpc`` (common/arg.cpp, ``add_rpc_devices``): each server's registry entry, from the RPC
    backend's ``ggml_backend_rpc_add_server``, registered with GGML, whose devices llama.cpp then offloads to.
    llama-cpp-python 0.3.36 has no argument for it; this calls the same functions of the library it loaded."""
    import llama_cpp  # noqa: F401  (loads its GGML)

    # the very libggml llama.cpp uses (a wheel's libggml.so and libggml.so.0 are copies: the name matters)
    with open("/proc/self/maps") as maps:
        loaded = {line.split()[-1] for line in maps if line.rstrip().endswith("libggml.so.0")}
    if len(loaded) != 1:
        raise SystemExit(f"cannot tell which libggml llama-cpp-python loaded: {sorted(loaded)}")
    ggml = ctypes.CDLL(loaded.pop())
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise SystemExit("this llama-cpp-python has no RPC backend (build it with GGML_RPC=on)")
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(
        ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server"))
    for server in servers.split(","):
        ggml.ggml_backend_register(add(server.encode()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", default="")
    ap.add_argument("--texts-json", default="[]")
    ap.add_argument("--out")
    ap.add_argument("--last-out")
    ap.add_argument("--decode-from", type=int, default=0)
    ap.add_argument("--decode-out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--type-k", choices=sorted(GGML_TYPES), default="f16")
    ap.add_argument("--type-v", choices=sorted(GGML_TYPES), default="f16")
    ap.add_argument("--no-repack", action="store_true")
    ap.add_argument("--n-gpu-layers", type=int, default=0,
                    help="layers offloaded to the GPU backend llama-cpp-python was built with (-1: all, the output "
                         "too); with a Vulkan build on lavapipe, set GGML_VK_VISIBLE_DEVICES=0")
    ap.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                    help="RPC servers whose devices take the offloaded layers (llama.cpp's --rpc; give --n-gpu-layers)")
    ap.add_argument("--tensor-split", default=None, metavar="N0,N1,...", help="llama.cpp's -ts, one per device")
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's log on stderr (where each buffer went)")
    ns = ap.parse_args()
    import llama_cpp
    from llama_cpp import Llama, __version__

    # Llama() has no argument for use_extra_bufts and takes its model params from the binding module's
    # llama_model_default_params (llama.py imports llama_cpp.llama_cpp as llama_cpp): that is the name replaced
    default_params = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        p = default_params()
        p.use_extra_bufts = not ns.no_repack
        return p

    llama_cpp.llama_cpp.llama_model_default_params = model_params
    if ns.rpc:
        add_rpc_devices(ns.rpc)

    def load(logits_all: bool) -> Llama:
        return Llama(ns.model, n_ctx=ns.n_ctx, n_batch=512, n_ubatch=ns.ubatch, n_threads=ns.threads,
                     n_threads_batch=ns.threads, logits_all=logits_all, flash_attn=ns.flash_attn, verbose=ns.verbose,
                     n_gpu_layers=ns.n_gpu_layers, use_mmap=True, type_k=GGML_TYPES[ns.type_k],
                     type_v=GGML_TYPES[ns.type_v],
                     tensor_split=[float(x) for x in ns.tensor_split.split(",")] if ns.tensor_split else None)

    llm = load(True)
    out = {"llama_cpp_python": __version__, "tokenized": []}
    for text in json.loads(ns.texts_json):
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        out["tokenized"].append({"text": text, "ids": ids, "detokenized": detokenize(llm, ids)})
    if ns.tokens:
        toks = [int(t) for t in ns.tokens.split(",")]
        llm.eval(toks)
        logits = np.asarray(llm.scores[:len(toks)], dtype=np.float32)
        np.save(ns.out, logits)
        out["positions"] = len(toks)
        if ns.last_out:
            last = load(False)
            last.eval(toks)  # one decode call (n_batch 512) whose only output is the last position
            row = np.ctypeslib.as_array(last._ctx.get_logits(), shape=(last.n_vocab(),))
            np.save(ns.last_out, np.array(row, dtype=np.float32)[None, :])
        if ns.decode_from:
            dec = load(True)
            dec.eval(toks[:ns.decode_from])
            for t in toks[ns.decode_from:]:
                dec.eval([t])  # one decode call per token
            np.save(ns.decode_out, np.asarray(dec.scores[:len(toks)], dtype=np.float32))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
