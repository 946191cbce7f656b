#!/usr/bin/env python3
"""The RPC commands a leader sends per prompt call and per decode step: ggml-hybrid's (``MoEModel``) against the
pinned llama.cpp's own client (llama-cpp-python 0.3.36), the model split 1:1 over two of ggml-hybrid's rpc-servers
on loopback, each reached through a counting proxy (:class:`CountingProxy`) that parses GGML's RPC stream (a
request is its command byte, a 64-bit size and that many bytes; a reply a 64-bit size and that many bytes) and
counts each side's commands by kind, replies and bytes, and the time from each graph sent to the first reply after
it (the server's compute of that graph, plus a loopback round trip: where a step's time goes).

Per step by difference: each side runs as a fresh process three times, (1 repetition, 1 token), (1 repetition,
1 + ``--steps`` tokens) and (2 repetitions, 1 token) of bench_hosts.py's workload (a prompt of ``--prompt`` tokens
in one call, then greedy tokens one call each), so that a decode step is (second - first) / steps and a warm
prompt call (after a reset) is third - first. What the counts mean for the time: every command that has a reply
is a round trip the client waits for, except ggml-hybrid's status requests (vendor patch 0014), which its client
reads with the reply that follows them (vendor patch 0017; before it, each synchronize read them first: a round
trip of its own).

    python tools/bench/rpc_counts.py --llama-python /opt/llref/bin/python [--steps 8] [--prompt 64]
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import click

HERE = Path(__file__).resolve().parent

#: GGML's RPC commands (protocol 7.0.0, ggml-rpc.cpp's enum rpc_cmd) and ggml-hybrid's (vendor patches 0014, 0016)
COMMANDS = ["ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
            "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
            "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR"]
HYBRID = {0xE0: "HYBRID_GRAPH_STATUS", 0xE1: "HYBRID_DEVICE_KINDS"}
#: the commands a server answers (every other one has no reply)
ANSWERED = {"ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "SET_TENSOR_HASH", "GET_TENSOR",
            "COPY_TENSOR", "GET_DEVICE_MEMORY", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "HYBRID_GRAPH_STATUS",
            "HYBRID_DEVICE_KINDS"}


def command_name(code: int) -> str:
    return COMMANDS[code] if code < len(COMMANDS) else HYBRID.get(code, f"0x{code:02x}")


class RPCStream:
    """One direction's messages parsed as they pass: ``header`` bytes (requests: the command byte and the 64-bit
    size; replies: the size), then the payload, skipped. ``on_message(code, size)`` when a header is complete (code
    None for a reply); ``feed``'s ``before(i)`` when a message starts at ``data[i]`` (tests/test_rpc_round_trips.py
    holds replies there); ``on_payload(chunk)``, if given, with each piece of a payload as it passes."""

    def __init__(self, requests: bool, on_message: Callable[[int | None, int], None],
                 on_payload: Callable[[bytes], None] | None = None) -> None:
        self.requests, self.on_message, self.on_payload = requests, on_message, on_payload
        self.head = b""
        self.left = 0

    def feed(self, data: bytes, before: Callable[[int], None] | None = None) -> None:
        i, n = 0, len(data)
        need = 9 if self.requests else 8
        while i < n:
            if self.left > 0:
                take = min(self.left, n - i)
                self.left -= take
                if self.on_payload is not None:  # after the count: ``left`` is 0 at the payload's last piece
                    self.on_payload(data[i:i + take])
                i += take
                continue
            if not self.head and before is not None:
                before(i)
            take = min(need - len(self.head), n - i)
            self.head += data[i:i + take]
            i += take
            if len(self.head) == need:
                size = struct.unpack("<Q", self.head[-8:])[0]
                self.on_message(self.head[0] if self.requests else None, size)
                self.head, self.left = b"", size


class CountingProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` and counts what passes: commands by kind, replies, bytes each way
    (every connection, until :meth:`take`); with ``keep_graphs``, each GRAPH_COMPUTE's payload too (the serialized
    graph: :meth:`take_graphs`) and a timeline of every message: (time, "request" or "reply", command, size), a reply
    named by the request it answers (:meth:`take_timeline`)."""

    def __init__(self, target: tuple[str, int], keep_graphs: bool = False) -> None:
        self.target = target
        self.lock = threading.Lock()
        self.counts: dict[str, float] = {}  # counts, and and "ms graph to next reply": the servers' compute, about
        self.keep_graphs = keep_graphs
        self.graphs: list[bytes] = []
        self.timeline: list[tuple[float, str, str, int]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.counts = self.counts, {}
        return out

    def take_graphs(self) -> list[bytes]:
        with self.lock:
            out, self.graphs = self.graphs, []
        return out

    def take_timeline(self) -> list[tuple[float, str, str, int]]:
        with self.lock:
            out, self.timeline = self.timeline, []
        return out

    def _count(self, key: str, n: float = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._serve(client, socket.create_connection(self.target))

    def _serve(self, client: socket.socket, server: socket.socket) -> None:
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        graph_sent: list[float] = []  # when the last graph went out, until the first reply after it
        graph: list[bytearray] = []  # the GRAPH_COMPUTE being read (keep_graphs)

        waiting: list[str] = []  # the requests a reply is due for, in order (a server answers in order)

        def request(code: int | None, size: int) -> None:
            name = command_name(code or 0)
            self._count(name)
            if self.keep_graphs:
                if name in ANSWERED:
                    waiting.append(name)
                with self.lock:
                    self.timeline.append((time.perf_counter(), "request", name, size))
            graph.clear()
            if self.keep_graphs and name == "GRAPH_COMPUTE":
                graph.append(bytearray())
                if size == 0:
                    payload(b"")
            self._count("bytes sent", 9 + size)
            if name == "GRAPH_COMPUTE":
                self._count("bytes of GRAPH_COMPUTE", size)  # its nodes and tensors: how big the graph is
            if name in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE") and not graph_sent:
                graph_sent.append(time.perf_counter())

        def payload(chunk: bytes) -> None:
            if graph:
                graph[0] += chunk
                if parse_requests.left == 0:  # the whole graph: kept in the order the graphs came
                    with self.lock:
                        self.graphs.append(bytes(graph.pop()))

        def reply(code: int | None, size: int) -> None:
            self._count("replies")
            if self.keep_graphs:
                with self.lock:
                    self.timeline.append((time.perf_counter(), "reply", waiting.pop(0) if waiting else "?", size))
            self._count("bytes received", 8 + size)
            if graph_sent:  # the server answers in order: this reply came once the graph was computed
                self._count("ms graph to next reply", (time.perf_counter() - graph_sent.pop()) * 1e3)

        parse_requests = RPCStream(True, request, payload)
        for src, dst, parse in ((client, server, parse_requests), (server, client, RPCStream(False, reply))):
            threading.Thread(target=self._pump, args=(src, dst, parse), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, parse: RPCStream) -> None:
        try:
            while data := src.recv(1 << 16):
                parse.feed(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "from ggml_hybrid.cli import main; main()", "rpc-server",
                             "--host", "127.0.0.1", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # a bounded poll for the port
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"rpc-server on port {port} exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"rpc-server on port {port} did not listen within 120 s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def leader_command(ns: SimpleNamespace, side: str, rpc: str, reps: int, decode: int) -> list[str]:
    """The command of one leader run of part 1's workload over the workers ``rpc``: llama.cpp's client
    (``_llama_rpc_worker.py`` under ``ns.llama_python``) or ours (bench_hosts.py's side, split 1:1). Shared by this
    script, rpc_worker_cost.py and leader_cpu.py."""
    common = ["--rpc", rpc, "--prompt", str(ns.prompt), "--decode", str(decode), "--reps", str(reps)]
    if side == "llama.cpp":
        return [ns.llama_python, str(HERE / "_llama_rpc_worker.py"), ns.model, *common]
    return [sys.executable, str(HERE / "bench_hosts.py"), "--side", "ours", "--model", ns.model, *common,
            "--opt", "tensor_split=1,1"]


def stop_servers(servers: list[subprocess.Popen]) -> None:
    """Terminate the rpc-servers a run started and wait for each."""
    for s in servers:
        s.terminate()
        s.wait()


def _run(ns: SimpleNamespace, side: str, rpc: str, reps: int, decode: int) -> list[int]:
    cmd = leader_command(ns, side, rpc, reps, decode)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"{side} failed: {r.stderr[-3000:]}")
    return list(json.loads(r.stdout.splitlines()[-1])["tokens"])


def _table(title: str, per: dict[str, list[dict[str, float]]]) -> None:
    keys = sorted({k for side in per.values() for w in side for k in w if w[k]},
                  key=lambda k: (k.startswith("bytes") or k == "replies", k))
    print(f"\n{title} (worker 1 + worker 2):")
    print(f"| {'':28} | " + " | ".join(f"{side:>22}" for side in per) + " |")
    for k in keys:
        cells = []
        for side in per.values():
            a, b = (w.get(k, 0.0) for w in side)
            cells.append(f"{a:.4g} + {b:.4g}".rjust(22))
        print(f"| {k:28} | " + " | ".join(cells) + " |")
    for name, ws in per.items():
        waits = sum(w.get(k, 0.0) for w in ws for k in ANSWERED if k != "HYBRID_GRAPH_STATUS")
        print(f"{name}: commands answered (round trips waited for, statuses apart): {waits:g}; "
              f"statuses {sum(w.get('HYBRID_GRAPH_STATUS', 0.0) for w in ws):g}")


@click.command(help=__doc__)
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python 0.3.36 (GGML_RPC=on)")
@click.option("--model", default=None, help="the model (default: bench_hosts.py's generated qwen3moe)")
@click.option("--prompt", type=int, default=64, show_default=True)
@click.option("--steps", type=int, default=8, show_default=True, help="decode steps counted")
@click.option("--json-out", default=None, help="also write the per-step counts here")
def main(**kw: object) -> None:
    ns = SimpleNamespace(**kw)
    if ns.model is None:
        from ggml_hybrid.synthetic import write_model

        ns.model = str(write_model("/tmp/bench_hosts-16.gguf", n_layer=8, n_embd=512, n_expert=16, n_used=2,
                                   weight_type="q8_0", seed=5))
    ports = [_free_port(), _free_port()]
    servers = [_server(p) for p in ports]
    try:
        proxies = [CountingProxy(("127.0.0.1", p)) for p in ports]
        rpc = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
        step: dict[str, list[dict[str, float]]] = {}
        prompt: dict[str, list[dict[str, float]]] = {}
        tokens = {}
        for side in ("ours", "llama.cpp"):
            runs = []
            for reps, decode in ((1, 1), (1, 1 + ns.steps), (2, 1)):
                toks = _run(ns, side, rpc, reps, decode)
                if decode > 1:
                    tokens[side] = toks
                runs.append([p.take() for p in proxies])
            (a, b, c) = runs
            step[side] = [{k: (b[i].get(k, 0) - a[i].get(k, 0)) / ns.steps for k in set(a[i]) | set(b[i])}
                          for i in (0, 1)]
            prompt[side] = [{k: float(c[i].get(k, 0) - a[i].get(k, 0)) for k in set(a[i]) | set(c[i])}
                            for i in (0, 1)]
        print(f"model {ns.model}; prompt {ns.prompt} tokens; {ns.steps} decode steps; same tokens: "
              f"{tokens['ours'] == tokens['llama.cpp']}")
        _table("per decode step", step)
        _table(f"per prompt call ({ns.prompt} tokens, after a reset)", prompt)
        if ns.json_out:
            Path(ns.json_out).write_text(json.dumps({"step": step, "prompt": prompt}, indent=1) + "\n")
    finally:
        stop_servers(servers)


if __name__ == "__main__":
    main()
