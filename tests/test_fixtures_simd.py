"""The fixtures' logits per CPU (tools/make_reference_fixtures.py): a base recording and a variant per other SIMD tag,
stored as the XOR of the float bits; the tests take the recording of this CPU's tag, or the base and a tolerance."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from make_reference_fixtures import load_for_cpu, simd_tag, variant_paths, write_simd_variant

HERE = os.path.dirname(os.path.abspath(__file__))
BASES = sorted(glob.glob(os.path.join(HERE, "fixtures", "llama_ref", "*.npz"))
               + glob.glob(os.path.join(HERE, "fixtures", "converted", "*.npz")))


def _base(tmp_path, rng) -> tuple[str, dict]:
    rec = {"simd": np.asarray("sse3 avx2"), "sha256": np.asarray("ab" * 32), "tokens": np.arange(5, dtype=np.int32),
           "logits": rng.standard_normal((5, 7)).astype(np.float32), "last_logits": rng.standard_normal((1, 7),
                                                                                                    np.float32)}
    path = str(tmp_path / "case.npz")
    np.savez_compressed(path, **rec)
    return path, rec


def test_a_variant_gives_back_its_bits_and_other_tags_the_base(tmp_path):
    rng = np.random.default_rng(0)
    path, rec = _base(tmp_path, rng)
    other = rec["logits"].copy()
    other[2, 3] = np.nextafter(other[2, 3], np.float32(9))  # one ulp: what another CPU's kernels change
    other[4] = -0.0  # signs and zeros survive too
    write_simd_variant(path, "sse3 avx2 avx512f", {"logits": other})
    got, exact = load_for_cpu(path, "sse3 avx2 avx512f")
    assert exact and str(got["simd"]) == "sse3 avx2 avx512f"
    assert np.array_equal(got["logits"].view(np.uint32), other.view(np.uint32))
    assert np.array_equal(got["last_logits"], rec["last_logits"])  # not recorded again: the base's
    base, exact = load_for_cpu(path, "sse3 avx2")
    assert exact and np.array_equal(base["logits"], rec["logits"])
    unknown, exact = load_for_cpu(path, "a fake tag")  # no recording: the base's logits, not exact
    assert not exact and np.array_equal(unknown["logits"], rec["logits"]) and str(unknown["simd"]) == "sse3 avx2"
    assert variant_paths(path) == [str(tmp_path / "simd" / "sse3-avx2-avx512f" / "case.npz")]


def test_variants_of_other_inputs_or_shapes_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    path, rec = _base(tmp_path, rng)
    with pytest.raises(ValueError, match="recorded with simd tag 'sse3 avx2' itself"):
        write_simd_variant(path, "sse3 avx2", {"logits": rec["logits"]})
    with pytest.raises(ValueError, match="'logits' is not a float32 array of shape"):
        write_simd_variant(path, "avx512f", {"logits": rec["logits"][:3]})
    write_simd_variant(path, "avx512f", {"logits": rec["logits"] + 1})
    np.savez_compressed(path, **{**rec, "sha256": np.asarray("cd" * 32)})  # the base recorded again, other file
    with pytest.raises(ValueError, match="stale, its 'sha256' is not the base's"):
        load_for_cpu(path, "avx512f")


def test_the_tag_can_be_forced(monkeypatch):
    monkeypatch.setenv("GGML_HYBRID_SIMD_TAG", "not a cpu")
    assert simd_tag() == "not a cpu"
    _, exact = load_for_cpu(BASES[0])
    assert not exact


@pytest.mark.parametrize("path", BASES, ids=[os.path.relpath(p, os.path.join(HERE, "fixtures"))[:-4] for p in BASES])
def test_recorded_variants_are_of_the_recorded_inputs(path):
    base_tag = str(np.load(path)["simd"])
    assert base_tag == "ssse3 avx avx2 fma f16c"  # the AVX2 recording stays the base
    for var in variant_paths(path):
        tag = str(np.load(var)["simd"])
        assert tag != base_tag
        fx, exact = load_for_cpu(path, tag)  # raises for a stale variant
        assert exact and all(fx[k].dtype == np.float32 for k in fx if k.endswith(("logits", "_last", "_decode")))
