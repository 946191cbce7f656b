"""One exception hierarchy for everything ggml-hybrid raises on purpose.

Each error names the operation, the offending values and the rule, so that a
wrong call reads like a diagnosis rather than a crash report.
"""

from __future__ import annotations


class GgmlHybridError(Exception):
    """Base class of every error raised by ggml-hybrid."""


class StaleBuildError(GgmlHybridError, ImportError):
    """The compiled native module does not match the sources it sits next to."""


class ClosedError(GgmlHybridError, ValueError):
    """A native object was used after ``close()``."""


class ShapeError(GgmlHybridError, ValueError):
    """Shapes or strides that the operation cannot accept."""


class DTypeError(GgmlHybridError, TypeError):
    """A tensor or array element type the operation cannot accept."""


class IndexRangeError(GgmlHybridError, IndexError):
    """An index (row id, expert id) outside the range of the tensor it selects from."""


class BackendError(GgmlHybridError, RuntimeError):
    """A backend cannot run an operation or hold a buffer, or a native call failed."""


class AllocationError(BackendError, MemoryError):
    """A backend buffer or graph allocation failed."""


class ComputeError(BackendError):
    """A graph computation returned a failure status."""


class RegionError(GgmlHybridError, ValueError):
    """A graph region registration that the scheduler rejects."""


class RegionOpenError(RegionError):
    """A node inside a region is used by a node outside it (only outputs may be)."""


class RegionOverlapError(RegionError):
    """Two regions claim the same node."""


class RegionNotInGraphError(RegionError):
    """A region input or output is not part of the graph being scheduled."""


class RegionNotContiguousError(RegionError):
    """A region's nodes are interleaved with other nodes in graph order."""


class RegionUnsupportedError(RegionError):
    """The scheduler configuration cannot run regions (e.g. pipeline copies)."""
