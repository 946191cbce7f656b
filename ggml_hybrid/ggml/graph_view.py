"""Seeing a graph: its nodes as a text table, and GGML's own dot format (``ggml_graph_dump_dot``).

The table lists each node in compute order with its op (the unary or GLU kind for those), numpy-order shape, type,
the backend a scheduler gave it (after ``Scheduler.alloc``), its flags (param, input, output, loss) and its
sources. The dot text is GGML's: nodes coloured by role (parameters yellow, nodes with a gradient green/blue),
leaves pink, one edge per source; render it with Graphviz (``dot -Tsvg``).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from .._native import CData, cstr, ffi, lib
from ..files import atomic_write, check_output

if TYPE_CHECKING:
    from .graph import Graph
    from .sched import Scheduler

_FLAGS = (("param", "GGML_TENSOR_FLAG_PARAM"), ("input", "GGML_TENSOR_FLAG_INPUT"),
          ("output", "GGML_TENSOR_FLAG_OUTPUT"), ("loss", "GGML_TENSOR_FLAG_LOSS"))


def _label(p: CData, names: dict[int, str]) -> str:
    return cstr(p.name) or names.get(int(ffi.cast("uintptr_t", p)), "?")


def describe(graph: Graph, sched: Scheduler | None = None) -> str:
    """One line per node: index, name, op, shape, type, backend, flags and sources."""
    nodes = graph.nodes
    names = {int(ffi.cast("uintptr_t", t.ptr)): f"#{i}" for i, t in enumerate(nodes)}
    rows = [("#", "name", "op", "shape", "type", "backend", "flags", "sources")]
    for i, t in enumerate(nodes):
        p = t.ptr
        backend = "-"
        if sched is not None:
            b = sched.tensor_backend(t)
            backend = b.name if b is not None else "-"
        flags = ",".join(n for n, f in _FLAGS if p.flags & getattr(lib, f)) or "-"
        srcs = ", ".join(_label(s.ptr, names) for s in t.src) or "-"
        rows.append((str(i), cstr(p.name) or "-", t.op, str(list(t.shape)), t.dtype.name, backend, flags, srcs))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines = ["  ".join(r[c].ljust(widths[c]) for c in range(len(widths))) + "  " + r[-1] for r in rows]
    grads = ", gradients" if graph.grads else ""
    head = f"graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs (size {graph.size}{grads})"
    return "\n".join([head, *(line.rstrip() for line in lines)])


def dot(graph: Graph, path: str | os.PathLike[str] | None = None, forward: Graph | None = None) -> str:
    """GGML's dot text of ``graph`` (and written to ``path`` when given). ``forward``: for a graph with a backward
    pass, its forward part, which GGML colours apart."""
    fd, tmp = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        # GGML logs "dot -Tpng <file> ..." about the temporary file: that line is dropped, the package's log restored
        lib.ggml_log_set(lib._hy_drop_log, ffi.NULL)
        try:
            lib.ggml_graph_dump_dot(graph.ptr, forward.ptr if forward is not None else ffi.NULL, tmp.encode())
        finally:
            lib.hy_log_quiet()
        with open(tmp, encoding="utf-8", errors="replace") as f:
            text = f.read()
    finally:
        os.unlink(tmp)
    if path is not None:
        with atomic_write(check_output(path, [], "Graph.dot: path")) as out:
            out.write(text.encode())
    return text


@ffi.def_extern()
def _hy_drop_log(level: int, text: CData, user_data: CData) -> None:
    return None
