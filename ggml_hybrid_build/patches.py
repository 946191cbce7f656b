"""The patch series applied: to a whole GGML source tree, or (their header parts) to a tree of GGML's headers."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import pin as pin_source
from . import progress


def apply(tree: Path, patches: list[Path]) -> None:
    """``patches`` applied in order inside the GGML folder ``tree`` (``patch -p1``; a patch in ``git format-patch``
    form carries its message ahead of the diff, which ``patch`` passes over)."""
    for p in patches:
        progress.log(f"applying {p.name}")
        progress.run(["patch", "-p1", "--forward", "--batch", "-s", "-d", str(tree), "-i", str(p)])


def prepare_source(pin: dict[str, Any], dest: Path, patches: list[Path] | None) -> None:
    """Extract GGML from the archive into dest and apply ``patches`` (None or []: none); dest appears whole or not at
    all."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pin_source.extract_ggml(pin, tmp)
    apply(tmp, patches or [])
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def header_sections(patch_text: str, keep: Callable[[str], bool]) -> str:
    """The parts of a unified diff (``git diff``'s or plain) whose file, relative to GGML's folder, ``keep`` accepts."""
    lines = patch_text.splitlines(keepends=True)
    git = any(line.startswith("diff --git ") for line in lines)
    out, take = [], False
    for i, line in enumerate(lines):
        if git and line.startswith("diff --git "):
            take = keep(line.split()[-1].split("/", 1)[-1])  # b/PATH
        elif not git and line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            take = keep(path.split("/", 1)[-1])
        if take:
            out.append(line)
    return "".join(out)


def probed_header(path: str) -> bool:
    """A header of ggml-base that the ABI probe reads (``include/*.h``, ``src/*.h``, relative to GGML's folder)."""
    return bool(re.fullmatch(r"(include|src)/[^/]+\.h", path))


def patch_headers(tree: Path, patches: list[Path]) -> None:
    """Apply the header parts of ``patches`` to a tree of GGML's headers."""
    for p in patches:
        part = header_sections(p.read_text(errors="replace"), probed_header)
        if part:
            progress.run(["patch", "-p1", "--forward", "--batch", "-s", "-d", str(tree)], input=part.encode())
