"""The first build's progress on the user's terminal (issue 34): pip captures the build's output, so the build
writes its stages and the compile's file count to the controlling terminal, and keeps the full output on
stderr (what ``pip -v`` shows)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from ggml_hybrid_build import progress

ROOT = Path(__file__).resolve().parents[1]
FAKE_NINJA = ("import sys\n"
              "for i in range(1, 6):\n"
              "    print(f'[{i}/5] Building C object ggml/src/f{i}.c.o', flush=True)\n"
              "print('linking done', flush=True)\n"
              "sys.exit(int(sys.argv[1]))\n")


def test_compile_progress_is_counted_on_the_terminal_and_the_output_kept(capfd):
    tty = io.StringIO()
    progress.run_with_progress([sys.executable, "-c", FAKE_NINJA, "0"], "compiling GGML", tty=tty)
    shown = tty.getvalue()
    assert "compiling GGML: 5/5 files (100%)" in shown and shown.endswith("\n")
    assert "ggml/src/f3.c.o" not in shown  # the terminal gets the count, not the compiler's lines
    err = capfd.readouterr().err
    assert all(f"[{i}/5] Building C object" in err for i in range(1, 6)) and "linking done" in err
    with pytest.raises(subprocess.CalledProcessError):
        progress.run_with_progress([sys.executable, "-c", FAKE_NINJA, "3"], "compiling GGML", tty=io.StringIO())


def test_a_stage_goes_to_the_log_and_the_terminal(capfd):
    tty = io.StringIO()
    progress.stage("configuring GGML with CMake", tty=tty)
    assert "configuring GGML with CMake" in tty.getvalue() and tty.getvalue().startswith("[ggml-hybrid build ")
    assert "[ggml-hybrid build] configuring GGML with CMake" in capfd.readouterr().err


def test_with_stderr_captured_the_stages_reach_the_controlling_terminal():
    """As under pip: stderr a pipe, the terminal the process's controlling one; the stage shows on it."""
    master, slave = pty.openpty()
    code = "from ggml_hybrid_build import progress\nprogress.stage('compiling GGML on 2 cores')\n"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    seen = b""
    end = time.monotonic() + 60
    while time.monotonic() < end and b"compiling GGML on 2 cores" not in seen:
        r, _, _ = select.select([master], [], [], 1)
        if r:
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    err = proc.communicate(timeout=60)[1]
    os.close(master)
    assert proc.returncode == 0, err
    assert b"compiling GGML on 2 cores" in seen
    assert b"[ggml-hybrid build] compiling GGML on 2 cores" in err


def test_without_a_terminal_nothing_is_opened():
    """No controlling terminal (CI): the stages are only logged."""
    code = "from ggml_hybrid_build import progress\nprint(progress.terminal() is None)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, start_new_session=True,
                       stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
