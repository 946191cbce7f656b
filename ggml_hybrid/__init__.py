"""ggml-hybrid: run Mixture-of-Experts models larger than GPU memory over a patched GGML scheduler.

The layers, bottom up (docs/architecture.md has the map):

- ``ggml_hybrid._native``: the cffi module (pinned GGML, the patch series, our C);
- ``ggml_hybrid.ggml``: owned Python objects over GGML: backends, contexts, tensors, ops, graphs,
  the scheduler and its regions;
- ``ggml_hybrid.moe``: the routed-expert FFN, the device expert cache (slot cache, executor), the
  CPU share of misses, the CPU worker, FFN-only stack sessions and routing traces;
- ``ggml_hybrid.model``: GGUF files, hyperparameters, the KV cache, the decoder graph, ``MoEModel``,
  tokenizer, sampling and generation;
- ``ggml_hybrid.placement``: tensor layout over devices, the devices, the memory planner;
- ``ggml_hybrid.cli``: the ``ggml-hybrid`` command.

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
