"""Fuzzing ``ggml-hybrid rpc-server``: hostile byte sequences over TCP, the server checked alive after each.

GGML's RPC protocol, as the pinned GGML speaks it (``ggml-rpc.cpp``, protocol 7.0): a request is
``| command (1 byte) | size (8 bytes, little endian) | payload (size bytes) |``, a reply
``| size (8 bytes) | payload |``; the first request of a connection is HELLO. Tensors travel as
``rpc_tensor`` (296 bytes, packed). This module writes such messages itself (no GGML involved), from
exact ones to garbage, and a case is one connection's worth of them:

- ``raw``: random bytes, with or without a hello first;
- ``frames``: a hello, then frames with random commands, sizes (right, wrong, huge) and payloads;
- ``tensors``: a hello and a real buffer (ALLOC_BUFFER, BUFFER_GET_BASE), then the tensor commands
  (SET/GET/MEMSET/COPY/INIT_TENSOR, GET_ALLOC_SIZE, SET_TENSOR_HASH, BUFFER_CLEAR, FREE_BUFFER) with
  tensors whose every field is drawn from valid, boundary and hostile values around that buffer;
- ``graphs``: the same buffer, then GRAPH_COMPUTE / GRAPH_RECOMPUTE of graphs of such tensors (ops,
  sources, views, counts that agree with the message or not);
- ``ops``: the same buffer, then well-formed one-node graphs (every tensor a plausible type, packed, inside the
  buffer) of any op with random small shapes, sources and parameters, the node flagged to be computed: what only
  the shape and type rules stop (a type the op's CPU kernel lacks aborts it);
- ``index``: the same buffer, then index data written with SET_TENSOR (in range, -1, the bound, 2^31-1, -2^31,
  random) and well-formed one-node graphs of the ops whose kernels index by it (GET_ROWS, SET_ROWS, MUL_MAT_ID,
  ADD_ID), each followed by ggml-hybrid's graph status request or, now and then, by another command (an
  upstream client would not ask): what only the kernels' own checks stop (vendor patches 0013 and 0014).

After each case the harness makes a fresh connection, says hello and asks the device count: the
server must answer (it did not crash or hang), within a time limit.
"""

from __future__ import annotations

import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

# commands (enum rpc_cmd)
ALLOC_BUFFER, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR = range(6)
SET_TENSOR, SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE, GET_DEVICE_MEMORY = range(6, 12)
INIT_TENSOR, GET_ALLOC_SIZE, HELLO, DEVICE_COUNT, GRAPH_RECOMPUTE, MEMSET_TENSOR = range(12, 18)
N_COMMANDS = 20  # RPC_CMD_COUNT; values from it up are unknown commands
# ggml-hybrid's graph status request (vendor patch 0014): no payload; the reply is | status (int32) | message
# (252 bytes, NUL-terminated) |. A server of ours marks its hello reply (the byte after the version) with
# HYBRID_MARK; a client that does not ask after a failed graph is dropped.
GRAPH_STATUS, HYBRID_MARK, STATUS_BYTES = 0xE0, 0x69, 256
# ggml-hybrid's device kinds request (vendor patch 0016, whose servers mark 0x69; 0x68: patch 0014's alone): no
# payload; the reply is | n_devices (uint32) | 16 bytes: enum ggml_backend_dev_type of each device (0: CPU) |.
DEVICE_KINDS, KINDS_BYTES = 0xE1, 20

MAX_SRC, N_OP_PARAMS, MAX_NAME = 10, 16, 64
# GGML_TENSOR_FLAG_COMPUTE: the CPU backend skips a node without it (it computes nothing), so a graph built to run
# a kernel sets it on its nodes
FLAG_COMPUTE = 16
N_TYPES, N_OPS = 41, 101  # GGML_TYPE_COUNT, GGML_OP_COUNT of the pinned GGML
TENSOR_BYTES = 296
HELLO_BYTES = 24
KINDS = ("raw", "frames", "tensors", "graphs", "ops", "index")

