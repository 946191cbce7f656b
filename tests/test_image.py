"""The Containerfile's image, built by ``tools/build_image.sh`` (buildah, no daemon) and run here with ``buildah run``
(chroot isolation: the host's network, so its ports are loopback ports of this machine): its entry point answers both
commands' ``--help``; its ``rpc-server`` serves this checkout's leader (the logits checked against the leader's own
CPU); its ``serve`` answers ``/health`` and a greedy completion as this checkout's ``serve`` does, for a generated model
mounted read-only, as the user the image names (not root).

The image is ``GGML_HYBRID_IMAGE`` (default ``localhost/ggml-hybrid:latest``). Not built yet: skipped, saying how to
build it, unless ``--slow``, where the test builds it first with the script (8-9 minutes on 2 cores, docs/rpc.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

ROOT = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("GGML_HYBRID_IMAGE", "localhost/ggml-hybrid:latest")
DRIVER = os.environ.get("STORAGE_DRIVER", "vfs")  # as tools/build_image.sh stores it
CLI = [sys.executable, "-c", "from ggml_hybrid.cli import main; main()"]  # this checkout's ggml-hybrid
START_S = 120  # a process in the image starts (imports the package, loads GGML's CPU variants) within this
PROMPT = "The image serves the same tokens."


def buildah(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", "--storage-driver", DRIVER, *args], capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Container:
    """A working container of the image: commands run through its entry point, as its user."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.entrypoint: list[str] = config.get("Entrypoint") or []
        self.user: str = config.get("User") or "0"

    def argv(self, args: list[str], volumes: dict[Path, str] | None = None) -> list[str]:
        mounts = [a for host, inside in (volumes or {}).items() for a in ("--volume", f"{host}:{inside}:ro")]
        return ["buildah", "--storage-driver", DRIVER, "run", "--isolation", "chroot", "--user", self.user, *mounts,
                self.name, "--", *self.entrypoint, *args]


@pytest.fixture(scope="module")
def container(request) -> Iterator[Container]:
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (Debian: apt-get install buildah): the image is built and run with it")
    if os.geteuid() != 0:
        pytest.skip("buildah runs the image here as root (vfs storage, chroot isolation); this user is not root")
    found = buildah("inspect", "--type", "image", IMAGE)
    if found.returncode != 0:
        if not request.config.getoption("--slow"):
            pytest.skip(f"{IMAGE} is not built: tools/build_image.sh builds it (or pytest --slow, which runs it)")
        subprocess.run(["bash", str(ROOT / "tools" / "build_image.sh"), "--tag", IMAGE], cwd=ROOT, check=True,
                       timeout=3 * 3600)
        found = buildah("inspect", "--type", "image", IMAGE)
        assert found.returncode == 0, found.stderr
    config = json.loads(found.stdout)["OCIv1"]["config"]
    made = buildah("from", "--pull-never", IMAGE)
    assert made.returncode == 0, made.stderr
    c = Container(made.stdout.strip(), config)
    try:
        yield c
    finally:
        buildah("rm", c.name)


@contextmanager
def started(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A process in its own session (buildah and what it runs in the image), ended as a group: Ctrl-C, then kill."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        proc.stderr_file = err  # type: ignore[attr-defined]
        try:
            yield proc
        finally:
            for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 30)):
                if proc.poll() is not None:
                    break
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass


def log(proc: subprocess.Popen[str]) -> str:
    f = proc.stderr_file  # type: ignore[attr-defined]
    f.seek(0)
    return str(f.read())


def wait_listening(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}: {log(proc)}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listened on port {port} within {START_S} s: {log(proc)}"
            time.sleep(0.2)  # a bounded poll for the port


def wait_healthy(proc: subprocess.Popen[str], port: int) -> dict[str, Any]:
    deadline = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode}: {log(proc)}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return dict(json.loads(r.read()))
        except (OSError, urllib.error.HTTPError):  # not listening yet, or 503 while loading
            assert time.monotonic() < deadline, f"/health was not 200 within {START_S} s: {log(proc)}"
            time.sleep(0.2)  # a bounded poll for the model to load


def complete(port: int) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("image")
    path = Path(write_model(d / "m.gguf", n_layer=4, n_expert=8, n_used=2, weight_type="q8_0", seed=31))
    d.chmod(0o755)  # the image's user (not root) reads it through the mount
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("command", ["serve", "rpc-server"])
def test_the_entry_point_runs_both_commands(container, command):
    assert container.entrypoint == ["ggml-hybrid"] and container.user != "0"
    r = subprocess.run(container.argv([command, "--help"]), capture_output=True, text=True, timeout=START_S)
    assert r.returncode == 0 and r.stdout.startswith(f"Usage: ggml-hybrid {command} "), r.stdout + r.stderr


def test_the_images_rpc_server_serves_this_leader(container, model):
    port = free_port()
    with MoEModel(model, SessionOptions(n_threads=1)) as m:
        tokens = m.tokenizer.encode(PROMPT)
        reference = m.eval(tokens, "all")
    with started(container.argv(["rpc-server", "--port", str(port), "--threads", "1"])) as proc:
        wait_listening(proc, port)
        with MoEModel(model, SessionOptions.parse(["n_threads=1", f"rpc=127.0.0.1:{port}"])) as m:
            assert set(m.layout.layer_device) == {"RPC0"} and m.device_memory("RPC0")["weights"] > 0
            got = m.eval(tokens, "all")
        assert proc.poll() is None, log(proc)
    # the image's GGML is another build (every x86-64 level, the best picked at run time) than this checkout's
    # (-march=native): the same kernels where both pick the same level, so the same bits; within float rounding else
    assert np.array_equal(got, reference) or np.allclose(got, reference, rtol=1e-4, atol=1e-4)
    assert np.array_equal(got.argmax(-1), reference.argmax(-1))


def test_the_images_serve_answers_health_and_completes_as_this_checkout(container, model):
    inside, here = free_port(), free_port()
    with started(container.argv(["serve", "/models/m.gguf", "--port", str(inside)], {model.parent: "/models"})) as p:
        health = wait_healthy(p, inside)
        text = complete(inside)
    with started([*CLI, "serve", str(model), "--port", str(here)]) as p:
        wait_healthy(p, here)
        expected = complete(here)
    assert health.get("status") == "ok", health
    assert text == expected and text
