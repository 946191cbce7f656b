"""Where the build reads and writes: the checkout, the package's native folder, the cache; and one build per folder.

Read as module attributes (``paths.VENDOR``), so that a test can point the build at a copy of ``vendor/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor"
PACKAGE = ROOT / "ggml_hybrid"
NATIVE = PACKAGE / "_native"
# The unpatched pin's CPU backend library, for the test that loads it into our ggml-base (--pin-cpu)
PIN_CPU_DIR = ROOT / "build" / "pin-cpu"


def _load_native(name: str) -> ModuleType:
    # loaded by path: the package itself cannot be imported before it is built
    spec = importlib.util.spec_from_file_location(f"_ggml_hybrid_{name}", NATIVE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# The fingerprints of the sources (the patch series, the cdef, our C) that the package checks again at import.
info = _load_native("buildinfo")


def cache_root() -> Path:
    env = os.environ.get("GGML_HYBRID_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ggml-hybrid"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One build of ``path`` at a time: a second one waits, then finds the first one's result. Builds of other
    folders (another option set, the CUDA backend) go on meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
