"""Backends (CPU; CUDA and Vulkan when built and present) and their buffers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from .._native import CData, cstr, ffi, lib
from .._native.backends import load_backend_reg, optional_backends
from .._native.managed import Managed
from ..checks import check_choice, check_int
from ..errors import AllocationError, ArgumentError, BackendError

if TYPE_CHECKING:
    from .context import Context
    from .tensor import Tensor

# More CPU threads than this only queue on the cores (and each costs a stack and a spin).
THREADS_PER_CORE = 4


def max_threads() -> int:
    """The most CPU threads a backend accepts: THREADS_PER_CORE times the cores of this machine."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)

# addresses of the live buffers made through this package: a scheduler must not
# re-allocate tensors that live in them
_user_buffers: set[int] = set()


def _free_buffer(ptr: CData) -> None:
    _user_buffers.discard(int(ffi.cast("uintptr_t", ptr)))
    lib.ggml_backend_buffer_free(ptr)


def user_buffers() -> list[CData]:
    return [ffi.cast("ggml_backend_buffer_t", a) for a in list(_user_buffers)]


class Buffer(Managed):
    """A backend buffer; keeps its backend (when it has one) alive."""

    _kind = "buffer"

    def __init__(self, ptr: CData, backend: Backend | None = None, owned: bool = True) -> None:
        if ptr == ffi.NULL:
            raise AllocationError("backend buffer allocation failed")
        super().__init__(ptr, _free_buffer, owned)
        if owned:
            _user_buffers.add(int(ffi.cast("uintptr_t", ptr)))
        self._backend = backend
        self._memory: np.ndarray | None = None  # host memory the buffer lies over (from_host_memory)

    @property
    def size(self) -> int:
        return int(lib.ggml_backend_buffer_get_size(self.ptr))

    @property
    def name(self) -> str:
        return cstr(lib.ggml_backend_buffer_name(self.ptr))

    @property
    def is_host(self) -> bool:
        return bool(lib.ggml_backend_buffer_is_host(self.ptr))

    def clear(self, value: int = 0) -> None:
        check_int(value, "Buffer.clear: value", 0, 255)
        lib.ggml_backend_buffer_clear(self.ptr, value)

    @classmethod
    def from_host_memory(cls, array: npt.ArrayLike, usage: str = "weights") -> Buffer:
        """A CPU buffer over existing host memory (e.g. a memory-mapped GGUF file); keeps ``array`` alive."""
        arr = np.asarray(array)
        if not arr.flags.c_contiguous:
            raise ArgumentError("Buffer.from_host_memory: the memory must be C-contiguous")
        ptr = ffi.cast("void *", arr.ctypes.data)
        buf = cls(lib.ggml_backend_cpu_buffer_from_ptr(ptr, arr.nbytes), None)
        buf._memory = arr
        buf.set_usage(usage)
        return buf

    def place(self, tensor: Tensor, offset: int) -> None:
        """Give ``tensor`` (unallocated, not a view) the memory at byte ``offset`` of this buffer."""
        p = tensor.ptr
        if p.buffer != ffi.NULL or p.data != ffi.NULL or p.view_src != ffi.NULL:
            raise AllocationError(f"Buffer.place: tensor {tensor.name!r} already has memory or is a view")
        need = int(lib.ggml_backend_buffer_get_alloc_size(self.ptr, p))
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + need > self.size:
            raise AllocationError(f"Buffer.place: tensor {tensor.name!r} needs {need} bytes at offset {offset!r}, "
                                  f"past the end of the {self.size}-byte buffer")
        base = ffi.cast("char *", lib.ggml_backend_buffer_get_base(self.ptr))
        status = lib.ggml_backend_tensor_alloc(self.ptr, p, base + offset)
        if status != lib.GGML_STATUS_SUCCESS:
            raise AllocationError(f"Buffer.place: GGML could not place tensor {tensor.name!r}")
        # tensor -> context -> this buffer (not closed with the context); placed tensors belong to a Context
        cast("Context", tensor.context)._keep.append(self)

    def set_usage(self, usage: str) -> None:
        """'weights' tells the scheduler to run ops where their weights live; 'compute' or 'any' otherwise."""
        table = {"any": lib.GGML_BACKEND_BUFFER_USAGE_ANY, "weights": lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
                 "compute": lib.GGML_BACKEND_BUFFER_USAGE_COMPUTE}
        check_choice(usage, "Buffer.set_usage: usage", sorted(table))
        lib.ggml_backend_buffer_set_usage(self.ptr, table[usage])


class Threadpool(Managed):
    _kind = "threadpool"

    def __init__(self, ptr: CData) -> None:
        if ptr == ffi.NULL:
            raise BackendError("could not create a CPU threadpool")
        super().__init__(ptr, lib.hy_threadpool_free)


