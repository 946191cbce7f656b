"""Small random-weight MoE language models in the real GGUF layouts, for tests, the demo and benchmarks.

``write_model(path, ModelSpec(...))`` writes a file that llama.cpp loads as the
same architecture, with the tensor names, shapes and metadata keys of real files:
``qwen3moe`` (per-head q/k norm), ``qwen2moe`` (q/k/v biases and a shared expert
with its sigmoid gate), ``llama`` with routed experts (Mixtral style; byte-level BPE
or, with ``vocab="spm"``, a SentencePiece vocabulary), ``olmoe``, ``glm4moe``,
``deepseek2`` (latent attention) and ``gpt-oss`` (MXFP4 experts with
``expert_type="mxfp4"``). Matrices are quantized with GGML's own routines (a row
length that does not fit the type's blocks falls back to Q8_0 or F16, as
llama.cpp's quantizer does); norms, biases, sinks and routers stay F32 as
llama.cpp's quantizer leaves them. The vocabulary is trained on a fixed corpus
(:mod:`.vocab`), so the same spec always gives the same file.
"""

from .spec import ARCHS, PRE, ModelSpec
from .vocab import train_vocab
from .writer import TEMPLATES, write_model, write_moe_stack

__all__ = ["ARCHS", "PRE", "TEMPLATES", "ModelSpec", "train_vocab", "write_model", "write_moe_stack"]
