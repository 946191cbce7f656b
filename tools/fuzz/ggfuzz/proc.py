"""Running one fuzz case in its own process, with a time limit, and classifying what came out.

Two ways to run a command line of ``ggml-hybrid``:

- ``fork``: a child forked from this (already importing) process calls the CLI's ``main``; the
  import cost is paid once, so thousands of cases fit in minutes. The parent must hold no threads
  when it forks (it only imports; models are generated in a separate process).
- ``subprocess``: the real ``ggml-hybrid`` console script in a fresh interpreter, exactly as a user
  runs it. Every failure found in fork mode is run again this way before it is reported.

Both put the child in its own process group (a timeout kills the group), cap its address space
(a runaway allocation becomes a MemoryError, not a dead machine) and write stdout and stderr to
files (no pipe to fill).
"""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GiB = 1 << 30
# what the classes mean; every case ends in exactly one
CLASSES = {
    "fine": "ran, or stopped with one 'error:' line and exit status 2 (interrupted: also exit 130 or SIGINT)",
    "traceback": "a Python traceback on stderr (uncaught, or 'Exception ignored')",
    "signal": "killed by a signal (SIGSEGV, SIGABRT, SIGBUS, ...)",
    "hang": "still running at the time limit (killed)",
    "nonfinite": "exit status 0 with NaN or infinite logits in --logits-out",
    "data_loss": "the command changed a file it should only read (the model)",
    "wrong_output": "exit status 0 with logits that differ from an undisturbed run",
    "untyped": "the Python API raised an exception that is not a ggml-hybrid error",
    "unclear": "any other outcome: an unexpected exit status, or stderr that is not one 'error:' line",
}
BAD = tuple(c for c in CLASSES if c != "fine")


@dataclass
class Outcome:
    rc: int | None          # exit status; negative: the signal; None: killed at the time limit
    seconds: float
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.rc is None


def cli_command() -> list[str]:
    """The ``ggml-hybrid`` console script of this interpreter's environment (or an equivalent -c line)."""
    script = os.path.join(os.path.dirname(sys.executable), "ggml-hybrid")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from ggml_hybrid.cli import main; sys.argv[0] = 'ggml-hybrid'; main()"]


def child_env() -> dict[str, str]:
    # no gdb backtrace on a GGML abort (slow), no BLAS threads (fork safety)
    return dict(os.environ, GGML_NO_BACKTRACE="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _limit_memory(mem_limit: int) -> None:
    if mem_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))


