"""Index values out of range inside tensors (issue 28, its last part): vendor patches 0013 and 0014.

The Python layer checks the index data it is given, but indices computed in a graph (here by a GET_ROWS of an
I32 table, which nothing checks) reach GGML's kernels as they are. Upstream's CPU kernels then abort the process
(GET_ROWS, SET_ROWS, ADD_ID: ``GGML_ASSERT``) or write out of bounds (MUL_MAT_ID: a Release build has no
assert); on an RPC server that stopped the server for every client. Now the kernel skips the index and records
it, the compute fails with one :class:`~ggml_hybrid.errors.GraphIndexError` naming the op, the value and the
valid range, and the backend (or the RPC connection) computes the next graph as ever. Oracles: numpy's gather,
scatter, matrix products and sums over the same arrays, for the computes after a failed one.

Each local case runs in a child interpreter: before the patches it aborted, and must fail the test, not the run.
"""

from __future__ import annotations

import json
import re
import socket
import struct

import numpy as np
import pytest
from ggfuzz import rpc_cases as rc
from helpers import run_isolated
from index_cases import BAD, F32, OPS, attempt, check

import ggml_hybrid as gh
from ggml_hybrid.errors import GraphIndexError
from ggml_hybrid.ggml import rpc


@pytest.mark.parametrize("op", OPS)
def test_a_computed_index_out_of_range_is_a_typed_error_on_the_cpu(op):
    """Before patch 0013 the child died (GGML_ASSERT, or MUL_MAT_ID's writes out of bounds)."""
    p = run_isolated(f"""
        import json
        from index_cases import attempt
        print("RESULT", json.dumps(attempt(cpu, {op!r})))
    """)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, (p.returncode, p.stdout[-500:], p.stderr[-1500:])
    check(op, json.loads(line[len("RESULT "):]))


def test_the_error_names_the_node_and_its_source():
    p = run_isolated("""
        from index_cases import run_op
        try:
            run_op(cpu, "get_rows", [0, 7, 1, 2])
        except gh.errors.GraphIndexError as exc:
            print("MSG", exc)
    """)
    msg = next((x for x in p.stdout.splitlines() if x.startswith("MSG ")), "")
    # its position in the caller's graph, its name, the source that held the index (the reshaped gather)
    pattern = r"GET_ROWS node [0-9]+ \(.*\): index 7 in its source 1 \(.*\) is outside 0\.\.3"
    assert re.search(pattern, msg), (msg, p.stderr)


# -- over RPC ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    proc, port = rc.start_server()
    try:
        yield proc, port
    finally:
        rc.stop_server(proc)


@pytest.fixture(scope="module")
def rpc_backend(server):
    _, port = server
    dev = rpc.server_devices(f"127.0.0.1:{port}")[0]
    b = rpc.open_device(dev)
    cpu = gh.cpu(1)
    yield b, cpu
    cpu.close()
    b.close()


@pytest.mark.parametrize("op", OPS)
def test_a_computed_index_out_of_range_on_an_rpc_server_is_a_typed_error_and_the_connection_stays(server,
                                                                                                   rpc_backend, op):
    """Before patches 0013/0014 the server aborted (the client then got a lost connection, every other client
    too). Now the client gets the op, the value and the range; the same connection computes the next graph."""
    proc, port = server
    backend, cpu = rpc_backend
    result = attempt(backend, op, cpu)
    check(op, result)
    for _, msg, *_ in result["errors"]:
        assert f"RPC server 127.0.0.1:{port}" in msg
    assert rpc.connection_error(backend.endpoint) == "" and proc.poll() is None


