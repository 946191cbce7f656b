"""The build's log (stderr, what ``pip -v`` shows) and its progress on the user's terminal.

pip runs the build with its output captured (shown only with -v), so a first install would be silent for minutes:
the stages, and the compile's progress, also go to the terminal (/dev/tty) when there is one.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from typing import Any, TextIO

_NINJA_STATUS = re.compile(rb"^\[(\d+)/(\d+)\] ")
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[ggml-hybrid build] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> None:
    """A command of the build, logged; a failure raises ``CalledProcessError``."""
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def terminal() -> TextIO | None:
    """The controlling terminal to write progress to, when stderr is not already it (pip captures stderr);
    None without one (CI, a pipe)."""
    if sys.stderr.isatty():
        return None
    try:
        return open("/dev/tty", "w", encoding="utf-8", errors="replace")
    except OSError:
        return None


def _elapsed() -> str:
    s = int(time.monotonic() - _T0)
    return f"{s // 60}:{s % 60:02d}"


def stage(msg: str, tty: TextIO | None = None) -> None:
    """A step a user waits on: logged, and shown on the terminal with the time since the build began."""
    log(msg)
    own = tty is None
    tty = terminal() if own else tty
    if tty is not None:
        with contextlib.suppress(OSError):
            tty.write(f"[ggml-hybrid build {_elapsed()}] {msg}\n")
            tty.flush()
        if own:
            tty.close()


def run_with_progress(cmd: list[str], what: str, tty: TextIO | None = None) -> None:
    """``run(cmd)`` for a Ninja/Make build, its ``[done/total]`` lines counted on the terminal as one line."""
    own = tty is None
    tty = terminal() if own else tty
    if tty is None:
        run(cmd)
        return
    log("$ " + " ".join(str(c) for c in cmd))
    shown = 0.0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.buffer.write(line)  # the full output stays where pip -v shows it
            m = _NINJA_STATUS.match(line)
            now = time.monotonic()
            if m and (now - shown > 0.5 or m.group(1) == m.group(2)):
                done, total = int(m.group(1)), int(m.group(2))
                with contextlib.suppress(OSError):
                    tty.write(f"\r[ggml-hybrid build {_elapsed()}] {what}: {done}/{total} files "
                              f"({100 * done // total}%)\x1b[K")
                    tty.flush()
                shown = now
    with contextlib.suppress(OSError):
        tty.write("\n" if shown else "")
        tty.flush()
    if own:
        tty.close()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
