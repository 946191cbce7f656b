"""Output files: never one of the inputs, and written whole or not at all.

Every file the package writes (``--logits-out``, routing traces) goes through here. An output that
names an input (the model file itself, or a link to it) is refused before anything is opened:
truncating a memory-mapped model under a running process kills it (SIGBUS) and destroys the file.
Data is written to a temporary file in the destination's folder and renamed over the destination
only when complete, so a full disk, an error or an interrupt leaves the old file (or none), never
a truncated one.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO

from .errors import ArgumentError


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: the same device and inode, or the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a regular file ("does not exist", "is a directory", ...), or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (a part of the path is not a directory)"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    except ValueError:  # os.stat refuses a path with a NUL byte
        return "is not a valid path (it holds a NUL byte)"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a device, FIFO or socket)"
    return None


def check_output(path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]], what: str) -> str:
    """``path`` as a string, if it can be written as an output: not an input, not a directory or device."""
    path = os.fspath(path)
    for src in inputs:
        if same_file(path, src):
            raise ArgumentError(f"{what} {path!r} is the input file {os.fspath(src)!r}; writing it would destroy "
                                "the input: choose another path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _check_folder(path, what)  # checked now, not after a whole run
        return path
    except NotADirectoryError:
        raise ArgumentError(f"{what} {path!r} cannot be written: a part of the path is not a directory") from None
    except OSError as exc:
        raise ArgumentError(f"{what} {path!r} cannot be written: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ArgumentError(f"{what} {path!r} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise ArgumentError(f"{what} {path!r} is not a regular file (a device, FIFO or socket)")
    return path


def _check_folder(path: str, what: str) -> None:
    """The folder a new output goes in exists and this process may create files in it."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ArgumentError(f"{what} {path!r} cannot be written: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ArgumentError(f"{what} {path!r} cannot be written: the folder {folder!r} is not writable")


def _mode_for(path: str) -> int:
    """The permissions the replaced file had, or a new file's under the process umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class AtomicFile:
    """A temporary file next to ``path``; :meth:`commit` renames it over ``path``, :meth:`discard` removes it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        fd, self.tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(self.path)}.", suffix=".tmp")
        self.file: IO[bytes] | None = os.fdopen(fd, "wb")

    def commit(self) -> None:
        f, self.file = self.file, None
        if f is None:
            return
        try:
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), _mode_for(self.path))  # mkstemp's 0600 would outlive the rename
            f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            f.close()
            self._remove()
            raise

    def discard(self) -> None:
        f, self.file = self.file, None
        if f is not None:
            f.close()
            self._remove()

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """``with atomic_write(p) as f: ...``: ``p`` is replaced by what was written, or left as it was."""
    out = AtomicFile(path)
    try:
        assert out.file is not None
        yield out.file
    except BaseException:
        out.discard()
        raise
    out.commit()


__all__ = ["AtomicFile", "atomic_write", "check_output", "not_a_file", "same_file"]
