"""Shared helpers: build a graph from a small builder function, compute it, return numpy.

Typical use::

    out = compute(cpu, lambda c, t: c.mul_mat(t["w"], t["x"]),
                  consts={"w": w_f32}, inputs={"x": x_f32})

``consts`` go into a weights context that is allocated and filled *before*
the builder runs (so index tensors there already hold data when an op is
built); ``inputs`` are ``set_input()`` tensors of the graph context, filled
after ``Scheduler.alloc`` (the data-set-after-build path). Every native object
the helper creates is closed before it returns.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.synthetic import ARCHS

EPS32 = 2.0 ** -24  # unit roundoff of float32 (round to nearest)
EPS16 = 2.0 ** -11  # unit roundoff of float16
EPSBF16 = 2.0 ** -8  # unit roundoff of bfloat16
F16_TINY = 2.0 ** -25  # half the smallest float16 subnormal: the absolute rounding floor of anything stored as fp16


def q8_err(amax):
    """|x - dequant(quant(x))| for Q8_0/Q8_K blocks of max |x| = amax: d = amax/127, q = round(x/d) costs d/2;
    Q8_0 stores d as fp16 (|d - d16| <= u16 d + F16_TINY, times |q| <= 127)."""
    return np.asarray(amax) * (1 / 254 + EPS16) * (1 + 1e-4) + 127 * F16_TINY


class Raw:
    """A tensor spec whose data is not a plain numpy array of the tensor's own dtype (quantized bytes, BF16 bits)."""

    def __init__(self, dtype, shape, data=None):
        self.dtype = gh.as_ggml_type(dtype)
        self.shape = tuple(shape)
        self.data = data


def quantized(x: np.ndarray, dtype) -> tuple[Raw, np.ndarray]:
    """Quantize float rows of ``x``; returns (spec for compute(), the dequantized float64 values)."""
    t = gh.as_ggml_type(dtype)
    q = gh.quantize(np.asarray(x, np.float32), t)
    deq = gh.dequantize(q, t, x.shape[-1]).astype(np.float64)
    return Raw(t, x.shape, q), deq


def _spec(value):
    if isinstance(value, Raw):
        return value.dtype, value.shape, value.data
    arr = np.asarray(value)
    return gh.as_ggml_type(arr.dtype), arr.shape or (1,), arr


def compute(backend, build, consts=None, inputs=None, graph_size: int = 256):
    """Build with ``build(ctx, tensors)`` (returning one tensor or a tuple), compute, return numpy copies."""
    consts = dict(consts or {})
    inputs = dict(inputs or {})
    tensors: dict[str, gh.Tensor] = {}
    with gh.Context(n_tensors=len(consts) + 1) as wctx, \
            gh.Context(n_tensors=256, graph_size=graph_size) as ctx, \
            gh.Scheduler([backend], graph_size=graph_size) as sched:
        for name, v in consts.items():
            dtype, shape, _ = _spec(v)
            tensors[name] = wctx.new_tensor(dtype, shape, name)
        if consts:
            wctx.allocate(backend, "weights")
            for name, v in consts.items():
                data = _spec(v)[2]
                if data is not None:
                    tensors[name].set(data)
        for name, v in inputs.items():
            dtype, shape, _ = _spec(v)
            tensors[name] = ctx.new_tensor(dtype, shape, name).set_input()
        outs = build(ctx, tensors)
        single = isinstance(outs, gh.Tensor)
        outs = (outs,) if single else tuple(outs)
        for o in outs:
            o.set_output()
        graph = ctx.new_graph(graph_size).expand(*outs)
        sched.alloc(graph)
        for name, v in inputs.items():
            tensors[name].set(_spec(v)[2])
        sched.compute(graph)
        res = [o.numpy() for o in outs]
    return res[0] if single else res


