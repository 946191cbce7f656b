#!/usr/bin/env python3
"""A TCP proxy that delays every byte by a fixed time in each direction: latency between emulated hosts.

This machine's kernel has no ``netem``, so the links of ``tools/netlab.py`` get their latency from this proxy:
it listens on one address, connects each client it accepts to the target, and forwards each direction's bytes
``delay`` seconds after they arrived (a round trip gains ``2 * delay``). The delay does not limit the rate: a
reader thread keeps receiving while a writer thread sends what has waited long enough, in order, as a link of
that latency would (up to :data:`MAX_IN_FLIGHT` bytes in flight per direction; a reader waits beyond that).

A half-close travels (the peer sees EOF after the delay too); a reset or an error on either side closes both
sides of that connection. Each connection is independent; the proxy serves until it is stopped.

    python tools/delay_proxy.py --listen 10.77.1.2:50053 --to 127.0.0.1:50052 --delay-ms 1

prints ``delay-proxy: listening on HOST:PORT`` once it accepts connections (``--listen HOST:0`` picks a port).
"""

from __future__ import annotations

import collections
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import click

CHUNK = 256 * 1024
MAX_IN_FLIGHT = 64 * 1024 * 1024  # bytes waiting in one direction before the reader stops reading


def _address(ctx: click.Context, param: click.Parameter, text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{text!r} is not HOST:PORT")
    return host, int(port)


class _Pipe:
    """One direction of one connection: ``src`` to ``dst``, each chunk sent ``delay`` seconds after it arrived."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float, on_error: Callable[[], None]) -> None:
        self.src, self.dst, self.delay, self.on_error = src, dst, delay, on_error
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()  # (due, data); b"" is EOF
        self.bytes = 0
        self.cond = threading.Condition()
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK)
                with self.cond:
                    while self.bytes > MAX_IN_FLIGHT and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    self.queue.append((time.monotonic() + self.delay, data))
                    self.bytes += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            self.on_error()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    due, data = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # the chunk's due time: the delay is the point of this proxy
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.bytes -= len(data)
                    self.cond.notify_all()
        except OSError:
            self.on_error()


def _connect(client: socket.socket, target: tuple[str, int], delay: float) -> None:
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pipes: list[_Pipe] = []
    lock = threading.Lock()

    def fail() -> None:  # a reset or an error: both sides go
        with lock:
            for p in pipes:
                p.close()
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    pipes += [_Pipe(client, upstream, delay, fail), _Pipe(upstream, client, delay, fail)]
    for p in pipes:
        p.start()


def listen_on(address: tuple[str, int]) -> socket.socket:
    """A listening socket on ``address`` (port 0: a free one)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        srv.bind(address)
        srv.listen(64)
    except OSError:
        srv.close()
        raise
    srv.settimeout(0.2)  # a bounded wait in accept(), so that ``stop`` is seen
    return srv


def serve(srv: socket.socket, target: tuple[str, int], delay: float, stop: threading.Event) -> None:
    """Accept on ``srv`` (:func:`listen_on`) and forward to ``target`` with ``delay`` seconds each way, until ``stop``
    is set; then close ``srv`` (the connections already made go on until either side ends them)."""
    try:
        while not stop.is_set():
            try:
                client, _ = srv.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            threading.Thread(target=_connect, args=(client, target, delay), daemon=True).start()
    finally:
        srv.close()


@click.command(help=__doc__)
@click.option("--listen", required=True, callback=_address, metavar="HOST:PORT")
@click.option("--to", "target", required=True, callback=_address, metavar="HOST:PORT")
@click.option("--delay-ms", required=True, type=float, help="one-way delay in milliseconds, each direction")
def main(listen: tuple[str, int], target: tuple[str, int], delay_ms: float) -> None:
    if not 0 <= delay_ms <= 60_000:
        raise click.BadParameter(f"--delay-ms {delay_ms} is not in 0..60000", param_hint="--delay-ms")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        srv = listen_on(listen)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}") from None
    host, port = srv.getsockname()
    print(f"delay-proxy: listening on {host}:{port}", flush=True)
    t = threading.Thread(target=serve, args=(srv, target, delay_ms / 1000, stop), daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.5)  # a timed join: the signal handlers run between joins


if __name__ == "__main__":
    main()
