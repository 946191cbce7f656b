"""``ggml-hybrid rpc-server``: serve this machine's device to ggml-hybrid (or llama.cpp) sessions over TCP.

GGML's RPC server runs in a daemon thread (its C call never returns); the main thread waits for
Ctrl-C or SIGTERM and then ends the process at once, so that no clean-up races the server thread.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
from types import FrameType

import click

from ..ggml.backend import THREADS_PER_CORE, max_threads
from ..units import MiB
from .main import main

# --mem is sent to GGML as a size_t of bytes
MAX_MEM_MIB = (2**64 - 1) // MiB

_WARNING = ("warning: rpc-server listens on {endpoint}, which other machines can reach. The RPC protocol has no "
            "authentication and no encryption: anyone who can connect can run graphs on this device and read or "
            "write its memory. Bind to 127.0.0.1 (the default) unless the network is trusted.")


def _check_host(host: str) -> ipaddress.IPv4Address:
    # GGML's server takes a dotted IPv4 address, not a name
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        raise click.BadParameter(f"{host!r} is not an IPv4 address (e.g. 127.0.0.1, or 0.0.0.0 for every interface)",
                                 param_hint="--host") from None


def _check_port(host: str, port: int) -> None:
    """Fail before GGML does (it would only say 'Failed to create server socket')."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as GGML's server does
        s.bind((host, port))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    finally:
        s.close()


def _check_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """The one thread rule of every command (``-t`` of ``run``, ``n_threads``): 1..4 x the cores."""
    if value is not None and not 1 <= value <= max_threads():
        raise click.BadParameter(f"{value} is not an integer in 1..{max_threads()} ({THREADS_PER_CORE} x the cores)")
    return value


def _check_mem(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and not 1 <= value <= MAX_MEM_MIB:
        raise click.BadParameter(f"{value} is not a size in 1..{MAX_MEM_MIB} MiB (what 64 bits of bytes hold)")
    return value


def _served_devices() -> list:
    """llama.cpp's rpc-server choice: the GPUs, else the CPU."""
    from .._native import lib

    devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    gpus = [d for d in devs if lib.ggml_backend_dev_type(d) == lib.GGML_BACKEND_DEVICE_TYPE_GPU]
    cpus = [d for d in devs if lib.ggml_backend_dev_type(d) == lib.GGML_BACKEND_DEVICE_TYPE_CPU]
    return gpus or cpus[:1]


@main.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="IPv4 address to listen on. Any other than a loopback address exposes the device to the network, "
                   "without authentication.")
@click.option("--port", "-p", default=50052, show_default=True, type=click.IntRange(1, 65535))
@click.option("--threads", "-t", type=int, callback=_check_threads, metavar="N",
              help=f"CPU threads of the served CPU, 1..{THREADS_PER_CORE} x the cores (default: all cores).")
@click.option("--mem", type=int, callback=_check_mem, metavar="MiB",
              help="Memory the device reports to clients, in MiB (default: what it has).")
@click.option("--unchecked-ops", is_flag=True,
              help="Also run graph ops the server has no shape rules for (upstream's behaviour; for trusted clients "
                   "only: a malformed graph of such an op can stop the server or corrupt its memory).")
def rpc_server(host: str, port: int, threads: int | None, mem: int | None, unchecked_ops: bool) -> None:
    """Serve this machine's device (its GPUs, else its CPU) to sessions started with --rpc HOST:PORT.

    Runs in the foreground until Ctrl-C. Each client is served by a thread of its own (the devices run one
    command at a time); a client has 10 s to say hello, and a malformed message drops its client, not the
    server (docs/rpc.md).
    """
    from ..ggml import rpc

    address = _check_host(host)
    endpoint = f"{host}:{port}"
    if not address.is_loopback:
        click.echo(_WARNING.format(endpoint=endpoint), err=True)
    _check_port(host, port)
    devices = _served_devices()
    if not devices:
        raise click.ClickException("no device to serve")
    stop = threading.Event()
    result: list[int] = []

    failure: list[BaseException] = []

    def serve() -> None:
        try:
            result.append(rpc.serve(endpoint, threads or os.cpu_count() or 1, devices, (mem or 0) * MiB,
                                    unchecked_ops))
        except BaseException as exc:  # reported by the main thread, which must not wait for ever
            failure.append(exc)
        finally:
            stop.set()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    threading.Thread(target=serve, name="rpc-server", daemon=True).start()
    while not stop.wait(0.5):  # a timed wait: signal handlers run between waits
        pass
    if failure:
        raise click.ClickException(f"the RPC server on {endpoint} could not start: {failure[0]}")
    if result:  # the server returned: it could not start (GGML said why on stderr)
        raise click.ClickException(f"the RPC server on {endpoint} stopped" if result[0] == 0 else
                                   "this build of GGML has no RPC server")
    click.echo(f"rpc-server on {endpoint}: stopped", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # now, without interpreter clean-up: GGML's server thread may be serving a client and must not see
    # its globals destroyed under it; the kernel closes the sockets
    os._exit(0)
