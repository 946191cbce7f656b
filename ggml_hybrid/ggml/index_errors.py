"""Index values out of range met by GGML's kernels (vendor patches 0013 and 0014): one typed error.

The Python layer checks the index data it is given (:meth:`Tensor.set`, constants, indices sorted in the
graph), but indices can also be computed in a graph by other ops or written where it does not look. For those
the CPU kernels of GET_ROWS, GET_ROWS_BACK, SET_ROWS, MUL_MAT_ID, ADD_ID and SSM_SCAN skip an index out of
range instead of aborting the process (or reading and writing out of bounds), record the first one, and the
compute fails; an RPC server reports the same to its client, whose connection stays up. Both become one
:class:`~ggml_hybrid.errors.GraphIndexError` naming the node, its op, the value and the valid range.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._native import CData, cstr, ffi, lib
from ..errors import GraphIndexError

if TYPE_CHECKING:
    from .backend import Backend

_ERROR_BYTES = 512
_get: CData | None = None
_take: CData | None = None


def _getter() -> CData | None:
    global _get
    if _get is None:
        reg = lib.ggml_backend_reg_by_name(b"CPU")
        ptr = (lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_cpu_get_index_error")
               if reg != ffi.NULL else ffi.NULL)
        if ptr == ffi.NULL:
            return None
        _get = ffi.cast("bool (*)(ggml_backend_t, struct ggml_cpu_index_error *)", ptr)
    return _get


def _name(t: CData) -> str:
    return bytes(ffi.string(t.name)).decode("utf-8", "replace")


def _position(graph: CData | None, node: CData) -> int:
    """The node's position in ``graph`` (a ggml_cgraph), -1 when it is not one of its nodes."""
    if graph is None:
        return -1
    return next((i for i in range(lib.ggml_graph_n_nodes(graph)) if lib.ggml_graph_node(graph, i) == node), -1)


def describe(err: CData, graph: CData | None = None) -> str:
    """'GET_ROWS node 3 ('y'): index -1 in its source 1 ('rows') is outside 0..7' for a recorded error; the node's
    position is the one in ``graph`` (the caller's graph; a scheduler computes split copies of it)."""
    node = err.node
    src = node.src[err.src] if 0 <= err.src < lib.GGML_MAX_SRC else ffi.NULL
    src_name = _name(src) if src != ffi.NULL else "?"
    i = _position(graph, node) if graph is not None else int(err.node_index)
    where = f"node {i}" if i >= 0 else "a node"
    return (f"{cstr(lib.ggml_op_desc(node))} {where} ({_name(node)!r}): index {int(err.value)} in its source "
            f"{int(err.src)} ({src_name!r}) is outside 0..{int(err.bound) - 1}")


def local_error(backends: Iterable[Backend], graph: CData | None = None) -> GraphIndexError | None:
    """The index error that failed the last compute of the first CPU backend among ``backends`` that met one
    (``graph``: the ggml_cgraph computed, for the node's position in it)."""
    get = _getter()
    if get is None:
        return None
    err = ffi.new("struct ggml_cpu_index_error *")
    for b in backends:
        if not b.closed and b.endpoint is None and b.is_cpu and get(b.ptr, err):
            return GraphIndexError(f"graph compute on {b.name}: {describe(err, graph)}")
    return None


def _taker() -> CData | None:
    """The RPC backend's ``ggml_backend_rpc_take_compute_error``, looked up once (this runs after every compute on
    an RPC device)."""
    global _take
    if _take is None:
        reg = lib.ggml_backend_reg_by_name(b"RPC")
        ptr = (lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_take_compute_error")
               if reg != ffi.NULL else ffi.NULL)
        if ptr == ffi.NULL:
            return None
        _take = ffi.cast("size_t (*)(const char *, char *, size_t)", ptr)
    return _take


def take_remote_error(endpoint: str) -> str:
    """Why the last graph computed on ``endpoint``'s server failed there with the connection kept ('' if none);
    forgotten once read."""
    take = _taker()
    if take is None:
        return ""
    buf = ffi.new("char[]", _ERROR_BYTES)
    take(endpoint.encode(), buf, _ERROR_BYTES)
    return cstr(buf)


def raise_remote(backends: Iterable[Backend]) -> None:
    """Raise :class:`GraphIndexError` if a graph failed on the server of any of ``backends`` (RPC devices)."""
    for b in backends:
        if b.endpoint is not None and not b.closed:
            reason = take_remote_error(b.endpoint)
            if reason:
                raise GraphIndexError(f"graph compute on {b.name} (RPC server {b.endpoint}): {reason}")


def raise_local(backends: Iterable[Backend], graph: CData | None = None) -> None:
    """Raise :class:`GraphIndexError` if the last compute of a CPU backend among ``backends`` met an index out of
    range (call after a compute that failed; ``graph``: the ggml_cgraph computed)."""
    err = local_error(backends, graph)
    if err is not None:
        raise err


__all__ = ["describe", "local_error", "raise_local", "raise_remote", "take_remote_error"]
