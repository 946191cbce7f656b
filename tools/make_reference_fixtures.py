#!/usr/bin/env python3
"""Record llama.cpp's logits and token ids for small generated models as test fixtures.

    python tools/make_reference_fixtures.py --llama-python /path/to/venv/bin/python [--out tests/fixtures/llama_ref]

The interpreter given must have ``llama-cpp-python==0.3.36`` (see docs/models.md).
Each case becomes ``CASE.npz``: the model spec (JSON), the sha256 of the file
the generator wrote, the prompt tokens, llama.cpp's float32 logits of every
position, and llama.cpp's ids for the tokenizer texts. Tests regenerate the
model from the spec, check the hash, and compare without building llama.cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import numpy as np

from ggml_hybrid.model.synthetic import ModelSpec, write_model

PROMPT = "Hello, world! The quick brown fox jumps over the lazy dog."
TEXTS = ["Hello, world! The quick brown fox", "It's 2026-11-29; naïve café 東京   x\n\ny 12345678",
         "  leading spaces and  ĞÜ don't\tWE'LL", "def forward(x): return x + 3.14159  # ok", ""]

# name -> (spec, ubatch): F32/Q8_0 must match to 1e-3; the others are recorded as reached
CASES = {
    "qwen3moe_f32": (ModelSpec(arch="qwen3moe", weight_type="f32", seed=1), 512),
    "qwen3moe_q8_0": (ModelSpec(arch="qwen3moe", weight_type="q8_0", seed=2), 512),
    "qwen3moe_f16_tied": (ModelSpec(arch="qwen3moe", weight_type="f16", tie_embeddings=True, seed=3), 512),
    "qwen3moe_q8_0_ubatch5": (ModelSpec(arch="qwen3moe", weight_type="q8_0", seed=8), 5),
    # GGML's CPU K-quant kernels round differently for batches under 8 rows, which random weights amplify;
    # llama.cpp repacks Q4_K (q4_K_8x8) and matches the >= 8-row results, so this case uses one ubatch
    "qwen3moe_q4_K": (ModelSpec(arch="qwen3moe", weight_type="q4_K", n_embd=256, n_ff_exp=256, n_head=2,
                                n_head_kv=1, head_dim=128, seed=4), 512),
    "qwen2moe_q8_0": (ModelSpec(arch="qwen2moe", weight_type="q8_0", head_dim=16, seed=5), 512),
    "llama_q6_K": (ModelSpec(arch="llama", weight_type="q6_K", n_embd=256, n_ff_exp=256, n_head=4, n_head_kv=2,
                             head_dim=64, seed=6), 512),
}


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prompt_tokens(path) -> list[int]:
    from ggml_hybrid.model.gguf_store import GGUFStore
    from ggml_hybrid.model.tokenizer import Tokenizer

    store = GGUFStore(path)
    try:
        return Tokenizer.from_gguf(store).encode(PROMPT)
    finally:
        store.close()


def reference(llama_python: str, model: str, tokens: list[int], ubatch: int, out_npy: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [llama_python, os.path.join(here, "llama_reference.py"), model, "--tokens", ",".join(map(str, tokens)),
           "--texts-json", json.dumps(TEXTS), "--out", out_npy, "--ubatch", str(ubatch)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"llama_reference failed for {model}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python==0.3.36")
    ap.add_argument("--out", default=os.path.join("tests", "fixtures", "llama_ref"))
    ap.add_argument("--case", action="append", help="only these cases")
    ns = ap.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (spec, ubatch) in CASES.items():
            if ns.case and name not in ns.case:
                continue
            path = write_model(os.path.join(tmp, f"{name}.gguf"), spec)
            tokens = prompt_tokens(path)
            npy = os.path.join(tmp, f"{name}.npy")
            info = reference(ns.llama_python, path, tokens, ubatch, npy)
            np.savez_compressed(os.path.join(ns.out, f"{name}.npz"), spec=json.dumps(asdict(spec)),
                                sha256=sha256(path), tokens=np.asarray(tokens, np.int32), logits=np.load(npy),
                                ubatch=ubatch, tokenized=json.dumps(info["tokenized"]),
                                llama_cpp_python=info["llama_cpp_python"])
            print(f"{name}: {len(tokens)} positions, {os.path.getsize(os.path.join(ns.out, name + '.npz'))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
