"""Graph regions: parts of a graph that the patched scheduler hands to a Python executor.

A region is every node on a path from its inputs to its outputs. The graph is
split and allocated as usual; at compute time the scheduler makes the inputs
ready on the region's backend and calls the executor instead of running the
region's nodes. See docs/regions.md for the rules and guarantees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from .._native import CData, cstr, ffi, lib
from .._native.callbacks import escaped
from .._native.status import check_status
from ..errors import (
    ComputeError,
    GgmlHybridError,
    RegionError,
    RegionNotContiguousError,
    RegionNotInGraphError,
    RegionOpenError,
    RegionOverlapError,
    RegionUnsupportedError,
)
from .tensor import BorrowedScope, Tensor

if TYPE_CHECKING:
    from .backend import Backend
    from .sched import Scheduler


class _Decline:
    def __repr__(self) -> str:
        return "DECLINE"


#: Returned by an executor to have the region's own nodes run as usual.
DECLINE = _Decline()

_STATUS_ERRORS = {
    lib.GGML_SCHED_REGION_ERR_OPEN: RegionOpenError,
    lib.GGML_SCHED_REGION_ERR_OVERLAP: RegionOverlapError,
    lib.GGML_SCHED_REGION_ERR_NOT_IN_GRAPH: RegionNotInGraphError,
    lib.GGML_SCHED_REGION_ERR_CONTIGUITY: RegionNotContiguousError,
    lib.GGML_SCHED_REGION_ERR_UNSUPPORTED: RegionUnsupportedError,
    lib.GGML_SCHED_REGION_ERR_EMPTY: RegionError,
    lib.GGML_SCHED_REGION_ERR_EXECUTOR: ComputeError,
}


@dataclass(eq=False)
class Region:
    """A registered region. ``executor(call: RegionCall)`` returns DECLINE or anything else for done."""

    id: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    executor: Callable[[RegionCall], object] | NativeExecutor
    backend: Backend | None
    name: str = ""
    calls: int = field(default=0)
    declined: int = field(default=0)


@runtime_checkable
class NativeExecutor(Protocol):
    """An executor written in C: the scheduler calls ``c_function(..., c_user_data)`` (a
    ``ggml_backend_sched_region_exec_t``: a cdata function pointer or a function of ``lib``) with no Python
    frame; when it fails, :meth:`error` gives the typed exception to raise."""

    @property
    def c_function(self) -> CData | Callable[..., int]: ...

    @property
    def c_user_data(self) -> CData: ...

    def error(self) -> GgmlHybridError | None: ...


class RegionCall:
    """What an executor receives for one compute of its region."""

    def __init__(self, sched: Scheduler, region: Region, backend: Backend | None, inputs: list[Tensor],
                 outputs: list[Tensor]) -> None:
        self.sched = sched
        self.region = region
        #: the backend the region runs on (its inputs were made ready there)
        self.backend = backend
        #: the effective inputs: the scheduler's copies on ``backend`` where it made them
        self.inputs = inputs
        #: the outputs, to be written in place
        self.outputs = outputs

    def input_arrays(self) -> list[np.ndarray]:
        """Read-only numpy views of host inputs (copies for device inputs)."""
        return [t.view_numpy(writable=False) if t.is_host else t.numpy() for t in self.inputs]

    def write_output(self, i: int, array: npt.ArrayLike) -> None:
        """Write output ``i`` (any backend) from a numpy array of its shape and dtype."""
        self.outputs[i].set(np.asarray(array))

    def compute_own_nodes(self) -> None:
        """Run the region's own nodes on its backend, exactly what declining would run."""
        status = lib.ggml_backend_sched_compute_region_nodes(self.sched.ptr, self.region.id)
        check_status(status, f"region {self.region.id}: computing its own nodes")


def raise_region_status(sched: Scheduler) -> None:
    """Raise the typed error for the scheduler's last region failure, if any."""
    rid, msg = ffi.new("int *"), ffi.new("const char **")
    status = lib.ggml_backend_sched_get_region_status(sched.ptr, rid, msg)
    if status == lib.GGML_SCHED_REGION_OK:
        return
    exc = _STATUS_ERRORS.get(status, RegionError)
    text = cstr(msg[0])
    region = sched._regions[rid[0]] if 0 <= rid[0] < len(sched._regions) else None
    if region is not None and isinstance(region.executor, NativeExecutor):
        typed = region.executor.error()  # a native executor knows what failed; the scheduler only that it did
        if typed is not None:
            raise typed
    if region is not None and region.name:
        text = f"{text} [region name {region.name!r}]"
    raise exc(text)


# error=-1: an exception that escapes the try below (Ctrl-C at the first or last bytecode) fails the region
@ffi.def_extern(error=-1, onerror=escaped)
def _hy_region_exec(region_id: int, backend: CData, inputs: CData, n_inputs: int, outputs: CData,
                             n_outputs: int, user_data: CData) -> int:
    sched: Scheduler = ffi.from_handle(user_data)
    scope = BorrowedScope()  # the tensors are valid during the call only
    try:
        region = sched._regions[region_id]
        be = next((b for b in sched._backends if b.ptr == backend), None)
        call = RegionCall(sched, region, be, [Tensor(inputs[i], scope) for i in range(n_inputs)],
                          [Tensor(outputs[i], scope) for i in range(n_outputs)])
        region.calls += 1
        run = cast("Callable[[RegionCall], object]", region.executor)  # native ones never come through here
        if run(call) is DECLINE:
            region.declined += 1
            return lib.GGML_SCHED_REGION_DECLINE
        return lib.GGML_SCHED_REGION_DONE
    except BaseException as exc:
        sched._pending_error = exc
        return -1
    finally:
        scope.closed = True
