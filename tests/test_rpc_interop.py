"""Interop with the pinned llama.cpp's own RPC, both ways, across emulated hosts.

- The pin's own ``rpc-server`` (llama.cpp's ``tools/rpc/rpc-server.cpp``, built unpatched by
  ``python -m ggml_hybrid_build --pin-rpc-server``) serves this project's leader: every expert mode gives the bits of
  the resident run on the local CPU (the oracle), as ggml-hybrid's own server does. What it lacks is checked too: an
  index out of range in a graph aborts it (no patch 0013/0014: the leader gets a lost connection, not a
  :class:`GraphIndexError`), and it serves one client at a time (a second leader's handshake waits until
  ``rpc_timeout``).
- This project's ``rpc-server`` serves the pinned llama.cpp's client (llama-cpp-python 0.3.36 built with
  ``GGML_RPC=on``, the ``reference`` tests): its logits over our servers are the bits of its own CPU run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import RPCError
from ggml_hybrid.ggml import rpc
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Where a layer runs never changes a bit of the logits."
REFERENCE = ROOT / "tools" / "llama_reference.py"


def pin_rpc_server() -> Path:
    path = Path(os.environ.get("GGML_HYBRID_PIN_RPC_SERVER") or ROOT / "build" / "pin-rpc-server" / "ggml-rpc-server")
    if not path.exists():
        pytest.skip("the pin's own rpc-server is not built: `python -m ggml_hybrid_build --pin-rpc-server`")
    return path


def llama_python() -> str:
    exe = os.environ.get("GGML_HYBRID_LLAMA_PYTHON")
    if not exe:
        pytest.skip("no llama-cpp-python: set GGML_HYBRID_LLAMA_PYTHON to a Python that has it (built with "
                    "GGML_RPC=on)")
    return exe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("interop")
    return write_model(d / "m.gguf", n_layer=4, n_expert=8, n_used=2, weight_type="q8_0", seed=31)


@pytest.fixture(scope="module")
def reference(model):
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
        return tokens, np.concatenate([m.eval(tokens[:5], "all"), m.eval(tokens[5:], "all")])


# -- the pin's own server, our leader ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream_hosts(module_labs):
    """Two workers running the pin's own rpc-server, over 1 Gbit/s links."""
    exe = pin_rpc_server()
    lab = module_labs(2)
    for link in lab.links:
        link.shape("1gbit")
    lab.start_workers(upstream=exe)
    return lab


MODES = {
    "every layer on one worker": ["split_mode=none"],
    "layers split over both workers": ["tensor_split=1,1"],
    "cache on a worker, share 0": ["split_mode=none", "disk_experts=true", "expert_cache_slots=3"],
    "cache on a worker, share 0.5": ["split_mode=none", "disk_experts=true", "expert_cache_slots=3",
                                     "moe_cpu_share=0.5"],
    "cache on both workers, share auto": ["tensor_split=1,1", "disk_experts=true", "expert_cache_slots=2",
                                          "moe_cpu_share=auto"],
    "host tier on the leader": ["split_mode=none", "disk_experts=true", "expert_cache_slots=2",
                                "host_tier_bytes=16M"],
}


@pytest.mark.parametrize("mode", list(MODES))
def test_the_pins_own_server_serves_our_leader_bit_identically(model, reference, upstream_hosts, mode):
    tokens, ref = reference
    with upstream_hosts.leader.entered():
        m = MoEModel(model, SessionOptions.parse(["n_threads=1", f"rpc={upstream_hosts.rpc()}", *MODES[mode]]))
    with m:
        assert set(m.layout.layer_device) <= {"RPC0", "RPC1"}
        got = np.concatenate([m.eval(tokens[:5], "all"), m.eval(tokens[5:], "all")])
    assert np.array_equal(got, ref)


def _bad_gather(backend: gh.Backend) -> None:
    """A GET_ROWS whose index (9) another GET_ROWS computes: out of range for a table of 4 rows."""
    with gh.Context(n_tensors=8, graph_size=16) as c:
        ta, table, sel = c.new_tensor("f32", (4, 3), "a"), c.new_tensor("i32", (3, 1), "table"), \
            c.new_tensor("i32", (3,), "sel")
        y = c.get_rows(ta, c.reshape(c.get_rows(table, sel), (3,)))
        c.allocate(backend)
        ta.set(np.zeros((4, 3), np.float32))
        sel.set(np.arange(3, dtype=np.int32))
        table.set(np.array([[0], [9], [1]], np.int32))
        c.new_graph(16).expand(y).compute(backend)
        y.numpy()  # the results: the first reply after the graph