def assert_same_bits(ours, theirs) -> None:
    """Two results of :func:`compute` (an array or a tuple of them) hold the same bytes: dtype, shape and every bit
    (NaNs included)."""
    ours = ours if isinstance(ours, (tuple, list)) else (ours,)
    theirs = theirs if isinstance(theirs, (tuple, list)) else (theirs,)
    assert len(ours) == len(theirs), f"{len(ours)} outputs vs {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        bits_a = np.ascontiguousarray(a).view(f"u{a.itemsize}").ravel()
        bits_b = np.ascontiguousarray(b).view(f"u{b.itemsize}").ravel()
        bad = np.flatnonzero(bits_a != bits_b)
        if bad.size:
            i0 = bad[0]
            raise AssertionError(f"output {i}: {bad.size} of {a.size} values differ; the first at flat index {i0}: "
                                 f"{a.ravel()[i0]!r} vs {b.ravel()[i0]!r}")


def canon(shape) -> tuple[int, ...]:
    """Drop leading size-1 dims (GGML cannot tell numpy shape (1, 3) from (3,)); keep at least one dim."""
    shape = tuple(int(s) for s in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def check_close(got, ref, atol, what: str = "") -> None:
    """Assert same (canonical) shape and |got - ref| <= atol elementwise (atol may be an array)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert canon(got.shape) == canon(ref.shape), f"{what}: shape {got.shape} != expected {ref.shape}"
    got = got.reshape(ref.shape)
    atol = np.broadcast_to(np.asarray(atol, np.float64), ref.shape)
    err = np.abs(got - ref)
    bad = ~(err <= atol)  # also catches NaN
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {ref.size} elements out of tolerance; first at {i}: "
                             f"got {got[i]!r}, expected {ref[i]!r}, |err| {err[i]:.3g} > atol {atol[i]:.3g}; "
                             f"max err/atol {np.nanmax(err / np.maximum(atol, 1e-300)):.3g}")


def tile_to(b: np.ndarray, shape) -> np.ndarray:
    """GGML broadcasting of b onto a of ``shape``: b is repeated (tiled) along each dim it divides."""
    b = b.reshape((1,) * (len(shape) - b.ndim) + b.shape)
    return np.tile(b, tuple(s // bs for s, bs in zip(shape, b.shape)))


def pad_shape(shape, nd: int) -> tuple[int, ...]:
    return (1,) * (nd - len(shape)) + tuple(shape)


def dot_tol(absprod_sum, k: int):
    """Worst-case float32 rounding of a k-term dot product (any summation order): (k + 2) u sum|a_i b_i|."""
    return (k + 2) * EPS32 * np.asarray(absprod_sum) + 1e-30


def block_amax(x: np.ndarray, block: int) -> np.ndarray:
    """max |x| over each block of ``block`` consecutive elements along the last axis, repeated per element."""
    n = x.shape[-1]
    assert n % block == 0
    m = np.abs(x).reshape(x.shape[:-1] + (n // block, block)).max(axis=-1)
    return np.repeat(m, block, axis=-1)


def lcm(*xs: int) -> int:
    return math.lcm(*xs)


# --------------------------------------------------------------------------------------------------------------
# running code in a child interpreter: for calls that may kill the process (a GGML_ASSERT/abort or a segfault)
# --------------------------------------------------------------------------------------------------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gh.__file__)))

PRELUDE = """\
import numpy as np
import ggml_hybrid as gh
from helpers import compute, Raw
cpu = gh.cpu(2)
"""


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``PRELUDE + code`` in a fresh interpreter (GGML_NO_BACKTRACE: no gdb on abort)."""
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, TESTS_DIR] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=TESTS_DIR)


def assert_typed_error_isolated(code: str, expected: str = "GgmlHybridError") -> None:
    """``code`` must raise gh.errors.<expected> (and the interpreter must survive it)."""
    body = textwrap.indent(textwrap.dedent(code), "    ")
    wrapped = (f"try:\n{body}\nexcept gh.errors.{expected} as exc:\n    print('TYPED', type(exc).__name__, exc)\n"
               f"else:\n    print('NO ERROR')\n")
    p = run_isolated(wrapped)
    assert p.returncode == 0 and "TYPED" in p.stdout, (
        f"expected gh.errors.{expected}; child exit code {p.returncode} "
        f"(negative = killed by signal {-p.returncode if p.returncode < 0 else ''}), "
        f"stdout {p.stdout.strip()[-500:]!r}, stderr {p.stderr.strip()[-1500:]!r}")


