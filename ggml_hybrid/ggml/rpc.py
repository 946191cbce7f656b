"""GGML's RPC backend: devices of other processes or machines (``ggml-hybrid rpc-server``), over TCP.

A session given ``rpc=HOST:PORT[,HOST:PORT...]`` (llama.cpp's ``--rpc``) asks each server for its
devices and names them as llama.cpp does: ``RPC0``, ``RPC1``, ... in the order of the list, each
server's devices in its own order. GGML reaches the backend through its registry (the functions are
proc addresses of the ``RPC`` entry), as llama.cpp does, whether it is linked in or loaded.

Failures never abort (vendor patch 0003): a connection that cannot be made, a failed handshake or a
connection lost mid-run leaves GGML's calls without effect, and :func:`raise_if_lost` /
:func:`check_buffer` turn the endpoint's recorded reason into one :class:`~ggml_hybrid.errors.RPCError`.
A lost connection stays failed until everything that uses it (the session's backends and buffers) is
closed; the next session connects afresh.
"""

from __future__ import annotations

import re
import socket
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

from .._native import CData, cstr, ffi, lib
from ..errors import OptionError, RPCError
from .backend import Backend

_ERROR_BYTES = 512
DEFAULT_TIMEOUT_S = 120  # the rpc_timeout option's default
# buffer type address -> endpoint, for every RPC backend opened: which connection a buffer depends on
_buffer_types: dict[int, str] = {}
_procs: dict[str, CData] = {}


def _proc(name: str, ctype: str) -> CData:
    fn = _procs.get(name)
    if fn is None:
        reg = lib.ggml_backend_reg_by_name(b"RPC")
        ptr = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg != ffi.NULL else ffi.NULL
        if ptr == ffi.NULL:
            raise RPCError(f"this build of GGML has no RPC backend ({name} not found); rebuild with ggml_hybrid_build")
        fn = _procs[name] = ffi.cast(ctype, ptr)
    return fn


def connection_error(endpoint: str) -> str:
    """Why the connection to ``endpoint`` failed ('' when it has not, or a new one has since succeeded)."""
    get = _proc("ggml_backend_rpc_get_error", "size_t (*)(const char *, char *, size_t)")
    buf = ffi.new("char[]", _ERROR_BYTES)
    get(endpoint.encode(), buf, _ERROR_BYTES)
    return cstr(buf)


def _fail(endpoint: str, fallback: str) -> RPCError:
    _links.pop(endpoint, None)  # the connection failed: the next one measures its link
    return RPCError(f"RPC server {endpoint}: {connection_error(endpoint) or fallback}")


def _reason(endpoint: str) -> str:
    """:func:`connection_error`; a failed connection forgets its measured link (a reconnect measures anew)."""
    reason = connection_error(endpoint)
    if reason:
        _links.pop(endpoint, None)
    return reason


