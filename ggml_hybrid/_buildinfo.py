"""Fingerprints of what the native module is built from.

Pure Python and free of imports from the package, so that ``build.py`` can load
it by path before the package exists, and the package can check at import that
the compiled module matches the sources next to it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CDEF_DIR = PACKAGE_DIR / "_cdef"
# Declarations of functions that only exist once our patch series is applied.
CDEF_PATCHED_DIR = CDEF_DIR / "patched"
# Present in a source checkout (editable install), absent from a wheel.
REPO_DIR = PACKAGE_DIR.parent
VENDOR_DIR = REPO_DIR / "vendor"


def _digest(parts: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def patch_files(vendor_dir: Path = VENDOR_DIR) -> list[Path]:
    """The patch series in the order it is applied (numbered file names)."""
    return sorted((vendor_dir / "patches").glob("*.patch"))


def patch_series_hash(vendor_dir: Path = VENDOR_DIR) -> str:
    return _digest([(p.name, p.read_bytes()) for p in patch_files(vendor_dir)])


def cdef_files(patched: bool = True) -> list[Path]:
    """cdef headers in the fixed order they are concatenated in."""
    files = sorted(CDEF_DIR.glob("*.h"))
    if patched:
        files += sorted(CDEF_PATCHED_DIR.glob("*.h"))
    return files


def cdef_hash(patched: bool = True) -> str:
    return _digest([(p.name, p.read_bytes()) for p in cdef_files(patched)])


def load_pin(vendor_dir: Path = VENDOR_DIR) -> dict:
    return json.loads((vendor_dir / "pin.json").read_text())
