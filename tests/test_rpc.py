"""GGML's RPC backend as a real device: ``ggml-hybrid rpc-server`` subprocesses on loopback ports.

The oracle is the CPU resident run of the same model (the default options, one thread): the server
computes with the same CPU kernels, so every placement on RPC devices must give the same bits. The
failure tests check what vendor patch 0003 promises: a refused connection, a failed handshake and a
server killed mid-run are one typed error naming the endpoint, never an abort or a hang.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from click.testing import CliRunner
from ggfuzz import rpc_cases as rc

from ggml_hybrid.cli import main
from ggml_hybrid.errors import RPCError
from ggml_hybrid.ggml import rpc
from ggml_hybrid.options import OptionError, SessionOptions
from ggml_hybrid.placement.devices import describe_devices, device_names
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model
from ggml_hybrid.units import MiB

CLI = [sys.executable, "-c", "from ggml_hybrid.cli import main; main()"]  # the ggml-hybrid entry point
PROMPT = "Where a layer runs never changes a bit of the logits."
START_S = 60  # a server process starts (imports the package) well within this on a loaded 2-core machine


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``ggml-hybrid rpc-server`` on a free loopback port, started and waited for; :meth:`stop` always ends it."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        # output to files: pipes nobody reads while it runs would fill up (with a hostile client's refusals)
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(self.port), "--threads", "1", *extra],
                                     stdout=self._out, stderr=self._err, text=True)
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                _, err = self.stop()
                raise RuntimeError(f"rpc-server exited with {self.proc.returncode}: {err}")
            try:
                # the probe is a client too: the server accepts it, reads nothing and waits for the next
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rpc-server did not listen on {self.endpoint} within {START_S} s") from None
                time.sleep(0.1)

    def log(self) -> str:
        """What the server wrote to stderr so far."""
        self._err.seek(0)
        return self._err.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, then (if it lingers) kill; (exit status, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.seek(0)
        return self.proc.returncode, self._err.read()


@contextmanager
def rpc_server(*extra: str):
    s = Server(*extra)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server():
    with rpc_server() as s:
        yield s


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("rpc")
    return write_model(d / "m.gguf", n_layer=4, n_expert=8, n_used=2, weight_type="q8_0", seed=31)


@pytest.fixture(scope="module")
def reference(model):
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
        return tokens, m.eval(tokens, "all")


def opts(*items: str) -> SessionOptions:
    return SessionOptions.parse(["n_threads=1", *items])


def run_both_halves(m: MoEModel, tokens: list[int]) -> np.ndarray:
    return np.concatenate([m.eval(tokens[:5], "all"), m.eval(tokens[5:], "all")])


# -- the device ---------------------------------------------------------------------------------------------


def test_all_layers_on_the_rpc_device_are_bit_identical(model, reference, server):
    tokens, ref = reference
    with MoEModel(model, opts(f"rpc={server.endpoint}")) as m:
        assert list(m.devices) == ["RPC0"]
        b = m.devices["RPC0"]
        assert b.name == f"RPC0[{server.endpoint}]" and b.endpoint == server.endpoint and not b.is_cpu
        assert set(m.layout.layer_device) == {"RPC0"} and m.layout.output_device == "RPC0"
        got = run_both_halves(m, tokens)
        # the weights really are on the server: not host memory, and more than nothing there
        assert m.device_memory("RPC0")["weights"] > 0
        assert all(not t.is_host for dev, ctx in m.weight_ctxs if dev == "RPC0" for t in ctx.tensors())
    assert np.array_equal(got, ref)


def test_the_host_tier_feeds_an_rpc_device_bit_identically(model, reference, server):
    """Queued uploads from the host tier's buffers (not the mapping) across a real process boundary."""
    tokens, ref = reference
    with MoEModel(model, opts(f"rpc={server.endpoint}", "disk_experts=true", "expert_cache_slots=2",
                              "host_tier_bytes=16M")) as m:
        got = run_both_halves(m, tokens)
        ex, tier = m.experts.executors[0], m.experts.tier.counters
        assert ex.load_mode == "queued" and tier.misses > 0
        assert tier.hits + tier.misses == m.counters.total.misses
    assert np.array_equal(got, ref)


def test_a_graph_run_again_after_another_is_bit_identical(model, server):
    """A prompt graph evaluated again after a decode graph (a second request of the same length): GGML's scheduler
    used to leave the graph's sources replaced by copies in a context the next split freed, so the graph ran
    again read freed tensors (an abort or a crash here; patch 0001). Every run equals the CPU's."""
    seqs = [[7, 8, 9, 10], [11], [7, 8, 9, 10], [12], [7, 8, 9, 10]]
    out = []
    for remote in ([], [f"rpc={server.endpoint}"]):
        with MoEModel(model, opts(*remote)) as m:
            got = []
            for i, toks in enumerate(seqs):
                if i == 3:
                    m.reset()
                got.append(m.eval(toks, "all"))
            out.append(got)
    for cpu, remote in zip(*out):
        assert np.array_equal(cpu, remote)


