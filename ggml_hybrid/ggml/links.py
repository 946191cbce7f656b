"""The link to an RPC server, measured on the connection a session opens (what ``devices`` reports, what ``plan``
prices the experts over, what the automatic CPU share's cost model starts from).

A measurement puts a 4 MiB buffer on the server for a moment: the round trip of a small read (the median of
:data:`LINK_PINGS`), then the time of a :data:`LINK_PROBE_BYTES` upload and the read that must come after it, less a
round trip. It is kept (:func:`ggml_hybrid.ggml.rpc.link_of`) while a backend of the process holds the connection;
with none open the next connection is measured anew, and a failed one forgets it (``ggml/rpc.py``). Here rather than
in ``rpc.py`` because it needs tensors, whose module asks ``rpc.py`` about their buffers.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from . import rpc
from .context import Context

LINK_PROBE_BYTES = 4 << 20
LINK_PINGS = 5


def measure_link(device: rpc.RPCDevice) -> rpc.Link:
    """The :class:`~ggml_hybrid.ggml.rpc.Link` to ``device``'s server: the one measured on the connection a backend
    of this process holds, or measured now (and kept). Raises :class:`~ggml_hybrid.errors.RPCError` when the
    connection fails meanwhile (its replies would read as zeros: nothing measured)."""
    known = rpc.known_link(device.endpoint)
    if known is not None:
        return known
    backend = rpc.open_device(device)
    ctx = Context(n_tensors=2)
    try:
        big = ctx.new_tensor("f32", (LINK_PROBE_BYTES // 4,), "link_probe")
        small = ctx.new_tensor("f32", (1,), "link_ping")
        ctx.allocate(backend)
        small.numpy()  # the buffer is there: the pings that follow are round trips only
        rtts = []
        for _ in range(LINK_PINGS):
            t0 = time.perf_counter()
            small.numpy()
            rtts.append(time.perf_counter() - t0)
        rtt = statistics.median(rtts)
        data = np.zeros(LINK_PROBE_BYTES // 4, np.float32)
        t0 = time.perf_counter()
        big.set(data)
        small.numpy()  # the reply comes after the upload
        upload = max(time.perf_counter() - t0 - rtt, 1e-9)
        rpc.raise_if_lost([backend])  # the replies read as zeros: nothing was measured
    finally:
        ctx.close()
        backend.close()
    link = rpc.Link(LINK_PROBE_BYTES / upload, rtt)
    rpc.keep_link(device.endpoint, link)
    return link


__all__ = ["LINK_PINGS", "LINK_PROBE_BYTES", "measure_link"]