@dataclass(frozen=True)
class RPCDevice:
    """One device of an RPC server, named as this session names it."""

    name: str  # RPC0, RPC1, ...
    endpoint: str  # HOST:PORT
    index: int  # the device's number on its server
    dev: CData = field(repr=False, compare=False)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes, as the server reports them (asked now)."""
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(self.dev, free, total)
        if total[0] == 0 and connection_error(self.endpoint):
            raise _fail(self.endpoint, "no reply")
        return int(free[0]), int(total[0])


def _resolve(endpoint: str) -> None:
    """GGML resolves the host itself, but would log its failure on stderr: check it here first (IPv4, as GGML)."""
    host = endpoint.rpartition(":")[0]
    try:
        socket.gethostbyname(host)
    except (OSError, UnicodeError) as exc:
        raise RPCError(f"RPC server {endpoint}: cannot resolve host {host!r} ({exc})") from None


_ENDPOINT_RE = re.compile(r"([^\s:,]+):([0-9]+)")


def endpoint_list(text: str) -> list[str]:
    """``"host:50052,10.0.0.2:50052"`` -> ["host:50052", "10.0.0.2:50052"]: HOST:PORT items, each once
    (llama.cpp's --rpc; IPv4 addresses or host names, as GGML's RPC client takes them). A bad item raises
    ValueError naming it and the rule."""
    out: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        m = _ENDPOINT_RE.fullmatch(item)
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"{item!r} is not HOST:PORT with a port in 1..65535")
        endpoint = f"{m.group(1)}:{int(m.group(2))}"
        if endpoint in out:
            raise ValueError(f"{endpoint} is given twice")
        out.append(endpoint)
    return out


def parse_endpoints(text: str) -> list[str]:
    """``"HOST:PORT,..."`` -> the endpoints; bad text raises OptionError."""
    try:
        return endpoint_list(text)
    except ValueError as exc:
        raise OptionError(f"rpc={text}: {exc}") from None


def set_timeout(seconds: float) -> None:
    """Connections made from now on give up on a connect, a send or a reply that takes more than ``seconds``
    (0: no limit): the connection then fails, and the next call raises :class:`RPCError` saying so."""
    _proc("ggml_backend_rpc_set_timeout", "void (*)(double)")(float(seconds))


def watch_interrupts() -> None:
    """Make Ctrl-C end a wait for a server in progress (its connection fails), so that the interrupt reaches
    Python even when the server is frozen (``rpc_server.h``)."""
    lib.hy_rpc_watch_interrupts()


def server_devices(text: str, timeout: float = DEFAULT_TIMEOUT_S) -> list[RPCDevice]:
    """The devices of the servers in ``text`` (``HOST:PORT,...``), each server asked over the network;
    connections give up after ``timeout`` seconds without progress (0: never)."""
    endpoints = parse_endpoints(text)
    set_timeout(timeout)
    watch_interrupts()
    add_server = _proc("ggml_backend_rpc_add_server", "ggml_backend_reg_t (*)(const char *)")
    out: list[RPCDevice] = []
    for endpoint in endpoints:
        _resolve(endpoint)
        reg = add_server(endpoint.encode())  # GGML keeps one registry entry per endpoint
        if reg == ffi.NULL:
            raise _fail(endpoint, "the server has no device")
        for i in range(lib.ggml_backend_reg_dev_count(reg)):
            out.append(RPCDevice(f"RPC{len(out)}", endpoint, i, lib.ggml_backend_reg_dev_get(reg, i)))
    return out


def open_device(device: RPCDevice) -> Backend:
    """A backend on ``device``: connects to its server (or shares the connection the process has to it)."""
    ptr = lib.ggml_backend_dev_init(device.dev, ffi.NULL)
    if ptr == ffi.NULL:
        raise _fail(device.endpoint, f"could not open device {device.index} of the server")
    backend = Backend(ptr, device.name)
    backend.endpoint, backend.remote_index = device.endpoint, device.index
    with _opened_lock:
        _opened.setdefault(device.endpoint, weakref.WeakSet()).add(backend)
    buft = lib.ggml_backend_get_default_buffer_type(ptr)
    if buft == ffi.NULL:  # the connection failed after the backend was made
        backend.close()
        raise _fail(device.endpoint, "no buffer type")
    _buffer_types[int(ffi.cast("uintptr_t", buft))] = device.endpoint
    return backend


#: GGML's enum ggml_backend_dev_type, by value: what a server's device computes on
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel")


def device_kind(endpoint: str, index: int) -> str | None:
    """What device ``index`` of ``endpoint``'s server computes on (:data:`DEVICE_KINDS`), as the server said on the
    connection's handshake; None when unknown: not connected yet, or a server that does not say (llama.cpp's own, or
    ggml-hybrid's before vendor patch 0016)."""
    get = _proc("ggml_backend_rpc_get_device_kind", "int (*)(const char *, uint32_t)")
    kind = int(get(endpoint.encode(), index))
    return DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else None


def computes_on_cpu(backend: Backend) -> bool:
    """Whether ``backend`` is a device of an RPC server that computes on its CPU backend (so that the expert cache's
    rounds can give it compacted rows, as to a local CPU device)."""
    return (backend.endpoint is not None and backend.remote_index is not None
            and device_kind(backend.endpoint, backend.remote_index) == "cpu")


