"""Bad arguments to the public Python API raise one typed ggml-hybrid error (issue 18's API fault cases).

Each case below is one the API fuzzer (tools/fuzz, kind ``api``) found raising a bare AttributeError,
TypeError, KeyError or ValueError from inside the package, or silently accepting a wrong value
(negative token ids wrapping around, float shape sizes truncated).
"""

from __future__ import annotations

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import (
    ArgumentError,
    ArgumentTypeError,
    GgmlHybridError,
    IndexRangeError,
    ModelFileError,
    OptionError,
    ShapeError,
)
from ggml_hybrid.plan.planner import plan
from ggml_hybrid.synthetic import ModelSpec, write_model, write_moe_stack

ONE = gh.SessionOptions(n_threads=1)
SPEC = ModelSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff_exp=32, n_expert=4, n_used=2,
                 vocab_size=320, weight_type="q8_0", seed=5)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("api") / "m.gguf", SPEC)


@pytest.fixture(scope="module")
def model(path):
    with gh.MoEModel(path, ONE) as m:
        yield m


@pytest.mark.parametrize("kw,err,words", [
    (dict(device="x"), ArgumentTypeError, "device must be a Backend"),
    (dict(progress=np.array([1.5])), ArgumentTypeError, "progress must be callable"),
    (dict(dry_run_devices="DEV0"), ArgumentTypeError, "list of device names"),
    (dict(dry_run_devices=[[1]]), ArgumentTypeError, "list of device names"),
    (dict(dry_run_devices=[]), ArgumentError, "1..15 distinct devices"),
    (dict(dry_run_devices=["DEV0", "DEV0"]), ArgumentError, "distinct"),
])
def test_model_constructor_arguments(path, kw, err, words):
    with pytest.raises(err, match=words):
        gh.MoEModel(path, ONE, **kw)


def test_model_path_with_a_nul_byte():
    with pytest.raises(ModelFileError, match="NUL byte"):
        gh.MoEModel("a\x00b", ONE)


@pytest.mark.parametrize("value,err", [([1.5], ArgumentTypeError), (np.array([1]), ArgumentTypeError),
                                       ("/tmp", ArgumentError), ("DEV9", ArgumentError)])
def test_device_names(model, value, err):
    with pytest.raises(err):
        model.device_memory(value)
    with pytest.raises(err):
        model.backend(value)
    assert model.backend("CPU") is model.host and model.backend("DEV0") is model.device
    assert model.device_memory("DEV0") == model.device_memory()  # one device: the same bytes


@pytest.mark.parametrize("prompt,err", [(np.int64(3), ArgumentTypeError), ("ab", ArgumentTypeError),
                                        ([1.5], ArgumentTypeError), ([-1], IndexRangeError),
                                        ([320], IndexRangeError)])
def test_generate_prompt(model, prompt, err):
    with pytest.raises(err):
        "".join(gh.generate(model, prompt, 2))


@pytest.mark.parametrize("sampler", [np.array([], np.int32), 3, {}, [1]])
def test_generate_sampler(model, sampler):
    with pytest.raises(ArgumentTypeError, match="sampler must be callable"):
        "".join(gh.generate(model, [1], 2, sampler))


def test_tokenizer_arguments(model):
    tok = model.tokenizer
    with pytest.raises(IndexRangeError):
        tok.token_bytes(-1)  # was tokens[-1]: the last token, silently
    with pytest.raises(IndexRangeError):
        tok.token_bytes(tok.n_vocab)
    with pytest.raises(ArgumentTypeError):
        tok.token_bytes([1])
    with pytest.raises(ArgumentTypeError):
        tok.decode(np.int64(3))
    with pytest.raises(ArgumentTypeError):
        tok.decode("/x")
    with pytest.raises(ArgumentTypeError):
        tok.encode("hi", np.array([True, False]))
    ids = tok.encode("hello world")
    assert tok.decode(np.array(ids)) == tok.decode(iter(ids)) == tok.decode(ids)


@pytest.mark.parametrize("logits,err", [([[1.0, "a"]], ArgumentTypeError), ({}, ArgumentTypeError),
                                        (iter([1.0]), ArgumentTypeError), ([], ArgumentError),
                                        ([0.0, np.nan], ArgumentError)])
def test_sampler_logits(logits, err):
    with pytest.raises(err):
        gh.Sampler(temperature=1.0, seed=1)(logits)
    assert gh.Sampler(temperature=1.0, seed=1)([0.0, -np.inf]) == 0


@pytest.mark.parametrize("kw,words", [
    (dict(opts=np.array([])), "opts must be a SessionOptions"), (dict(opts=[1]), "opts must be a SessionOptions"),
    (dict(vram=3), "list of device sizes"), (dict(vram=[1.5]), "device size in bytes"),
    (dict(vram=[-1]), "device size in bytes"), (dict(ram=[1]), "host memory in bytes"),
    (dict(ram=np.array([])), "host memory in bytes"),
])
def test_plan_arguments(path, kw, words):
    with pytest.raises(OptionError, match=words):
        plan(path, **kw)


def test_stack_session_arguments(tmp_path):
    stack = write_moe_stack(tmp_path / "s.gguf", n_layer=1, n_embd=32, n_ff=32, n_expert=4, n_used=2,
                            expert_type="q8_0", seed=9)
    for bad in ("x", np.array([]), [1], lambda: None):
        with pytest.raises(OptionError, match="options must be a SessionOptions"):
            gh.MoEStackSession(stack, bad)
    with pytest.raises(ArgumentError):
        gh.MoEStackSession(stack, ONE, simulated_bus_bytes_per_s=0)


@pytest.mark.parametrize("shape", [1.5, None, (2.0, 2), ("a",), (2**63,)])
def test_new_tensor_shapes(shape):
    with gh.Context(n_tensors=4) as c:
        with pytest.raises(GgmlHybridError) as info:
            c.new_tensor("f32", shape)
    assert isinstance(info.value, (ArgumentTypeError, ShapeError))


@pytest.mark.parametrize("vocab", ["bpe", "spm"])
@pytest.mark.parametrize("text", ["\ud800", "ok \udfff then", "x\ud83d"])
def test_encode_refuses_a_lone_surrogate_with_one_typed_error(tmp_path, vocab, text):
    """Issue 28 item 16: text that UTF-8 cannot carry is one ArgumentError naming where (it was a bare
    UnicodeEncodeError, or whatever the tokenizer library raised)."""
    from ggml_hybrid.synthetic import write_model as write

    kw = dict(arch="llama", vocab="spm", vocab_size=512) if vocab == "spm" else dict(arch="qwen3moe")
    p = write(tmp_path / f"{vocab}.gguf", seed=15, **kw)
    with gh.MoEModel(p, ONE) as m:
        for special in (False, True):
            with pytest.raises(ArgumentError, match="lone surrogate"):
                m.tokenizer.encode(text, special=special)
        assert m.tokenizer.encode("ok then")  # valid text still encodes
