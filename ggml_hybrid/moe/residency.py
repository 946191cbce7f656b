"""What a disk layer's expert cache holds and how often each expert was asked for: read from either executor.

The request history is the cache's own (:mod:`.slot_cache`'s docstring: every call that asked for an expert, on
the device or on the CPU, kept across evictions); the held experts are those whose slot holds them with the load
committed (a load in flight, or a prefetch not yet used, is not held). Read between calls: the native executor's
arrays are written by its calls (the serving engine reads them between its steps).

A CPU playing the device that computes from the host tier's frames (``tier_direct``) plans no slots: it has no
history to read (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._native import ffi, lib
from .executor import ExpertCacheExecutor
from .native_executor import NativeExpertExecutor


@dataclass(frozen=True)
class Residency:
    """One layer's cache: ``requests[e]`` calls asked for expert ``e``; ``held`` the experts in committed slots,
    in increasing order."""

    requests: npt.NDArray[np.int64]
    held: tuple[int, ...]


def residency(executor: ExpertCacheExecutor | NativeExpertExecutor) -> Residency | None:
    """The cache of ``executor``'s layer now (None: a layer computed from the host tier's frames, without slots)."""
    if isinstance(executor, ExpertCacheExecutor):
        cache = executor.cache
        return Residency(np.array([cache.reuse_key(e)[0] for e in range(cache.n_experts)], np.int64),
                         tuple(sorted(cache.resident())))
    if executor.tier_direct:
        return None
    c = lib.hy_moe_exec_cache(executor.c_user_data)
    n_expert, n_slots = int(c.n_experts), int(c.n_slots)
    requests = np.frombuffer(ffi.buffer(c.requests, 8 * n_expert), np.int64).copy()
    slots = np.frombuffer(ffi.buffer(c.slot_expert, 4 * n_slots), np.int32)
    pending = np.frombuffer(ffi.buffer(c.uncommitted, 4 * n_slots), np.int32)
    held = sorted(int(e) for e, u in zip(slots, pending) if e >= 0 and u != e)
    return Residency(requests, tuple(held))


__all__ = ["Residency", "residency"]
