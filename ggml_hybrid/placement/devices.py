"""The devices a session can place tensors on: RPC servers' devices, GPUs (CUDA, Vulkan), or CPU backend
instances standing in for them.

Names follow llama.cpp: ``RPC0``, ``RPC1``, ... for the devices of the ``rpc`` servers (first, as
llama.cpp puts them), ``CUDA0``, ``CUDA1``, ..., ``Vulkan0``, ``Vulkan1``, ... and ``CPU`` for host memory. On a
machine without a GPU and without RPC servers, ``virtual_devices`` CPU backend instances play the devices as ``DEV0``,
``DEV1``, ...: each has its own buffers, threadpool and expert cache, so multi-device layouts run (and
is tested) anywhere.
"""

from __future__ import annotations

import os

from .._native.backends import optional_backends
from ..ggml import links, rpc
from ..ggml.backend import Backend, cpu_instance, cpu_library, gpu, gpu_device_names
from ..ggml.backend import devices as ggml_devices
from ..options import MAX_DEVICES, OptionError, SessionOptions, device_list
from .layout import CPU


def _local_names(opts: SessionOptions, remote: int) -> list[str]:
    gpus = gpu_device_names()
    real = "GPU devices" if gpus else "RPC devices" if remote else None
    if real is not None and opts.virtual_devices != 1:  # it would do nothing: refused, not ignored
        raise OptionError(f"virtual_devices={opts.virtual_devices}: CPU instances play devices only on a machine "
                          f"without a GPU or RPC server; this session has {real} (select them with devices=, -dev)")
    if gpus:
        return gpus
    if remote:
        return []  # real devices: no CPU instance plays one
    return [f"DEV{i}" for i in range(opts.virtual_devices)]


def _rpc_devices(opts: SessionOptions) -> list[rpc.RPCDevice]:
    return rpc.server_devices(opts.rpc, opts.rpc_timeout) if opts.rpc is not None else []


def _checked(names: list[str]) -> list[str]:
    if len(names) > MAX_DEVICES:
        raise OptionError(f"{len(names)} devices ({', '.join(names)}): a session has at most {MAX_DEVICES} (a GGML "
                          "scheduler holds at most 16 backends, the host CPU included)")
    return names


def available_device_names(opts: SessionOptions | None = None) -> list[str]:
    """Every accelerator name a session with ``opts`` could use (CPU not included); asks RPC servers."""
    opts = opts or SessionOptions()
    remote = [d.name for d in _rpc_devices(opts)]
    return remote + _local_names(opts, len(remote))


def _select(opts: SessionOptions, names: list[str]) -> list[str]:
    """``devices`` (llama.cpp's -dev) of ``names``, in its order; all of them when not given."""
    if opts.devices is None:
        return _checked(names)
    chosen = device_list(opts.devices)
    for n in chosen:
        if n not in names:
            raise OptionError(f"devices={opts.devices}: {n} is not a device of this session; the devices are "
                              f"{', '.join(names)} (see `ggml-hybrid devices`)")
    return chosen


def device_names(opts: SessionOptions | None = None) -> list[str]:
    """The accelerator names a session with ``opts`` uses, in order (CPU not included); asks RPC servers."""
    opts = opts or SessionOptions()
    return _select(opts, available_device_names(opts))


def open_devices(opts: SessionOptions, n_threads: int) -> dict[str, Backend]:
    """Backends for :func:`device_names`, in order (CPU instances with ``n_threads`` threads and ``opts.poll``)."""
    remote = {d.name: d for d in _rpc_devices(opts)}
    names = _select(opts, list(remote) + _local_names(opts, len(remote)))
    out: dict[str, Backend] = {}
    try:
        for name in names:
            if name in remote:
                links.measure_link(remote[name])  # once per connection: the expert cache's cost model starts from it
                out[name] = rpc.open_device(remote[name])
            else:
                out[name] = cpu_instance(int(name[3:]), n_threads, opts.poll) if name.startswith("DEV") else gpu(name)
    except BaseException:
        for b in out.values():
            b.close()
        raise
    return out


def plan_device_names(opts: SessionOptions, vram: list[int] | None) -> list[str]:
    """The devices a plan is for: with ``rpc`` the session's own (``vram``, if given, sizes them in order);
    else with ``vram`` those of ``devices`` (one size each), this machine's GPUs (one size each) or CUDA0, CUDA1, ...;
    else the session's."""
    if vram is not None and opts.rpc is None and opts.devices is not None:
        names = device_list(opts.devices)
        if len(names) != len(vram):
            raise OptionError(f"devices={opts.devices}: {len(names)} device(s) but {len(vram)} --vram size(s); give "
                              "one size per device")
        return names
    if opts.rpc is not None:
        names = device_names(opts)
        if vram is not None and len(vram) != len(names):
            raise OptionError(f"vram: {len(vram)} device sizes given for the {len(names)} devices "
                              f"({', '.join(names)}); give one per device, or none to ask the servers")
        return names
    if not vram:
        return device_names(opts)
    gpus = gpu_device_names()  # this machine's GPUs when the sizes are theirs (asked, or one given for each)
    return gpus if len(gpus) == len(vram) else [f"CUDA{i}" for i in range(len(vram))]


def device_free_memory(opts: SessionOptions) -> list[int] | None:
    """Free bytes of each device of a session with ``rpc`` (the servers asked now); None when some device
    cannot say (a CPU instance playing one)."""
    gpus = {d.name: d.memory_free for d in ggml_devices() if d.type == "gpu"}
    remote = {d.name: d.memory()[0] for d in _rpc_devices(opts)}
    out = []
    for name in device_names(opts):
        free = remote.get(name, gpus.get(name))
        if free is None:
            return None
        out.append(free)
    return out


def describe_devices(opts: SessionOptions | None = None) -> list[dict]:
    opts = opts or SessionOptions()
    rows = []
    remote = _rpc_devices(opts)
    for d in remote:
        free, total = d.memory()
        link = links.measure_link(d)
        rows.append({"name": d.name, "kind": "rpc", "description": f"device {d.index} of the RPC server {d.endpoint}",
                     "memory_total": total, "memory_free": free, "link_bytes_per_s": link.bytes_per_s,
                     "link_rtt_s": link.rtt_s})
    gpus = {d.name: d for d in ggml_devices() if d.type == "gpu"}
    for name in _local_names(opts, len(remote)):
        g = gpus.get(name)
        rows.append({"name": name, "kind": "gpu" if g else "cpu-instance",
                     "description": g.description if g else "CPU backend instance playing a device (no GPU)",
                     "memory_total": g.memory_total if g else None, "memory_free": g.memory_free if g else None})
    cpu_lib = os.path.basename(cpu_library())
    rows.append({"name": CPU, "kind": "host",
                 "description": "host memory and the CPU backend" + (f" ({cpu_lib})" if cpu_lib else ""),
                 "memory_total": None, "memory_free": None})
    return rows


def backend_notes() -> list[str]:
    """One line per optional backend of this install that gives no device (not loadable, or no GPU found)."""
    return [st.summary() for st in optional_backends().values() if not st.devices]


__all__ = ["available_device_names", "backend_notes", "describe_devices", "device_free_memory", "device_names",
           "open_devices", "plan_device_names"]
