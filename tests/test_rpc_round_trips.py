"""The round trips of a leader over RPC: a graph's status (vendor patch 0014) never costs one of its own.

ggml-hybrid's client follows every graph it sends with a status request. Upstream's client waits for nothing
after a graph compute: its next reply (the activations copied to the next worker, the logits) is the only round
trip, and that reply waits for the graph. Ours must cost no more: the status is read with that reply, never alone
before it (which was a round trip more per worker per step; issue 44, docs/benchmarks.md section 28).

The oracle is a proxy in front of each server that holds every status reply until the client has sent another
request that it will wait for (so a client that waits for a status alone waits for ever; ``rpc_timeout`` then
fails it), and the resident run on the local CPU for the bits.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from rpc_counts import ANSWERED, RPCStream, command_name
from test_rpc import opts, rpc_server

from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

STATUS = "HYBRID_GRAPH_STATUS"  # vendor patch 0014's command


class StatusGate:
    """A proxy from a loopback port to ``target`` that, while :attr:`holding`, keeps each status reply (and what
    follows it) from the client until the client has sent a later request that has a reply."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.holding = False
        self.cond = threading.Condition()
        self.held = 0  # status replies held at least until a later request
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            conn = _Connection(self, client, server)
            threading.Thread(target=conn.requests, daemon=True).start()
            threading.Thread(target=conn.replies, daemon=True).start()


class _Connection:
    def __init__(self, gate: StatusGate, client: socket.socket, server: socket.socket) -> None:
        self.gate, self.client, self.server = gate, client, server
        self.answered: list[tuple[str, int]] = []  # (command, its number among answered requests), in order
        self.sent = 0  # answered requests the client sent so far
        self.closed = False

    def requests(self) -> None:
        def on_request(code: int | None, size: int) -> None:
            if command_name(code or 0) in ANSWERED:
                with self.gate.cond:
                    self.answered.append((command_name(code or 0), self.sent))
                    self.sent += 1
                    self.gate.cond.notify_all()

        reader = RPCStream(True, on_request)
        self._pump(self.client, self.server, lambda data: (reader.feed(data), self.server.sendall(data)))

    def replies(self) -> None:
        chunk = {"data": b"", "sent": 0}  # the chunk being forwarded and how much of it went

        def before(i: int) -> None:  # a reply starts at data[i]: a status is held (with all after it) while held
            with self.gate.cond:
                cmd, number = self.answered.pop(0) if self.answered else ("", -1)
                if cmd != STATUS or not self.gate.holding:
                    return
                self.gate.held += 1
                self.client.sendall(chunk["data"][chunk["sent"]:i])  # what came before it goes now
                chunk["sent"] = i
                while self.sent <= number + 1 and not self.closed:  # until a later request that has a reply
                    self.gate.cond.wait()

        reader = RPCStream(False, lambda code, size: None)

        def forward(data: bytes) -> None:
            chunk["data"], chunk["sent"] = data, 0
            reader.feed(data, before)
            self.client.sendall(data[chunk["sent"]:])

        self._pump(self.server, self.client, forward)

    def _pump(self, src: socket.socket, dst: socket.socket, forward: Callable[[bytes], object]) -> None:
        try:
            while data := src.recv(1 << 16):
                forward(data)
        except OSError:
            pass
        with self.gate.cond:
            self.closed = True
            self.gate.cond.notify_all()
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@contextmanager
def gated(*endpoints: str) -> Iterator[list[StatusGate]]:
    gates = [StatusGate(e) for e in endpoints]
    try:
        yield gates
    finally:
        for g in gates:
            g.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("rt") / "m.gguf", n_layer=4, n_expert=8, n_used=2, weight_type="q8_0",
                       seed=31)


@pytest.fixture(scope="module")
def two_servers():
    with rpc_server() as a, rpc_server() as b:
        yield a, b


def _steps(m: MoEModel, prompt: list[int], n: int, gates: list[StatusGate], hold_prompt: bool) -> np.ndarray:
    for g in gates:
        g.holding = hold_prompt
    rows = [m.eval(prompt, "last")]
    for g in gates:
        g.holding = True
    for _ in range(n):
        rows.append(m.eval([int(np.argmax(rows[-1][-1]))], "last"))
    for g in gates:
        g.holding = False
    return np.concatenate(rows)


@pytest.mark.parametrize("hold_prompt", [False, True], ids=["decode", "prompt-and-decode"])
def test_a_split_over_two_workers_waits_for_no_status_alone(model, two_servers, hold_prompt):
    """Every layer split 1:1 over two workers (as bench_hosts.py's part 1): the prompt call and each decode step
    complete while every status reply is held until the client asks for something else, with the bits of the
    resident run on the CPU. Before patch 0017 a synchronize read the statuses first: the step waited for a held
    status and failed after rpc_timeout."""
    prompt = list(range(10, 30))
    with MoEModel(model, opts()) as m:
        ref = _steps(m, prompt, 4, [], False)
    a, b = two_servers
    with gated(a.endpoint, b.endpoint) as gates, \
            MoEModel(model, opts(f"rpc={gates[0].endpoint},{gates[1].endpoint}", "tensor_split=1,1",
                                 "rpc_timeout=20")) as m:
        assert set(m.layout.layer_device) == {"RPC0", "RPC1"}
        got = _steps(m, prompt, 4, gates, hold_prompt)
        assert all(g.held >= 4 for g in gates)  # each worker's status of every step was held (the oracle ran)
    assert np.array_equal(got, ref)
