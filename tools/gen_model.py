#!/usr/bin/env python3
"""Write a small random-weight MoE language model in a real GGUF layout (llama.cpp loads it too).

This is ``ggml-hybrid gen`` (``ggml_hybrid/cli/gen.py``), with the same arguments:

    python tools/gen_model.py OUT.gguf [--arch qwen3moe|qwen2moe|llama|olmoe|glm4moe|deepseek2|gpt-oss|qwen3next|
        qwen35moe] [--type q8_0]
        [--layers 2] [--embd 64] [--heads 4] [--kv-heads 2] [--head-dim 32] [--ff 64] [--experts 8] [--used 2]
        [--vocab 384] [--seed 0] [--set FIELD=VALUE ...]

``--set`` sets any other ModelSpec field (ggml_hybrid/synthetic/spec.py), e.g.
``--set expert_type=mxfp4`` (gpt-oss), ``--set n_dense_lead=1``, ``--set vocab=spm``, ``--set d_state=128``
``--set attn_interval=4`` (qwen3next, qwen35moe: delta-net head size, one attention layer in four).
Matrices are quantized with GGML's own routines; the vocabulary is trained on a fixed
corpus. The same arguments always give the same file.
"""

from __future__ import annotations

import sys

from ggml_hybrid.cli.main import main as _group


def main() -> None:
    import ggml_hybrid.cli  # noqa: F401  (registers the commands, gen among them)

    _group(["gen", *sys.argv[1:]], prog_name="ggml-hybrid")  # its usage line names the command it is


if __name__ == "__main__":
    main()
