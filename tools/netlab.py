#!/usr/bin/env python3
"""Hosts and links on one machine: a leader and RPC workers in network namespaces, joined by shaped links.

Each host is a network namespace of its own (``ip netns``, Debian's iproute2; root): the leader ``<prefix>l`` and
workers ``<prefix>w1``, ``<prefix>w2``, ... (``<prefix>``: ``ghlab-<pid>-<n>-``); worker ``i`` is joined to the
leader by a veth pair, ``w<i>`` in the leader (address ``10.77.<i>.1/24``) and ``eth0`` in the worker
(``10.77.<i>.2/24``). The addresses exist only inside these namespaces: the machine's own network is never touched.
What a link can be made to do:

- a rate (``tc ... tbf`` on both ends: ``1gbit``, ``10gbit``, ``25gbit``; this kernel has no ``netem``);
- a share of packets dropped, each direction (iptables' ``statistic`` match; Debian's ``iptables``);
- a partition: the link set down, then up again;
- latency: a worker started with ``delay_ms`` is reached through ``tools/delay_proxy.py`` (run in the worker's
  namespace, on the link's address), which delays each direction by that much.

:class:`Lab` creates the namespaces, starts processes in them (``ggml-hybrid rpc-server`` on the workers), runs
code of this process inside one (:meth:`Namespace.entered`: the calling thread joins the namespace, so the
sockets it opens, such as GGML's RPC client's, live there) and always removes everything in :meth:`Lab.close`
(processes killed, namespaces deleted). ``tests/netns.py`` is the pytest fixture over it.

As a script, it builds a topology for a user to try (root)::

    python tools/netlab.py --workers 2 --rate 1gbit --delay-ms 0.5 -- ggml-hybrid run model.gguf -n 16 -ts 1,1

starts ``rpc-server`` on each worker, runs the command in the leader's namespace with ``--rpc`` to the workers
appended, prints the link measurements, and tears the lab down; with no command it waits for Ctrl-C and prints
how to run commands in it (``ip netns exec <prefix>l ...``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import click

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")
TOOLS = Path(__file__).resolve().parent
RPC_PORT = 50052
PROXY_PORT = 50053  # a delayed worker: the proxy on the link's address, the server on the worker's loopback
START_S = 90.0  # a server process starts (imports the package) well within this on a loaded 2-core machine
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kmg]?)bit")


PREFIX = "ghlab-"  # namespaces: ghlab-<pid of the process that made them>-<serial>-l, ...-w1, ...
_serial = itertools.count()


def remove_stale() -> None:
    """Delete the namespaces of labs whose process is gone (killed before it could clean up), and what runs in
    them."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.startswith(PREFIX)):
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _delete_namespace(name)


def _delete_namespace(name: str) -> None:
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)  # a process inside a lab's own namespace: started by a lab
    _run(["ip", "netns", "del", name], check=False)