class Backend(Managed):
    """An initialised GGML backend."""

    _kind = "backend"

    def __init__(self, ptr: CData, kind: str) -> None:
        if ptr == ffi.NULL:
            raise BackendError(f"could not initialise the {kind} backend")
        super().__init__(ptr, lib.ggml_backend_free)
        self.kind = kind
        self.endpoint: str | None = None  # HOST:PORT of the server, for a device of GGML's RPC backend
        self.remote_index: int | None = None  # the device's number on that server
        self._n_threads: int | None = None
        self._poll = 0
        self._pools: dict[tuple[int, int], Threadpool] = {}

    @property
    def name(self) -> str:
        return cstr(lib.ggml_backend_name(self.ptr))

    @property
    def is_cpu(self) -> bool:
        return bool(lib.hy_is_cpu(self.ptr))

    @property
    def n_threads(self) -> int | None:
        return self._n_threads

    @n_threads.setter
    def n_threads(self, n: int) -> None:
        self.set_threads(n, self._poll)

    @property
    def poll(self) -> int:
        return self._poll

    def set_threads(self, n: int, poll: int = 0) -> None:
        """Run graphs on ``n`` threads whose idle ones spin ``poll`` (0..100, llama.cpp's --poll) before sleeping.

        The pool is persistent (without one each graph compute, each split, would start its own threads)
        and kept per setting, so that a session switching between its decode and prompt thread counts
        (``n_threads``, ``n_threads_batch``) reuses its pools.
        """
        if not self.is_cpu:
            raise BackendError(f"n_threads applies to the CPU backend, not {self.name}")
        check_int(n, "n_threads", 1, max_threads())
        check_int(poll, "poll", 0, 100)
        lib.hy_cpu_set_n_threads(self.ptr, n)
        pool = self._pools.get((n, poll))
        if pool is None:
            params = ffi.new("struct ggml_threadpool_params *")
            lib.ggml_threadpool_params_init(params, n)
            params.poll = poll
            pool = self._pools[(n, poll)] = Threadpool(lib.hy_threadpool_new(params))
        lib.hy_cpu_set_threadpool(self.ptr, pool.ptr)
        self._n_threads, self._poll = n, poll

    def close(self) -> None:
        super().close()  # the backend first: it holds a pool
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def alloc_buffer(self, size: int) -> Buffer:
        check_int(size, "alloc_buffer: size", 0)
        return Buffer(lib.ggml_backend_alloc_buffer(self.ptr, size), self)

    def supports(self, tensor: Tensor) -> bool:
        """Whether this backend can compute the node ``tensor``."""
        return bool(lib.ggml_backend_supports_op(self.ptr, tensor.ptr))

    def synchronize(self) -> None:
        lib.ggml_backend_synchronize(self.ptr)

    def __repr__(self) -> str:
        return f"<Backend {self.name if not self.closed else 'closed'}>"


def cpu(n_threads: int | None = None, poll: int = 0) -> Backend:
    """A CPU backend with its own persistent threadpool of ``n_threads`` (default: all cores); ``poll`` as in
    :meth:`Backend.set_threads`."""
    b = Backend(lib.hy_cpu_init(), "CPU")
    b.set_threads(n_threads if n_threads is not None else (os.cpu_count() or 1), poll)
    return b


def cpu_instance(index: int, n_threads: int | None = None, poll: int = 0) -> Backend:
    """A CPU backend that the scheduler treats as a separate device (its own buffer type), 0 <= index < 16.

    Several of them play several devices on a machine without GPUs: nodes pinned to each stay
    there, as they would on two GPUs.
    """
    check_int(index, "cpu_instance: index", 0, lib.HY_MAX_INSTANCES - 1)
    b = Backend(lib.hy_cpu_instance(index), "CPU")
    b.set_threads(n_threads if n_threads is not None else (os.cpu_count() or 1), poll)
    return b


class LibraryBackend(Backend):
    """A backend of a library :func:`backend_from_library` loaded: closing it also takes the library out of GGML's
    registry (its devices leave :func:`devices`)."""

    def __init__(self, ptr: CData, kind: str, reg: CData) -> None:
        super().__init__(ptr, kind)
        self._reg: CData | None = reg

    def close(self) -> None:
        super().close()
        if self.closed and self._reg is not None:
            lib.ggml_backend_unload(self._reg)
            self._reg = None


def backend_from_library(path: str | os.PathLike[str], n_threads: int | None = None) -> LibraryBackend:
    """A backend on the first device of the GGML backend library at ``path``, loaded into this process's ggml-base
    until the backend is closed: only a library that carries ggml-base's ABI stamp (built by ggml_hybrid_build against
    the same interface), and not one of this install's own (closing would unload it). Its threads are set through its
    own registry (``ggml_backend_set_n_threads``). Used by the test that runs the op tests through the unpatched
    pin's CPU backend (tests/test_pin_backend.py)."""
    if n_threads is not None:
        check_int(n_threads, "n_threads", 1, max_threads())
    st, reg = load_backend_reg(Path(path))
    if not st.loaded:
        raise BackendError(f"backend library {os.fspath(path)!r} did not load: {st.detail}")
    if not st.devices:
        lib.ggml_backend_unload(reg)
        raise BackendError(f"backend library {os.fspath(path)!r} has no device: {st.detail}")
    ptr = lib.ggml_backend_dev_init(lib.ggml_backend_reg_dev_get(reg, 0), ffi.NULL)
    if ptr == ffi.NULL:
        lib.ggml_backend_unload(reg)
    b = LibraryBackend(ptr, st.name, reg)
    if n_threads is not None:
        fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
        if fn == ffi.NULL:
            b.close()
            raise BackendError(f"backend library {os.fspath(path)!r} has no thread count to set")
        ffi.cast("void (*)(ggml_backend_t, int)", fn)(b.ptr, n_threads)
    return b