# --------------------------------------------------------------------------------------------------------------
# GGUF files edited through the gguf package: for model files that the synthetic writer refuses to produce
# --------------------------------------------------------------------------------------------------------------

def rewrite_gguf(src, dst, arch=None, set_keys=None, drop_keys=(), tensors=None, drop_tensors=()) -> str:
    """Copy the GGUF ``src`` to ``dst`` with changes; returns ``dst``.

    ``arch`` renames the architecture (and the ``<arch>.`` keys); ``set_keys`` maps a key to
    ``(value, GGUFValueType[, sub_type])``; ``tensors`` maps a name to new float data (replacing or adding a
    tensor, F32/F16 only); ``drop_keys`` / ``drop_tensors`` leave keys / tensors out. Tensors that are kept
    are copied byte for byte (quantized ones with their raw type).
    """
    import gguf

    r = gguf.GGUFReader(str(src))
    old_arch = r.fields["general.architecture"].contents()
    arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        new_key = arch + key[len(old_arch):] if key.startswith(old_arch + ".") else key
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(new_key, f.contents(), f.types[0], sub)
    for key, (value, vtype, *sub) in set_keys.items():
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    tensors = dict(tensors or {})
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in tensors:
            w.add_tensor(t.name, np.asarray(tensors.pop(t.name)))
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        w.add_tensor(name, np.asarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def region_weights(region) -> set[str]:
    """Names of the leaves (weights) the nodes from an expert region's inputs to its output read."""
    from ggml_hybrid._native import ffi

    def key(t):
        return int(ffi.cast("uintptr_t", t.ptr))

    stop = {key(t) for t in region.inputs}
    seen, names, stack = set(), set(), [region.out]
    while stack:
        t = stack.pop()
        if key(t) in seen or key(t) in stop:
            continue
        seen.add(key(t))
        if t.op == "NONE":
            names.add(t.name)
        stack.extend(t.src)
    return names


def greedy_chat_reply(m, template, msgs, n: int) -> str:
    """The reply the default sampler gives to ``msgs`` rendered by ``template``, from an empty cache: at most ``n``
    tokens, up to an end-of-generation token (the oracle of the chat tests: what a fresh model says)."""
    from ggml_hybrid.runtime.sampling import Sampler

    tok = m.tokenizer
    m.reset()
    logits = m.eval(tok.encode(template.render(msgs), add_bos=tok.add_bos, special=True))
    s, reply = Sampler(), []
    for _ in range(n):
        tid = s(logits[-1])
        if tid in tok.eog_ids:
            break
        reply.append(tid)
        logits = m.eval([tid])
    return tok.decode(reply)


# An OpenAI tool both the structured-output tests and the server's use: bounded arguments, so a forced call's
# grammar is finite.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}


# a small model of each family (ggml_hybrid.synthetic.write_model's keywords), with what makes it different
# switched on (as tests/test_families.py): sliding windows, latent
# attention, dense leading layers, a SentencePiece vocabulary, delta-net layers
FAMILY_SPECS = {
    "qwen3moe": {}, "qwen2moe": dict(n_head_kv=4, head_dim=16), "llama": dict(vocab="spm", vocab_size=512),
    "olmoe": dict(n_head_kv=4, head_dim=16),
    "glm4moe": dict(n_layer=3, n_dense_lead=1, n_rot=16, gating="sigmoid", weights_scale=2.5, qk_norm=True),
    "deepseek2": dict(n_layer=3, n_dense_lead=1, n_expert=16, n_used=4, gating="sigmoid", weights_scale=2.5,
                      n_group=4, n_group_used=2),
    "gpt-oss": dict(n_layer=2, head_dim=32, expert_type="mxfp4", n_swa=4),
    "qwen3next": dict(n_layer=4, n_rot=8, attn_interval=2), "qwen35moe": dict(n_layer=4, n_rot=8, attn_interval=2),
}
assert set(FAMILY_SPECS) == set(ARCHS)