@pytest.mark.parametrize("executor", ["native", "python"])
@pytest.mark.parametrize("share", [0.0, 0.5, "auto"])
def test_expert_cache_on_the_rpc_device_is_bit_identical(model, reference, server, share, executor):
    tokens, ref = reference
    o = opts(f"rpc={server.endpoint}", "disk_experts=true", "expert_cache_slots=3", f"moe_cpu_share={share}",
             f"moe_executor={executor}")
    with MoEModel(model, o) as m:
        got = run_both_halves(m, tokens)
        rpc0 = m.devices["RPC0"]
        assert all(b is rpc0 for b in m.experts.layer_backends)
        c = m.counters.total
        # auto may give the CPU every miss: a device round costs its exchanges with the server (the round trips)
        assert (c.misses + c.cpu_misses if share == "auto" else c.misses) > 0
        assert c.bytes_loaded == c.misses * m.experts.executors[0].expert_bytes
        if share == 0.5:
            assert c.cpu_misses > 0
        # the loads crossed to the server: each slot holds one expert's bytes of the file, each a different one,
        # and the scratch slot (the last) its zeros; with auto a slot may never be loaded (the CPU took the misses
        # it would have held: how many follows the link as measured), and keeps its zeros
        ex = m.experts.executors[0]
        assert ex.buffers and all(not b.is_host and b.name.startswith("RPC") for b in ex.buffers)
        if executor == "native":  # GGML's RPC client copies an upload when it queues it: no staging needed
            assert ex.load_mode == "queued" and c.bytes_staged == 0
        for kind, t in ex.slot_tensors.items():
            slots = t.numpy().reshape(-1, t.nb[2])  # read back from the server
            mapped = {row.tobytes(): e for e, row in enumerate(np.asarray(ex._raw[kind]).reshape(-1, t.nb[2]))}
            held = [mapped.get(s.tobytes()) for s in slots[:-1] if share != "auto" or s.any()]
            assert None not in held and len(set(held)) == len(held) == (3 if share != "auto" else len(held))
            assert held or c.misses == 0
            assert not slots[-1].any()
    assert np.array_equal(got, ref)


@pytest.fixture(scope="module")
def two_servers():
    with rpc_server() as a, rpc_server() as b:
        yield a, b


# llama.cpp's split of the 4 layers + output over the devices: -ts 1,1 cuts at half of the 5
@pytest.mark.parametrize("items, layers, output, experts", [
    (["tensor_split=1,1"], ["RPC0", "RPC0", "RPC0", "RPC1"], "RPC1", ["resident"] * 4),
    (["tensor_split=1,1", "n_gpu_layers=2"], ["CPU", "CPU", "CPU", "RPC0"], "RPC1", ["cpu", "cpu", "cpu", "resident"]),
    (["override_tensor=blk\\.1\\.=RPC1,exps=CPU"], ["RPC0", "RPC0", "RPC0", "RPC1"], "RPC1",
     ["cpu", "resident", "cpu", "cpu"]),
    (["split_mode=none", "disk_experts=true", "expert_cache_slots=2", "moe_cpu_share=0.5"], ["RPC0"] * 4, "RPC0",
     ["disk"] * 4),
])
def test_layout_flags_over_two_servers_are_bit_identical(model, reference, two_servers, items, layers, output,
                                                         experts):
    tokens, ref = reference
    a, b = two_servers
    with MoEModel(model, opts(f"rpc={a.endpoint},{b.endpoint}", *items)) as m:
        assert list(m.devices) == ["RPC0", "RPC1"]
        assert [m.devices[n].endpoint for n in m.devices] == [a.endpoint, b.endpoint]
        lay = m.layout
        assert list(lay.layer_device) == layers and lay.output_device == output
        assert list(lay.expert_mode) == experts
        if any(i.startswith("override_tensor") for i in items):
            assert {d for n, d in lay.tensors.items() if n.startswith("blk.1.")} == {"RPC1"}
        got = run_both_halves(m, tokens)
    assert np.array_equal(got, ref)