def _read(path: str, limit: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def run_forked(target: Callable[[], object], workdir: str, timeout: float, mem_limit: int = 8 * GiB) -> Outcome:
    """Run ``target()`` in a forked child (cwd ``workdir``); its return value or SystemExit code is the status."""
    out_path, err_path = os.path.join(workdir, "stdout.txt"), os.path.join(workdir, "stderr.txt")
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        code = 1
        try:
            os.setpgid(0, 0)
            os.chdir(workdir)
            faulthandler.disable()  # the parent's (pytest's) would report the child's crash on the parent's stderr
            for fd, path in ((1, out_path), (2, err_path)):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            # the parent's sys.stdout/stderr may not be the descriptors (pytest replaces them)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # strict, as Python does
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _limit_memory(mem_limit)
            try:
                rv = target()
                code = rv if isinstance(rv, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # what the interpreter would print for an uncaught exception
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return _wait(pid, t0, timeout, out_path, err_path)


def _wait(pid: int, t0: float, timeout: float, out_path: str, err_path: str) -> Outcome:
    rc: int | None = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - t0 > timeout:
            _kill_group(pid)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    return Outcome(rc, time.monotonic() - t0, _read(out_path), _read(err_path))


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            return
        except ProcessLookupError:
            continue


def start_subprocess(args: list[str], workdir: str, mem_limit: int = 8 * GiB) -> subprocess.Popen[bytes]:
    """Start ``ggml-hybrid ARGS`` in its own session (a process group of its own), outputs to files in workdir."""
    out = open(os.path.join(workdir, "stdout.txt"), "wb")
    err = open(os.path.join(workdir, "stderr.txt"), "wb")
    try:
        return subprocess.Popen(cli_command() + args, cwd=workdir, stdout=out, stderr=err, env=child_env(),
                                start_new_session=True, preexec_fn=lambda: _limit_memory(mem_limit))
    finally:
        out.close()
        err.close()


def finish_subprocess(p: subprocess.Popen[bytes], workdir: str, t0: float, timeout: float) -> Outcome:
    """Wait for ``p`` up to ``timeout`` seconds after ``t0``; kill its group past that."""
    try:
        p.wait(timeout=max(0.0, timeout - (time.monotonic() - t0)))
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        _kill_group(p.pid)
        p.wait()
        rc = None
    return Outcome(rc, time.monotonic() - t0, _read(os.path.join(workdir, "stdout.txt")),
                   _read(os.path.join(workdir, "stderr.txt")))


def run_subprocess(args: list[str], workdir: str, timeout: float, mem_limit: int = 8 * GiB) -> Outcome:
    t0 = time.monotonic()
    return finish_subprocess(start_subprocess(args, workdir, mem_limit), workdir, t0, timeout)


def run_cli(args: list[str], workdir: str, timeout: float, how: str = "fork", mem_limit: int = 8 * GiB) -> Outcome:
    """``ggml-hybrid ARGS`` in ``workdir``, forked (``how="fork"``) or as a fresh process (``"subprocess"``)."""
    if how == "subprocess":
        return run_subprocess(args, workdir, timeout, mem_limit)

    def target() -> object:
        from ggml_hybrid.cli import main

        sys.argv = ["ggml-hybrid", *args]
        return main(args, prog_name="ggml-hybrid")

    return run_forked(target, workdir, timeout, mem_limit)


# -- classification ------------------------------------------------------------------------------

def has_traceback(stderr: str) -> bool:
    return "Traceback (most recent call last)" in stderr or "Exception ignored" in stderr


# GGML's own diagnostic with check_tensors (ggml_validate_row_data prints the block it refused, as in llama.cpp)
GGML_DIAGNOSTIC = "ggml_validate_row_data: "


def one_error_line(stderr: str) -> bool:
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(GGML_DIAGNOSTIC)]
    return len(lines) == 1 and lines[0].startswith("error: ")


def logits_finite(path: str) -> bool | None:
    """Whether the .npy at ``path`` holds only finite values; None when there is no readable file."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return bool(np.isfinite(arr).all()) if arr.dtype.kind == "f" else None


def classify(o: Outcome, logits_path: str | None = None, interrupted: bool = False) -> str:
    """The class of one command's outcome (see :data:`CLASSES`).

    ``interrupted``: the command was sent SIGINT, so dying of SIGINT (what Ctrl-C does to a process
    that has not set up its handler yet) is fine, as are exit status 130 (the CLI's Ctrl-C exit, after
    the stats of what ran, as llama.cpp) and stopping with one 'error:' line.
    """
    if o.timed_out:
        return "hang"
    if has_traceback(o.stderr):
        return "traceback"
    assert o.rc is not None
    if o.rc < 0:
        return "fine" if interrupted and o.rc == -signal.SIGINT else "signal"
    if o.rc == 0:
        if logits_path is not None and os.path.exists(logits_path) and logits_finite(logits_path) is False:
            return "nonfinite"
        return "fine"
    if o.rc == 2 and (one_error_line(o.stderr) or interrupted and "error: " in o.stderr):
        return "fine"
    if o.rc == 130 and interrupted:
        return "fine"
    return "unclear"


def run_checked(args: list[str], workdir: str, timeout: float, how: str = "fork", logits: str | None = None,
                mem_limit: int = 8 * GiB) -> dict[str, object]:
    """Run and classify ``ggml-hybrid ARGS``; a failure found forked is run again as a fresh process, whose
    class is the one reported (``fork_class`` keeps the first)."""
    o = run_cli(args, workdir, timeout, how, mem_limit)
    cls = classify(o, os.path.join(workdir, logits) if logits else None)
    rec: dict[str, object] = {"class": cls, "rc": o.rc, "seconds": round(o.seconds, 3), "stderr": o.stderr[-1500:],
                              "args": args}
    if cls != "fine" and how == "fork":
        if logits and os.path.exists(os.path.join(workdir, logits)):
            os.unlink(os.path.join(workdir, logits))
        o2 = run_cli(args, workdir, timeout, "subprocess", mem_limit)
        rec.update({"fork_class": cls, "class": classify(o2, os.path.join(workdir, logits) if logits else None),
                    "rc": o2.rc, "seconds": round(o2.seconds, 3), "stderr": o2.stderr[-1500:]})
    return rec


def worst(classes: list[str]) -> str:
    """The most serious class of several (the order of :data:`CLASSES`, 'fine' last)."""
    order = list(CLASSES)[1:] + ["fine"]
    return min(classes, key=order.index) if classes else "fine"


__all__ = ["BAD", "CLASSES", "Outcome", "classify", "cli_command", "finish_subprocess", "has_traceback",
           "logits_finite", "one_error_line", "run_checked", "run_cli", "run_forked", "run_subprocess",
           "start_subprocess", "worst"]
