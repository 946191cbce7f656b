"""tools/bench/rpc_worker_cost.py reads graphs as a worker receives them, and a step's phases from the messages' times.

The oracles: GGML's own tensor structs on the client that sent the graph (each node's address, which GGML's RPC
client sends as the tensor's id, its op, type, shape, strides, sources and name), ``ggml_is_contiguous``, and
messages built here with a known framing and known times.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from rpc_counts import COMMANDS, CountingProxy, RPCStream
from rpc_worker_cost import PHASES, Names, describe, node_diff, parse_graph, phases
from test_rpc import rpc_server

import ggml_hybrid as gh
from ggml_hybrid._native import ffi
from ggml_hybrid.ggml import rpc


def _address(t: gh.Tensor) -> int:
    return int(ffi.cast("uintptr_t", t.ptr))


def test_a_graph_parsed_as_the_worker_receives_it():
    """A small graph (a permuted, non-contiguous view; a copy; a product; a softmax; a gather by an I32 index)
    computed on one of our rpc-servers through the proxy: the GRAPH_COMPUTE it keeps parses to the graph's nodes, in
    order, each with the op, type, shape, strides, sources and name of the tensor the client built."""
    with rpc_server() as s:
        host, port = s.endpoint.rsplit(":", 1)
        proxy = CountingProxy((host, int(port)), keep_graphs=True)
        (dev,) = rpc.server_devices(f"127.0.0.1:{proxy.port}", timeout=30)
        backend = rpc.open_device(dev)
        try:
            with gh.Context(n_tensors=16, graph_size=16) as c:
                a, b = c.new_tensor("f32", (6, 4, 8), "a"), c.new_tensor("f32", (5, 8), "b")
                rows = c.new_tensor("i32", (3,), "rows").set_input()
                p = c.permute(a, (1, 0, 2))                       # a view: [4, 6, 8], not contiguous
                y = c.soft_max(c.mul_mat(b, c.cont(p)))           # [4, 6, 5]
                z = c.get_rows(c.reshape(y, (24, 5)), rows)
                c.allocate(backend)
                a.set(np.arange(6 * 4 * 8, dtype=np.float32).reshape(6, 4, 8) / 100)
                b.set(np.ones((5, 8), np.float32))
                rows.set(np.array([0, 7, 23], np.int32))
                g = c.new_graph(16).expand(z)
                g.compute(backend)
                z.numpy()  # the first reply after the graph: it was computed
                (payload,) = proxy.take_graphs()
                parsed = parse_graph(payload)
                nodes = g.nodes
                assert parsed.nodes == [_address(n) for n in nodes]
                for n in nodes:
                    t = parsed.tensors[_address(n)]
                    assert (t.op, t.type, t.ne, t.nb, t.name) == (n.ptr.op, n.ptr.type, n.ne, n.nb, n.name)
                    assert [x for x in t.src if x] == [_address(x) for x in n.src]
                    for src in n.src:  # every source travels with the graph, leaves (a, b, rows) included
                        ts = parsed.tensors[_address(src)]
                        assert (ts.op, ts.ne, ts.nb, ts.flags) == (src.ptr.op, src.ne, src.nb, src.ptr.flags)
                lines = describe(parsed, Names(), {})
                assert len(lines) == len(nodes)
                for line, n in zip(lines, nodes):
                    head = line.split(" <- ")[0]  # the node itself; its sources follow the arrow
                    assert ("nb=" in head) == (not n.is_contiguous), line
                    assert f"'{n.name}'" in line
                assert any("input 'rows'" in line for line in lines)  # set_input travels as the input flag
        finally:
            backend.close()
            proxy.listener.close()


def _message(code: int, payload: bytes) -> bytes:
    return bytes([code]) + struct.pack("<Q", len(payload)) + payload


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(st.binary(max_size=40), min_size=1, max_size=6), cuts=st.lists(st.integers(0, 400)))
def test_rpc_stream_gives_each_payload_whole_however_it_is_cut(payloads, cuts):
    """Messages fed in pieces cut anywhere: on_payload's pieces add up to each payload, message by message."""
    stream = b"".join(_message(COMMANDS.index("SET_TENSOR"), p) for p in payloads)
    got: list[bytearray] = []
    reader = RPCStream(True, lambda code, size: got.append(bytearray()), lambda chunk: got[-1].extend(chunk))
    edges = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    for lo, hi in zip(edges, edges[1:]):
        reader.feed(stream[lo:hi])
    assert [bytes(g) for g in got] == payloads


