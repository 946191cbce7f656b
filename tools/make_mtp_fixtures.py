#!/usr/bin/env python3
"""llama.cpp's next-token-prediction (MTP) draft head on converter-made files, as test fixtures.

    python tools/make_mtp_fixtures.py --llama-python /opt/llref/bin/python \
        [--conv-python PY --llama-cpp SDIST/vendor/llama.cpp] [--family glm4moe ...] [--out tests/fixtures/mtp]

For every family whose pinned llama.cpp runs an MTP head (``qwen35moe``, ``qwen3next``, ``glm4moe``: the converted
fixtures' own files, ``tests/fixtures/converted``; ``glm47flash``: GLM-4.7-Flash's layout, the one converter that
writes a deepseek2 file with a head, made here by ``tools/converted/hf_side.py`` and the pinned converter at F32
and Q8_0 into ``--out``, which needs ``--conv-python`` and ``--llama-cpp``), at F32 and Q8_0:
``tools/llama_mtp_reference.py`` runs the target and the MTP context on the prompt of the converted fixtures, and
``FAMILY.npz`` keeps what the tests compare against (small: a few positions' logits):

- ``tokens``, ``positions`` (the rows kept), ``simd`` (this CPU's tag; the variants mechanism of
  ``tools/make_reference_fixtures.py``), per type ``{t}_sha256`` (of the file) and ``{t}_file`` (its path under
  ``tests/fixtures``);
- ``{t}_target_h`` [T, n_embd]: the target's hidden state (``h_nextn``) of every position;
- ``{t}_target_logits`` and ``{t}_mtp_logits`` [positions, n_vocab]: the target's and the head's logits there (the
  head over the prompt in one batch, position p pairing x_p with h_{p-1});
- ``{t}_draft_tokens`` [3] and ``{t}_draft_logits`` [3, n_vocab]: three draft steps after the prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import click
import numpy as np
from make_converted_fixtures import PROMPT, convert_family
from make_reference_fixtures import simd_tag

from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.text.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")
CONVERTED = ("glm4moe", "qwen35moe", "qwen3next")  # files of tests/fixtures/converted
MADE = ("glm47flash",)  # files made here
FAMILIES = CONVERTED + MADE
TYPES = ("f32", "q8_0")
DRAFT = 3


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def positions(n: int) -> list[int]:
    return sorted({0, 1, 2, n // 2, n - 2, n - 1})


def record(family: str, files: dict[str, str], llama_py: str, out: str, tmp: str) -> None:
    store = GGUFStore(files["f32"])
    try:
        tokens = Tokenizer.from_gguf(store).encode(PROMPT)
    finally:
        store.close()
    keep = positions(len(tokens))
    rec: dict = {"family": family, "tokens": np.asarray(tokens, np.int32), "positions": np.asarray(keep, np.int32),
                 "simd": simd_tag()}
    for t, path in files.items():
        dst = os.path.join(tmp, f"{family}-{t}.npz")
        r = subprocess.run([llama_py, os.path.join(HERE, "llama_mtp_reference.py"), path, "--tokens",
                            ",".join(map(str, tokens)), "--draft", str(DRAFT), "--out", dst],
                           capture_output=True, text=True, check=False)
        if r.returncode:
            raise SystemExit(f"llama_mtp_reference failed on {path}:\n{r.stderr[-4000:]}")
        info = json.loads(r.stdout.strip().splitlines()[-1])
        z = np.load(dst)
        rec.update({f"{t}_sha256": sha256(path), f"{t}_file": os.path.relpath(path, FIXTURES),
                    f"{t}_target_h": z["target_h"], f"{t}_target_logits": z["target_logits"][keep],
                    f"{t}_mtp_logits": z["mtp_logits"][keep], f"{t}_draft_tokens": z["draft_tokens"],
                    f"{t}_draft_logits": z["draft_logits"]})
        rec["llama_cpp_python"] = info["llama_cpp_python"]
    dst = os.path.join(out, f"{family}.npz")
    np.savez_compressed(dst, **rec)
    print(f"{family}: {len(tokens)} tokens, {os.path.getsize(dst)} bytes")


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python==0.3.36")
@click.option("--conv-python", help="a Python with torch, transformers, tokenizers (for glm47flash)")
@click.option("--llama-cpp", help="vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist (for glm47flash)")
@click.option("--out", default=os.path.join(FIXTURES, "mtp"), show_default=True)
@click.option("--family", "families", multiple=True, type=click.Choice(FAMILIES), help="only these (repeat)")
def main(llama_python: str, conv_python: str | None, llama_cpp: str | None, out: str,
         families: tuple[str, ...]) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in families or FAMILIES:
            if family in MADE:
                if not conv_python or not llama_cpp:
                    raise click.UsageError(f"{family}: --conv-python and --llama-cpp make its files")
                convert_family(family, {"conv_python": conv_python, "llama_cpp": llama_cpp}, tmp)
                files = {}
                for t in TYPES:
                    files[t] = os.path.join(out, f"{family}-{t}.gguf")
                    shutil.copyfile(os.path.join(tmp, f"{family}-{t}.gguf"), files[t])
            else:
                files = {t: os.path.join(FIXTURES, "converted", f"{family}-{t}.gguf") for t in TYPES}
            record(family, files, llama_python, out, tmp)


if __name__ == "__main__":
    main()
