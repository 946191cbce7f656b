"""The devices a session can place tensors on: CUDA GPUs, or CPU backend instances standing in for them.

Names follow llama.cpp: ``CUDA0``, ``CUDA1``, ... and ``CPU`` for host memory. On a machine
without a GPU, ``virtual_devices`` CPU backend instances play the devices as ``DEV0``, ``DEV1``,
...: each has its own buffers, threadpool and expert cache, so multi-device layouts run (and
is tested) anywhere.
"""

from __future__ import annotations

from ..ggml.backend import Backend, cpu_instance, cuda, cuda_available
from ..options import SessionOptions
from .layout import CPU


def device_names(opts: SessionOptions | None = None) -> list[str]:
    """The accelerator names a session with ``opts`` would have (CPU not included)."""
    if cuda_available():
        from .._native import lib

        return [f"CUDA{i}" for i in range(lib.ggml_hybrid_cuda_device_count())]
    n = (opts or SessionOptions()).virtual_devices
    return [f"DEV{i}" for i in range(n)]


def open_devices(opts: SessionOptions, n_threads: int) -> dict[str, Backend]:
    """Backends for :func:`device_names`, in order."""
    out = {}
    for name in device_names(opts):
        out[name] = cuda(int(name[4:])) if name.startswith("CUDA") else cpu_instance(int(name[3:]), n_threads)
    return out


def describe_devices(opts: SessionOptions | None = None) -> list[dict]:
    from ..ggml.backend import devices as ggml_devices

    gpus = {d.name: d for d in ggml_devices() if d.type == "gpu"}
    rows = []
    for name in device_names(opts):
        d = gpus.get(name)
        rows.append({"name": name, "kind": "gpu" if d else "cpu-instance",
                     "description": d.description if d else "CPU backend instance playing a device (no GPU)",
                     "memory_total": d.memory_total if d else None, "memory_free": d.memory_free if d else None})
    rows.append({"name": CPU, "kind": "host", "description": "host memory and the CPU backend",
                 "memory_total": None, "memory_free": None})
    return rows


__all__ = ["describe_devices", "device_names", "open_devices"]