class LabError(RuntimeError):
    """A lab that cannot be made here (no root, no iproute2) or a command inside it that failed."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable() -> str | None:
    """Why no lab can be made on this machine (None: one can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"
    name = f"ghprobe{os.getpid()}"
    r = _run(["ip", "netns", "add", name], check=False)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return None


def rate_bits(text: str) -> int:
    """``"10gbit"`` -> 10_000_000_000 (tc's units: k, m, g are powers of 1000)."""
    m = _RATE.fullmatch(text.strip().lower())
    if not m:
        raise ValueError(f"{text!r} is not a rate such as 1gbit, 10gbit, 500mbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


class Namespace:
    """A network namespace of the lab: commands and processes run inside it, and this thread can join it."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab, self.name = lab, name

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(self.cmd(*argv), check)

    def popen(self, argv: Sequence[str], **kw: object) -> subprocess.Popen[str]:
        """A process inside the namespace, ended by :meth:`Lab.close` if it is still running."""
        p = subprocess.Popen(self.cmd(*argv), text=True, **kw)  # type: ignore[call-overload]
        self.lab.processes.append(p)
        return p

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread in this namespace (its new sockets live here), back where it was on exit."""
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_DIR / self.name, os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise LabError(f"setns into {self.name}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                if libc.setns(home, CLONE_NEWNET) != 0:  # pragma: no cover - the kernel gave this very namespace
                    raise LabError(f"setns back from {self.name}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(home)
            os.close(target)


@dataclass
class Link:
    """The veth pair between the leader and worker ``index``."""

    lab: Lab
    index: int
    rate: str | None = None
    drop: float = 0.0
    up: bool = True

    @property
    def leader_dev(self) -> str:
        return f"w{self.index}"

    @property
    def leader_addr(self) -> str:
        return f"10.77.{self.index}.1"

    @property
    def worker_addr(self) -> str:
        return f"10.77.{self.index}.2"

    @property
    def worker(self) -> Namespace:
        return self.lab.workers[self.index - 1]

    def _ends(self) -> list[tuple[Namespace, str]]:
        return [(self.lab.leader, self.leader_dev), (self.worker, "eth0")]

    def shape(self, rate: str | None) -> None:
        """Limit each direction to ``rate`` (tc's token bucket; None: no limit)."""
        for ns, dev in self._ends():
            _run(["tc", "-n", ns.name, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                bits = rate_bits(rate)
                burst = max(bits // 8 // 250, 64 * 1024)  # 4 ms of the rate: at least one tick of any HZ
                _run(["tc", "-n", ns.name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", str(bits),
                      "burst", str(burst), "latency", "50ms"])
        self.rate = rate

    def set_drop(self, share: float) -> None:
        """Drop ``share`` of the packets in each direction (on the worker's side; 0: none)."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"drop share {share} is not in 0..1")
        ns = self.worker
        ns.run("iptables", "-F", "INPUT")
        ns.run("iptables", "-F", "OUTPUT")
        if share > 0:
            for chain in ("INPUT", "OUTPUT"):
                ns.run("iptables", "-A", chain, "-i" if chain == "INPUT" else "-o", "eth0", "-m", "statistic",
                       "--mode", "random", "--probability", f"{share:.6f}", "-j", "DROP")
        self.drop = share

    def set_up(self, up: bool) -> None:
        """Partition (``False``: both ends down) or heal the link; the addresses come back with it."""
        for ns, dev in self._ends():
            _run(["ip", "-n", ns.name, "link", "set", dev, "up" if up else "down"])
        self.up = up


@dataclass
class Worker:
    """``ggml-hybrid rpc-server`` in a worker's namespace (behind the delaying proxy when ``delay_ms``)."""

    link: Link
    threads: int = 1
    delay_ms: float = 0.0
    extra: tuple[str, ...] = ()
    command: Sequence[str] = field(default_factory=lambda: [sys.executable, "-c",
                                                            "from ggml_hybrid.cli import main; main()"])
    # the pin's own rpc-server (python -m ggml_hybrid_build --pin-rpc-server) instead of ggml-hybrid's
    upstream: Path | None = None
    proc: subprocess.Popen[str] | None = None
    proxy: subprocess.Popen[str] | None = None
    log_file: object = None

    def argv(self, host: str) -> list[str]:
        if self.upstream is not None:  # llama.cpp's flags
            return [str(self.upstream), "-H", host, "-p", str(RPC_PORT), "-t", str(self.threads), *self.extra]
        return [*self.command, "rpc-server", "--host", host, "--port", str(RPC_PORT), "--threads", str(self.threads),
                *self.extra]

    @property
    def endpoint(self) -> str:
        return f"{self.link.worker_addr}:{PROXY_PORT if self.delay_ms else RPC_PORT}"

    def start(self) -> Worker:
        """Start the server (and its proxy) and wait until the leader can connect."""
        ns = self.link.worker
        host = "127.0.0.1" if self.delay_ms else self.link.worker_addr
        self.log_file = tempfile.TemporaryFile("w+")
        self.proc = ns.popen(self.argv(host), stdout=self.log_file, stderr=subprocess.STDOUT)
        if self.delay_ms and (self.proxy is None or self.proxy.poll() is not None):
            self.proxy = ns.popen([sys.executable, str(TOOLS / "delay_proxy.py"), "--listen",
                                   f"{self.link.worker_addr}:{PROXY_PORT}", "--to", f"127.0.0.1:{RPC_PORT}",
                                   "--delay-ms", str(self.delay_ms)], stdout=subprocess.DEVNULL)
        self._wait_listening(ns, host)
        return self

    def _wait_listening(self, ns: Namespace, host: str) -> None:
        # the server listening inside its namespace (a probe from there: a connection through the proxy would
        # succeed before the server listens), then the leader's way to it
        deadline = time.monotonic() + START_S
        probes = [(ns, host, RPC_PORT), (self.link.lab.leader, *self.endpoint.split(":"))]
        for where, h, port in probes:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise LabError(f"rpc-server on {self.endpoint} exited with {self.proc.returncode}: {self.log()}")
                with where.entered():
                    try:
                        socket.create_connection((h, int(port)), timeout=1).close()
                        break
                    except OSError:
                        pass
                if time.monotonic() > deadline:
                    raise LabError(f"rpc-server on {self.endpoint} did not listen within {START_S:g} s: {self.log()}")
                time.sleep(0.1)  # a bounded poll for the port

    def log(self) -> str:
        if self.log_file is None:
            return ""
        self.log_file.seek(0)  # type: ignore[attr-defined]
        return str(self.log_file.read())  # type: ignore[attr-defined]

    def kill(self) -> None:
        """SIGKILL the server (its proxy stays: the leader's connection through it then fails as the server's)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait()


class Lab:
    """A leader namespace and ``n_workers`` worker namespaces, each worker joined to the leader by a :class:`Link`.
    Use it as a context manager (or call :meth:`close`): everything it made goes, also on failure."""

    def __init__(self, n_workers: int, prefix: str | None = None) -> None:
        if not 1 <= n_workers <= 8:
            raise ValueError(f"{n_workers} workers: a lab has 1..8")
        remove_stale()
        self.prefix = prefix or f"{PREFIX}{os.getpid()}-{next(_serial)}-"
        self.processes: list[subprocess.Popen[str]] = []
        self.leader = Namespace(self, f"{self.prefix}l")
        self.workers = [Namespace(self, f"{self.prefix}w{i}") for i in range(1, n_workers + 1)]
        self.links = [Link(self, i) for i in range(1, n_workers + 1)]
        self.servers: list[Worker] = []
        self._made: list[str] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        for ns in (self.leader, *self.workers):
            _run(["ip", "netns", "add", ns.name])
            self._made.append(ns.name)
            _run(["ip", "-n", ns.name, "link", "set", "lo", "up"])
        for link in self.links:
            w = link.worker.name
            _run(["ip", "link", "add", "name", link.leader_dev, "netns", self.leader.name, "type", "veth", "peer",
                  "name", "eth0", "netns", w])
            _run(["ip", "-n", self.leader.name, "addr", "add", f"{link.leader_addr}/24", "dev", link.leader_dev])
            _run(["ip", "-n", w, "addr", "add", f"{link.worker_addr}/24", "dev", "eth0"])
            link.set_up(True)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_worker(self, index: int, threads: int = 1, delay_ms: float = 0.0, extra: Sequence[str] = (),
                     command: Sequence[str] | None = None, upstream: Path | None = None) -> Worker:
        """``rpc-server`` on worker ``index`` (1-based; behind a proxy of ``delay_ms`` each way when not 0; the pin's
        own server when ``upstream`` names it), waited for; its ``--rpc`` item is :attr:`Worker.endpoint`."""
        kw = {} if command is None else {"command": list(command)}
        w = Worker(self.links[index - 1], threads, delay_ms, tuple(extra), upstream=upstream,
                   **kw)  # type: ignore[arg-type]
        self.servers.append(w)
        return w.start()

    def start_workers(self, threads: int = 1, delay_ms: float = 0.0, extra: Sequence[str] = (),
                      command: Sequence[str] | None = None, upstream: Path | None = None) -> list[Worker]:
        """``rpc-server`` on every worker, each waited for."""
        return [self.start_worker(link.index, threads, delay_ms, extra, command, upstream) for link in self.links]

    def rpc(self) -> str:
        """The leader's ``--rpc`` value for the workers started."""
        return ",".join(w.endpoint for w in self.servers)

    def close(self) -> None:
        """Kill every process started in the lab (and any left in its namespaces), delete the namespaces."""
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()

    # -- measurements -------------------------------------------------------------------------------------------

    def measure(self, index: int, megabytes: int = 64, pings: int = 50, timeout: float = 60) -> dict[str, float]:
        """The link to worker ``index`` as a TCP connection sees it: ``gbit_s`` (one direction, leader to worker,
        ``megabytes`` sent) and ``rtt_ms`` (median of ``pings`` one-byte round trips; nan for none), through a
        proxy of the worker's delay when its server has one. A send or a reply that waits more than ``timeout``
        seconds raises :class:`TimeoutError`."""
        link = self.links[index - 1]
        delay = max((w.delay_ms for w in self.servers if w.link is link), default=0.0)
        sink = link.worker.popen([sys.executable, "-c", _SINK, link.worker_addr], stdout=subprocess.PIPE)
        proxy = None
        try:
            assert sink.stdout is not None
            port = int(sink.stdout.readline())
            if delay:
                proxy = link.worker.popen([sys.executable, str(TOOLS / "delay_proxy.py"), "--listen",
                                           f"{link.worker_addr}:0", "--to", f"{link.worker_addr}:{port}",
                                           "--delay-ms", str(delay)], stdout=subprocess.PIPE)
                assert proxy.stdout is not None
                port = int(proxy.stdout.readline().rpartition(":")[2])
            with self.leader.entered():
                s = socket.create_connection((link.worker_addr, port), timeout=timeout)
            with s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rtts = []
                for _ in range(pings):
                    t0 = time.perf_counter()
                    s.sendall(b"p")
                    s.recv(1)
                    rtts.append(time.perf_counter() - t0)
                block = b"\0" * (1 << 20)
                t0 = time.perf_counter()
                s.sendall(b"b")
                for _ in range(megabytes):
                    s.sendall(block)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)  # the sink's acknowledgement: everything arrived
                seconds = time.perf_counter() - t0
        finally:
            for p in (sink, proxy):
                if p is not None:
                    p.kill()
                    p.wait()
        rtts.sort()
        rtt = rtts[len(rtts) // 2] * 1e3 if rtts else float("nan")
        return {"gbit_s": megabytes * (1 << 20) * 8 / seconds / 1e9, "rtt_ms": rtt}


# the sink of Lab.measure: echoes each 'p', then after 'b' reads to EOF and acknowledges
_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
c, _ = srv.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)) == b"p":
    c.sendall(b"p")
while c.recv(1 << 20):
    pass
c.sendall(b"k")
"""


def _check_rate(value: str | None) -> str | None:
    if value is not None:
        try:
            rate_bits(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rate") from None
    return value


@click.command(help=__doc__, context_settings={"ignore_unknown_options": True})
@click.option("--workers", type=click.IntRange(1, 8), default=2, show_default=True,
              help="worker hosts, each running rpc-server")
@click.option("--rate", default=None, callback=lambda ctx, param, v: _check_rate(v),
              help="each link's rate, e.g. 1gbit, 10gbit, 25gbit (default: none)")
@click.option("--delay-ms", type=click.FloatRange(0, 60_000), default=0.0, help="one-way latency of each link")
@click.option("--drop", type=click.FloatRange(0, 1), default=0.0, help="share of packets each link drops, each way")
@click.option("--threads", type=int, default=1, show_default=True, help="each rpc-server's --threads")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def main(workers: int, rate: str | None, delay_ms: float, drop: float, threads: int, command: tuple[str, ...]) -> None:
    why = unavailable()
    if why:
        raise click.ClickException(why)
    with Lab(workers) as lab:
        for link in lab.links:
            link.shape(rate)
            link.set_drop(drop)
        lab.start_workers(threads, delay_ms)
        for link in lab.links:
            m = lab.measure(link.index)
            click.echo(f"link {lab.leader.name} <-> {link.worker.name} ({link.worker_addr}): {m['gbit_s']:.2f} "
                       f"Gbit/s, rtt {m['rtt_ms']:.3f} ms", err=True)
        if command:
            sys.exit(subprocess.run(lab.leader.cmd(*command, "--rpc", lab.rpc())).returncode)
        click.echo(f"ready: ip netns exec {lab.leader.name} ggml-hybrid run MODEL --rpc {lab.rpc()}  (Ctrl-C ends "
                   "the lab)", err=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