# op numbers (enum ggml_op of the pinned GGML). The graph cases draw their ops from those the server checks
# the shapes of (docs/rpc.md#validation: every op of the language models' graphs), the ops that compute
# nothing, the custom ops it refuses, a few ops it refuses without --unchecked-ops and numbers past the last op
OP_NONE, OP_DUP, OP_ADD, OP_ADD_ID, OP_SUB, OP_MUL, OP_DIV, OP_SQR, OP_SQRT = 0, 1, 2, 3, 6, 7, 8, 9, 10
OP_SUM_ROWS, OP_REPEAT, OP_CONCAT, OP_NORM, OP_RMS_NORM, OP_MUL_MAT, OP_MUL_MAT_ID = 15, 20, 22, 24, 25, 29, 30
OP_SCALE, OP_CPY, OP_CONT, OP_RESHAPE, OP_VIEW, OP_PERMUTE, OP_TRANSPOSE = 32, 34, 35, 36, 37, 38, 39
OP_GET_ROWS, OP_SET_ROWS, OP_SOFT_MAX, OP_ROPE, OP_CLAMP, OP_CONV_TRANSPOSE_1D, OP_IM2COL = 40, 42, 46, 48, 50, 51, 52
OP_POOL_2D, OP_PAD, OP_ARGSORT, OP_FILL, OP_FLASH_ATTN_EXT, OP_SSM_CONV, OP_GATED_DELTA_NET = 61, 64, 69, 73, 74, 76, 86
OP_UNARY, OP_MAP_CUSTOM1, OP_MAP_CUSTOM2, OP_MAP_CUSTOM3, OP_CUSTOM, OP_GLU = 91, 92, 93, 94, 95, 100
CHECKED_OPS = (OP_DUP, OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_SQR, OP_SQRT, OP_NORM, OP_RMS_NORM, OP_MUL_MAT, OP_SCALE,
               OP_CPY, OP_CONT, OP_UNARY, OP_GLU, OP_ADD_ID, OP_SUM_ROWS, OP_REPEAT, OP_CONCAT, OP_MUL_MAT_ID,
               OP_GET_ROWS, OP_SET_ROWS, OP_SOFT_MAX, OP_ROPE, OP_CLAMP, OP_ARGSORT, OP_FILL, OP_FLASH_ATTN_EXT,
               OP_SSM_CONV, OP_GATED_DELTA_NET)
UNCHECKED_OPS = (OP_CONV_TRANSPOSE_1D, OP_IM2COL, OP_POOL_2D, OP_PAD)  # refused unless --unchecked-ops
FUZZED_OPS = CHECKED_OPS + UNCHECKED_OPS + (OP_NONE, OP_RESHAPE, OP_VIEW, OP_PERMUTE, OP_TRANSPOSE, OP_MAP_CUSTOM1,
                                            OP_MAP_CUSTOM2, OP_MAP_CUSTOM3, OP_CUSTOM, N_OPS, N_OPS + 1, 2**32 - 1)


def frame(cmd: int, payload: bytes, size: int | None = None) -> bytes:
    """A request; ``size`` overrides the declared payload size (a lie)."""
    return struct.pack("<BQ", cmd & 0xFF, len(payload) if size is None else size & (2**64 - 1)) + payload


def hello() -> bytes:
    return frame(HELLO, bytes(HELLO_BYTES))