@dataclass(frozen=True)
class Link:
    """What the connection to a server carries, as measured when it was made (:mod:`ggml_hybrid.ggml.links`): bytes
    per second of an upload (``LINK_PROBE_BYTES`` to the server, less a round trip) and the round trip of a small
    read (the median of ``LINK_PINGS``)."""

    bytes_per_s: float
    rtt_s: float

    def seconds(self, nbytes: int) -> float:
        """The time one upload of ``nbytes`` takes over the link (its round trip and its bytes)."""
        return self.rtt_s + nbytes / self.bytes_per_s


_links: dict[str, Link] = {}  # endpoint -> its connection's link, while a backend of this process holds it
_opened: dict[str, weakref.WeakSet[Backend]] = {}  # endpoint -> the backends opened on it (open or closed)
_opened_lock = threading.Lock()  # serve opens sessions from several threads


def _connected(endpoint: str) -> bool:
    """Whether a backend of this process on ``endpoint`` is open: then GGML's connection to it is the one measured
    (it keeps one per endpoint while anything uses it); with none open, the next is a new one, maybe over another
    link (the same address, another host: a worker rescheduled behind its stable name)."""
    with _opened_lock:
        return any(not b.closed for b in _opened.get(endpoint, ()))


def known_link(endpoint: str) -> Link | None:
    """The link measured on the connection to ``endpoint`` that a backend of this process still holds (None: not
    measured, failed since, or no backend holds it: the next connection may go over another link)."""
    known = _links.get(endpoint)
    return known if known is not None and _connected(endpoint) else None


def keep_link(endpoint: str, link: Link) -> None:
    """Record ``link`` as measured on the connection to ``endpoint`` (:func:`ggml_hybrid.ggml.links.measure_link`)."""
    _links[endpoint] = link


def link_of(endpoint: str | None) -> Link | None:
    """The measured link to ``endpoint`` (None: not an RPC server's, or not measured in this process)."""
    return None if endpoint is None else _links.get(endpoint)


def lost(backends: Iterable[Backend]) -> RPCError | None:
    """The error of the first of ``backends`` whose RPC connection has failed, or None."""
    for b in backends:
        if b.endpoint is not None and not b.closed:
            reason = _reason(b.endpoint)
            if reason:
                return RPCError(f"RPC server {b.endpoint} ({b.kind}): {reason}")
    return None


def raise_if_lost(backends: Iterable[Backend], cause: BaseException | None = None) -> None:
    """Raise :class:`RPCError` (from ``cause``) if the connection of any of ``backends`` has failed."""
    err = lost(backends)
    if err is not None:
        raise err from cause


def check_buffer(buffer: CData) -> None:
    """Raise :class:`RPCError` if ``buffer`` lives on an RPC server whose connection failed (its data
    would read as zeros)."""
    if not _buffer_types:  # no RPC device opened in this process
        return
    endpoint = _buffer_types.get(int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_type(buffer))))
    if endpoint is not None:
        reason = _reason(endpoint)
        if reason:
            raise RPCError(f"RPC server {endpoint}: {reason}")


def serve(endpoint: str, n_threads: int, devices: list[CData], mem: int = 0, unchecked_ops: bool = False) -> int:
    """Run GGML's RPC server on ``endpoint`` over ``devices`` (blocks while it runs; see ``rpc_server.h``).
    ``unchecked_ops``: run graph nodes of ops the server has no shape rules for (docs/rpc.md#validation)."""
    arr = ffi.new("ggml_backend_dev_t[]", devices)
    return int(lib.hy_rpc_serve(endpoint.encode(), n_threads, arr, len(devices), mem, int(unchecked_ops)))


__all__ = ["DEFAULT_TIMEOUT_S", "Link", "RPCDevice", "check_buffer", "connection_error",
           "keep_link", "known_link", "link_of", "lost", "open_device", "parse_endpoints", "raise_if_lost", "serve",
           "server_devices", "set_timeout", "watch_interrupts"]
