"""tools/delay_proxy.py, the latency of the emulated links (this kernel has no netem), on loopback.

Oracles: the bytes an echo server sent back (every byte, in order, whatever the chunking), the clock's lower bound
(a reply through a proxy of delay d cannot come back before 2d; no upper bound is asserted, the machine is shared),
and the socket's own EOF and reset.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import delay_proxy
import pytest
from hypothesis import given
from hypothesis import strategies as st

PROXY = Path(__file__).resolve().parents[1] / "tools" / "delay_proxy.py"


class Echo:
    """A loopback TCP server that echoes every byte it gets, and closes its side on EOF."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        try:
            while data := c.recv(65536):
                c.sendall(data)
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


@pytest.fixture(scope="module")
def proxied():
    """(echo server, a function making a client through a proxy of the given delay)."""
    echo = Echo()
    stops: list[threading.Event] = []

    def connect(delay: float) -> socket.socket:
        srv = delay_proxy.listen_on(("127.0.0.1", 0))
        stop = threading.Event()
        stops.append(stop)
        threading.Thread(target=delay_proxy.serve, args=(srv, ("127.0.0.1", echo.port), delay, stop),
                         daemon=True).start()
        s = socket.create_connection(srv.getsockname(), timeout=30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    yield echo, connect
    for s in stops:
        s.set()
    echo.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


@given(chunks=st.lists(st.binary(min_size=1, max_size=300_000), min_size=1, max_size=6))
def test_every_byte_arrives_in_order(proxied, chunks):
    _, connect = proxied
    with connect(0.0) as s:
        sender = threading.Thread(target=lambda: [s.sendall(c) for c in chunks])
        sender.start()
        want = b"".join(chunks)
        got = _recv_exactly(s, len(want))
        sender.join()
    assert got == want


@pytest.mark.parametrize("delay", [0.02, 0.1])
def test_a_round_trip_takes_at_least_twice_the_delay(proxied, delay):
    _, connect = proxied
    with connect(delay) as s:
        for _ in range(3):
            t0 = time.monotonic()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            assert time.monotonic() - t0 >= 2 * delay


def test_the_delay_does_not_limit_the_rate(proxied):
    """A window of data in flight: 20 messages sent at once come back after about one round trip, not twenty (the
    bound asserted: less than 20 round trips, which a proxy that delayed each message in turn could not meet)."""
    _, connect = proxied
    delay = 0.1
    with connect(delay) as s:
        t0 = time.monotonic()
        for i in range(20):
            s.sendall(bytes([i]) * 1000)
        assert _recv_exactly(s, 20_000) == b"".join(bytes([i]) * 1000 for i in range(20))
        assert time.monotonic() - t0 < 20 * 2 * delay


def test_a_half_close_travels_and_the_reply_still_arrives(proxied):
    _, connect = proxied
    with connect(0.01) as s:
        s.sendall(b"last words")
        s.shutdown(socket.SHUT_WR)
        assert _recv_exactly(s, 100) == b"last words"  # then EOF: the echo server closed its side after ours
        assert s.recv(1) == b""


ECHO_PROCESS = """
import socket
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
while data := c.recv(65536):
    c.sendall(data)
"""


def test_the_upstream_killed_closes_the_client():
    """The server's process killed (the kernel ends its connection): the client behind the proxy sees its
    connection end too, never a connection that stays open with nobody behind it."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO_PROCESS], stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        srv = delay_proxy.listen_on(("127.0.0.1", 0))
        threading.Thread(target=delay_proxy.serve, args=(srv, ("127.0.0.1", port), 0.01, stop), daemon=True).start()
        with socket.create_connection(srv.getsockname(), timeout=30) as s:
            s.sendall(b"a")
            assert s.recv(1) == b"a"
            echo.kill()
            echo.wait()
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        stop.set()
        echo.kill()
        echo.wait()


def test_nothing_listening_upstream_closes_the_client():
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    srv = delay_proxy.listen_on(("127.0.0.1", 0))
    stop = threading.Event()
    threading.Thread(target=delay_proxy.serve, args=(srv, ("127.0.0.1", port), 0.0, stop), daemon=True).start()
    try:
        with socket.create_connection(srv.getsockname(), timeout=30) as s:
            assert s.recv(1) == b""
    finally:
        stop.set()


def test_the_script_prints_its_address_and_refuses_a_bad_delay():
    p = subprocess.Popen([sys.executable, str(PROXY), "--listen", "127.0.0.1:0", "--to", "127.0.0.1:9",
                          "--delay-ms", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("delay-proxy: listening on 127.0.0.1:")
    finally:
        p.terminate()
        assert p.wait(timeout=30) == 0
    r = subprocess.run([sys.executable, str(PROXY), "--listen", "127.0.0.1:0", "--to", "127.0.0.1:9",
                        "--delay-ms", "-1"], capture_output=True, text=True)
    assert r.returncode == 2 and "--delay-ms -1.0 is not in 0..60000" in r.stderr and "Traceback" not in r.stderr
