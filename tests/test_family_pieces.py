"""The families' pieces against independent oracles: llama.cpp's float32 scalars (YaRN, the latent attention scale),
the routing of ``build_moe_ffn`` in float64 numpy, and the SentencePiece encoder against a ``tokenizers`` BPE."""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest
from helpers import compute
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid.errors import ModelFileError
from ggml_hybrid.model.families.deepseek2 import mla_kq_scale
from ggml_hybrid.model.rope import attn_factor, f32, kq_scale, logf
from ggml_hybrid.moe.ffn import ExpertWeights, Router, Routing, build_moe_ffn
from ggml_hybrid.synthetic.vocab import SPM_USER, spm_vocab
from ggml_hybrid.text.spm import SPMTokenizer

# -- float32 scalars ---------------------------------------------------------------------------------------------

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.logf.restype, _libm.logf.argtypes = ctypes.c_float, [ctypes.c_float]


def test_logf_is_the_c_librarys():
    x = np.random.default_rng(0).uniform(1.0, 200.0, 20000).astype(np.float32)
    ours = np.array([logf(v) for v in x], np.float32)
    assert np.array_equal(ours, np.array([_libm.logf(float(v)) for v in x], np.float32))
    # why not numpy: its correctly rounded float32 log differs from the C library's in some last bits
    rounded = np.log(x.astype(np.float64)).astype(np.float32)
    assert (ours != rounded).any()


# DeepSeek-V3, Kimi K2 and V2 (factor, mscale_all_dim): llama.cpp's rope attn_factor and attention scale for a
# 192-wide key, computed in C by the reference build (docs: /work/notes/families/deepseek2.md, §3)
@pytest.mark.parametrize("factor, mscale, attn, scale_bits", [(40, 1.0, 0.73052, 0x3e0a7ab9),
                                                                (32, 1.0, 0.7426256, 0x3e060060),
                                                                (40, 0.707, 0.73052, 0x3deaf30e)])
def test_yarn_scalars_are_llama_cpps(factor, mscale, attn, scale_bits):
    freq_scale = f32(1) / f32(factor)
    a = attn_factor(freq_scale, True, 1.0, mscale, deepseek2=True)
    assert abs(float(a) - attn) < 1e-6
    got = mla_kq_scale(float(a), float(freq_scale), mscale, 192)
    assert np.float32(got).view(np.uint32) == scale_bits
    # without YaRN: 1.0f / sqrtf(192)
    assert mla_kq_scale(1.0, 1.0, 0.0, 192) == kq_scale(192)


@pytest.mark.parametrize("d", [32, 64, 96, 112, 128, 192, 576])
def test_attention_scale_is_float32(d):
    assert kq_scale(d) == float(np.float32(1) / np.sqrt(np.float32(d)))
    if d in (96, 112):  # where the double 1/sqrt(d) rounds to another float
        assert kq_scale(d) != float(np.float32(1 / math.sqrt(d)))


# -- routing -------------------------------------------------------------------------------------------------------

def routing64(logits, gating, k, norm, scale, sel_bias=None, groups=0, groups_used=0):
    """llama.cpp's build_moe_ffn routing in float64: (ids, weights) per token."""
    if gating == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    else:
        probs = 1 / (1 + np.exp(-logits))
    sel = probs + (sel_bias if sel_bias is not None else 0)
    if groups > 1:
        g = sel.reshape(sel.shape[0], groups, -1)
        score = np.sort(g, axis=-1)[..., -2:].sum(axis=-1)           # each group's two best
        keep = np.argsort(-score, axis=-1, kind="stable")[:, :groups_used]
        mask = np.full(g.shape, -np.inf)
        for t in range(g.shape[0]):
            mask[t, keep[t]] = g[t, keep[t]]
        sel = mask.reshape(sel.shape)
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), 6.103515625e-5)
    if scale not in (0, 1):
        w = w * np.float32(scale)
    return ids, w


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 6), gating=st.sampled_from(["softmax", "sigmoid"]), norm=st.booleans(),
       scale=st.sampled_from([0.0, 1.0, 2.5]), bias=st.booleans(), groups=st.sampled_from([0, 2, 4]),
       router_scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**31 - 1))