def test_devices_and_plan_ask_the_server(model):
    with rpc_server("--mem", "1024") as s:
        rows = describe_devices(opts(f"rpc={s.endpoint}"))
        assert [r["name"] for r in rows] == ["RPC0", "CPU"]
        assert rows[0]["kind"] == "rpc" and s.endpoint in rows[0]["description"]
        assert rows[0]["memory_total"] == rows[0]["memory_free"] == 1024 * MiB
        r = CliRunner().invoke(main, ["devices", "--rpc", s.endpoint, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)[0]["memory_total"] == 1024 * MiB
        p = plan(model, opts(f"rpc={s.endpoint}"))
        d = p.devices["RPC0"]
        assert d.vram == 1024 * MiB and d.fits is True
        # what the plan says the device holds is what a load puts there, but for the compute buffers: the
        # dry run's CPU instances read the host's inputs in place, a real device gets copies
        with MoEModel(model, opts(f"rpc={s.endpoint}")) as m:
            held = m.device_memory("RPC0")
        assert {k: getattr(d, k) for k in held if k != "compute"} == {k: v for k, v in held.items() if k != "compute"}
        assert 0 < d.compute <= held["compute"]
    with rpc_server("--mem", "1") as s:
        p = plan(model, opts(f"rpc={s.endpoint}"))
        assert p.devices["RPC0"].vram == MiB and p.devices["RPC0"].fits is False


# -- failures ------------------------------------------------------------------------------------------------


def test_server_killed_mid_generation_is_one_typed_error_and_the_process_goes_on(model, reference):
    tokens, ref = reference
    faulthandler.dump_traceback_later(180, exit=True)  # a hang would end the test run, loudly
    try:
        with rpc_server() as s:
            m = MoEModel(model, opts(f"rpc={s.endpoint}", "disk_experts=true", "expert_cache_slots=2"))
            killed_at: list[float] = []
            generating = threading.Event()

            def kill_mid_generation() -> None:
                # the event: the prompt is evaluated and decoding under way (it slept 0.3 s from the start; a
                # loaded machine could still be evaluating the prompt, or not have begun)
                assert generating.wait(120)
                killed_at.append(time.monotonic())
                s.kill()

            killer = threading.Thread(target=kill_mid_generation)
            killer.start()
            with pytest.raises(RPCError) as err:
                logits = m.eval(tokens)
                generating.set()
                while True:  # greedy decoding until the server is gone
                    if m.n_past >= m.n_ctx - 1:
                        m.reset()
                    logits = m.eval([int(np.argmax(logits[-1]))])
            raised_at = time.monotonic()
            killer.join(10)
            assert killed_at and raised_at - killed_at[0] < 10
            assert s.endpoint in str(err.value) and "lost" in str(err.value)
            # the session stays failed (not aborted, not hung) until closed
            with pytest.raises(RPCError):
                m.eval([1])
            m.close()
        # the endpoint connects afresh: nobody listens now
        with pytest.raises(RPCError, match="cannot connect"):
            MoEModel(model, opts(f"rpc={s.endpoint}"))
        # another model on another server, and one on the CPU, compute as ever
        with rpc_server() as s2, MoEModel(model, opts(f"rpc={s2.endpoint}")) as m2:
            assert np.array_equal(run_both_halves(m2, tokens), ref)
        with MoEModel(model, opts()) as m3:
            assert np.array_equal(run_both_halves(m3, tokens), ref)
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_server_killed_between_tokens_fails_the_next_eval(model, reference):
    tokens, _ = reference
    with rpc_server() as s:
        with MoEModel(model, opts(f"rpc={s.endpoint}")) as m:
            m.eval(tokens)
            s.kill()
            with pytest.raises(RPCError, match=f"RPC server {s.endpoint} \\(RPC0\\)"):
                m.eval([1])


def test_server_killed_while_loading_is_one_typed_error(model, reference):
    tokens, ref = reference
    with rpc_server() as s:
        seen = []

        def progress(done: int, total: int) -> None:
            seen.append(done)
            if done == 5:  # a few weights are on the server
                s.kill()

        with pytest.raises(RPCError, match=f"RPC server {s.endpoint}"):
            MoEModel(model, opts(f"rpc={s.endpoint}"), progress=progress)
        assert len(seen) > 5  # the load went on without the server, then said so
    with MoEModel(model, opts()) as m:
        assert np.array_equal(run_both_halves(m, tokens), ref)


def test_refused_connection_is_one_error_line_and_exit_2(model):
    port = free_port()  # nothing listens there
    p = subprocess.run([*CLI, "run", model, "--rpc", f"127.0.0.1:{port}", "--tokens", "1,2", "-n", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert lines == [f"error: RPC server 127.0.0.1:{port}: cannot connect: Connection refused"], p.stderr


@pytest.mark.parametrize("args, expect", [
    (["--rpc", "no-such-host.invalid:50052"], "cannot resolve host 'no-such-host.invalid'"),
    (["--rpc", "127.0.0.1"], "is not HOST:PORT"),
    (["--rpc", "127.0.0.1:0"], "port in 1..65535"),
    (["--rpc", "127.0.0.1:50052,127.0.0.1:50052"], "given twice"),
])
def test_bad_addresses_are_one_error_line(model, args, expect):
    r = CliRunner().invoke(main, ["run", model, "--tokens", "1", "-n", "1", *args])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    lines = r.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], r.output


def test_a_server_that_is_not_an_rpc_server_fails_the_handshake(model):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_hang_up() -> None:
        conn, _ = listener.accept()
        conn.close()

    t = threading.Thread(target=accept_and_hang_up)
    t.start()
    try:
        with pytest.raises(RPCError, match=f"127.0.0.1:{port}: no reply to the handshake"):
            device_names(opts(f"rpc=127.0.0.1:{port}"))
    finally:
        t.join(10)
        listener.close()


@pytest.mark.parametrize("text, expect", [
    ("a:1,b:2", "a:1,b:2"), (" a:01 , 10.0.0.2:50052 ", "a:1,10.0.0.2:50052"), ("none", None),
])
def test_rpc_option_canonical_text(text, expect):
    assert SessionOptions.parse([f"rpc={text}"]).rpc == expect


@pytest.mark.parametrize("text", ["a", "a:", ":1", "a:1:2", "a:70000", "a:1,", "a b:1", "a:1,a:1", "[::1]:5"])
def test_rpc_option_rejects(text):
    with pytest.raises(OptionError, match="rpc="):
        SessionOptions.parse([f"rpc={text}"])


def test_parse_endpoints_names_the_option():
    with pytest.raises(OptionError, match="rpc=x: 'x' is not HOST:PORT"):
        rpc.parse_endpoints("x")


# -- the server command --------------------------------------------------------------------------------------


def test_ctrl_c_stops_the_server_cleanly():
    s = Server()
    code, err = s.stop()
    assert code == 0 and f"rpc-server on {s.endpoint}: stopped" in err, err
    assert "warning" not in err  # loopback: no warning


def test_binding_beyond_loopback_warns_once():
    s = Server("--host", "0.0.0.0")  # listens on every interface, loopback included
    code, err = s.stop()
    lines = err.splitlines()
    assert code == 0 and lines[0].startswith(f"warning: rpc-server listens on 0.0.0.0:{s.port}, "), err
    assert "no authentication" in lines[0] and sum("warning" in x for x in lines) == 1


@pytest.mark.parametrize("args, expect", [
    (["--host", "localhost"], "not an IPv4 address"),
    (["--port", "0"], "0 is not in the range"),
])
def test_server_argument_errors(args, expect):
    r = CliRunner().invoke(main, ["rpc-server", *args])
    assert r.exit_code == 2 and expect in r.output, r.output


def test_server_threads_follow_the_one_thread_rule():
    """Issue 28 item 19: --threads 512 was accepted; every other thread flag stops at 4 x the cores."""
    from ggml_hybrid.ggml.backend import max_threads

    n = max_threads()
    r = CliRunner().invoke(main, ["rpc-server", "--threads", str(n + 1)])
    assert r.exit_code == 2 and f"1..{n}" in r.output and "4 x the cores" in r.output, r.output
    r = CliRunner().invoke(main, ["rpc-server", "--threads", "0"])
    assert r.exit_code == 2 and f"1..{n}" in r.output, r.output


def test_server_mem_beyond_64_bits_is_one_error_line_not_a_silent_hang():
    """Issue 28 item 5: --mem 2^60 raised an OverflowError in the server thread, and the command then waited for
    ever without listening. Now it is refused up front, and any failure of the server thread ends the command."""
    port = free_port()
    p = subprocess.run([*CLI, "rpc-server", "--port", str(port), "--mem", str(2**60)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stderr
    assert "--mem" in p.stderr and "1..17592186044415 MiB" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # the largest accepted size starts a server that reports it
    with rpc_server("--mem", str((2**64 - 1) // MiB)) as s:
        rows = describe_devices(opts(f"rpc={s.endpoint}"))
        assert rows[0]["memory_total"] == (2**64 - 1) // MiB * MiB


def test_a_server_thread_that_fails_ends_the_command(monkeypatch):
    def broken(*args, **kwargs):
        raise OverflowError("int too big to convert")

    monkeypatch.setattr(rpc, "serve", broken)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        r = CliRunner().invoke(main, ["rpc-server", "--port", str(free_port())])
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert r.exit_code == 2 and "could not start: int too big to convert" in r.output, r.output


def test_server_on_a_port_in_use_is_one_error_line():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = CliRunner().invoke(main, ["rpc-server", "--port", str(port)])
    assert r.exit_code == 2 and r.output.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"



# -- hostile clients (issue 28 item 4) and frozen servers (item 3) ---------------------------------------------


def _session(port: int):
    """A client that said hello and holds a real 4096-byte buffer: (socket, buffer handle, base address)."""
    sock = rc.connect(port, timeout=20)
    buffer, size = struct.unpack("<QQ", rc.request(sock, rc.ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)))
    assert buffer and size >= 4096
    (base,) = struct.unpack("<Q", rc.request(sock, rc.BUFFER_GET_BASE, struct.pack("<Q", buffer)))
    return sock, buffer, base


def _graph(*tensors: bytes, nodes: list[int]) -> bytes:
    return (struct.pack("<II", 0, len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
            + struct.pack("<I", len(tensors)) + b"".join(tensors))


def _f32(id: int, buffer: int, data: int, ne=(4, 1, 1, 1), **kw) -> bytes:
    return rc.tensor(id=id, type=0, buffer=buffer, ne=ne, data=data, **kw)


# each message killed the upstream server (abort, assert, segfault or a jump to an address the client chose)
HOSTILE = {
    "declared size 2^63 (std::length_error)": lambda b, base: rc.frame(rc.SET_TENSOR, b"", 2**63),
    "tensor past its buffer (GGML_ASSERT)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, b, base + 4090, op=rc.OP_SCALE, src=[2]), _f32(2, b, base), nodes=[1])),
    "node without data (segfault)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, 0, 0, op=rc.OP_ADD, src=[2, 2]), _f32(2, b, base), nodes=[1])),
    "write past the tensor (ggml_backend_tensor_set assert)": lambda b, base: rc.frame(
        rc.SET_TENSOR, _f32(1, b, base) + struct.pack("<BQ", 0, 8) + bytes(64)),
    "read past the tensor (ggml_backend_tensor_get assert)": lambda b, base: rc.frame(
        rc.GET_TENSOR, _f32(1, b, base) + struct.pack("<QQ", 0, 64)),
    "a function pointer of the client's (MAP_CUSTOM1)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, b, base + 64, op=rc.OP_MAP_CUSTOM1, src=[2], op_params=[0x41414140, 0x41, 1, 0, 0, 0]),
        _f32(2, b, base), nodes=[1])),
    "2^128 elements (GGML_ASSERT in ggml_new_tensor)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, b, base, ne=(2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1), nb=(4, 4, 4, 4), op=rc.OP_SCALE,
             src=[1]), nodes=[1])),
    "ADD of mismatched shapes (kernel assert)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, b, base, ne=(8, 1, 1, 1), op=rc.OP_ADD, src=[2, 3]), _f32(2, b, base + 64, ne=(4, 1, 1, 1)),
        _f32(3, b, base + 128, ne=(3, 1, 1, 1)), nodes=[1])),
    # ops outside the shape-checked list ran as the client described them
    "CONV_TRANSPOSE_1D with a stride past its output (a write out of bounds)": lambda b, base: rc.frame(
        rc.GRAPH_COMPUTE, _conv_transpose(b, base, stride=1 << 20)),
    "ROPE over more dimensions than a row has (kernel assert)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _f32(1, b, base, ne=(4, 1, 1, 1), op=rc.OP_ROPE, src=[2, 3], op_params=[0, 64, 0]),
        _f32(2, b, base + 64, ne=(4, 1, 1, 1)), rc.tensor(id=3, type=26, buffer=b, ne=(1, 1, 1, 1), data=base + 128),
        nodes=[1])),
    "GET_ROWS with fewer indices than output rows (a read out of bounds)": lambda b, base: rc.frame(
        rc.GRAPH_COMPUTE, _graph(_f32(1, b, base, ne=(4, 8, 1, 1), op=rc.OP_GET_ROWS, src=[2, 3]),
                                 _f32(2, b, base + 256, ne=(4, 2, 1, 1)),
                                 rc.tensor(id=3, type=26, buffer=b, ne=(2, 1, 1, 1), data=base + 512), nodes=[1])),
}

