"""The graph API covers every operation of the pin: its op list against the pin's enums and CPU kernels.

Oracles: the pin's own ggml.h (GGML_OP_*, GGML_UNARY_OP_*, GGML_GLU_OP_* as written there), the library's name tables
(ggml_op_name and friends over the enums) and the pin's ggml-cpu.c (the cases of ggml_compute_forward: which ops
have a CPU kernel). A new pin's new op or kind fails here until it has a method or a stated reason.
"""

from __future__ import annotations

import inspect
import re
import tarfile

import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid._native import buildinfo, cstr, lib
from ggml_hybrid.ggml.ops import OpsMixin
from ggml_hybrid.ggml.ops import catalog as cat
from ggml_hybrid_build.pin import fetch_archive as pin_archive

T = gh.GGMLType


def _pin_source(path: str) -> str:
    """A file of the pinned GGML source, from the pin's archive (downloaded and checked by the build)."""
    pin = buildinfo.load_pin()
    with tarfile.open(pin_archive(pin)) as tar:
        f = tar.extractfile(f"{pin['ggml_path'].rstrip('/')}/{path}")
        assert f is not None
        return f.read().decode()


@pytest.fixture(scope="module")
def ggml_h() -> str:
    if not buildinfo.VENDOR_DIR.is_dir():
        pytest.skip("needs the source checkout's vendor/ (the pin)")
    return _pin_source("include/ggml.h")


def _enum(header: str, name: str, prefix: str) -> list[str]:
    body = re.search(r"enum " + name + r"\s*\{(.*?)\};", header, re.S)
    assert body, name
    return [m for m in re.findall(prefix + r"(\w+)", body.group(1)) if m != "COUNT"]


def test_the_library_names_the_ops_of_the_pins_header(ggml_h):
    assert list(cat.OP_CODES) == _enum(ggml_h, "ggml_op", "GGML_OP_")
    assert [cstr(lib.ggml_unary_op_name(i)) for i in range(lib.GGML_UNARY_OP_COUNT)] == \
        _enum(ggml_h, "ggml_unary_op", "GGML_UNARY_OP_")
    assert [cstr(lib.ggml_glu_op_name(i)) for i in range(lib.GGML_GLU_OP_COUNT)] == \
        _enum(ggml_h, "ggml_glu_op", "GGML_GLU_OP_")


def test_every_op_has_a_method_or_a_reason():
    ops = set(cat.OP_CODES)
    assert not set(cat.OP_METHODS) & set(cat.NOT_EXPOSED)
    assert set(cat.OP_METHODS) | set(cat.NOT_EXPOSED) == ops, (
        f"ops with neither a method nor a reason: {sorted(ops - set(cat.OP_METHODS) - set(cat.NOT_EXPOSED))}; "
        f"named but not in the pin: {sorted((set(cat.OP_METHODS) | set(cat.NOT_EXPOSED)) - ops)}")
    assert set(cat.UNARY_METHODS) == set(gh.ggml.ops.UNARY_KINDS)
    assert set(cat.GLU_METHODS) == set(gh.ggml.ops.GLU_KINDS)


def test_every_named_method_exists_and_every_op_method_is_named():
    named = set(cat.method_ops())
    public = {n for n, f in inspect.getmembers(OpsMixin, inspect.isfunction) if not n.startswith("_")}
    aliases = {"soft_max_ext", "rope_ext", "flash_attn_ext"}
    assert named <= public, f"named in the catalog but missing: {sorted(named - public)}"
    assert public - aliases <= named, f"methods the catalog does not name: {sorted(public - aliases - named)}"


def test_ops_without_a_cpu_kernel_are_the_ones_listed():
    if not buildinfo.VENDOR_DIR.is_dir():
        pytest.skip("needs the source checkout's vendor/ (the pin)")
    src = _pin_source("src/ggml-cpu/ggml-cpu.c")
    start = src.index("static void ggml_compute_forward(")
    body = src[start:src.index("\n}\n", start)]
    handled = set(re.findall(r"case GGML_OP_(\w+):\s*\{", body))
    # ops GGML computes nothing for: leaves and views (their cases abort if a graph ever asks)
    no_compute = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "COUNT"}
    missing = {op for op in cat.OP_METHODS if op not in handled and op not in no_compute}
    assert missing == set(cat.NO_CPU_KERNEL)


