#!/usr/bin/env python3
"""How far llama.cpp's logits on one CPU are from its logits on another: every fixture that has a variant for
another simd tag (``tools/make_reference_fixtures.py``), per logits key, against the base recording.

    python tools/simd_differences.py [--fixtures tests/fixtures]

Prints, per fixture and per tag, the max over positions of max|a - b| / max|b| (the tests' measure) of each logits
key, and the max per weight type: what the tests' tolerances for a CPU with an unknown tag are set from
(``TOLERANCE`` in tests/test_lm.py, ``OTHER_CPU`` in tests/test_converted.py; see docs/models.md).
"""

from __future__ import annotations

import glob
import json
import os

import click
import numpy as np
from make_reference_fixtures import load_for_cpu, variant_paths

CONVERTED_TYPES = ("f32", "f16", "q8_0", "q4_k_m")


def rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(a - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())


def differences(base_path: str) -> dict[str, dict[str, float]]:
    """tag -> logits key -> relative difference from the base, for every variant of ``base_path``."""
    base, _ = load_for_cpu(base_path, str(np.load(base_path)["simd"]))
    out: dict[str, dict[str, float]] = {}
    for var in variant_paths(base_path):
        with np.load(var) as v:
            tag, keys = str(v["simd"]), [k[4:] for k in v.files if k.startswith("xor_")]
        other, _ = load_for_cpu(base_path, tag)
        out[tag] = {k: rel(other[k], base[k]) for k in keys}
    return out


def _line(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in d.items())


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--fixtures", default=os.path.join("tests", "fixtures"), show_default=True)
def main(fixtures: str) -> None:
    worst: dict[str, float] = {}
    for path in sorted(glob.glob(os.path.join(fixtures, "llama_ref", "*.npz"))):
        wtype = json.loads(str(np.load(path)["spec"]))["weight_type"]
        for tag, d in differences(path).items():
            print(f"llama_ref/{os.path.basename(path)[:-4]} ({wtype}) [{tag}]: {_line(d)}")
            worst[f"llama_ref {wtype}"] = max(worst.get(f"llama_ref {wtype}", 0.0), *d.values())
    for path in sorted(glob.glob(os.path.join(fixtures, "converted", "*.npz"))):
        for tag, d in differences(path).items():
            print(f"converted/{os.path.basename(path)[:-4]} [{tag}]: {_line(d)}")
            for t in CONVERTED_TYPES:
                got = [v for k, v in d.items() if k.startswith(f"{t}_")]
                worst[f"converted {t}"] = max(worst.get(f"converted {t}", 0.0), *got)
    print("max per weight type:")
    for k, v in sorted(worst.items()):
        print(f"  {k}: {v:.3g}")


if __name__ == "__main__":
    main()