# types (enum ggml_type) and their element sizes; a block type's size is its block's
F32, F16, Q8_0, I8, I16, I32, BF16 = 0, 1, 8, 24, 25, 26, 30
_TYPE_SIZE = {F32: 4, F16: 2, Q8_0: 34, I8: 1, I16: 2, I32: 4, BF16: 2}
GELU, SWIGLU_OAI = 8, 3  # enum ggml_unary_op, enum ggml_glu_op


def _t(id: int, type_: int, buffer: int, data: int, ne=(4, 1, 1, 1), **kw) -> bytes:
    """A packed tensor of any type (a block type's ne[0] a whole number of 32-element blocks); a node (with an op)
    is flagged to be computed, so the CPU backend runs its kernel."""
    ts = _TYPE_SIZE[type_]
    n0 = ne[0] // 32 if type_ == Q8_0 else ne[0]
    nb = (ts, ts * n0, ts * n0 * ne[1], ts * n0 * ne[1] * ne[2])
    flags = rc.FLAG_COMPUTE if kw.get("op") else 0
    return rc.tensor(id=id, type=type_, buffer=buffer, ne=ne, nb=nb, data=data, flags=flags, **kw)


def _f(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# Well-formed one-node graphs whose shapes every rule of patch 0011 accepted but whose types the op's CPU kernel
# has no code for: GGML_ABORT, or a call through a conversion or dot-product function the type lacks (a
# segfault). The server's fuzzer sent nodes without GGML_TENSOR_FLAG_COMPUTE, so no kernel ever ran, until
# 2026-12-02; each of these stopped the server then.
KERNEL_TYPES = {
    "GELU of an I32 tensor (unary kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, I32, b, base, op=rc.OP_UNARY, src=[2], op_params=[GELU]), _t(2, I32, b, base + 64), nodes=[1])),
    "ADD of I32 tensors (binary kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, I32, b, base, op=rc.OP_ADD, src=[2, 3]), _t(2, I32, b, base + 64), _t(3, I32, b, base + 128),
        nodes=[1])),
    "RMS_NORM of an F16 tensor (kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, F16, b, base, op=rc.OP_RMS_NORM, src=[2], op_params=[_f(1e-6)]), _t(2, F16, b, base + 64),
        nodes=[1])),
    "SCALE of an F16 tensor (kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, F16, b, base, op=rc.OP_SCALE, src=[2], op_params=[_f(2.0), 0]), _t(2, F16, b, base + 64),
        nodes=[1])),
    "SWIGLU_OAI of an F16 tensor (kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, F16, b, base, op=rc.OP_GLU, src=[2], op_params=[SWIGLU_OAI, 0, _f(1.702), _f(7.0)]),
        _t(2, F16, b, base + 64, ne=(8, 1, 1, 1)), nodes=[1])),
    "CPY of I32 into F16 (copy kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, F16, b, base, op=rc.OP_CPY, src=[2, 3]), _t(2, I32, b, base + 64), _t(3, F16, b, base),
        nodes=[1])),
    "REPEAT of an I8 tensor (kernel abort)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, I8, b, base, ne=(8, 1, 1, 1), op=rc.OP_REPEAT, src=[2]), _t(2, I8, b, base + 64), nodes=[1])),
    "GET_ROWS of I16 rows (kernel abort)": lambda b, base: rc.frame(rc.SET_TENSOR, _t(3, I32, b, base + 512, ne=(
        2, 1, 1, 1)) + struct.pack("<BQ", 0, 0) + bytes(8)) + rc.frame(rc.GRAPH_COMPUTE, _graph(
            _t(1, F32, b, base, ne=(4, 2, 1, 1), op=rc.OP_GET_ROWS, src=[2, 3]),
            _t(2, I16, b, base + 256, ne=(4, 4, 1, 1)), _t(3, I32, b, base + 512, ne=(2, 1, 1, 1)), nodes=[1])),
    "SET_ROWS into I16 rows (a call through a null from_float)": lambda b, base: rc.frame(rc.SET_TENSOR, _t(
        3, I32, b, base + 512, ne=(2, 1, 1, 1)) + struct.pack("<BQ", 0, 0) + bytes(8)) + rc.frame(
            rc.GRAPH_COMPUTE, _graph(
                _t(1, I16, b, base, ne=(4, 4, 1, 1), op=rc.OP_SET_ROWS, src=[2, 3, 4]),
                _t(2, F32, b, base + 256, ne=(4, 2, 1, 1)), _t(3, I32, b, base + 512, ne=(2, 1, 1, 1)),
                _t(4, I16, b, base, ne=(4, 4, 1, 1)), nodes=[1])),
    "CONT of Q8_0 into F32 (the kernel reads a second source CONT has not)": lambda b, base: rc.frame(
        rc.GRAPH_COMPUTE, _graph(_t(1, F32, b, base, ne=(32, 1, 1, 1), op=rc.OP_CONT, src=[2]),
                                 _t(2, Q8_0, b, base + 256, ne=(32, 1, 1, 1)), nodes=[1])),
    "MUL_MAT of I32 weights (a call through a null vec_dot)": lambda b, base: rc.frame(rc.GRAPH_COMPUTE, _graph(
        _t(1, F32, b, base, ne=(2, 1, 1, 1), op=rc.OP_MUL_MAT, src=[2, 3]), _t(2, I32, b, base + 64, ne=(4, 2, 1, 1)),
        _t(3, F32, b, base + 128), nodes=[1])),
    "MUL_MAT_ID of I32 experts (a call through a null vec_dot)": lambda b, base: rc.frame(rc.SET_TENSOR, _t(
        4, I32, b, base + 512, ne=(1, 1, 1, 1)) + struct.pack("<BQ", 0, 0) + bytes(4)) + rc.frame(
            rc.GRAPH_COMPUTE, _graph(
                _t(1, F32, b, base, ne=(2, 1, 1, 1), op=rc.OP_MUL_MAT_ID, src=[2, 3, 4]),
                _t(2, I32, b, base + 64, ne=(4, 2, 2, 1)), _t(3, F32, b, base + 256, ne=(4, 1, 1, 1)),
                _t(4, I32, b, base + 512, ne=(1, 1, 1, 1)), nodes=[1])),
    "FLASH_ATTN_EXT with I32 keys (a call through a null vec_dot)": lambda b, base: rc.frame(
        rc.GRAPH_COMPUTE, _graph(
            _t(1, F32, b, base, ne=(4, 1, 1, 1), op=rc.OP_FLASH_ATTN_EXT, src=[2, 3, 4], op_params=[_f(0.5), 0, 0]),
            _t(2, F32, b, base + 64, ne=(4, 1, 1, 1)), _t(3, I32, b, base + 128, ne=(4, 2, 1, 1)),
            _t(4, F32, b, base + 256, ne=(4, 2, 1, 1)), nodes=[1])),
}


