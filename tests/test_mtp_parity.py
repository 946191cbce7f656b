"""The draft head (next-token-prediction block) against llama.cpp's MTP context, on converter-made files.

``tests/fixtures/mtp/FAMILY.npz`` (``tools/make_mtp_fixtures.py``) holds what the pinned llama.cpp computes with a
target context and an MTP context (``LLAMA_CONTEXT_TYPE_MTP``) on GLM-4.5's, Qwen3-Next's and Qwen3.5's converted
fixtures and on a GLM-4.7-Flash-layout file (deepseek2 with a head), at F32 and Q8_0: the target's hidden state of
every position, the head's logits over the prompt in one batch, and three draft steps. ggml-hybrid computes the same
from its own hidden states, bit for bit on a CPU with the fixture's SIMD features (within a bound on others, as the
converted fixtures).
"""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
MTP = os.path.join(FIXTURES, "mtp")
from make_reference_fixtures import load_for_cpu  # noqa: E402

FAMILIES = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(MTP, "*.npz")))
TYPES = ("f32", "q8_0")
OTHER_CPU = {"f32": 1e-3, "q8_0": 1e-3}  # as tests/test_converted.py's bounds on another CPU


def _load(family: str, tag: str | None = None) -> dict:
    fx, exact = load_for_cpu(os.path.join(MTP, f"{family}.npz"), tag)
    return {**fx, "exact": exact}


def _same(got: np.ndarray, ref: np.ndarray, fx: dict, t: str, what: str) -> None:
    assert got.shape == ref.shape, what
    if fx["exact"]:
        assert np.array_equal(got, ref), f"{what}: not bit-identical to llama.cpp (max |diff| " \
                                         f"{np.abs(got - ref).max():.3g})"
    else:
        scale = np.abs(ref).max(axis=-1, keepdims=True)
        assert (np.abs(got - ref) / scale).max() <= OTHER_CPU[t], what


def test_every_family_with_a_head_is_recorded():
    assert FAMILIES == ["glm47flash", "glm4moe", "qwen35moe", "qwen3next"]  # deepseek2, glm4moe, qwen35moe, qwen3next
    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(MTP, "*")))
    assert total < 1.5 * 2 ** 20  # the fixtures stay small: 1.1 MiB


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_head_matches_llama_cpp(family, t):
    fx = _load(family)
    path = os.path.join(FIXTURES, str(fx[f"{t}_file"]))
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == str(fx[f"{t}_sha256"]), "stale: rerun make_mtp_fixtures.py"
    tokens = [int(x) for x in fx["tokens"]]
    keep = [int(p) for p in fx["positions"]]
    opts = SessionOptions(n_threads=1, n_ctx=256, spec_type="draft-mtp")
    with MoEModel(path, opts) as m:
        assert m.hp.arch == ("deepseek2" if family == "glm47flash" else family)
        # the target, with the head's input: its output-normed hidden state of every position
        logits = m.eval(tokens, "all")
        _same(logits[keep], fx[f"{t}_target_logits"], fx, t, "target logits")
        h = m.head.target_hidden(0)
        _same(h, fx[f"{t}_target_h"], fx, t, "target hidden state")
        # the head over the prompt in one batch: position p pairs x_p with h_{p-1} (zeros at p = 0)
        prev = np.concatenate([np.zeros((1, m.hp.n_embd), np.float32), h[:-1]])
        head_logits, _ = m.draft_step([(0, tokens, prev, 0)])
        _same(head_logits[keep], fx[f"{t}_mtp_logits"], fx, t, "head logits")
        # draft steps: the target's greedy token with its last h, then the head's argmax with the head's own h
        tok, state = int(np.argmax(logits[-1])), h[-1]
        for i, (want_tok, want) in enumerate(zip(fx[f"{t}_draft_tokens"], fx[f"{t}_draft_logits"])):
            assert tok == int(want_tok)
            lg, hd = m.draft_step([(0, [tok], state, len(tokens) + i)])
            _same(lg[0], want, fx, t, f"draft step {i}")
            tok, state = int(np.argmax(lg[0])), hd[0]


def _llama_python():
    exe = os.environ.get("GGML_HYBRID_LLAMA_PYTHON")
    if exe:
        return exe
    try:
        import llama_cpp  # noqa: F401
        return sys.executable
    except ImportError:
        return None


@pytest.mark.reference
@pytest.mark.parametrize("family", FAMILIES)
def test_fixtures_recomputed_live(family, tmp_path):
    """llama.cpp's MTP context run again on the recorded files (needs llama-cpp-python==0.3.36): the same numbers."""
    exe = _llama_python()
    if exe is None:
        pytest.skip("no llama-cpp-python: set GGML_HYBRID_LLAMA_PYTHON to a Python that has it")
    tool = os.path.join(HERE, "..", "tools", "llama_mtp_reference.py")
    for t in TYPES:
        fx = _load(family)
        out = tmp_path / f"{t}.npz"
        r = subprocess.run([exe, tool, os.path.join(FIXTURES, str(fx[f"{t}_file"])), "--tokens",
                            ",".join(str(int(x)) for x in fx["tokens"]), "--out", str(out)],
                           capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        z = np.load(out)
        keep = [int(p) for p in fx["positions"]]
        _same(z["target_h"], fx[f"{t}_target_h"], fx, t, "target hidden state")
        _same(z["mtp_logits"][keep], fx[f"{t}_mtp_logits"], fx, t, "head logits")
        _same(z["draft_logits"], fx[f"{t}_draft_logits"], fx, t, "draft steps")
        assert (z["draft_tokens"] == fx[f"{t}_draft_tokens"]).all()
