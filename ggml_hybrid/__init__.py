"""ggml-hybrid: run Mixture-of-Experts models larger than GPU memory over a patched GGML scheduler.

The layers, bottom up; each imports only the layers below it (docs/architecture.md has the map):

- ``ggml_hybrid._native``: the cffi module: the pinned GGML with the patch series (vendor/), our C
  (``_native/src``), the build's fingerprints checked at import, optional backends loaded at run time;
- ``ggml_hybrid.ggml``: owned Python objects over GGML: backends, contexts, tensors, ops, graphs, the scheduler
  and its regions, RPC devices;
- ``ggml_hybrid.options``: ``SessionOptions``, every option with its rule;
- ``ggml_hybrid.gguf``: the memory-mapped GGUF file, its header, metadata and tensor-name rules;
- ``ggml_hybrid.moe``: the routed-expert FFN and its region, the device expert cache (slot cache, native and
  Python executors), the CPU share of misses, the CPU worker, the host tier, FFN-only stack sessions, routing
  traces;
- ``ggml_hybrid.model``: graph building: hyperparameters, one module per family, layers, the KV cache and
  recurrent states, the decoder graph;
- ``ggml_hybrid.placement``: the layout (which device holds each tensor, from llama.cpp's flags) and the devices;
- ``ggml_hybrid.text``: tokenizers (byte-level BPE, SentencePiece) and chat templates;
- ``ggml_hybrid.runtime``: ``LoadedModel`` (what was loaded), ``Session`` (what a run holds), ``MoEModel`` (the
  session that loads its own model), the serving engine, generation, sampling, constrained decoding;
- ``ggml_hybrid.synthetic``: GGUF writers of every family (random weights), for tests, benchmarks and the demo;
- ``ggml_hybrid.plan``: the planner (bytes per device before loading), ``inspect``, the Kubernetes Deployment;
- ``ggml_hybrid.server``: ``serve``'s HTTP app (OpenAI's and Anthropic's APIs; /tokenize, /props, /slots, metrics);
- ``ggml_hybrid.cli``: the ``ggml-hybrid`` command.

Shared by every layer: ``ggml_hybrid.errors`` (every exception), ``ggml_hybrid.checks`` (argument rules),
``ggml_hybrid.units`` (byte sizes), ``ggml_hybrid.files`` (output files), ``ggml_hybrid.serial`` (one call at a
time), ``ggml_hybrid.machine`` (cores and memory).

Everything a user needs is importable from here.
"""

from __future__ import annotations

from . import errors
from ._native import GGML_VERSION, ffi, lib
from ._native.managed import live_objects
from .errors import GgmlHybridError
from .ggml.backend import Backend, Buffer, Device, cpu, cuda, cuda_available, devices, gpu, vulkan, vulkan_available
from .ggml.context import Context
from .ggml.dtypes import GGMLType, as_ggml_type
from .ggml.graph import Graph
from .ggml.quant import dequantize, quantize
from .ggml.regions import DECLINE, Region, RegionCall
from .ggml.sched import Scheduler
from .ggml.step_io import StepIO
from .ggml.tensor import Tensor
from .moe.stack_session import MoEStackSession
from .options import SessionOptions
from .runtime.generate import GenerationStats, complete, generate
from .runtime.loaded_model import LoadedModel
from .runtime.moe_model import MoEModel
from .runtime.sampling import Sampler
from .runtime.session import Session
from .text.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "DECLINE", "GGML_VERSION", "Backend", "Buffer", "Context", "Device", "GGMLType", "GenerationStats",
    "GgmlHybridError", "Graph", "LoadedModel", "MoEModel", "MoEStackSession", "Region", "RegionCall", "Sampler",
    "Scheduler", "Session", "SessionOptions", "StepIO", "Tensor", "Tokenizer", "__version__", "as_ggml_type",
    "complete", "cpu", "cuda", "cuda_available", "dequantize", "devices", "errors", "ffi", "generate", "gpu", "lib",
    "live_objects", "quantize", "vulkan", "vulkan_available",
]