@pytest.mark.parametrize("what", list(KERNEL_TYPES))
def test_a_type_the_kernel_lacks_drops_its_client_not_the_server(hostile_server, what):
    """Issue 28 item 4 (the kernels' types): each of these stopped the server once its node was flagged to be
    computed; now the server refuses the graph with its usual message and drops that client only (the families'
    own graphs still run: test_every_family_runs_on_the_rpc_device_bit_identical)."""
    port = hostile_server.port
    before = hostile_server.log().count(f"[graph_compute] graph node 0 ({what.split()[0]}) refused")
    sock, buffer, base = _session(port)
    with sock:
        sock.sendall(KERNEL_TYPES[what](buffer, base))
        sock.settimeout(20)
        assert sock.recv(1) == b""  # the server closed the connection
    assert rc.alive(port) == 1 and hostile_server.proc.poll() is None
    # with its usual message, naming the node and its op
    refusal = f"[graph_compute] graph node 0 ({what.split()[0]}) refused"
    assert hostile_server.log().count(refusal) == before + 1, hostile_server.log()[-2000:]


def _conv_transpose(b: int, base: int, stride: int) -> bytes:
    """A CONV_TRANSPOSE_1D node: kernel [3, 1, 1], input [2, 1], output [(2 - 1) * 1 + 3, 1] (for stride 1)."""
    return _graph(_f32(1, b, base, ne=(4, 1, 1, 1), op=rc.OP_CONV_TRANSPOSE_1D, src=[2, 3], op_params=[stride, 0, 1]),
                  _f32(2, b, base + 64, ne=(3, 1, 1, 1)), _f32(3, b, base + 128, ne=(2, 1, 1, 1)), nodes=[1])