# The GPU backends a build may carry, in the order their devices are listed (as llama.cpp lists them): GGML's
# registry name, which also prefixes each device's name (CUDA0, CUDA1, ..., Vulkan0, ...), and the build switch
GPU_BACKENDS = {"CUDA": "cuda", "Vulkan": "vulkan"}


def gpu_device_count(backend: str) -> int:
    """Devices of the GPU backend ``backend`` ("CUDA", "Vulkan") in this install: 0 without its library, its runtime,
    a driver or a device."""
    check_choice(backend, "backend", GPU_BACKENDS)
    st = optional_backends().get(backend)
    return st.devices if st is not None else 0


def gpu_device_names() -> list[str]:
    """Every GPU device of this install, in order: CUDA0, CUDA1, ..., then Vulkan0, ... (empty on a CPU machine)."""
    return [f"{b}{i}" for b in GPU_BACKENDS for i in range(gpu_device_count(b))]


def gpu(name: str) -> Backend:
    """A backend on the GPU device ``name`` ("CUDA0", "Vulkan1", ...)."""
    prefix = name.rstrip("0123456789") if isinstance(name, str) else ""
    index = name[len(prefix):] if isinstance(name, str) else ""
    if prefix not in GPU_BACKENDS or not index or (len(index) > 1 and index[0] == "0"):
        raise BackendError(f"{name!r} is not a GPU device name ({', '.join(b + '0' for b in GPU_BACKENDS)}, ...)")
    st = optional_backends().get(prefix)
    if st is None:
        switch = GPU_BACKENDS[prefix]
        raise BackendError(f"this build has no {prefix} backend; rebuild with `python -m ggml_hybrid_build --{switch}` "
                           f"(or GGML_HYBRID_{switch.upper()}=1 pip install -e .)")
    if not st.devices:
        raise BackendError(st.summary())
    if int(index) >= st.devices:
        raise BackendError(f"{prefix} device {int(index)} does not exist ({st.devices} device(s) found)")
    dev = lib.ggml_backend_dev_by_name(name.encode())
    if dev == ffi.NULL:
        raise BackendError(f"GGML registered no device named {name}")
    return Backend(lib.ggml_backend_dev_init(dev, ffi.NULL), name)


def _gpu_index(backend: str, device: int) -> str:
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        n = gpu_device_count(backend)
        raise BackendError(f"{backend} device {device!r} does not exist ({n} device(s) found)")
    return f"{backend}{device}"


def cuda_device_count() -> int:
    """CUDA devices of this install: 0 without the CUDA backend, its runtime, a driver or a GPU."""
    return gpu_device_count("CUDA")


def cuda_available() -> bool:
    return cuda_device_count() > 0


def cuda(device: int = 0) -> Backend:
    return gpu(_gpu_index("CUDA", device))


def vulkan_device_count() -> int:
    """Vulkan devices of this install: 0 without the Vulkan backend, the Vulkan loader, a driver or a device (a CPU
    driver such as lavapipe counts only with GGML_VK_VISIBLE_DEVICES)."""
    return gpu_device_count("Vulkan")


def vulkan_available() -> bool:
    return vulkan_device_count() > 0


def vulkan(device: int = 0) -> Backend:
    return gpu(_gpu_index("Vulkan", device))


def cpu_features() -> str:
    """The instruction-set features the loaded CPU backend library was built with ("SSE3 AVX AVX2 ...")."""
    return cstr(lib.hy_cpu_features())


def cpu_library() -> str:
    """The file of the CPU backend in use (in a portable build, the variant GGML chose for this CPU)."""
    dev = lib.ggml_backend_dev_by_name(b"CPU")
    return cstr(lib.hy_reg_path(lib.ggml_backend_dev_backend_reg(dev))) if dev != ffi.NULL else ""


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int


_DEV_TYPES = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
              lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}


def devices() -> list[Device]:
    """The devices GGML registered: the CPU and those of the optional backends that loaded."""
    optional_backends()
    out = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append(Device(cstr(lib.ggml_backend_dev_name(dev)), cstr(lib.ggml_backend_dev_description(dev)),
                          _DEV_TYPES.get(lib.ggml_backend_dev_type(dev), "other"), int(free[0]), int(total[0])))
    return out


__all__ = ["GPU_BACKENDS", "Backend", "Buffer", "Device", "LibraryBackend", "backend_from_library", "cpu",
           "cpu_features", "cpu_instance", "cpu_library", "cuda", "cuda_available", "cuda_device_count", "devices",
           "gpu", "gpu_device_count", "gpu_device_names", "vulkan", "vulkan_available", "vulkan_device_count"]
