#!/usr/bin/env python3
"""Generate a small random-weight MoE GGUF in the real tensor layout (quantized with GGML's own routines).

The file holds a stack of MoE FFN layers as llama.cpp names them for qwen3moe:
``blk.N.ffn_norm.weight``, ``blk.N.ffn_gate_inp.weight`` and the routed experts
``blk.N.ffn_{gate,up,down}_exps.weight`` (or the fused ``ffn_gate_up_exps``).

    python tools/gen_moe_gguf.py OUT.gguf [--layers 4] [--embd 256] [--ff 256] [--experts 16] [--used 4] [--type q4_K]
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np

import ggml_hybrid as gh

ARCH = "qwen3moe"


def write_moe_stack(path, n_layer=4, n_embd=256, n_ff=256, n_expert=16, n_used=4, expert_type="q8_0",
                    fused=False, seed=0) -> str:
    t = gh.as_ggml_type(expert_type)
    for name, n in (("n_embd", n_embd), ("n_ff", n_ff)):
        if n % t.block_size:
            raise ValueError(f"{name}={n} must be a multiple of the {t.name} block size {t.block_size}")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    w.add_expert_feed_forward_length(n_ff)
    w.add_layer_norm_rms_eps(1e-6)

    def experts(rows, cols):
        # scaled so that activations stay O(1) through the stack
        data = (rng.standard_normal((n_expert, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        if t == gh.GGMLType.F32:
            return data, None
        if t == gh.GGMLType.F16:
            return data.astype(np.float16), None
        return gh.quantize(data, t), gguf.GGMLQuantizationType(int(t))

    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                     (rng.standard_normal((n_expert, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
        kinds = [("gate_up", 2 * n_ff, n_embd)] if fused else [("gate", n_ff, n_embd), ("up", n_ff, n_embd)]
        for kind, rows, cols in kinds + [("down", n_embd, n_ff)]:
            data, raw = experts(rows, cols)
            w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--fused", action="store_true", help="one ffn_gate_up_exps tensor instead of gate and up")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    write_moe_stack(ns.out, ns.layers, ns.embd, ns.ff, ns.experts, ns.used, ns.type, ns.fused, ns.seed)
    print(ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