# -- one example call per method: the node it makes has the op the catalog says -------------------------------------

SHAPES = {"v": (8,), "m": (3, 8), "m4": (4, 4), "t3": (2, 3, 8), "img": (1, 2, 6, 6), "k2": (3, 2, 3, 3),
          "k1": (3, 2, 3), "sig": (1, 2, 10), "rows": (4, 8), "col": (1, 8), "one": (1,), "sq": (2, 4, 4),
          "rope_in": (3, 2, 8), "bias": (5, 8), "x3": (3, 2, 8), "sm": (2, 3, 5), "tok": (2, 2, 4)}


def _t(c: gh.Context, name: str, dtype: str = "f32") -> gh.Tensor:
    return c.new_tensor(dtype, SHAPES[name], name)


def _param(c: gh.Context) -> gh.Tensor:
    p = c.new_tensor("f32", (3, 8), "p")
    p.set_param()
    return p


EXAMPLES = {
    "dup": lambda c: c.dup(_t(c, "m")),
    "add": lambda c: c.add(_t(c, "m"), _t(c, "v")),
    "add_cast": lambda c: c.add_cast(_t(c, "m", "f16"), _t(c, "v")),
    "add_id": lambda c: c.add_id(_t(c, "x3"), _t(c, "bias"), c.new_tensor("i32", (3, 2), "ids")),
    "add1": lambda c: c.add1(_t(c, "m"), _t(c, "one")),
    "acc": lambda c: c.acc(_t(c, "m"), _t(c, "v")),
    "sub": lambda c: c.sub(_t(c, "m"), _t(c, "v")),
    "mul": lambda c: c.mul(_t(c, "m"), _t(c, "v")),
    "div": lambda c: c.div(_t(c, "m"), _t(c, "v")),
    "sqr": lambda c: c.sqr(_t(c, "m")), "sqrt": lambda c: c.sqrt(_t(c, "m")), "log": lambda c: c.log(_t(c, "m")),
    "sin": lambda c: c.sin(_t(c, "m")), "cos": lambda c: c.cos(_t(c, "m")),
    "sum": lambda c: c.sum(_t(c, "m")), "sum_rows": lambda c: c.sum_rows(_t(c, "m")),
    "cumsum": lambda c: c.cumsum(_t(c, "m")), "mean": lambda c: c.mean(_t(c, "m")),
    "argmax": lambda c: c.argmax(_t(c, "m")),
    "count_equal": lambda c: c.count_equal(_t(c, "m", "i32"), _t(c, "m", "i32")),
    "repeat": lambda c: c.repeat(_t(c, "v"), (2, 8)), "repeat_like": lambda c: c.repeat_like(_t(c, "v"), _t(c, "m")),
    "repeat_back": lambda c: c.repeat_back(_t(c, "m"), (8,)),
    "concat": lambda c: c.concat(_t(c, "m"), _t(c, "m"), axis=0),
    "silu_back": lambda c: c.silu_back(_t(c, "m"), _t(c, "m")),
    "norm": lambda c: c.norm(_t(c, "m")), "rms_norm": lambda c: c.rms_norm(_t(c, "m")),
    "rms_norm_back": lambda c: c.rms_norm_back(_t(c, "m"), _t(c, "m")),
    "group_norm": lambda c: c.group_norm(_t(c, "img"), 2), "l2_norm": lambda c: c.l2_norm(_t(c, "m")),
    "mul_mat": lambda c: c.mul_mat(_t(c, "m"), _t(c, "rows")),
    "mul_mat_f32": lambda c: c.mul_mat_f32(_t(c, "m"), _t(c, "rows")),
    "mul_mat_hadamard": lambda c: c.mul_mat_hadamard(c.new_tensor("f32", (8, 8), "h"), _t(c, "m")),
    "mul_mat_id": lambda c: c.mul_mat_id(c.new_tensor("f32", (4, 5, 8), "e"), c.new_tensor("f32", (3, 1, 8), "x"),
                                         c.new_tensor("i32", (3, 2), "ids")),
    "out_prod": lambda c: c.out_prod(_t(c, "m"), c.new_tensor("f32", (3, 5), "b")),
    "scale": lambda c: c.scale(_t(c, "m"), 2.0), "scale_bias": lambda c: c.scale_bias(_t(c, "m"), 2.0, 1.0),
    "set": lambda c: c.set(_t(c, "m"), _t(c, "v")),
    "cpy": lambda c: c.cpy(_t(c, "m"), _t(c, "m", "f16")), "cast": lambda c: c.cast(_t(c, "m"), "f16"),
    "cont": lambda c: c.cont(c.transpose(_t(c, "m"))),
    "reshape": lambda c: c.reshape(_t(c, "m"), (24,)), "view": lambda c: c.view(_t(c, "m"), (8,)),
    "permute": lambda c: c.permute(_t(c, "m"), (1, 0)), "transpose": lambda c: c.transpose(_t(c, "m")),
    "get_rows": lambda c: c.get_rows(_t(c, "m"), c.new_tensor("i32", (2,), "r")),
    "get_rows_back": lambda c: c.get_rows_back(_t(c, "m"), c.new_tensor("i32", (3,), "r"), 5),
    "set_rows": lambda c: c.set_rows(_t(c, "bias"), _t(c, "m"), c.new_tensor("i32", (3,), "r")),
    "diag": lambda c: c.diag(_t(c, "col")),
    "diag_mask_inf": lambda c: c.diag_mask_inf(_t(c, "m4")), "diag_mask_zero": lambda c: c.diag_mask_zero(_t(c, "m4")),
    "soft_max": lambda c: c.soft_max(_t(c, "m")),
    "soft_max_back": lambda c: c.soft_max_back(_t(c, "m"), _t(c, "m")),
    "rope": lambda c: c.rope(_t(c, "rope_in"), c.new_tensor("i32", (3,), "pos"), 8),
    "rope_multi": lambda c: c.rope_multi(_t(c, "rope_in"), c.new_tensor("i32", (12,), "pos"), 8, [2, 1, 1, 0]),
    "rope_back": lambda c: c.rope_back(_t(c, "rope_in"), c.rope(_t(c, "rope_in"), c.new_tensor("i32", (3,), "p"),
                                                                  8)),
    "clamp": lambda c: c.clamp(_t(c, "m"), -1.0, 1.0),
    "conv_transpose_1d": lambda c: c.conv_transpose_1d(c.new_tensor("f32", (2, 3, 3), "k"),
                                                       c.new_tensor("f32", (2, 7), "x")),
    "im2col": lambda c: c.im2col(_t(c, "k2"), _t(c, "img")),
    "conv_1d": lambda c: c.conv_1d(_t(c, "k1", "f16"), _t(c, "sig")),
    "conv_2d": lambda c: c.conv_2d(_t(c, "k2", "f16"), _t(c, "img")),
    "im2col_back": lambda c: c.im2col_back(c.new_tensor("f32", (1, 4, 4, 18), "g"), _t(c, "k2"), (1, 2, 6, 6)),
    "im2col_3d": lambda c: c.im2col_3d(c.new_tensor("f32", (6, 2, 2, 2), "k"), c.new_tensor("f32", (2, 3, 4, 4), "x"),
                                       2),
    "col2im_1d": lambda c: c.col2im_1d(c.new_tensor("f32", (5, 6), "cols"), 2, 2),
    "conv_2d_direct": lambda c: c.conv_2d_direct(_t(c, "k2"), _t(c, "img")),
    "conv_3d_direct": lambda c: c.conv_3d_direct(c.new_tensor("f32", (6, 2, 2, 2), "k"),
                                                 c.new_tensor("f32", (2, 3, 4, 4), "x"), (1, 2, 3)),
    "conv_2d_dw_direct": lambda c: c.conv_2d_dw_direct(c.new_tensor("f32", (2, 1, 3, 3), "k"), _t(c, "img")),
    "conv_transpose_2d": lambda c: c.conv_transpose_2d(c.new_tensor("f32", (2, 3, 2, 2), "k"), _t(c, "img"), 2),
    "pool_1d": lambda c: c.pool_1d(_t(c, "m"), "max", 2),
    "pool_2d": lambda c: c.pool_2d(_t(c, "img"), "avg", 2),
    "pool_2d_back": lambda c: c.pool_2d_back(c.new_tensor("f32", (1, 2, 3, 3), "g"), _t(c, "img"), "max", 2),
    "interpolate": lambda c: c.interpolate(_t(c, "img"), (1, 2, 9, 4), "bilinear"),
    "upscale": lambda c: c.upscale(_t(c, "img"), 2),
    "pad": lambda c: c.pad(_t(c, "m"), (1, 2)), "pad_reflect_1d": lambda c: c.pad_reflect_1d(_t(c, "m"), 2, 1),
    "roll": lambda c: c.roll(_t(c, "m"), (1, -3)), "arange": lambda c: c.arange(0.0, 5.0, 0.5),
    "timestep_embedding": lambda c: c.timestep_embedding(_t(c, "v"), 6),
    "argsort": lambda c: c.argsort(_t(c, "m")), "argsort_top_k": lambda c: c.argsort_top_k(_t(c, "m"), 2),
    "top_k": lambda c: c.top_k(_t(c, "m"), 2),
    "leaky_relu": lambda c: c.leaky_relu(_t(c, "m")), "tri": lambda c: c.tri(_t(c, "m4")),
    "fill": lambda c: c.fill(_t(c, "m"), 2.0),
    "flash_attn": lambda c: c.flash_attn(c.new_tensor("f32", (2, 3, 8), "q"), c.new_tensor("f16", (1, 5, 8), "k"),
                                         c.new_tensor("f16", (1, 5, 8), "v")),
    "ssm_conv": lambda c: c.ssm_conv(c.new_tensor("f32", (1, 4, 6), "sx"), c.new_tensor("f32", (4, 3), "cw")),
    "ssm_scan": lambda c: c.ssm_scan(c.new_tensor("f32", (2, 2, 4, 8), "s"), c.new_tensor("f32", (1, 3, 2, 4), "x"),
                                     c.new_tensor("f32", (1, 3, 2), "dt"), c.new_tensor("f32", (2, 1), "A"),
                                     c.new_tensor("f32", (1, 3, 1, 8), "B"), c.new_tensor("f32", (1, 3, 1, 8), "C"),
                                     c.new_tensor("i32", (1,), "ids")),
    "win_part": lambda c: c.win_part(c.new_tensor("f32", (5, 7, 3), "a"), 3),
    "win_unpart": lambda c: c.win_unpart(c.new_tensor("f32", (6, 3, 3, 4), "a"), 5, 7, 3),
    "get_rel_pos": lambda c: c.get_rel_pos(c.new_tensor("f16", (5, 4), "a"), 3, 3),
    "add_rel_pos": lambda c: c.add_rel_pos(c.new_tensor("f32", (2, 6, 9), "a"), c.new_tensor("f32", (2, 2, 3, 3), "w"),
                                           c.new_tensor("f32", (2, 2, 3, 3), "h")),
    "rwkv_wkv6": lambda c: c.rwkv_wkv6(_t(c, "tok"), _t(c, "tok"), _t(c, "tok"), c.new_tensor("f32", (2, 4), "tf"),
                                       _t(c, "tok"), c.new_tensor("f32", (1, 32), "s")),
    "gated_linear_attn": lambda c: c.gated_linear_attn(_t(c, "tok"), _t(c, "tok"), _t(c, "tok"), _t(c, "tok"),
                                                       c.new_tensor("f32", (1, 32), "s"), 0.5),
    "rwkv_wkv7": lambda c: c.rwkv_wkv7(*[c.new_tensor("f32", (2, 1, 64), n) for n in "rwkvab"],
                                       c.new_tensor("f32", (1, 4096), "s")),
    "solve_tri": lambda c: c.solve_tri(_t(c, "m4"), c.new_tensor("f32", (4, 2), "b")),
    "gated_delta_net": lambda c: c.gated_delta_net(*[c.new_tensor("f32", (1, 2, 2, 4), n) for n in "qkv"],
                                                   c.new_tensor("f32", (1, 2, 2, 1), "g"),
                                                   c.new_tensor("f32", (1, 2, 2, 1), "b"),
                                                   c.new_tensor("f32", (1, 2, 4, 4), "s")),
    "lightning_indexer": lambda c: c.lightning_indexer(c.new_tensor("f32", (2, 3, 2, 8), "q"),
                                                       c.new_tensor("f32", (2, 5, 1, 8), "k"),
                                                       c.new_tensor("f32", (2, 1, 3, 2), "w"),
                                                       c.new_tensor("f16", (1, 1, 3, 5), "m")),
    "dsv4_hc_comb": lambda c: c.dsv4_hc_comb(c.new_tensor("f32", (3, 24), "mix"), c.new_tensor("f32", (3,), "s"),
                                             c.new_tensor("f32", (24,), "b")),
    "dsv4_hc_pre": lambda c: c.dsv4_hc_pre(c.new_tensor("f32", (3, 4, 8), "x"), c.new_tensor("f32", (3, 4), "w")),
    "dsv4_hc_pre_gated": lambda c: c.dsv4_hc_pre_gated(c.new_tensor("f32", (3, 4, 8), "x"),
                                                       c.new_tensor("f32", (3, 4, 8), "g")),
    "dsv4_hc_post": lambda c: c.dsv4_hc_post(c.new_tensor("f32", (3, 8), "x"), c.new_tensor("f32", (3, 4, 8), "r"),
                                             c.new_tensor("f32", (3, 4), "p"), c.new_tensor("f32", (3, 4, 4), "cb")),
    "unary": lambda c: c.unary(_t(c, "m"), "tanh"), "xielu": lambda c: c.xielu(_t(c, "m")),
    "glu": lambda c: c.glu(_t(c, "m"), kind="reglu"),
    "cross_entropy_loss": lambda c: c.cross_entropy_loss(_t(c, "m"), _t(c, "m")),
    "cross_entropy_loss_back": lambda c: c.cross_entropy_loss_back(_t(c, "one"), _t(c, "m"), _t(c, "m")),
    "opt_step_adamw": lambda c: c.opt_step_adamw(_param(c), _t(c, "m"), _t(c, "m"), _t(c, "m"),
                                                 c.new_tensor("f32", (7,), "h")),
    "opt_step_sgd": lambda c: c.opt_step_sgd(_param(c), _t(c, "m"), c.new_tensor("f32", (2,), "h")),
    "swiglu_oai": lambda c: c.swiglu_oai(_t(c, "m"), _t(c, "m"), 1.7, 7.0),
    "swiglu_clamp": lambda c: c.swiglu_clamp(_t(c, "m"), _t(c, "m"), 7.0),
}


