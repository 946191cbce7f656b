#!/usr/bin/env python3
"""Model files made the way users make them, and three oracles on them, as test fixtures.

    python tools/make_converted_fixtures.py --conv-python /opt/conv/bin/python \
        --llama-python /opt/llref/bin/python --llama-cpp SDIST/vendor/llama.cpp [--family qwen2moe ...] \
        [--out tests/fixtures/converted]

For every family (see ``tools/converted/hf_side.py``):

1. a tiny random Hugging Face model made with transformers' own class (``--conv-python``: torch, transformers,
   tokenizers, sentencepiece), its tokenizer trained on a small fixed corpus, with the family's features on;
2. converted by the pinned llama.cpp's ``convert_hf_to_gguf.py`` with its own gguf-py (``--llama-cpp``: the
   ``vendor/llama.cpp`` directory of the llama-cpp-python 0.3.36 sdist, GGML's own) to F32, F16 and Q8_0
   (``tools/converted/run_converter.py``), and the F32 file quantized to Q4_K_M by llama.cpp's quantizer
   (``tools/converted/quantize.py``, ``--llama-python``: llama-cpp-python 0.3.36);
3. llama.cpp's logits for every file (every position; the last position alone; a prompt then one decode call per
   token) and its token ids for the tokenizer texts (``tools/llama_reference.py``, ggml-hybrid's default
   settings), and transformers' float32 logits of the same token ids with its greedy continuation.

Written to ``--out``: ``FAMILY-TYPE.gguf`` (the converter's and the quantizer's files, byte for byte) and
``FAMILY.npz`` (the oracles, the sha256 of each file, the versions). Tests compare against these without torch,
transformers or llama.cpp. The Hugging Face model is seeded, so a rerun gives the same files (checked: the
recorded hashes).

llama.cpp's logits on another CPU (another SIMD tag, see ``make_reference_fixtures``): ``--logits-only`` runs only
step 3's llama.cpp part on the files already in ``--out`` (their hashes checked; no converter, no transformers) and
writes ``simd/TAG/FAMILY.npz`` beside ``FAMILY.npz``, which stays as it is:

    python tools/make_converted_fixtures.py --llama-python /opt/llref/bin/python --logits-only

A full run writes ``FAMILY.npz`` anew with this CPU's tag and removes the family's variants.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import click
import numpy as np
from make_reference_fixtures import Case, reference, sha256, simd_tag, variant_paths, write_simd_variant

from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.text.tokenizer import Tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("qwen2moe", "qwen3moe", "mixtral", "olmoe", "deepseek2", "deepseek3", "glm4moe", "gpt-oss",
            "qwen3next", "qwen35moe")
TYPES = ("f32", "f16", "q8_0", "q4_k_m")
# 20 to 30 tokens: past gpt-oss's sliding window of 8, and several ubatches of 7
PROMPT = "Hello, world! The quick brown fox."
GREEDY = 8
DECODE_FROM = 12
DECODE_TYPES = ("f32", "q4_k_m")  # token-by-token decode recorded for these (the fixtures' size)


def _run(cmd: list[str], what: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"{what} failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _prompt_tokens(path: str) -> list[int]:
    store = GGUFStore(path)
    try:
        return Tokenizer.from_gguf(store).encode(PROMPT)
    finally:
        store.close()


def convert_family(family: str, ns: dict, work: str) -> dict:
    """Steps 1 and 2 (the Hugging Face model, the converter's three files) into ``work``; what exists is kept."""
    conv_py, llama_cpp = ns["conv_python"], ns["llama_cpp"]
    hf = os.path.join(work, family)
    made_json = os.path.join(work, f"{family}.made.json")
    if not os.path.exists(made_json):
        shutil.rmtree(hf, ignore_errors=True)
        made = _last_json(_run([conv_py, os.path.join(HERE, "converted", "hf_side.py"), "make", family, hf],
                               f"making the {family} model"))
        with open(made_json, "w") as f:
            json.dump(made, f)
    with open(made_json) as f:
        made = json.load(f)
    from converted.hf_side import FAMILIES as HF  # the family table only (no torch import)

    for t in ("f32", "f16", "q8_0"):
        dst = os.path.join(work, f"{family}-{t}.gguf")
        if os.path.exists(dst):
            continue
        cmd = [conv_py, os.path.join(HERE, "converted", "run_converter.py"), "--llama-cpp", llama_cpp]
        if HF[family]["pre"]:
            cmd += ["--pre", HF[family]["pre"]]
        _run(cmd + [hf, "--outtype", t, "--outfile", dst + ".part"], f"converting {family} to {t}")
        os.replace(dst + ".part", dst)
    return made


def make_family(family: str, ns: dict, tmp: str, out: str) -> None:
    conv_py, llama_py = ns["conv_python"], ns["llama_python"]
    made = convert_family(family, ns, tmp)
    hf = os.path.join(tmp, family)
    from converted.hf_side import FAMILIES as HF

    files = {t: os.path.join(out, f"{family}-{t}.gguf") for t in TYPES}
    for t in ("f32", "f16", "q8_0"):
        shutil.copyfile(os.path.join(tmp, f"{family}-{t}.gguf"), files[t])
    _run([llama_py, os.path.join(HERE, "converted", "quantize.py"), files["f32"], files["q4_k_m"], "Q4_K_M"],
         f"quantizing {family}")
    tokens = _prompt_tokens(files["f32"])
    rec: dict = {"family": family, "hf_class": HF[family]["cls"], "pre": HF[family]["pre"] or "",
                 "tokens": np.asarray(tokens, np.int32), "simd": simd_tag(), "made": json.dumps(made),
                 "decode_from": DECODE_FROM}
    for t in TYPES:
        npy, last = os.path.join(tmp, f"{family}-{t}.npy"), os.path.join(tmp, f"{family}-{t}.last.npy")
        info = reference(llama_py, files[t], tokens, Case(spec=None, decode_from=DECODE_FROM), npy, last)  # type: ignore[arg-type]
        rec.update({f"{t}_sha256": sha256(files[t]), f"{t}_logits": np.load(npy), f"{t}_last": np.load(last)})
        if t in DECODE_TYPES:
            rec[f"{t}_decode"] = np.load(npy[:-4] + ".decode.npy")
        if t == "f32":
            rec["tokenized"] = json.dumps(info["tokenized"])
            rec["llama_cpp_python"] = info["llama_cpp_python"]
    hf_npy = os.path.join(tmp, f"{family}-hf.npy")
    res = _last_json(_run([conv_py, os.path.join(HERE, "converted", "hf_side.py"), "logits", hf, "--tokens",
                           ",".join(map(str, tokens)), "--out", hf_npy, "--greedy", str(GREEDY)],
                          f"transformers logits of {family}"))
    rec.update({"hf_logits": np.load(hf_npy), "hf_greedy": np.asarray(res["greedy"], np.int32),
                "transformers": res["transformers"]})
    dst = os.path.join(out, f"{family}.npz")
    for var in variant_paths(dst):  # other CPUs' logits of the files being replaced
        os.remove(var)
    np.savez_compressed(dst, **rec)
    sizes = {t: os.path.getsize(files[t]) for t in TYPES}
    print(f"{family}: {len(tokens)} tokens, files {sizes}, npz {os.path.getsize(os.path.join(out, family + '.npz'))}")


def add_simd_variant(family: str, llama_py: str, tmp: str, out: str) -> None:
    """llama.cpp's logits on the recorded files of ``family``, as this CPU computes them, next to the fixture's
    (``--logits-only``): a variant for this CPU's simd tag (see ``make_reference_fixtures``), the base untouched."""
    base = os.path.join(out, f"{family}.npz")
    with np.load(base) as z:
        fx = {k: z[k] for k in z.files}
    tag = simd_tag()
    tokens = [int(x) for x in fx["tokens"]]
    got: dict[str, np.ndarray] = {}
    for t in TYPES:
        path = os.path.join(out, f"{family}-{t}.gguf")
        if sha256(path) != str(fx[f"{t}_sha256"]):
            raise SystemExit(f"{path} is not the file {base} was recorded on: make the fixtures again")
        npy, last = os.path.join(tmp, f"{family}-{t}.npy"), os.path.join(tmp, f"{family}-{t}.last.npy")
        info = reference(llama_py, path, tokens, Case(spec=None, decode_from=DECODE_FROM), npy, last)  # type: ignore[arg-type]
        if t == "f32" and json.loads(str(fx["tokenized"])) != info["tokenized"]:
            raise SystemExit(f"{family}: llama.cpp's token ids differ from the fixture's on this CPU")
        got.update({f"{t}_logits": np.load(npy), f"{t}_last": np.load(last)})
        if f"{t}_decode" in fx:
            got[f"{t}_decode"] = np.load(npy[:-4] + ".decode.npy")
    if str(fx["simd"]) == tag:
        same = [k for k, v in got.items() if np.array_equal(v, fx[k])]
        print(f"{family}: this CPU recorded the base; {len(same)} of {len(got)} logits arrays equal it bit for bit")
        return
    var = write_simd_variant(base, tag, got)
    print(f"{family}: variant {var}, {os.path.getsize(var)} bytes")


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--conv-python", help="a Python with torch, transformers, tokenizers, sentencepiece")
@click.option("--llama-python", required=True, help="a Python with llama-cpp-python==0.3.36")
@click.option("--llama-cpp", help="vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist")
@click.option("--out", default=os.path.join("tests", "fixtures", "converted"), show_default=True)
@click.option("--family", "families", multiple=True, type=click.Choice(FAMILIES), help="only these (repeat)")
@click.option("--work", help="keep the Hugging Face models and converted files here, and reuse what is there "
              "(default: a temporary directory)")
@click.option("--convert-only", is_flag=True, help="steps 1 and 2 only, into --work")
@click.option("--logits-only", is_flag=True, help="only llama.cpp's logits on the files already in --out, as this "
              "CPU computes them: a variant for its simd tag (the fixtures themselves untouched)")
def main(conv_python: str | None, llama_python: str, llama_cpp: str | None, out: str, families: tuple[str, ...],
         work: str | None, convert_only: bool, logits_only: bool) -> None:
    if logits_only:
        with tempfile.TemporaryDirectory() as tmp:
            for family in families or FAMILIES:
                add_simd_variant(family, llama_python, tmp, out)
        return
    if not conv_python or not llama_cpp:
        raise click.UsageError("--conv-python and --llama-cpp are needed (all but --logits-only)")
    os.makedirs(out, exist_ok=True)
    ns = {"conv_python": conv_python, "llama_python": llama_python, "llama_cpp": llama_cpp}
    if convert_only and not work:
        raise click.UsageError("--convert-only needs --work")
    with tempfile.TemporaryDirectory() as tmp:
        if work:
            os.makedirs(work, exist_ok=True)
        for family in families or FAMILIES:
            if convert_only:
                convert_family(family, ns, work or tmp)
                print(f"{family}: converted into {work}", flush=True)
            else:
                make_family(family, ns, work or tmp, out)


if __name__ == "__main__":
    main()