@pytest.fixture(scope="module")
def hostile_server():
    with rpc_server() as s:
        yield s


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_malformed_message_drops_its_client_not_the_server(hostile_server, what):
    """Issue 28 item 4: each of these killed the server; now the server drops that client and serves the next."""
    port = hostile_server.port
    sock, buffer, base = _session(port)
    with sock:
        sock.sendall(HOSTILE[what](buffer, base))
        sock.settimeout(20)
        assert sock.recv(1) == b""  # the server closed the connection
    assert rc.alive(port) == 1 and hostile_server.proc.poll() is None
    # and a real session computes as ever on it


@pytest.mark.parametrize("unchecked", [False, True])
def test_ops_without_shape_rules_run_only_when_the_server_allows_them(unchecked):
    """A well-formed graph of an op the server has no shape rules for (CONV_TRANSPOSE_1D) is refused by default
    (its client dropped) and runs with --unchecked-ops, upstream's behaviour."""
    with rpc_server(*(["--unchecked-ops"] if unchecked else [])) as s:
        sock, buffer, base = _session(s.port)
        with sock:
            sock.sendall(rc.frame(rc.GRAPH_COMPUTE, _conv_transpose(buffer, base, stride=1)))
            sock.settimeout(2)
            assert rc._drain(sock) is unchecked  # the connection stays open only when the graph was accepted
        assert rc.alive(s.port) == 1 and s.proc.poll() is None