def test_the_proxy_keeps_each_graph_whole_across_reads():
    """A GRAPH_COMPUTE larger than one read (and requests around it) reaches the server unchanged, and the proxy
    keeps its payload whole; the timeline names each reply by the request it answers."""
    received = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while len(received) < len(stream):
                data = conn.recv(1 << 16)
                if not data:
                    break
                received.extend(data)
            conn.sendall(struct.pack("<Q", 4) + b"abcd")  # the reply to GET_TENSOR
            done.set()
            conn.recv(1)

    graph = bytes(range(256)) * 1200  # 300 KiB: several reads of 64 KiB
    stream = (_message(COMMANDS.index("SET_TENSOR"), b"x" * 100) + _message(COMMANDS.index("GRAPH_COMPUTE"), graph)
              + _message(COMMANDS.index("GET_TENSOR"), b"y" * 8))
    threading.Thread(target=serve, daemon=True).start()
    proxy = CountingProxy(listener.getsockname(), keep_graphs=True)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.sendall(stream)
            assert done.wait(30)
            reply = b""
            while len(reply) < 12:
                reply += c.recv(64)
        assert bytes(received) == stream
        assert proxy.take_graphs() == [graph]
        names = [(kind, name) for _, kind, name, _ in proxy.take_timeline()]
        assert names == [("request", "SET_TENSOR"), ("request", "GRAPH_COMPUTE"), ("request", "GET_TENSOR"),
                         ("reply", "GET_TENSOR")]
    finally:
        proxy.listener.close()
        listener.close()


def test_phases_of_a_step_from_its_messages():
    """Two steps with known times (ms): each phase is the gap between the messages that bound it, medians over
    the steps asked for."""
    def step(t0: float, gap: float) -> tuple[list, list]:
        ms = 1e-3
        w1 = [(t0 + 0.1 * ms, "request", "SET_TENSOR", 10), (t0 + (0.2 + gap) * ms, "request", "GRAPH_RECOMPUTE", 4),
              (t0 + (0.25 + gap) * ms, "request", "GET_TENSOR", 8), (t0 + (0.7 + gap) * ms, "reply", "GET_TENSOR", 8)]
        w2 = [(t0 + (0.9 + gap) * ms, "request", "GRAPH_RECOMPUTE", 4),
              (t0 + (0.95 + gap) * ms, "request", "GET_TENSOR", 8), (t0 + (1.2 + gap) * ms, "reply", "GET_TENSOR", 8)]
        return w1, w2

    w1, w2 = [], []
    t = 5.0
    for gap in (0.0, 0.1, 0.3):  # the first step is the one before those measured: its end starts the next
        a, b = step(t, gap)
        w1 += a
        w2 += b
        t = b[-1][0]
    got = phases(w1, w2, 2)
    want = dict(zip(PHASES, (0.2 + 0.2, 0.1 + 0.2, 0.5, 0.2, 0.3, 0.0, 1.2 + 0.2)))  # medians of gaps 0.1, 0.3
    assert got.keys() == want.keys()
    for k in PHASES:
        assert abs(got[k] - want[k]) < 1e-6, (k, got[k], want[k])


def test_node_diff_aligns_graphs_whose_lines_repeat():
    """48 layers of the same lines (a graph's size: 240 nodes), one side with a node more in each: the diff shows
    exactly those insertions (with difflib's junk heuristic on, lines repeated this often in a list of 200 or more
    align nothing)."""
    layer = ["MUL_MAT f32[64]", "RESHAPE f32[32,2]", "ROPE f32[32,2]", "SOFT_MAX f32[256]", "MUL_MAT_ID f32[64,2]"]
    theirs = layer * 48
    ours = [x for _ in range(48) for x in (*layer[:4], "CONT i32[2]", layer[4])]
    changed = [line for line in node_diff(theirs, ours) if line[:2] in ("- ", "+ ")]
    assert changed == ["+ CONT i32[2]"] * 48