def test_an_index_out_of_range_aborts_the_pins_server(tmp_path):
    """What does not work with the pin's server: its CPU kernels assert (no patch 0013) and it has no status reply
    (no patch 0014): the process ends, the leader gets a lost connection naming it (not a GraphIndexError), and
    every other client of that server loses it too. ggml-hybrid's server answers the same graph with the typed
    error and stays up (tests/test_index_faults.py)."""
    exe = pin_rpc_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "-p", str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        (dev,) = _wait_devices(f"127.0.0.1:{port}", proc)
        backend = rpc.open_device(dev)
        try:
            with pytest.raises(RPCError, match=f"RPC server 127.0.0.1:{port}.*connection was lost"):
                _bad_gather(backend)
        finally:
            backend.close()
        assert proc.wait(timeout=60) == -signal.SIGABRT
        assert "GGML_ASSERT" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_devices(endpoint: str, proc: subprocess.Popen) -> list[rpc.RPCDevice]:
    end = time.monotonic() + 60
    while True:
        try:
            return rpc.server_devices(endpoint, timeout=10)
        except RPCError:
            assert proc.poll() is None and time.monotonic() < end
            time.sleep(0.1)  # a bounded poll for the port


def test_the_pins_server_serves_one_client_at_a_time(model, upstream_hosts):
    """A second leader process while a first one holds the connection: the pin's server does not accept it until
    the first leaves (its accept loop serves one client), so the second's handshake runs into rpc_timeout;
    ggml-hybrid's server gives each client a thread (docs/rpc.md)."""
    lab = upstream_hosts
    endpoint = lab.servers[0].endpoint
    with lab.leader.entered():
        first = MoEModel(model, SessionOptions.parse(["n_threads=1", f"rpc={endpoint}"]))
    with first:
        code = (f"from ggml_hybrid.ggml import rpc\n"
                f"try:\n    rpc.server_devices({endpoint!r}, timeout=3)\nexcept Exception as e:\n    print(e)\n")
        r = subprocess.run(lab.leader.cmd(sys.executable, "-c", code), capture_output=True, text=True, timeout=120)
    assert f"RPC server {endpoint}: no reply to the handshake within 3 s" in r.stdout, (r.stdout, r.stderr)


# -- our server, the pin's own client ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def our_hosts(module_labs):
    lab = module_labs(3)  # a lab of its own (the other is the pin's servers')
    for link in lab.links:
        link.shape("1gbit")
    lab.start_worker(1)
    lab.start_worker(2)
    return lab


def _llama(lab, model, tokens: list[int], out: Path, *args: str) -> str:
    r = subprocess.run(lab.leader.cmd(llama_python(), str(REFERENCE), str(model), "--tokens",
                                      ",".join(map(str, tokens)), "--out", str(out), "--verbose", *args),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    json.loads(r.stdout.splitlines()[-1])
    return r.stderr


@pytest.mark.reference
@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("split", ["one worker", "two workers"])
def test_our_server_serves_the_pins_client_bit_identically(model, reference, our_hosts, tmp_path, split, flash):
    """llama.cpp's own client (``--rpc``, every layer offloaded) against its own CPU run: the same bits, prompt and
    token-by-token decode, with and without flash attention; the weights really went to our servers."""
    tokens, _ = reference
    lab = our_hosts
    servers = ",".join(w.endpoint for w in lab.servers[:1 if split == "one worker" else 2])
    fa = ["--flash-attn"] if flash else []
    decode = ["--decode-from", "5", "--decode-out"]
    _llama(lab, model, tokens, tmp_path / "cpu.npy", *fa, *decode, str(tmp_path / "cpu-dec.npy"))
    log = _llama(lab, model, tokens, tmp_path / "rpc.npy", "--rpc", servers, "--n-gpu-layers", "-1", *fa, *decode,
                 str(tmp_path / "rpc-dec.npy"), *(["--tensor-split", "1,1"] if split == "two workers" else []))
    for endpoint in servers.split(","):  # llama.cpp names device 0 of each server RPC0[HOST:PORT]
        assert f"RPC0[{endpoint}] model buffer size" in log, log[-2000:]
    for name in ("", "-dec"):
        assert np.array_equal(np.load(tmp_path / f"rpc{name}.npy"), np.load(tmp_path / f"cpu{name}.npy"))
