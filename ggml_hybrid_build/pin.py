"""The pinned GGML source: the registry archive ``vendor/pin.json`` names, fetched once with pip and checked against
its sha256, and the GGML folder inside it."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from . import paths, progress


def fetch_archive(pin: dict[str, Any]) -> Path:
    """The pinned sdist, downloaded once and checked against its sha256."""
    downloads = paths.cache_root() / "downloads"
    archive = downloads / pin["archive"]
    with paths.locked(archive):
        return _fetch_archive(pin, archive)


def _fetch_archive(pin: dict[str, Any], archive: Path) -> Path:
    if not archive.exists() or sha256(archive) != pin["sha256"]:
        with tempfile.TemporaryDirectory() as tmp:
            # `--no-binary NAME` rather than `:all:`: with `:all:` pip would also
            # build the sdist's build requirements (cmake) from source.
            progress.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin["package"],
                          f"{pin['package']}=={pin['version']}", "-d", tmp])
            got = Path(tmp) / pin["archive"]
            if not got.exists():
                raise SystemExit(f"pip did not produce {pin['archive']} (got {os.listdir(tmp)})")
            shutil.move(str(got), archive)
    digest = sha256(archive)
    if digest != pin["sha256"]:
        archive.unlink()
        raise SystemExit(f"sha256 mismatch for {pin['archive']}: expected {pin['sha256']}, got {digest}")
    return archive


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_ggml(pin: dict[str, Any], dest: Path, keep: Callable[[str], bool] = lambda rel: True) -> None:
    """The files (and folders) of the archive's GGML folder whose path relative to it ``keep`` accepts, into dest."""
    prefix = pin["ggml_path"].rstrip("/") + "/"
    with tarfile.open(fetch_archive(pin)) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(prefix):]
            if m.name.startswith(prefix) and rel and (m.isfile() or m.isdir()) and keep(rel):
                m.name = rel
                members.append(m)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            # a Python before the extraction filters (3.10.12, 3.11.4): Debian bookworm's 3.11.2 among them. The
            # members are regular files and folders already; refuse, as the data filter does, a name leaving dest
            for m in members:
                if PurePosixPath(m.name).is_absolute() or ".." in PurePosixPath(m.name).parts:
                    raise SystemExit(f"{pin['ggml_path']}/{m.name} in {pin.get('archive', 'the pinned archive')}: "
                                     "a member's path must stay inside the folder it is extracted to")
            tar.extractall(dest, members=members)
