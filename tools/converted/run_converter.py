#!/usr/bin/env python3
"""Run the pinned llama.cpp's ``convert_hf_to_gguf.py`` (from the llama-cpp-python 0.3.36 sdist) on a model
directory, with its own ``gguf-py``:

    python tools/converted/run_converter.py --llama-cpp SDIST/vendor/llama.cpp --pre qwen2 HFDIR \
        --outtype f32 --outfile model.gguf

One thing is changed, and only when ``--pre`` is given: the converter names a byte-level BPE tokenizer's
pre-tokenizer (``tokenizer.ggml.pre``) by hashing the token ids it gives a check text, which identifies a
*published* tokenizer; a tiny trained one has no known hash and would stop the conversion. ``--pre`` gives the
name the converter writes for the family's published tokenizer instead. Everything else (tensor names, shapes,
types, metadata, special tokens, chat template) is the converter's own. Needs torch, transformers, sentencepiece
and numpy in the interpreter that runs it.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--llama-cpp", required=True)
    ap.add_argument("--pre")
    ns, rest = ap.parse_known_args()
    root = os.path.abspath(ns.llama_cpp)
    os.environ.pop("NO_LOCAL_GGUF", None)
    sys.path[:0] = [root, os.path.join(root, "gguf-py")]
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", os.path.join(root, "convert_hf_to_gguf.py"))
    assert spec is not None and spec.loader is not None
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    import gguf

    # the converter's own gguf-py, not an installed one
    assert os.path.abspath(gguf.__file__).startswith(root), gguf.__file__
    if ns.pre:
        from conversion.base import TextModel

        TextModel.get_vocab_base_pre = lambda self, tokenizer: ns.pre  # type: ignore[method-assign]
    sys.argv = [os.path.join(root, "convert_hf_to_gguf.py")] + rest
    conv.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
