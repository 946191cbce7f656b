"""The host expert tier: a bounded cache of whole experts in host RAM between the device's slots and the file.

``host_tier_bytes=N`` (``--host-tier SIZE``) gives a model's disk layers one tier (``_native/src/host_tier.c``)
of at most N bytes. Each disk layer's executor (native, or the Python reference) asks it for the experts a call
loads as soon as the call's plan names them: I/O threads read each whole expert from the GGUF with large aligned
reads (``pread``, ``O_DIRECT`` where the filesystem allows it, so the reads cost no page cache), several in
flight, and each load copies its expert from the tier into its slot, waiting only for that expert's read. Experts
leave the tier by the expert cache's orders (``expert_eviction``, counting the calls that fetched them), never one
the current call fetched.

The CPU computes straight from the tier: its experts sit in one arena of equal frames, each kind at the same place
in every frame, so the arena is an expert tensor per layer whose expert index is the frame. The CPU worker
(``moe_cpu_share``) runs its rows from there, and a CPU playing the device computes every expert there (no slots,
no copies) when its experts would not be repacked (``repack=false``, or a type GGML's CPU does not repack: the
frames are plain CPU memory, as the file's bytes are; repacked, each read would need a second pass over the expert
and a layout a frame cannot share across layers). The file's experts are unmapped then
(:meth:`~ggml_hybrid.gguf.store.GGUFStore.unmap`): a model larger than RAM costs the budget, not the page cache.
With a device, the arena is the device's pinned host buffer type (``ggml_backend_dev_host_buffer_type``).

A fault (an I/O error, a short read, the file truncated or rewritten since it was opened) fails the call with
:class:`~ggml_hybrid.errors.ModelFileError` naming the layer, the expert and the cause; nothing of the failed
read is kept, so the next call reads it again.
"""

from __future__ import annotations

from .._native import CData, ffi, lib
from .._native.cstruct import Counters
from .._native.managed import Managed
from ..errors import AllocationError, ModelFileError, OptionError
from ..gguf.store import GGUFStore
from ..machine import available_memory, cgroup_memory_left
from ..units import MiB, format_bytes
from .slot_cache import POLICY_CODES

#: I/O threads reading experts; a few reads in flight keep an SSD's queue busy, more only add seeks
IO_THREADS = 4
#: what ``auto`` leaves beyond the session's own buffers: the process's growth while it runs (the host-side step
#: arrays, the allocator's retained heap, the CPU kernels' work buffers, threads' stacks); measured at 30-50 MiB
#: beyond the buffers after a prompt filling a 4096-token context (docs/moe.md, "The host expert tier"), fixed
AUTO_SLACK = 64 * MiB


class TierCounters(Counters, struct="hy_tier_counters"):
    """The tier's counters since it was made: the fields of the C struct ``hy_tier_counters``
    (``_native/src/host_tier.h`` lists and documents them), in its order."""


def memory_available() -> int:
    """The memory available now: ``MemAvailable``, or what this process's memory cgroup still allows, whichever is
    less (``auto`` sizes from it)."""
    avail = available_memory()
    left = cgroup_memory_left()
    if left is not None:
        avail = left if avail is None else min(avail, left)
    if avail is None:
        raise OptionError("host_tier_bytes=auto: this system does not say how much memory is available "
                          "(/proc/meminfo); give a size, e.g. --host-tier 8G")
    return avail


def auto_budget(available: int, held: int) -> int:
    """``host_tier_bytes=auto``: ``available`` bytes less ``held``, what the session holds in the same memory
    besides the tier (its KV cache, compute buffers, the weights it holds there; measured by a dry run of it,
    :func:`ggml_hybrid.runtime.moe_model.auto_host_tier`), less :data:`AUTO_SLACK`."""
    return max(0, available - held - AUTO_SLACK)