def tensor(id: int = 0, type: int = 0, buffer: int = 0, ne=(1, 1, 1, 1), nb=None, op: int = 0, op_params=(),
           flags: int = 0, src=(), view_src: int = 0, view_offs: int = 0, data: int = 0, name: bytes = b"",
           use_count: int = 0) -> bytes:
    """An ``rpc_tensor``; values are wrapped to their field's width (the fuzzer draws out-of-range ones)."""
    if nb is None:
        nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
    u32 = [x & 0xFFFFFFFF for x in (*ne, *nb)]
    params = [int(p) & 0xFFFFFFFF for p in op_params][:N_OP_PARAMS]
    params += [0] * (N_OP_PARAMS - len(params))
    srcs = [s & (2**64 - 1) for s in src][:MAX_SRC]
    srcs += [0] * (MAX_SRC - len(srcs))
    out = struct.pack("<QIQ", id & (2**64 - 1), type & 0xFFFFFFFF, buffer & (2**64 - 1))
    out += struct.pack("<4I4I", *u32)
    out += struct.pack("<I", op & 0xFFFFFFFF) + struct.pack(f"<{N_OP_PARAMS}I", *params)
    out += struct.pack("<I", flags & 0xFFFFFFFF) + struct.pack(f"<{MAX_SRC}Q", *srcs)
    out += struct.pack("<QQQ", view_src & (2**64 - 1), view_offs & (2**64 - 1), data & (2**64 - 1))
    out += name[:MAX_NAME].ljust(MAX_NAME, b"\0") + struct.pack("<I", use_count & 0xFFFFFFFF)
    assert len(out) == TENSOR_BYTES
    return out


# -- talking to a server --------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def request(sock: socket.socket, cmd: int, payload: bytes) -> bytes:
    """Send a well-formed request and read its reply."""
    sock.sendall(frame(cmd, payload))
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    return _recv_exact(sock, size)


