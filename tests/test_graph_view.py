"""Seeing a graph: Graph.describe's table and Graph.dot (GGML's ggml_graph_dump_dot).

Oracles: the graph's own nodes (op, shape, type, sources), the scheduler's assignments, and for the dot text
Graphviz's parser (``dot -Tplain``, when installed) besides the structure GGML writes (a record per node and leaf, an
edge per source).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import ArgumentError


@pytest.fixture
def trained_graph(cpu_backend):
    with gh.Context(n_tensors=8) as wc, gh.Context(n_tensors=256, graph_size=256, grads=True) as c, \
            gh.Scheduler([cpu_backend], graph_size=256) as sched:
        w = wc.new_tensor("f32", (3, 4), "w")
        x = wc.new_tensor("f32", (2, 4), "x")
        wc.allocate(cpu_backend)
        w.set(np.ones((3, 4), np.float32))
        x.set(np.ones((2, 4), np.float32))
        w.set_param()
        hidden = c.relu(c.mul_mat(w, x))
        hidden.name = "hidden"
        loss = c.sum(c.sqr(hidden))
        loss.name = "loss"
        graph = c.new_graph().expand(loss).backward(loss)
        sched.alloc(graph)
        yield graph, sched


def test_describe_lists_every_node_with_its_op_shape_type_backend_and_flags(trained_graph):
    graph, sched = trained_graph
    text = graph.describe(sched)
    lines = text.splitlines()
    assert lines[0] == f"graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs (size 256, gradients)"
    assert lines[1].split() == ["#", "name", "op", "shape", "type", "backend", "flags", "sources"]
    rows = lines[2:]
    assert len(rows) == graph.n_nodes
    for i, (row, node) in enumerate(zip(rows, graph.nodes)):
        cols = re.split(r"\s{2,}", row)
        assert cols[0] == str(i) and cols[2] == node.op and cols[3] == str(list(node.shape))
        assert cols[4] == node.dtype.name and cols[5] == sched.tensor_backend(node).name == "CPU"
    assert re.search(r"\bw\s+NONE\s+\[3, 4\]\s+F32\s+CPU\s+param\b", text)
    assert re.search(r"\bhidden\s+RELU\s+\[2, 3\]\s+F32\s+CPU\s+-\s+node_1\b", text)
    assert re.search(r"\bloss\s+SUM\s+\[1\]\s+F32\s+CPU\s+output,loss\s+node_3\b", text)
    assert str(graph) == graph.describe()  # without a scheduler: no backends
    assert " - " in str(graph).splitlines()[2]


def test_dot_has_a_record_per_node_and_an_edge_per_source(trained_graph, tmp_path):
    graph, _ = trained_graph
    text = graph.dot()
    assert text.startswith("digraph G {") and text.rstrip().endswith("}")
    records = re.findall(r'^\s+"(0x[0-9a-f]+)" \[', text, re.M)
    # a node that is another node's gradient is drawn inside that node's record (its <g> field)
    grads = {graph.grad(n) for n in graph.nodes} - {None}
    drawn = graph.n_nodes - sum(n in grads for n in graph.nodes) + graph.n_leafs
    assert len(set(records)) == len(records) == drawn
    edges = re.findall(r'^\s+"(0x[0-9a-f]+)"(?::\w+)? -> "(0x[0-9a-f]+)"', text, re.M)
    assert len(edges) == sum(len(n.src) for n in graph.nodes)
    assert "fillcolor = yellow" in text  # the parameter
    out = tmp_path / "g.dot"
    assert graph.dot(out) == text == out.read_text()
    if shutil.which("dot"):
        plain = subprocess.run(["dot", "-Tplain"], input=text, capture_output=True, text=True, check=True).stdout
        assert sum(line.startswith("node ") for line in plain.splitlines()) == drawn


def test_dot_refuses_a_directory(trained_graph, tmp_path):
    graph, _ = trained_graph
    with pytest.raises(ArgumentError, match="directory"):
        graph.dot(tmp_path)
