"""GGML's RPC backend as a real device: ``ggml-hybrid rpc-server`` subprocesses on loopback ports.

The oracle is the CPU resident run of the same model (the default options, one thread): the server
computes with the same CPU kernels, so every placement on RPC devices must give the same bits. The
failure tests check what vendor patch 0002 promises: a refused connection, a failed handshake and a
server killed mid-run are one typed error naming the endpoint, never an abort or a hang.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
from click.testing import CliRunner

from ggml_hybrid.cli import main
from ggml_hybrid.deploy.devices import describe_devices, device_names
from ggml_hybrid.errors import RPCError
from ggml_hybrid.ggml import rpc
from ggml_hybrid.options import OptionError, SessionOptions
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
        self.proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(self.port), "--threads", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise RuntimeError(f"rpc-server exited with {self.proc.returncode}: {out}{err}")
            try:
                # the probe is a client too: the server accepts it, reads nothing and waits for the next
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rpc-server did not listen on {self.endpoint} within {START_S} s") from None
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, then (if it lingers) kill; (exit status, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


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
        assert c.misses > 0 and c.bytes_loaded == c.misses * m.experts.executors[0].expert_bytes
        if share == 0.5:
            assert c.cpu_misses > 0
        # the loads crossed to the server: each slot holds one expert's bytes of the file, each a different one,
        # and the scratch slot (the last) its zeros
        ex = m.experts.executors[0]
        assert ex.buffers and all(not b.is_host and b.name.startswith("RPC") for b in ex.buffers)
        if executor == "native":  # GGML's RPC client copies an upload when it queues it: no staging needed
            assert ex.load_mode == "queued" and c.bytes_staged == 0
        for kind, t in ex.slot_tensors.items():
            slots = t.numpy().reshape(-1, t.nb[2])  # read back from the server
            mapped = {row.tobytes(): e for e, row in enumerate(np.asarray(ex._raw[kind]).reshape(-1, t.nb[2]))}
            held = [mapped.get(s.tobytes()) for s in slots[:-1]]
            assert None not in held and len(set(held)) == len(held) == 3
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

            def kill_soon() -> None:
                time.sleep(0.3)
                killed_at.append(time.monotonic())
                s.kill()

            threading.Thread(target=kill_soon).start()
            with pytest.raises(RPCError) as err:
                logits = m.eval(tokens)
                while True:  # greedy decoding until the server is gone
                    if m.n_past >= m.n_ctx - 1:
                        m.reset()
                    logits = m.eval([int(np.argmax(logits[-1]))])
            raised_at = time.monotonic()
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


def test_server_on_a_port_in_use_is_one_error_line():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = CliRunner().invoke(main, ["rpc-server", "--port", str(port)])
    assert r.exit_code == 2 and r.output.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"