FAMILY_SPECS = {"qwen3moe": {}, "qwen2moe": dict(head_dim=16), "llama": {}, "qwen3next": {}, "qwen35moe": {},
                "glm4moe": dict(n_layer=3, n_dense_lead=1, gating="sigmoid", qk_norm=True),
                "deepseek2": dict(n_layer=3, n_dense_lead=1, n_expert=16, n_used=4, gating="sigmoid", n_group=4,
                                  n_group_used=2, rope_scaling="yarn", rope_factor=40.0, rope_orig_ctx=512),
                "gpt-oss": dict(n_layer=2, expert_type="mxfp4", n_swa=4), "olmoe": dict(n_head_kv=4, head_dim=16)}


@pytest.mark.parametrize("flash_attn", ["off", "on"])
@pytest.mark.parametrize("arch", list(FAMILY_SPECS))
def test_every_family_runs_on_the_rpc_device_bit_identical(tmp_path, server, arch, flash_attn):
    """The shape rules refuse no graph node a model of any family sends (with and without flash attention):
    all layers on the RPC device give the CPU's logits bit for bit."""
    path = write_model(tmp_path / f"{arch}.gguf", arch=arch, weight_type="q8_0", seed=3, **FAMILY_SPECS[arch])
    out = []
    for remote in ([], [f"rpc={server.endpoint}"]):
        with MoEModel(path, opts(f"flash_attn={flash_attn}", *remote)) as m:
            tokens = m.tokenizer.encode(PROMPT)
            out.append(run_both_halves(m, tokens))
    assert np.array_equal(out[0], out[1])


def test_a_silent_client_blocks_nobody(model, reference, hostile_server):
    """Issue 28 item 4: a client that connects and never says hello (or stops mid-message) used to block every
    other client; each client is served by a thread of its own now."""
    tokens, ref = reference
    port = hostile_server.port
    silent = socket.create_connection(("127.0.0.1", port))
    stalled = rc.connect(port, timeout=20)
    stalled.sendall(rc.frame(rc.SET_TENSOR, b"", 4096)[:5])  # half a header, then nothing
    try:
        assert rc.alive(port, timeout=10) == 1
        with MoEModel(model, opts(f"rpc={hostile_server.endpoint}")) as m:
            assert np.array_equal(run_both_halves(m, tokens), ref)
    finally:
        silent.close()
        stalled.close()


def test_a_client_that_never_says_hello_is_dropped_after_the_handshake_timeout(hostile_server):
    silent = socket.create_connection(("127.0.0.1", hostile_server.port))
    silent.settimeout(30)
    t0 = time.monotonic()
    with silent:
        assert silent.recv(1) == b""
    assert 8 < time.monotonic() - t0 < 20  # RPC_SERVER_HELLO_TIMEOUT_S = 10


def test_bounded_random_message_fuzz(hostile_server):
    """Every kind of hostile case (random bytes, random frames, tensor commands and graphs around a real buffer);
    the server answers a fresh client after each. The long run is in docs/reliability.md."""
    r = rc.fuzz(hostile_server.port, seed=28, n_cases=800, deadline=time.monotonic() + 240)
    assert r["failed"] is None, r
    assert r["messages"] >= 2000 and all(r["kinds"].values()), r
    assert hostile_server.proc.poll() is None