def entry_bytes(nbytes: list[int]) -> int:
    """Host bytes one expert needs in the tier: each of its tensors' bytes rounded out to the 4 KiB reads. A frame
    of the tier is as large as the largest layer's (:func:`frame_bytes`)."""
    return sum((n + 4095) // 4096 * 4096 + 4096 for n in nbytes)


def frame_bytes(layers: list[list[int]]) -> int:
    """Bytes of one frame of a tier over layers whose experts' tensors have ``layers[i]`` bytes each."""
    return max(entry_bytes(nb) for nb in layers)


class HostTier(Managed):
    """One model's host expert tier (``_native/src/host_tier.c``); the disk layers' executors register their
    experts with :meth:`add_layer` before the first call."""

    _kind = "host_tier"

    def __init__(self, store: GGUFStore, budget: int, policy: str = "freq", n_threads: int = IO_THREADS,
                 direct: bool = True, buffer_type: CData | None = None) -> None:
        if store.fd is None:
            raise OptionError(f"host_tier_bytes: the model file {store.path!r} is closed")
        file_id = ffi.new("int64_t[]", list(store.identity))
        err = ffi.new("char[]", 400)
        if policy not in POLICY_CODES:
            raise OptionError(f"expert_eviction={policy!r}: the host tier evicts by one of {sorted(POLICY_CODES)}")
        buft = ffi.NULL if buffer_type is None else buffer_type
        ptr = lib.hy_tier_new(store.fd, file_id, budget, n_threads, int(direct), POLICY_CODES[policy], buft, err, 400)
        if ptr == ffi.NULL:
            raise AllocationError(ffi.string(err).decode())
        super().__init__(ptr, lib.hy_tier_free)
        self.store, self.budget = store, budget
        self.layer_labels: list[int] = []

    def add_layer(self, label: int, names: dict[str, str]) -> int:
        """Register the experts of one layer (``names``: kind -> tensor name, in the executor's kind order);
        returns its index in the tier."""
        infos = [self.store.info(n) for n in names.values()]
        n_expert = infos[0].shape[0]
        nbytes = [i.nbytes // i.shape[0] for i in infos]
        check_tier_budget(self.budget, entry_bytes(nbytes) * n_expert, self.budget)
        offsets = ffi.new("uint64_t[]", [i.offset for i in infos])
        sizes = ffi.new("size_t[]", nbytes)
        idx = int(lib.hy_tier_add_layer(self.ptr, label, n_expert, len(infos), offsets, sizes))
        if idx < 0:
            raise AllocationError(f"host tier: could not register layer {label}'s experts")
        self.layer_labels.append(label)
        return idx

    @property
    def counters(self) -> TierCounters:
        if self.closed:
            return self._final
        return TierCounters.from_c(lib.hy_tier_counters_of(self.ptr))

    @property
    def buffer_type(self) -> str:
        """The frames' buffer type: the device's pinned host type (e.g. ``Vulkan_Host``), or ``CPU`` (none asked, or
        the pinned allocation refused at the first call)."""
        return ffi.string(lib.ggml_backend_buft_name(lib.hy_tier_buffer_type(self.ptr))).decode()

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache (``O_DIRECT``; not every filesystem allows it, e.g. tmpfs)."""
        return bool(lib.hy_tier_direct(self.ptr))

    def raise_error(self) -> None:
        """Raise the tier's last failure (a read, the file changed, the budget): :class:`ModelFileError`, its
        message naming the layer, the expert and the cause."""
        raise ModelFileError(ffi.string(lib.hy_tier_error(self.ptr)).decode())

    def inject_fault(self, after: int = 0, kind: str = "eio") -> None:
        """Tests: the read after the next ``after`` reads fails, with an I/O error (``eio``) or short (``short``)."""
        lib.hy_tier_inject_fault(self.ptr, after, lib.HY_TIER_FAULT_EIO if kind == "eio" else lib.HY_TIER_FAULT_SHORT)

    def close(self) -> None:
        if not self.closed:
            self._final = self.counters
        super().close()


def check_tier_budget(budget: int, layer_need: int, given: int | str) -> None:
    """The tier must hold one layer's experts (``layer_need`` bytes in it): a call may load all of them."""
    if budget < layer_need:
        what = "" if given == budget else f" (host_tier_bytes={given} gives {budget} bytes here)"
        raise OptionError(f"host_tier_bytes={budget} ({format_bytes(budget)}){what}: the host tier must hold at "
                          f"least one layer's experts (a call may load all of them): {layer_need} bytes "
                          f"({format_bytes(layer_need)}); give --host-tier {-(-layer_need // MiB)}M or more")


def resolve_budget(value: int | str, need_total: int, host_slots: int = 0) -> int:
    """The byte budget of ``host_tier_bytes=value``: a size as given; ``auto`` here (a session's ``auto`` is sized
    before its model loads, :func:`~ggml_hybrid.runtime.moe_model.auto_host_tier`; this is what is left for experts
    loaded without one: an FFN stack, a model given a device) from the memory available less ``host_slots`` (the
    bytes of expert slots still to be allocated in host memory: a CPU playing the device) less the slack; never
    more than every disk layer's experts (``need_total`` bytes in the tier), which is all it can hold."""
    budget = auto_budget(memory_available(), host_slots) if value == "auto" else int(value)
    return min(budget, need_total)


__all__ = ["AUTO_SLACK", "IO_THREADS", "HostTier", "TierCounters", "auto_budget", "check_tier_budget", "entry_bytes",
           "frame_bytes", "memory_available", "resolve_budget"]
