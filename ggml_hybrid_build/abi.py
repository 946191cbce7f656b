"""The binary interface a backend library sees, and what follows from it: ggml-base's ABI stamp and the patches each
optional backend's source gets.

A backend library is built once per pin: from the pin's source and its own patches only, stamped with the pin's ABI,
as long as the patch series leaves what a backend takes from ggml-base's headers as the pin has it (the probe:
``abiprobe``). A patch that changes it (a struct's layout, an enum member's value, a function's signature, an inline
function) gives ggml-base the series' stamp, and each backend is then built with ggml-base's patches too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import abiprobe, paths, progress
from . import patches as series
from . import pin as pin_source


def header_tree(vendor: Path, patches: list[Path], dest: Path) -> None:
    """GGML's headers (include/*.h, src/*.h) of the pin in dest, with the header parts of ``patches`` applied."""
    pin_source.extract_ggml(paths.info.load_pin(vendor), dest, series.probed_header)
    series.patch_headers(dest, patches)


def pin_headers(vendor: Path | None = None) -> Path:
    """The pin's headers, unpatched, extracted once into the cache (reading the archive takes seconds)."""
    pin = paths.info.load_pin(vendor or paths.VENDOR)
    where = paths.cache_root() / "abi" / f"headers-{pin['ggml_version']}-{pin['sha256'][:16]}"
    with paths.locked(where):
        if not (where / "DONE").exists():
            shutil.rmtree(where, ignore_errors=True)
            header_tree(vendor or paths.VENDOR, [], where)
            (where / "DONE").write_text(pin["archive"] + "\n")
    return where


def abi_verdict(vendor: Path | None = None, fresh: bool = False) -> dict[str, Any]:
    """Whether the patch series keeps the interface a backend library takes from ggml-base's headers as the pin has
    it: ``abiprobe.compare`` of the pin's headers and the patched ones. Cached by the pin, the series' patches of
    ggml-base and the probe, so a build with nothing new only reads a file. Returns {"compatible", "differences",
    "checked" (items), "seconds" (the probe's time when it ran)}."""
    vendor = vendor or paths.VENDOR
    info = paths.info
    base = [p for p in info.patch_files(vendor) if info.touches_ggml_base(p)]
    h = hashlib.sha256((vendor / "pin.json").read_bytes())
    h.update(info.patches_hash(base).encode())
    h.update(Path(abiprobe.__file__).read_bytes())
    cached = paths.cache_root() / "abi" / f"{h.hexdigest()[:16]}.json"
    if cached.exists() and not fresh:
        return dict(json.loads(cached.read_text()))
    with paths.locked(cached):
        if cached.exists() and not fresh:
            return dict(json.loads(cached.read_text()))
        result = _probe(vendor, base)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _probe(vendor: Path, base: list[Path]) -> dict[str, Any]:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        pin_tree, patched_tree = pin_headers(vendor), Path(tmp) / "patched"
        shutil.copytree(pin_tree, patched_tree)
        series.patch_headers(patched_tree, base)
        try:
            verdict = abiprobe.compare(pin_tree, patched_tree)
        except abiprobe.ProbeError as e:  # the safe side: backends built with ggml-base's patches, as before
            verdict = abiprobe.Verdict([f"the ABI probe could not run: {e}"], 0, 0.0)
    result = {"compatible": verdict.compatible, "differences": verdict.differences, "checked": verdict.checked,
              "seconds": round(time.monotonic() - t0, 3), "probe_seconds": round(verdict.seconds, 3),
              "patches": [p.name for p in base]}
    if verdict.compatible:
        progress.log(f"ABI probe: the patch series keeps the interface of the pin's headers ({verdict.checked} "
                     f"items, {result['seconds']:.1f} s): backend libraries are built from the pin")
    else:
        progress.log("ABI probe: the patch series changes the interface of the pin's headers, so backend libraries "
                     "are built with ggml-base's patches:\n  " + "\n  ".join(verdict.differences[:20]))
    return result


def abi_stamp(vendor: Path | None = None) -> str:
    """ggml-base's ABI stamp: the pin's while the series keeps the pin's interface (a backend library built from
    the pin loads), else the pin's and the series' patches of ggml-base."""
    vendor = vendor or paths.VENDOR
    info = paths.info
    return str(info.pin_abi_stamp(vendor) if abi_verdict(vendor)["compatible"] else info.series_abi_stamp(vendor))


def backend_patches(name: str, vendor: Path | None = None) -> list[Path]:
    """The patches an optional backend's source gets: its own (src/ggml-NAME/, include/ggml-NAME.h), and those of
    ggml-base only when the series changes the pin's interface (or one of its own reaches ggml-base too). A patch
    of the CPU backend or another backend never reaches it."""
    vendor = vendor or paths.VENDOR
    info = paths.info
    every = info.patch_files(vendor)
    own = [p for p in every if info.touches_backend(p, name)]
    if abi_verdict(vendor)["compatible"] and not any(info.touches_ggml_base(p) for p in own):
        return list(own)
    return [p for p in every if p in own or info.touches_ggml_base(p)]


def abi_stamp_of(patches: list[Path], vendor: Path | None = None) -> str:
    """The stamp of a backend built from the pin with ``patches``: the pin's when they leave ggml-base as the pin
    has it, else ggml-base's."""
    vendor = vendor or paths.VENDOR
    info = paths.info
    return str(info.pin_abi_stamp(vendor)) if not any(info.touches_ggml_base(p) for p in patches) \
        else abi_stamp(vendor)