def test_graph_compute_straight_on_an_rpc_backend_gives_the_same_error(rpc_backend):
    """Graph.compute (no scheduler) over RPC: the same typed error, then the same graph with good data."""
    backend, _ = rpc_backend
    a = np.arange(12, dtype=F32).reshape(4, 3)
    with gh.Context(n_tensors=8, graph_size=16) as c:
        ta, table, sel = c.new_tensor("f32", (4, 3), "a"), c.new_tensor("i32", (3, 1), "table"), \
            c.new_tensor("i32", (3,), "sel")
        y = c.get_rows(ta, c.reshape(c.get_rows(table, sel), (3,)))
        c.allocate(backend)
        ta.set(a)
        sel.set(np.arange(3, dtype=np.int32))
        g = c.new_graph(16).expand(y)
        table.set(np.array([[0], [9], [1]], np.int32))
        with pytest.raises(GraphIndexError, match=r"GET_ROWS node \d .*index 9 in its source 1 .*outside 0\.\.3"):
            g.compute(backend)
        table.set(np.array([[2], [0], [1]], np.int32))
        g.compute(backend)
        assert np.array_equal(y.numpy(), a[[2, 0, 1]])


@pytest.mark.parametrize("value", BAD)
def test_a_raw_client_gets_the_status_and_another_client_is_served(server, value):
    """The protocol itself: GET_ROWS over an index written with SET_TENSOR; a client that asks gets the reason
    and keeps its connection; one that does not ask (an upstream client) is dropped; the server serves a fresh
    client after both."""
    proc, port = server
    v = {"-1": -1, "bound": 4, "2**31-1": 2**31 - 1}[value]
    for asks in (True, False):
        sock = rc.connect(port, timeout=20)
        with sock:
            buffer, _ = struct.unpack("<QQ", rc.request(sock, rc.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)))
            (base,) = struct.unpack("<Q", rc.request(sock, rc.BUFFER_GET_BASE, struct.pack("<Q", buffer)))
            messages, bound = rc.index_graph("GET_ROWS", [0, v], buffer, base)
            for m in messages:
                sock.sendall(m)
            if asks:
                status, reason = rc.graph_status(sock)
                assert status != 0 and "GET_ROWS" in reason and f"index {v} " in reason, reason
                assert f"outside 0..{bound - 1}" in reason
                # the connection stays up: a good graph then succeeds
                for m in rc.index_graph("GET_ROWS", [0, 3], buffer, base)[0]:
                    sock.sendall(m)
                assert rc.graph_status(sock) == (0, "")
            else:
                sock.sendall(rc.frame(rc.DEVICE_COUNT, b""))
                sock.settimeout(20)
                try:  # dropped (closed, or reset: it closed with our bytes unread): it would read zeros as results
                    assert sock.recv(1) == b""
                except ConnectionResetError:
                    pass
        assert rc.alive(port) == 1 and proc.poll() is None


def test_the_server_marks_its_hello(server):
    """A client of ours asks for graph status only where the hello reply says the server answers it."""
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        reply = rc.request(sock, rc.HELLO, bytes(rc.HELLO_BYTES))
        assert reply[3] == rc.HYBRID_MARK


def test_the_server_says_its_device_computes_on_a_cpu(server):
    """After the hello, the device kinds request (vendor patch 0016): one device, GGML's CPU type; the connection
    then serves the protocol's own commands as before."""
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        rc.request(sock, rc.HELLO, bytes(rc.HELLO_BYTES))
        reply = rc.request(sock, rc.DEVICE_KINDS, b"")
        assert len(reply) == rc.KINDS_BYTES and struct.unpack_from("<I", reply)[0] == 1 and reply[4] == 0
        assert struct.unpack("<I", rc.request(sock, rc.DEVICE_COUNT, b""))[0] == 1


def test_index_fuzz_kind(server):
    """A bounded run of the fuzzer's index cases (well-formed graphs, hostile index data): the server answers a
    fresh client after each."""
    _, port = server
    n, cases = 0, 0
    i = 0
    while cases < 60:
        case = rc.make_case(4, i)
        i += 1
        if case.kind != "index":
            continue
        cases += 1
        n += rc.run_case(port, case)[0]
        assert rc.alive(port) == 1
    assert n >= 300