def connect(port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    reply = request(sock, HELLO, bytes(HELLO_BYTES))
    if len(reply) != 4 + HELLO_BYTES:
        raise ConnectionError(f"hello reply of {len(reply)} bytes")
    return sock


def alive(port: int, timeout: float = 20.0) -> int:
    """A fresh client's hello and device count: the server's device count, or an exception."""
    with connect(port, timeout) as sock:
        (n,) = struct.unpack("<I", request(sock, DEVICE_COUNT, b""))
        return n


def start_server(*extra: str, timeout: float = 60.0) -> tuple[subprocess.Popen, int]:
    """``ggml-hybrid rpc-server`` on a free loopback port, one thread, waited for: (process, port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from ggml_hybrid.cli import main; main()", "rpc-server", "--port", str(port),
           "--threads", "1", *extra]
    # stderr to a file: a pipe nobody reads fills up with the server's refusals and blocks it
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log  # type: ignore[attr-defined]
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server exited with {proc.returncode}: {stop_server(proc)[1]}")
        try:
            alive(port, timeout=5)
            return proc, port
        except OSError:
            if time.monotonic() > end:
                stop_server(proc)
                raise RuntimeError(f"rpc-server did not answer on port {port} within {timeout} s") from None
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> tuple[int, str]:
    """Ctrl-C, then (if it lingers) kill: (exit status, stderr). A server that died before says so: its
    status is a negative signal number."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = proc.log  # type: ignore[attr-defined]
    log.seek(0)
    err = log.read()
    log.close()
    return proc.returncode, err


# -- cases ----------------------------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    messages: list[bytes] = field(default_factory=list)
    needs_buffer: bool = False  # the messages refer to a buffer made first (placeholders patched in)


# placeholders for the buffer handle and its base address, patched in once the buffer exists: high 32 bits a
# marker, low 32 bits 2^31 + an offset from the real value
_BUF_HI, _BASE_HI = 0x42554646, 0x42415345
BUF, BASE = (_BUF_HI << 32) + 2**31, (_BASE_HI << 32) + 2**31


def _pick(rng: random.Random, *choices):
    return choices[rng.randrange(len(choices))]


def _u64(rng: random.Random) -> int:
    return _pick(rng, 0, 1, 2**63, 2**64 - 1, 2**32, rng.getrandbits(64), rng.getrandbits(16))


def _size(rng: random.Random, right: int) -> int:
    return _pick(rng, right, right, right, right + 1, max(0, right - 1), 0, 2**64 - 1, 2**63, 2**40, 2**31,
                 rng.getrandbits(24))


def _ne(rng: random.Random) -> tuple[int, int, int, int]:
    def one() -> int:
        return _pick(rng, 1, 1, 2, 4, 8, 16, 32, 0, 3, 256, 2**31, 2**32 - 1, rng.getrandbits(32))
    return (one(), one(), one(), one())


def _tensor_fields(rng: random.Random, buf_size: int, ids: list[int]) -> dict:
    """One tensor's fields around the case's buffer: mostly plausible, each field hostile now and then."""
    type_ = _pick(rng, 0, 0, 0, 1, 8, 12, 24, 26, 4, 5, 6, rng.randrange(N_TYPES + 5), 2**32 - 1)
    ne = _ne(rng) if rng.random() < 0.4 else tuple(_pick(rng, 1, 2, 4, 8, 16, 32) for _ in range(4))
    ts = 4 if type_ == 0 else 2
    nb = (ts, ts * ne[0], ts * ne[0] * ne[1], ts * ne[0] * ne[1] * ne[2])
    if rng.random() < 0.3:
        nb = tuple(_pick(rng, 0, 1, 4, 16, 4096, 2**31, 2**32 - 1, rng.getrandbits(32)) for _ in range(4))
    buffer = _pick(rng, BUF, BUF, BUF, BUF, 0, _u64(rng), BUF + 8)
    offset = _pick(rng, 0, 0, 64, buf_size // 2, buf_size - 4, buf_size, buf_size + 64, rng.randrange(buf_size))
    data = _pick(rng, BASE + offset, BASE + offset, BASE + offset, 0, _u64(rng), BASE - 64)
    op = _pick(rng, *FUZZED_OPS)
    op_params = [rng.getrandbits(32) if rng.random() < 0.3 else rng.randrange(4) for _ in range(N_OP_PARAMS)]
    src = [(_pick(rng, *ids) if ids and rng.random() < 0.8 else _u64(rng)) if rng.random() < 0.5 else 0
           for _ in range(MAX_SRC)]
    return dict(type=type_, buffer=buffer, ne=ne, nb=nb, op=op, op_params=op_params, src=src,
                view_src=_pick(rng, 0, 0, 0, *(ids or [0]), _u64(rng)), view_offs=_pick(rng, 0, 0, 64, _u64(rng)),
                data=data, flags=rng.getrandbits(32) if rng.random() < 0.1 else FLAG_COMPUTE if op else 0,
                name=bytes(rng.getrandbits(8) for _ in range(_pick(rng, 0, 8, 64))), use_count=rng.randrange(4))


def _tensor(rng: random.Random, buf_size: int, ids: list[int] | None = None, id: int | None = None) -> bytes:
    return tensor(id=id if id is not None else rng.getrandbits(64), **_tensor_fields(rng, buf_size, ids or []))


def _tensor_command(rng: random.Random, buf_size: int) -> bytes:
    t = _tensor(rng, buf_size)
    cmd = _pick(rng, SET_TENSOR, GET_TENSOR, MEMSET_TENSOR, COPY_TENSOR, INIT_TENSOR, GET_ALLOC_SIZE,
                SET_TENSOR_HASH, BUFFER_CLEAR, FREE_BUFFER, BUFFER_GET_BASE)
    off, size = _pick(rng, 0, 0, 4, buf_size, _u64(rng)), _pick(rng, 4, 64, buf_size, 0, _u64(rng))
    if cmd == SET_TENSOR:
        payload = t + struct.pack("<BQ", rng.randrange(2), off & (2**64 - 1)) + bytes(rng.randrange(0, 512))
        return frame(cmd, payload, _size(rng, len(payload)) if rng.random() < 0.2 else None)
    if cmd == GET_TENSOR:
        payload = t + struct.pack("<QQ", off & (2**64 - 1), min(size, 1 << 20) if rng.random() < 0.8 else size)
    elif cmd == MEMSET_TENSOR:
        payload = t + struct.pack("<QQB", off & (2**64 - 1), size & (2**64 - 1), rng.randrange(256))
    elif cmd == COPY_TENSOR:
        payload = t + _tensor(rng, buf_size)
    elif cmd == INIT_TENSOR:
        payload = t
    elif cmd == GET_ALLOC_SIZE:
        payload = struct.pack("<I", _pick(rng, 0, 0, 1, 2**32 - 1)) + t + b"".join(
            _tensor(rng, buf_size) if rng.random() < 0.3 else bytes(TENSOR_BYTES) for _ in range(MAX_SRC))
    elif cmd == SET_TENSOR_HASH:
        payload = t + struct.pack("<QQ", off & (2**64 - 1), rng.getrandbits(64))
    elif cmd == BUFFER_CLEAR:
        payload = struct.pack("<QB", _pick(rng, BUF, BUF, _u64(rng)), rng.randrange(256))
    else:  # FREE_BUFFER, BUFFER_GET_BASE
        payload = struct.pack("<Q", _pick(rng, BUF, _u64(rng), _u64(rng)))
    return frame(cmd, payload, _size(rng, len(payload)) if rng.random() < 0.1 else None)


def _graph(rng: random.Random, buf_size: int) -> bytes:
    n_tensors = _pick(rng, 1, 2, 3, 4, 6, 8, 16)
    ids = [rng.getrandbits(64) | 1 for _ in range(n_tensors)]
    if rng.random() < 0.05:
        ids[-1] = ids[0]  # an id twice
    tensors = b"".join(_tensor(rng, buf_size, ids, id=i) for i in ids)
    n_nodes = _pick(rng, 1, 1, 2, min(3, n_tensors), n_tensors, 0, n_tensors + 1)
    nodes = [(_pick(rng, *ids) if rng.random() < 0.9 else _u64(rng)) for _ in range(n_nodes)]
    decl_nodes = n_nodes if rng.random() < 0.9 else _pick(rng, 0, n_nodes + 1, 2**32 - 1, 2**31)
    decl_tensors = n_tensors if rng.random() < 0.9 else _pick(rng, 0, n_tensors + 1, 2**32 - 1, 2**26)
    payload = (struct.pack("<II", _pick(rng, 0, 0, 0, 1, 2**32 - 1), decl_nodes & 0xFFFFFFFF)
               + struct.pack(f"<{n_nodes}Q", *[x & (2**64 - 1) for x in nodes])
               + struct.pack("<I", decl_tensors & 0xFFFFFFFF) + tensors)
    if rng.random() < 0.1:
        payload = payload[:rng.randrange(len(payload))]
    return frame(GRAPH_COMPUTE, payload, _size(rng, len(payload)) if rng.random() < 0.05 else None)


def _op_graph(rng: random.Random) -> bytes:
    """A well-formed one-node graph of a random op: sources and node of random small shapes, packed, inside the
    case's buffer, with random small parameters (only the op's shape rules tell it from a real one); the node is
    flagged to be computed, so an accepted graph runs its CPU kernel."""
    def one(id: int, offset: int, op: int = 0, src: tuple[int, ...] = ()) -> tuple[bytes, int]:
        # F32 mostly, F16, I32 and now and then a type few kernels take (BF16, I16, I8)
        type_, ts = _pick(rng, (0, 4), (0, 4), (0, 4), (1, 2), (1, 2), (26, 4), (26, 4), (30, 2), (25, 2), (24, 1))
        ne = (rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 2), 1)
        nb = (ts, ts * ne[0], ts * ne[0] * ne[1], ts * ne[0] * ne[1] * ne[2])
        params = [_pick(rng, 0, 0, 1, 2, 3, 4, 8, 40, 2**32 - 1, rng.getrandbits(32)) for _ in range(N_OP_PARAMS)]
        return tensor(id=id, type=type_, buffer=BUF, ne=ne, nb=nb, op=op, op_params=params if op else (), src=src,
                      data=BASE + offset, flags=FLAG_COMPUTE if op else 0), ts * ne[0] * ne[1] * ne[2]
    n_src = rng.randint(1, 7)
    parts, offset = [], 0
    for i in range(n_src):
        t, size = one(100 + i, offset)
        parts.append(t)
        offset += (size + 63) // 64 * 64
    op = _pick(rng, *CHECKED_OPS, *CHECKED_OPS, *UNCHECKED_OPS, rng.randrange(N_OPS))
    node, _ = one(1, offset, op=op, src=tuple(100 + i for i in range(n_src)))
    payload = (struct.pack("<II", 0, 1) + struct.pack("<Q", 1) + struct.pack("<I", n_src + 1) + b"".join(parts)
               + node)
    return frame(GRAPH_COMPUTE, payload)


# -- index values (vendor patches 0013, 0014) --------------------------------------------------------------------

INDEX_OPS = {"GET_ROWS": OP_GET_ROWS, "SET_ROWS": OP_SET_ROWS, "MUL_MAT_ID": OP_MUL_MAT_ID, "ADD_ID": OP_ADD_ID}
I32 = 26  # GGML_TYPE_I32


def _t32(id: int, type_: int, offset: int, ne: tuple[int, int, int, int], op: int = 0, src=(), buffer: int = BUF,
         base: int = BASE) -> bytes:
    """A packed 4-byte-element tensor at ``base + offset`` of the buffer (a node, flagged to be computed, when it
    has an op)."""
    nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
    return tensor(id=id, type=type_, buffer=buffer, ne=ne, nb=nb, op=op, src=src, data=base + offset,
                  name=f"t{id}".encode(), flags=FLAG_COMPUTE if op else 0)


def index_graph(op: str, indices: list[int], buffer: int = BUF, base: int = BASE) -> tuple[list[bytes], int]:
    """The messages of one ``op`` node whose index tensor holds ``indices`` (SET_TENSOR of the indices, then
    GRAPH_COMPUTE), every tensor well-formed and inside a 4 KiB buffer at ``base``; and the valid bound (indices
    must lie in 0..bound-1). GET_ROWS and SET_ROWS select among 4 rows of 4, MUL_MAT_ID among 3 experts, ADD_ID
    among 3 rows; the index tensor is id 3 ("t3"), at offset 1024."""
    n = len(indices)
    idx_at, out_at = 1024, 2048
    if op == "GET_ROWS":  # rows [4, 4] selected by n indices -> [n, 4]
        bound = 4
        idx = _t32(3, I32, idx_at, (n, 1, 1, 1), buffer=buffer, base=base)
        srcs = [_t32(2, 0, 0, (4, 4, 1, 1), buffer=buffer, base=base), idx]
        node = _t32(1, 0, out_at, (4, n, 1, 1), op=OP_GET_ROWS, src=(2, 3), buffer=buffer, base=base)
    elif op == "SET_ROWS":  # n rows of 4 written into rows [4, 4] at the n indices (the node views the target)
        bound = 4
        idx = _t32(3, I32, idx_at, (n, 1, 1, 1), buffer=buffer, base=base)
        srcs = [_t32(2, 0, 0, (4, n, 1, 1), buffer=buffer, base=base), idx,
                _t32(4, 0, out_at, (4, 4, 1, 1), buffer=buffer, base=base)]
        node = _t32(1, 0, out_at, (4, 4, 1, 1), op=OP_SET_ROWS, src=(2, 3, 4), buffer=buffer, base=base)
    elif op == "MUL_MAT_ID":  # experts [3, 2, 4], inputs [T, 1, 4], ids [T, 2] -> [T, 2, 2]
        bound, used = 3, 2
        tokens = max(1, (n + used - 1) // used)
        indices = (indices + [0] * used * tokens)[:used * tokens]
        idx = _t32(3, I32, idx_at, (used, tokens, 1, 1), buffer=buffer, base=base)
        srcs = [_t32(2, 0, 0, (4, 2, 3, 1), buffer=buffer, base=base),
                _t32(4, 0, 512, (4, 1, tokens, 1), buffer=buffer, base=base), idx]
        node = _t32(1, 0, out_at, (2, used, tokens, 1), op=OP_MUL_MAT_ID, src=(2, 4, 3), buffer=buffer, base=base)
    elif op == "ADD_ID":  # a [T, 2, 4] + rows of b [3, 4] named by ids [T, 2]
        bound, k = 3, 2
        tokens = max(1, (n + k - 1) // k)
        indices = (indices + [0] * k * tokens)[:k * tokens]
        idx = _t32(3, I32, idx_at, (k, tokens, 1, 1), buffer=buffer, base=base)
        srcs = [_t32(2, 0, 0, (4, k, tokens, 1), buffer=buffer, base=base),
                _t32(4, 0, 512, (4, 3, 1, 1), buffer=buffer, base=base), idx]
        node = _t32(1, 0, out_at, (4, k, tokens, 1), op=OP_ADD_ID, src=(2, 4, 3), buffer=buffer, base=base)
    else:
        raise ValueError(op)
    data = struct.pack(f"<{len(indices)}i", *[((v + 2**31) % 2**32) - 2**31 for v in indices])
    set_idx = frame(SET_TENSOR, idx + struct.pack("<BQ", 0, 0) + data)
    graph = (struct.pack("<II", 0, 1) + struct.pack("<Q", 1) + struct.pack("<I", len(srcs) + 1) + b"".join(srcs)
             + node)
    return [set_idx, frame(GRAPH_COMPUTE, graph)], bound


def graph_status(sock: socket.socket) -> tuple[int, str]:
    """Ask a ggml-hybrid server how the last graph went: (GGML status, reason)."""
    reply = request(sock, GRAPH_STATUS, b"")
    status, message = struct.unpack("<i252s", reply)
    return status, message.split(b"\0", 1)[0].decode("utf-8", "replace")


def _index_messages(rng: random.Random) -> list[bytes]:
    op = _pick(rng, *INDEX_OPS)
    n = _pick(rng, 1, 2, 3, 4)
    bound = 4 if op in ("GET_ROWS", "SET_ROWS") else 3
    values = [_pick(rng, 0, 1, bound - 1, -1, bound, bound + 1, 2**31 - 1, -2**31, rng.getrandbits(32) - 2**31)
              for _ in range(n)]
    messages, _ = index_graph(op, values)
    after = _pick(rng, frame(GRAPH_STATUS, b""), frame(GRAPH_STATUS, b""), frame(GRAPH_STATUS, b""),
                  frame(DEVICE_COUNT, b""), frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)), frame(GRAPH_STATUS, b"x"))
    return messages + [after]


def make_case(seed: int, index: int, n_messages: int = 8) -> Case:
    """Case ``index`` of ``seed``: the same bytes every time."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = KINDS[rng.randrange(len(KINDS))]
    case = Case(kind)
    buf_size = 4096
    if kind == "raw":
        if rng.random() < 0.5:
            case.messages.append(hello())
        case.messages += [rng.randbytes(rng.randrange(1, 600)) for _ in range(n_messages)]
    elif kind == "frames":
        case.messages.append(hello() if rng.random() < 0.9 else frame(HELLO, bytes(_pick(rng, 0, 23, 25, 4096))))
        for _ in range(n_messages):
            cmd = rng.randrange(N_COMMANDS + 4) if rng.random() < 0.9 else rng.randrange(256)
            payload = rng.randbytes(_pick(rng, 0, 4, 8, 9, 12, 16, 24, TENSOR_BYTES, TENSOR_BYTES + 17,
                                          rng.randrange(2048)))
            case.messages.append(frame(cmd, payload, _size(rng, len(payload)) if rng.random() < 0.3 else None))
    else:
        case.needs_buffer = True
        case.messages.append(hello())
        # an index round is three messages: as many rounds as make about n_messages
        for _ in range(n_messages if kind != "index" else max(1, n_messages // 3)):
            if kind == "ops":
                case.messages.append(_op_graph(rng))
            elif kind == "index":
                case.messages += _index_messages(rng)
            elif kind == "tensors" or rng.random() < 0.2:
                case.messages.append(_tensor_command(rng, buf_size))
            elif rng.random() < 0.15:
                case.messages.append(frame(GRAPH_RECOMPUTE, struct.pack("<I", _pick(rng, 0, 0, 1, 2**32 - 1))))
            else:
                case.messages.append(_graph(rng, buf_size))
    return case


def _patch(message: bytes, buffer: int, base: int) -> bytes:
    for hi, value in ((_BUF_HI, buffer), (_BASE_HI, base)):
        pattern = re.compile(rb"(?s)(....)" + re.escape(struct.pack("<I", hi)))

        def real(m: re.Match, value: int = value) -> bytes:
            (low,) = struct.unpack("<I", m.group(1))
            return struct.pack("<Q", (value + low - 2**31) & (2**64 - 1))

        message = pattern.sub(real, message)
    return message


def _drain(sock: socket.socket) -> bool:
    """Read what the server sent; False once it closed the connection."""
    try:
        while True:
            if not sock.recv(1 << 16):
                return False
    except (TimeoutError, BlockingIOError):
        return True
    except OSError:
        return False


def run_case(port: int, case: Case, wait: float = 0.02) -> tuple[int, int]:
    """Send the case's messages on one connection (until the server drops it): (messages sent, messages after
    which the connection stayed open: taken as valid, or not yet refused)."""
    sent = kept = 0
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        messages = list(case.messages)
        if case.needs_buffer:
            request(sock, HELLO, bytes(HELLO_BYTES))
            buffer, size = struct.unpack("<QQ", request(sock, ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)))
            (base,) = struct.unpack("<Q", request(sock, BUFFER_GET_BASE, struct.pack("<Q", buffer)))
            sent += 3
            kept += 3
            messages = [_patch(m, buffer, base) for m in messages[1:]]
        sock.settimeout(wait)
        for m in messages:
            try:
                sock.sendall(m)
            except OSError:
                break
            sent += 1
            if not _drain(sock):
                break
            kept += 1
    return sent, kept


def fuzz(port: int, seed: int, n_cases: int, n_messages: int = 8, check_every: int = 1,
         deadline: float | None = None) -> dict:
    """Run cases ``0..n_cases-1`` against the server on ``port``; stops at the first case after which the
    server does not answer a fresh client. Returns counts and the failing case, if any."""
    sent = kept = cases = 0
    kinds: dict[str, int] = {k: 0 for k in KINDS}
    t0 = time.monotonic()
    for i in range(n_cases):
        if deadline is not None and time.monotonic() > deadline:
            break
        case = make_case(seed, i, n_messages)
        try:
            n_sent, n_kept = run_case(port, case)
            sent += n_sent
            kept += n_kept
        except (ConnectionError, OSError, struct.error):
            pass  # the server may drop a hostile client at any point of the set-up too
        cases += 1
        kinds[case.kind] += 1
        if (i + 1) % check_every == 0 or i == n_cases - 1:
            try:
                alive(port)
            except (OSError, ConnectionError, struct.error) as exc:
                return dict(messages=sent, kept=kept, cases=cases, kinds=kinds, seconds=time.monotonic() - t0,
                            failed=i, error=f"{type(exc).__name__}: {exc}")
    return dict(messages=sent, kept=kept, cases=cases, kinds=kinds, seconds=time.monotonic() - t0, failed=None,
                error=None)