def _ops_under(t: gh.Tensor) -> set[str]:
    """The ops of ``t`` and of everything it depends on (views' sources included)."""
    seen, stack, ops = set(), [t.ptr], set()
    while stack:
        p = stack.pop()
        if int(gh.ffi.cast("uintptr_t", p)) in seen:
            continue
        seen.add(int(gh.ffi.cast("uintptr_t", p)))
        ops.add(cstr(lib.ggml_op_name(p.op)))
        stack.extend(p.src[i] for i in range(lib.GGML_MAX_SRC) if p.src[i] != gh.ffi.NULL)
    return ops


@pytest.mark.parametrize("method", sorted(cat.method_ops()))
def test_each_method_makes_the_op_the_catalog_names(method):
    op = cat.method_ops()[method]
    with gh.Context(n_tensors=64) as c:
        if op in ("UNARY", "GLU") and method in {**cat.UNARY_METHODS, **cat.GLU_METHODS}.values() \
                and method not in EXAMPLES:
            kind = method
            node = getattr(c, method)(_t(c, "m"))
            assert cstr(lib.ggml_op_desc(node.ptr)).lower() == kind
        else:
            node = EXAMPLES[method](c)
        assert op in _ops_under(node), f"{method} made {sorted(_ops_under(node))}, the catalog says {op}"
        assert np.prod(node.shape) == node.nelements


def test_every_method_has_an_example():
    kinds = set(cat.UNARY_METHODS.values()) | set(cat.GLU_METHODS.values())
    assert set(cat.method_ops()) - kinds <= set(EXAMPLES), sorted(set(cat.method_ops()) - kinds - set(EXAMPLES))
    assert set(EXAMPLES) <= set(cat.method_ops())
