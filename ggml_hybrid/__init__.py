"""ggml-hybrid: run Mixture-of-Experts models larger than GPU memory over a patched GGML scheduler.

The native layer is GGML (pinned in ``vendor/``, patched, built by ``build.py``)
reached through cffi; this package wraps it in owned Python objects.
"""

from __future__ import annotations

from . import errors
from ._lib import ffi, lib
from ._managed import live_objects
from .backend import Backend, Buffer, Device, cpu, cuda, cuda_available, devices
from .context import Context
from .dtypes import GGMLType, as_ggml_type
from .errors import GgmlHybridError
from .graph import Graph
from .quant import dequantize, quantize
from .regions import DECLINE, Region, RegionCall
from .sched import Scheduler
from .tensor import Tensor

__version__ = "0.1.0"
GGML_VERSION = ffi.string(lib.ggml_hybrid_ggml_version()).decode()

__all__ = [
    "DECLINE", "Region", "RegionCall", "Backend", "Buffer", "Context", "Device", "GGMLType", "GgmlHybridError", "Graph", "Scheduler", "Tensor",
    "as_ggml_type", "cpu", "cuda", "cuda_available", "dequantize", "devices", "errors", "live_objects",
    "quantize", "GGML_VERSION", "__version__",
]