def _graph_nodes(message: bytes) -> list[tuple[int, int]]:
    """The (op, flags) of each computed tensor a GRAPH_COMPUTE message carries."""
    payload = message[9:]
    (n_nodes,) = struct.unpack_from("<I", payload, 4)
    (n_tensors,) = struct.unpack_from("<I", payload, 8 + 8 * n_nodes)
    at = 12 + 8 * n_nodes
    out = []
    for i in range(n_tensors):
        t = payload[at + i * rc.TENSOR_BYTES:at + (i + 1) * rc.TENSOR_BYTES]
        (op,) = struct.unpack_from("<I", t, 52)
        (flags,) = struct.unpack_from("<I", t, 120)
        if op:
            out.append((op, flags))
    return out


def test_the_fuzzers_op_graphs_run_their_kernels():
    """The `ops` kind's nodes carry GGML_TENSOR_FLAG_COMPUTE: without it the CPU backend skips a node, and the
    fuzzer had never run a kernel (until 2026-12-02)."""
    nodes = [n for i in range(300) if (c := rc.make_case(13, i)).kind == "ops"
             for m in c.messages[1:] for n in _graph_nodes(m)]
    assert len(nodes) > 100 and all(flags & rc.FLAG_COMPUTE for _, flags in nodes)


def test_a_frozen_server_is_a_timeout_not_a_hang(model, reference):
    """Issue 28 item 3: a server stopped (SIGSTOP) mid-session used to block the client in recv() for ever."""
    tokens, _ = reference
    with rpc_server() as s:
        with MoEModel(model, opts(f"rpc={s.endpoint}", "rpc_timeout=3")) as m:
            m.eval(tokens[:4])
            s.proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(RPCError, match=f"RPC server {s.endpoint}.*no reply within 3 s"):
                    m.eval([1])
                assert time.monotonic() - t0 < 30
            finally:
                s.proc.send_signal(signal.SIGCONT)


def _wait_idle(pid: int, quiet: float = 0.3, limit: float = 60) -> None:
    """Until process ``pid`` sleeps and uses no CPU for ``quiet`` seconds: it waits on something (a bounded wait)."""
    import psutil

    proc = psutil.Process(pid)
    end = time.monotonic() + limit

    def cpu() -> float:
        t = proc.cpu_times()
        return t.user + t.system

    while True:
        before = cpu()
        time.sleep(quiet)
        if cpu() == before and proc.status() == psutil.STATUS_SLEEPING:
            return
        assert time.monotonic() < end, "the process never stopped to wait"


def test_ctrl_c_ends_a_run_against_a_frozen_server(model):
    """Issue 28 item 3: Ctrl-C during `run --rpc` against a stopped server (no time limit) ends the run at once,
    with the usual report and exit status 130."""
    with rpc_server() as s:
        p = subprocess.Popen([*CLI, "run", model, "--rpc", s.endpoint, "--rpc-timeout", "0", "-t", "1",
                              "--tokens", "1,2,3", "-n", "100000", "--ignore-eos"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert p.stdout is not None
            p.stdout.read(8)  # it generates
            s.proc.send_signal(signal.SIGSTOP)
            _wait_idle(p.pid)  # now it waits for the server (it slept 1 s and assumed so)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        finally:
            s.proc.send_signal(signal.SIGCONT)
            if p.poll() is None:
                p.kill()
                p.communicate()
        text = err.decode()
        assert p.returncode == 130, (p.returncode, text)
        assert "stop: interrupted" in text and "Traceback" not in text, text


@pytest.mark.parametrize("timeout", [2, 4])
def test_an_upload_cut_off_half_way_fails_within_rpc_timeout(timeout):
    """A server stopped (SIGSTOP) while a large upload goes to it: the kernels take the first megabytes (their
    buffers, filled at the pace the receiver's window opens), then nothing moves. The upload fails rpc_timeout after
    the last byte moved (vendor patch 0015), so well before twice the limit; before the patch the send that had moved
    bytes waited its own full limit first and the next one another (7.2 s for a limit of 2 s, measured)."""
    import ggml_hybrid as gh

    with rpc_server() as s:
        (dev,) = rpc.server_devices(s.endpoint, timeout=timeout)
        backend = rpc.open_device(dev)
        ctx = gh.Context()
        try:
            t = ctx.new_tensor("f32", (64 << 20 >> 2,), "big")  # 64 MiB: far more than the sockets' buffers hold
            ctx.allocate(backend)
            data = np.ones(64 << 20 >> 2, np.float32)
            s.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RPCError, match=f"RPC server {s.endpoint}.*no reply within {timeout} s"):
                t.set(data)
                t.numpy()  # a reply the upload must come before
            elapsed = time.monotonic() - t0
        finally:
            s.proc.send_signal(signal.SIGCONT)
            ctx.close()
            backend.close()
    assert elapsed < 2 * timeout, f"the error came after {elapsed:.1f} s"