def test_routing_matches_llama_cpps_rule(run, tokens, gating, norm, scale, bias, groups, router_scale, seed):
    # a large router saturates sigmoid probabilities to 1.0, and the order of ties is the sort's: only with a
    # selection bias (distinct per expert) is the choice then unique
    assume(router_scale == 1.0 or bias)
    rng = np.random.default_rng(seed)
    X, E, F, k = 8, 32, 32, 2
    x = rng.standard_normal((tokens, E)).astype(np.float32)
    router = (rng.standard_normal((X, E)) * router_scale / math.sqrt(E)).astype(np.float32)
    sel_bias = (rng.standard_normal(X) * 0.5).astype(np.float32) if bias else None
    if bias:
        sel_bias[:2] += 5.0  # pin two experts: their own weights may be tiny (the sum is then clamped)
    consts = {"x": x, "r": router, "gate": np.zeros((X, F, E), np.float32), "up": np.zeros((X, F, E), np.float32),
              "down": np.zeros((X, E, F), np.float32)}
    if bias:
        consts["b"] = sel_bias

    def build(c, t):
        ew = ExpertWeights(down=t["down"], gate=t["gate"], up=t["up"])
        r = build_moe_ffn(c, c.new_graph(64), t["x"], Router(t["r"], selection_bias=t.get("b")), ew, k,
                          Routing(gating, norm, scale, groups, groups // 2))
        return c.cont(r.ids), c.cont(r.weights)

    ids, w = compute(gh.cpu(1), build, consts=consts, graph_size=512)
    # the router product in float64 is within float32 rounding of GGML's; ties are not drawn (random data)
    logits = x.astype(np.float64) @ router.astype(np.float64).T
    ref_ids, ref_w = routing64(logits, gating, k, norm, scale, sel_bias, groups, groups // 2)
    assert np.array_equal(ids.reshape(tokens, k), ref_ids)
    np.testing.assert_allclose(w.reshape(tokens, k), ref_w, rtol=1e-4, atol=1e-30)


# -- SentencePiece ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spm():
    v = spm_vocab(512)
    return SPMTokenizer(v.tokens, v.scores, v.types), v


def _hf_spm(v):
    """The ``tokenizers`` construction of an SPM vocabulary: merges ranked by the merged token's score."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers

    vocab = {t: i for i, t in enumerate(v.tokens)}
    merges = []
    for i, piece in enumerate(v.tokens):
        merges += [(piece[:j], piece[j:], v.scores[i]) for j in range(1, len(piece))
                   if piece[:j] in vocab and piece[j:] in vocab]
    merges.sort(key=lambda m: -m[2])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in SPM_USER])
    return tok


ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCXYZ.,;!?'\n\t0123456789éüß東京Мо😀<>/"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=60), user=st.booleans())
def test_spm_encoder_agrees_with_a_tokenizers_bpe(spm, text, user):
    """On this vocabulary (every character of the alphabet a piece or bytes, distinct scores) the two agree."""
    tok, v = spm
    if user:
        text = text[: len(text) // 2] + SPM_USER[0] + text[len(text) // 2:]
    hf = _hf_spm(v)
    assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False).ids


def test_spm_rules_llama_cpp_has(spm):
    tok, v = spm
    assert tok.encode("") == [1] and tok.encode("", add_bos=False) == []
    # a prefix space per text piece: after a user-defined token the text starts a new "word"
    a = tok.encode("a", add_bos=False)
    assert tok.encode(f"a{SPM_USER[0]}a", add_bos=False) == a + [v.tokens.index(SPM_USER[0])] + a
    # a character that is no piece is spelled in byte tokens (here U+2603 SNOWMAN: e2 98 83)
    snow = tok.encode("\u2603", add_bos=False)
    assert [v.tokens[i] for i in snow][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    # control tokens are never cut out of text, user-defined ones always
    assert 2 not in tok.encode("x</s>y", add_bos=False)
    # decoding as llama_detokenize: the first piece's prefix space dropped, control tokens silent
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and tok.decode(ids[1:]) == "Hello world" and tok.decode(ids) == " Hello world"


def test_spm_refuses_what_llama_cpp_aborts_on():
    v = spm_vocab(512)
    with pytest.raises(ModelFileError, match="twice"):
        SPMTokenizer(v.tokens + [v.tokens[300]], v.scores + [0.0], v.types + [1])
    no_bytes = [t if not t.startswith("<0x") else f"<b{i}>" for i, t in enumerate(v.tokens)]
    tok = SPMTokenizer(no_bytes, v.scores, v.types)
    with pytest.raises(ModelFileError, match="byte 0xE2"):
        tok.encode("\u2603")
