"""The fuzz suite (tools/fuzz) at CI size: every kind, a fixed seed, no failing case.

The harness runs in its own interpreter (``tools/fuzz/run.py``), as it does at large size: it
forks its cases, which must not happen from this process (other tests leave GGML and tokenizer
threads behind). The harness's classes are checked first on outcomes made to order, so that a
broken classifier cannot pass everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tools" / "fuzz" / "run.py"
from ggfuzz.proc import Outcome, classify, run_forked  # noqa: E402

SEED = 0


# -- the classifier and the fork runner --------------------------------------------------------------

def test_classes_of_made_outcomes(tmp_path):
    nan = tmp_path / "nan.npy"
    np.save(nan, np.array([[0.0, np.nan]], np.float32))
    ok = tmp_path / "ok.npy"
    np.save(ok, np.zeros((1, 2), np.float32))
    tb = "Traceback (most recent call last):\n  File ...\nValueError: x\n"
    assert classify(Outcome(0, 1.0, "", "")) == "fine"
    assert classify(Outcome(2, 1.0, "", "error: bad value\n")) == "fine"
    assert classify(Outcome(2, 1.0, "", "error: one\nerror: two\n")) == "unclear"
    assert classify(Outcome(1, 1.0, "", tb)) == "traceback"
    assert classify(Outcome(0, 1.0, "", "Exception ignored in: <function f>\n")) == "traceback"
    assert classify(Outcome(-11, 1.0, "", "")) == "signal"
    assert classify(Outcome(-2, 1.0, "", "")) == "signal"
    assert classify(Outcome(-2, 1.0, "", ""), interrupted=True) == "fine"
    assert classify(Outcome(130, 1.0, "", "load 0.6 s | stop: interrupted\n"), interrupted=True) == "fine"
    assert classify(Outcome(130, 1.0, "", ""), interrupted=False) == "unclear"
    assert classify(Outcome(130, 1.0, "", tb), interrupted=True) == "traceback"
    assert classify(Outcome(None, 60.0, "", "")) == "hang"
    assert classify(Outcome(0, 1.0, "", ""), str(nan)) == "nonfinite"
    assert classify(Outcome(0, 1.0, "", ""), str(ok)) == "fine"
    assert classify(Outcome(3, 1.0, "", "")) == "unclear"


def test_fork_runner_sees_signals_hangs_and_exit_codes(tmp_path):
    t0 = time.monotonic()
    assert run_forked(lambda: os.kill(os.getpid(), signal.SIGSEGV), str(tmp_path), 30).rc == -signal.SIGSEGV
    assert run_forked(lambda: time.sleep(30), str(tmp_path), 1).timed_out
    assert time.monotonic() - t0 < 20
    assert run_forked(lambda: sys.exit(2), str(tmp_path), 30).rc == 2
    o = run_forked(lambda: 1 / 0, str(tmp_path), 30)
    assert o.rc == 1 and "ZeroDivisionError" in o.stderr and classify(o) == "traceback"
    o = run_forked(lambda: print("out") or 0, str(tmp_path), 30)
    assert o.rc == 0 and o.stdout == "out\n"


def test_raw_reads_past_informational_replies(monkeypatch):
    """The server fuzzer's raw client reads the reply that follows `100 Continue` lines (the server writes one every
    0.5 s to a half-closed client whose reply has not started: a loaded server's slow reply came after it, and the
    client stopped at the first line, which read as an empty reply). The stand-in server writes its reply only once
    the client has received the 100 line (the client's socket is watched)."""
    import socket
    import threading
    import types

    from ggfuzz import server_cases

    got_continue = threading.Event()

    class Watched:  # the client's socket, telling the server when a 100 line has been received
        def __init__(self, s: socket.socket) -> None:
            self.s = s

        def __enter__(self) -> Watched:
            return self

        def __exit__(self, *exc: object) -> None:
            self.s.close()

        def __getattr__(self, name: str) -> object:
            return getattr(self.s, name)

        def recv(self, n: int) -> bytes:
            data = self.s.recv(n)
            if b"100 Continue" in data:
                got_continue.set()
            return data

    fake = types.SimpleNamespace(**vars(socket))
    fake.create_connection = lambda *a, **k: Watched(socket.create_connection(*a, **k))
    monkeypatch.setattr(server_cases, "socket", fake)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                while conn.recv(65536):  # until the client's half-close
                    pass
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if got_continue.wait(30):
                    conn.sendall(reply)

        t = threading.Thread(target=answer)
        t.start()
        out = server_cases._raw(srv.getsockname()[1], b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
                                30, half_close=True)
        t.join(30)
    assert out.endswith(reply), out


# -- every kind at CI size -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")  # shared: the base models are generated once


def fuzz(out: Path, kind: str, cases: int, *extra: str) -> dict:
    p = subprocess.run([sys.executable, str(RUN), kind, "--cases", str(cases), "--seed", str(SEED), "--out",
                        str(out), "--jobs", "2", *extra], capture_output=True, text=True, timeout=900)
    path = out / f"summary-{kind}.json"
    assert path.exists(), f"the harness wrote no summary (exit {p.returncode}): {p.stderr[-3000:]}"
    summary = json.loads(path.read_text())
    bad = [(f["index"], {c: (r["class"], r.get("repro", ""), r["stderr"][-600:]) for c, r in f["results"].items()},
            f.get("mutations") or f.get("args") or f.get("target"))
           for f in summary["failures"]]
    assert not bad and not summary["harness_errors"], json.dumps(bad or summary["harness_errors"], indent=1)[:8000]
    assert summary["classes"]["fine"] == cases and p.returncode == 0
    return summary


def test_gguf_mutations(out):
    s = fuzz(out, "gguf", 16)
    assert set(s["by_command"]) >= {"inspect", "run", "plan"}


def test_cli_values(out):
    fuzz(out, "cli", 16)


def test_api_faults(out):
    fuzz(out, "api", 16)


def test_signals(out):
    fuzz(out, "signals", 2, "--modes", "resident,disk-share")


def test_server_requests(tmp_path):
    """Issue 28: hostile requests against one real server (loopback, a free port, stopped by the harness), then
    idle connections: no crash, hang, undocumented 5xx or malformed error; /health answers; a clean exit."""
    pytest.importorskip("uvicorn")
    p = subprocess.run([sys.executable, str(RUN), "server", "--cases", "60", "--seed", str(SEED), "--jobs", "3",
                        "--idle", "60", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary-server.json").read_text())
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert summary["classes"].get("fine", 0) + summary["classes"].get("closed", 0) == 60
    assert summary["idle"]["health"][0] == 200 and summary["exit_status"] == 0
    # the requests reached every path: generations, refusals, the other endpoints
    kinds = {w.split(" ")[0] for w in summary["what"]}
    assert {"completion", "chat", "raw"} <= kinds
