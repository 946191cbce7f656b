"""The inputs and the result of a graph computed again and again (a decode step), bound to host arrays once.

A one-thread decode step of a CPU run computes for a few milliseconds, and each step's compute pushes the
interpreter's working set out of the caches: every Python call around it then runs cold. Setting six inputs
one ``ggml_backend_tensor_set`` at a time, computing, then reading the logits cost ggml-hybrid about 0.2 ms
a step where llama.cpp spends none (docs/benchmarks.md, section 8). With a :class:`StepIO`,
:meth:`Scheduler.step` does all of it in one native call (``hy_sched_step``): the caller rewrites
the arrays in place, and GGML copies them in, computes and copies the result out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._native import CData, ffi
from ..errors import BackendError, ShapeError
from .tensor import Tensor


class StepIO:
    """``inputs``: every input of a graph with the host array it is set from before each compute (the
    caller rewrites the arrays in place, never replaces them); ``output``: the result read after it (plain
    type, contiguous). The arrays' dtype and size are checked here, once; each compute checks that every
    tensor has memory of that size."""

    def __init__(self, inputs: Sequence[tuple[Tensor, np.ndarray]], output: Tensor) -> None:
        for t, arr in inputs:
            if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous \
                    or arr.dtype != t.dtype.numpy_dtype or arr.nbytes != t.nbytes:
                raise ShapeError(f"StepIO: input {t.name!r} ({t.dtype.name} {t.shape}) needs a C-contiguous "
                                 f"array of its dtype and size, got {getattr(arr, 'dtype', type(arr))} "
                                 f"{getattr(arr, 'shape', '')}")
        dt = output.dtype
        if dt.is_quantized or not output.is_contiguous:
            raise ShapeError(f"StepIO: output {output.name!r} is quantized or not contiguous")
        self.tensors = [t for t, _ in inputs] + [output]  # kept alive with their contexts
        # the pointers below are the tensors' structs, which go with their contexts' memory: each step checks
        # that none of these was closed
        self.contexts = list({id(t.context): t.context for t in self.tensors}.values())
        self._buffers = [ffi.from_buffer(arr) for _, arr in inputs]  # the arrays, kept alive by these
        self.c_in: CData = ffi.new("struct hy_io[]", max(len(inputs), 1))
        for c, (t, arr), buf in zip(self.c_in, inputs, self._buffers):
            c.tensor, c.data, c.size = t.ptr, buf, arr.nbytes
        self.n_in = len(inputs)
        self.out_ptr, self.out_size = output.ptr, output.nbytes
        self.out_shape, self.out_dtype = output.shape, dt.numpy_dtype
        self.bad: CData = ffi.new("int *")

    def raise_refused(self) -> None:
        """After a step that failed: the tensor the native call refused, if any, as a clear error."""
        k = self.bad[0]
        if k == 0:
            return
        t = self.tensors[k - 1]
        role = "output" if k == len(self.tensors) else "input"
        t._require_data(f"Scheduler.step, {role}")  # no memory: says so in the tensor's own words
        raise BackendError(f"Scheduler.step: {role} {t.name!r} is not in a backend buffer of its size that can "
                           f"be {'read' if role == 'output' else 'written'} (set up for {t.nbytes} bytes)")


__all__ = ["StepIO"]
