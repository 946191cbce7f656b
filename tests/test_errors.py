"""Deliberately wrong calls raise typed exceptions, and the interpreter survives them.

Each in-process test ends by computing something correct, so that a check which
left native state broken would fail too. Calls that crash the process instead
(package bugs: a GGML_ASSERT, abort or segfault the Python layer does not
prevent) run in a child interpreter (helpers.assert_typed_error_isolated) and
are each reproduced in a child process, which must survive with the typed error.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from helpers import Raw, assert_typed_error_isolated, run_isolated

import ggml_hybrid as gh

E = gh.errors
F32 = np.float32


def weights(backend, **arrays):
    """A context holding the given arrays as allocated tensors (data set)."""
    ctx = gh.Context(n_tensors=len(arrays) + 1)
    ts = {name: ctx.new_tensor(a.dtype, a.shape, name) for name, a in arrays.items()}
    ctx.allocate(backend)
    for name, a in arrays.items():
        ts[name].set(a)
    return ctx, ts


def still_works(run):
    """A small correct computation: the library is usable after the error."""
    a = np.arange(6, dtype=F32).reshape(2, 3)
    out = run(lambda c, t: c.mul_mat(t["a"], t["a"]), consts={"a": a})
    assert np.allclose(out, a @ a.T)


# ------------------------------------------------------------------------------------------------------------
# shapes and types
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a_shape,b_shape", [((3, 4), (2, 5)),  # k differs
                                             ((2, 3, 4), (3, 5, 4)),  # b's batch 3 is not a multiple of 2
                                             ((4,), (2, 3))])
def test_mul_mat_shape_mismatch(run, a_shape, b_shape):
    with gh.Context() as c:
        a, b = c.new_tensor("f32", a_shape, "a"), c.new_tensor("f32", b_shape, "b")
        with pytest.raises(E.ShapeError, match="mul_mat"):
            c.mul_mat(a, b)
        assert isinstance(E.ShapeError("x"), ValueError)  # also catchable as ValueError
    still_works(run)


def test_tensor_set_wrong_dtype_and_shape(cpu_backend, run):
    ctx, t = weights(cpu_backend, x=np.zeros((2, 3), F32))
    with ctx:
        x = t["x"]
        with pytest.raises(E.DTypeError):
            x.set(np.zeros((2, 3), np.int32))
        with pytest.raises(E.DTypeError):
            x.set(np.zeros((2, 3), np.float64))  # no silent conversion
        with pytest.raises(E.ShapeError):
            x.set(np.zeros((3, 2), F32))
        assert np.array_equal(x.numpy(), np.zeros((2, 3), F32))  # nothing was written
        x.set(np.ones((2, 3), F32))
        assert np.array_equal(x.numpy(), np.ones((2, 3), F32))
    still_works(run)


def test_quantized_tensor_takes_raw_bytes_only(cpu_backend):
    with gh.Context() as c:
        q = c.new_tensor("q8_0", (2, 32), "q")
        c.allocate(cpu_backend)
        with pytest.raises(E.DTypeError):
            q.set(np.zeros((2, 32), F32))
        with pytest.raises(E.DTypeError):
            q.set(np.zeros(q.nbytes - 1, np.uint8))
        raw = gh.quantize(np.ones((2, 32), F32), "q8_0")
        q.set(raw)
        assert np.array_equal(q.numpy(), raw.ravel())


@pytest.mark.parametrize("build", [
    pytest.param(lambda c, f16, f32, i32: c.rms_norm(f16), id="rms_norm(F16)"),
    pytest.param(lambda c, f16, f32, i32: c.mul_mat(f32, i32), id="mul_mat(b=I32)"),
    pytest.param(lambda c, f16, f32, i32: c.get_rows(f32, f32), id="get_rows(rows=F32)"),
    pytest.param(lambda c, f16, f32, i32: c.add(f32, f16), id="add(F32, F16)"),
    pytest.param(lambda c, f16, f32, i32: c.soft_max(i32), id="soft_max(I32)"),
    pytest.param(lambda c, f16, f32, i32: c.argsort(f16), id="argsort(F16)"),
    pytest.param(lambda c, f16, f32, i32: c.rope(f32, f32, 2), id="rope(pos=F32)"),
    pytest.param(lambda c, f16, f32, i32: c.mul_mat_id(c.reshape(f32, (1, 4, 4)), c.reshape(f32, (4, 1, 4)),
                                                       c.reshape(f16, (4, 4))), id="mul_mat_id(ids=F16)"),
])
def test_wrong_dtype(run, build):
    with gh.Context() as c:
        f16, f32, i32 = (c.new_tensor(t, (4, 4), t) for t in ("f16", "f32", "i32"))
        with pytest.raises(E.DTypeError):
            build(c, f16, f32, i32)
    still_works(run)


@pytest.mark.parametrize("op", ["concat", "swiglu"])
def test_mismatched_input_types_are_dtype_errors(op):
    with gh.Context() as c:
        f32, f16 = c.new_tensor("f32", (4, 4), "f32"), c.new_tensor("f16", (4, 4), "f16")
        with pytest.raises(E.DTypeError):
            getattr(c, op)(f32, f16)


def test_bad_scalar_arguments(run):
    with gh.Context() as c:
        a = c.new_tensor("f32", (2, 4), "a")
        pos = c.new_tensor("i32", (2,), "pos")
        with pytest.raises(ValueError):
            c.scale(a, float("nan"))
        with pytest.raises(ValueError):
            c.rms_norm(a, -1.0)
        with pytest.raises(ValueError):
            c.top_k(a, 5)  # k > row length
        with pytest.raises(ValueError):
            c.glu(a, kind="nope")
        with pytest.raises(ValueError):
            c.rope(c.reshape(a, (2, 1, 4)), pos, 4, mode="sideways")
        with pytest.raises(E.ShapeError):
            c.rope(c.reshape(a, (2, 1, 4)), pos, 3)  # odd n_dims
        with pytest.raises(E.ShapeError):
            c.view(a, (3, 4))  # past the end
        with pytest.raises(E.ShapeError):
            c.permute(a, (0, 0))
        with pytest.raises(E.ShapeError):
            c.reshape(a, (3, 3))
    still_works(run)


def test_tensor_name_too_long(cpu_backend, run):
    with gh.Context() as c:
        t = c.new_tensor("f32", (2,), "short")
        limit = gh.lib.GGML_MAX_NAME - 1
        t.name = "n" * limit  # the longest allowed
        assert t.name == "n" * limit
        with pytest.raises(ValueError, match="longer"):
            t.name = "n" * (limit + 1)
        with pytest.raises(ValueError):
            t.name = "é" * (limit // 2 + 1)  # the limit is in bytes, not characters
        assert t.name == "n" * limit  # unchanged
        with pytest.raises(ValueError):
            c.new_tensor("f32", (2,), "x" * 200)
    still_works(run)


# ------------------------------------------------------------------------------------------------------------
# index ranges
# ------------------------------------------------------------------------------------------------------------

A_ROWS = np.arange(12, dtype=F32).reshape(3, 4)


def test_get_rows_constant_index_out_of_range_at_build(cpu_backend, run):
    """An index tensor that already holds data is checked when the op is built."""
    for bad in (np.array([0, 3], np.int32), np.array([-1, 0], np.int32)):
        wctx, t = weights(cpu_backend, a=A_ROWS, rows=bad)
        with wctx, gh.Context(graph_size=32) as c:
            with pytest.raises(E.IndexRangeError, match="get_rows"):
                c.get_rows(t["a"], t["rows"])
            assert isinstance(E.IndexRangeError("x"), IndexError)
    still_works(run)


@pytest.mark.parametrize("where", ["graph_input", "weights_context"])
def test_get_rows_index_out_of_range_set_after_build(cpu_backend, where):
    """Data set into an index tensor after the op exists is checked by Tensor.set; good data then computes."""
    wctx, t = weights(cpu_backend, a=A_ROWS, rows0=np.zeros(2, np.int32))
    with wctx, gh.Context(graph_size=32) as c, gh.Scheduler([cpu_backend], graph_size=32) as s:
        rows = c.new_tensor("i32", (2,), "rows").set_input() if where == "graph_input" else t["rows0"]
        y = c.get_rows(t["a"], rows).set_output()
        g = c.new_graph(32).expand(y)
        s.alloc(g)
        for bad in ([0, 3], [2, 100], [-1, 0]):
            with pytest.raises(E.IndexRangeError, match="0..2"):
                rows.set(np.array(bad, np.int32))
        rows.set(np.array([2, 0], np.int32))
        s.compute(g)
        assert np.array_equal(y.numpy(), A_ROWS[[2, 0]])


def test_index_bound_is_the_tightest_of_its_uses(cpu_backend):
    wctx, t = weights(cpu_backend, big=np.zeros((5, 4), F32), small=np.arange(8, dtype=F32).reshape(2, 4))
    with wctx, gh.Context(graph_size=32) as c, gh.Scheduler([cpu_backend], graph_size=32) as s:
        rows = c.new_tensor("i32", (1,), "rows").set_input()
        y1 = c.get_rows(t["big"], rows)
        y2 = c.get_rows(t["small"], rows).set_output()
        y3 = c.get_rows(t["big"], rows)  # a later, looser use must not widen the bound
        g = c.new_graph(32).expand(y1, y2, y3)
        s.alloc(g)
        with pytest.raises(E.IndexRangeError):
            rows.set(np.array([3], np.int32))  # in range for big, not for small
        rows.set(np.array([1], np.int32))
        s.compute(g)
        assert np.array_equal(y2.numpy().ravel(), t["small"].numpy()[1])


def test_mul_mat_id_expert_out_of_range(cpu_backend, run):
    experts = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(F32)
    b = np.ones((2, 1, 4), F32)
    # a constant ids tensor: checked when mul_mat_id is built
    wctx, t = weights(cpu_backend, e=experts, b=b, ids=np.array([[0, 3], [1, 2]], np.int32))
    with wctx, gh.Context(graph_size=32) as c:
        with pytest.raises(E.IndexRangeError, match="mul_mat_id"):
            c.mul_mat_id(t["e"], t["b"], t["ids"])
    # a graph input: checked when its data is set
    wctx, t = weights(cpu_backend, e=experts, b=b)
    with wctx, gh.Context(graph_size=32) as c, gh.Scheduler([cpu_backend], graph_size=32) as s:
        ids = c.new_tensor("i32", (2, 2), "ids").set_input()
        y = c.mul_mat_id(t["e"], t["b"], ids).set_output()
        g = c.new_graph(32).expand(y)
        s.alloc(g)
        for bad in ([[0, 3], [1, 2]], [[0, 1], [-1, 2]], [[0, 1], [2, 2**31 - 1]]):
            with pytest.raises(E.IndexRangeError):
                ids.set(np.array(bad, np.int32))
        good = np.array([[2, 0], [1, 2]], np.int32)
        ids.set(good)
        s.compute(g)
        ref = np.stack([[experts[good[ti, j]] @ b[ti, 0] for j in range(2)] for ti in range(2)])
        assert np.allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    still_works(run)


# ------------------------------------------------------------------------------------------------------------
# capacity: context pools and graphs
# ------------------------------------------------------------------------------------------------------------

def test_context_pool_exhaustion(run):
    with gh.Context(n_tensors=2) as c:
        a = c.new_tensor("f32", (4,), "a")
        c.new_tensor("f32", (4,), "b")
        with pytest.raises(E.AllocationError, match="pool is full"):
            c.new_tensor("f32", (4,), "c")
        with pytest.raises(E.AllocationError):
            c.add(a, a)
        assert isinstance(E.AllocationError("x"), MemoryError)
    with gh.Context(n_tensors=2, mem_size=64, no_alloc=False) as c:  # a context that owns its data
        c.new_tensor("f32", (16,), "fits")  # 64 bytes of data
        with pytest.raises(E.AllocationError):
            c.new_tensor("f32", (64,), "does_not")  # 256 more bytes
    still_works(run)


def test_graph_overflow(cpu_backend, run):
    wctx, t = weights(cpu_backend, x=np.ones(4, F32))
    with wctx, gh.Context(graph_size=64) as c:
        y = t["x"]
        for _ in range(10):
            y = c.add(y, t["x"])
        small = c.new_graph(4)
        with pytest.raises(E.AllocationError, match="larger graph"):
            small.expand(y)
        assert small.n_nodes + small.n_leafs <= 4
        # a graph too large for the context's reserved graph memory
        with gh.Context(n_tensors=2, graph_size=8) as tiny:
            with pytest.raises(E.AllocationError, match="graph_size"):
                tiny.new_graph(4096)
        # a graph larger than the scheduler was made for
        g = c.new_graph(64).expand(y)
        with gh.Scheduler([cpu_backend], graph_size=4) as s:
            with pytest.raises(E.AllocationError, match="graph_size"):
                s.alloc(g)
        with gh.Scheduler([cpu_backend], graph_size=64) as s:
            s.compute(g)
            assert np.array_equal(y.numpy(), np.full(4, 11, F32))
    still_works(run)


# ------------------------------------------------------------------------------------------------------------
# closed objects
# ------------------------------------------------------------------------------------------------------------

def test_closed_context_graph_scheduler_backend(cpu_backend, run):
    c = gh.Context(graph_size=16)
    a = c.new_tensor("f32", (2,), "a")
    g = c.new_graph(16).expand(c.scale(a, 2.0))
    c.close()
    with pytest.raises(E.ClosedError):
        c.new_tensor("f32", (2,))
    with pytest.raises(E.ClosedError):
        _ = g.n_nodes
    with pytest.raises(E.ClosedError):
        c.new_graph(4)
    assert repr(a) == "<Tensor (closed context)>"
    s = gh.Scheduler([cpu_backend], graph_size=16)
    s.close()
    with pytest.raises(E.ClosedError):
        _ = s.n_splits
    b = gh.cpu(1)
    b.close()
    with pytest.raises(E.ClosedError):
        _ = b.name
    with pytest.raises(E.ClosedError):
        gh.Scheduler([b], graph_size=4)
    still_works(run)


TENSOR_AFTER_CLOSE = """
c = gh.Context()  # default size: its memory is returned to the OS by free()
t = c.new_tensor("f32", (2,), "t")
c.allocate(cpu)
c.close()
{action}
"""


@pytest.mark.parametrize("action", ["t.shape", "t.set(np.ones(2, np.float32))", "t.numpy()",
                                    "gh.Context().add(t, t)"])
def test_tensor_after_context_close(action):
    assert_typed_error_isolated(TENSOR_AFTER_CLOSE.format(action=action), "ClosedError")


# ------------------------------------------------------------------------------------------------------------
# the checks are what keeps the process alive
# ------------------------------------------------------------------------------------------------------------

def test_raw_c_call_aborts_where_python_raises():
    """The same mismatched mul_mat through gh.lib directly kills the interpreter (GGML_ASSERT -> abort)."""
    p = run_isolated("""
        c = gh.Context()
        a, b = c.new_tensor("f32", (3, 4), "a"), c.new_tensor("f32", (2, 5), "b")
        try:
            c.mul_mat(a, b)
        except gh.errors.ShapeError:
            print("python check raised ShapeError", flush=True)
        gh.lib.ggml_mul_mat(c.ptr, a.ptr, b.ptr)
        print("survived the raw call", flush=True)
    """)
    assert "python check raised ShapeError" in p.stdout
    assert "survived the raw call" not in p.stdout
    assert p.returncode == -signal.SIGABRT, (p.returncode, p.stderr[-500:])
    assert "GGML_ASSERT" in p.stderr


# Calls the Python layer lets through and GGML then kills the process on (found while writing these tests).
# Each must raise a typed error (ShapeError/DTypeError/IndexRangeError) instead.
CRASHES = {
    "mul_mat_transposed_b": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.mul_mat(t["a"], c.transpose(t["b"])),
                      consts={"a": np.ones((3, 2), np.float32), "b": np.ones((2, 4), np.float32)})
    """, "GGML_ASSERT(nb10 == ggml_type_size(src1->type)) in the CPU mul_mat: b's rows must be contiguous"),
    "mul_mat_id_permuted_b": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.mul_mat_id(t["e"], c.permute(t["b"], (2, 1, 0)), t["ids"]),
                      consts={"e": np.ones((2, 3, 4), np.float32), "b": np.ones((4, 1, 2), np.float32),
                              "ids": np.zeros((2, 1), np.int32)})
    """, "GGML_ASSERT(nb10 == ggml_type_size(src1->type)) in the CPU mul_mat_id"),
    "mul_mat_id_int_experts": ("DTypeError", """
        out = compute(cpu, lambda c, t: c.mul_mat_id(t["e"], t["b"], t["ids"]),
                      consts={"e": np.ones((2, 3, 4), np.int32), "b": np.ones((1, 1, 4), np.float32),
                              "ids": np.zeros((1, 1), np.int32)})
    """, "mul_mat_id does not check the experts' type; I32 experts segfault"),
    "mul_mat_q8_K_weights": ("DTypeError", """
        t8 = gh.GGMLType.Q8_K
        out = compute(cpu, lambda c, t: c.mul_mat(t["a"], t["b"]),
                      consts={"a": Raw(t8, (1, 256), np.zeros(t8.row_size(256), np.uint8)),
                              "b": np.ones((1, 256), np.float32)})
    """, "mul_mat accepts Q8_K (and Q8_1) weights, which have no CPU vec_dot: segfault"),
    "get_rows_q8_1": ("DTypeError", """
        t8 = gh.GGMLType.Q8_1
        out = compute(cpu, lambda c, t: c.get_rows(t["a"], t["r"]),
                      consts={"a": Raw(t8, (1, 32), np.zeros(t8.row_size(32), np.uint8)),
                              "r": np.zeros(1, np.int32)})
    """, "get_rows excludes Q8_K but not Q8_1, which has no to_float: segfault"),
    "rms_norm_transposed": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.rms_norm(c.transpose(t["a"])), consts={"a": np.ones((3, 4), np.float32)})
    """, "GGML_ASSERT(src0->nb[0] == sizeof(float)): rms_norm needs contiguous rows"),
    "sum_rows_transposed": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.sum_rows(c.transpose(t["a"])), consts={"a": np.ones((3, 4), np.float32)})
    """, "GGML_ASSERT(src0->nb[0] == sizeof(float)) in sum_rows"),
    "add_transposed": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.add(c.transpose(t["a"]), t["b"]),
                      consts={"a": np.ones((3, 4), np.float32), "b": np.ones((4, 3), np.float32)})
    """, "GGML_ASSERT(nb00 == sizeof(src0_t)) in the binary ops"),
    "scale_transposed": ("ShapeError", """
        with gh.Context() as c:
            a = c.new_tensor("f32", (3, 4), "a")
            c.scale(c.transpose(a), 2.0)
    """, "GGML_ASSERT(ggml_is_padded_1d(a)) when ggml_scale is built"),
    "silu_transposed": ("ShapeError", """
        with gh.Context() as c:
            a = c.new_tensor("f32", (3, 4), "a")
            c.silu(c.transpose(a))
    """, "GGML_ASSERT(ggml_is_contiguous_rows(a)) when the unary op is built"),
    "rope_non_contiguous": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.rope(c.permute(t["a"], (0, 2, 1)), t["p"], 2),
                      consts={"a": np.ones((2, 4, 2), np.float32), "p": np.zeros(2, np.int32)})
    """, "GGML_ASSERT(nb0 == nb00) in the CPU rope"),
    "cpy_transposed_to_q8_0": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.cpy(c.transpose(t["a"]), t["b"]),
                      consts={"a": np.ones((32, 2), np.float32),
                              "b": Raw("q8_0", (2, 32), np.zeros(2 * 34, np.uint8))})
    """, "a quantizing copy from a non-contiguous source aborts"),
    "get_rows_index_through_reshape": ("IndexRangeError", """
        with gh.Context() as w:
            a = w.new_tensor("f32", (3, 4), "a"); w.allocate(cpu); a.set(np.ones((3, 4), np.float32))
            with gh.Context(graph_size=64) as c, gh.Scheduler([cpu], 64) as s:
                rows = c.new_tensor("i32", (2, 2), "rows").set_input()
                y = c.get_rows(a, c.reshape(rows, (4,))).set_output()
                g = c.new_graph(64).expand(y); s.alloc(g)
                rows.set(np.array([[0, 1000000], [0, 0]], np.int32))
                s.compute(g)
    """, "the index bound is recorded on the reshape/view node, not on the tensor whose data is set, so "
         "out-of-range ids set into the base tensor reach GGML_ASSERT(i01 >= 0 && i01 < ne01)"),
    "get_rows_index_through_view": ("IndexRangeError", """
        with gh.Context() as w:
            a = w.new_tensor("f32", (3, 4), "a"); w.allocate(cpu); a.set(np.ones((3, 4), np.float32))
            with gh.Context(graph_size=64) as c, gh.Scheduler([cpu], 64) as s:
                rows = c.new_tensor("i32", (4,), "rows").set_input()
                y = c.get_rows(a, c.view(rows, (2,))).set_output()
                g = c.new_graph(64).expand(y); s.alloc(g)
                rows.set(np.array([0, 1000000, 0, 0], np.int32))
                s.compute(g)
    """, "same as get_rows_index_through_reshape, through a view"),
    "add_id_index_out_of_range": ("IndexRangeError", """
        out = compute(cpu, lambda c, t: c.add_id(t["a"], t["b"], t["ids"]),
                      consts={"a": np.ones((2, 1, 4), np.float32), "b": np.ones((3, 4), np.float32),
                              "ids": np.array([[0], [3]], np.int32)})
    """, "GGML_ASSERT(i11 >= 0 && i11 < ne11) in the CPU add_id"),
    "add_id_f16": ("DTypeError", """
        out = compute(cpu, lambda c, t: c.add_id(t["a"], t["b"], t["ids"]),
                      consts={"a": np.ones((2, 1, 4), np.float16), "b": np.ones((3, 4), np.float16),
                              "ids": np.zeros((2, 1), np.int32)})
    """, "the CPU add_id aborts on anything but F32"),
    "swiglu_oai_f16": ("DTypeError", """
        out = compute(cpu, lambda c, t: c.swiglu_oai(t["g"], t["u"], 1.702, 7.0),
                      consts={"g": np.ones((2, 4), np.float16), "u": np.ones((2, 4), np.float16)})
    """, "GGML_ABORT in the CPU swiglu_oai for F16"),
    "fill_transposed": ("ShapeError", """
        with gh.Context() as c:
            c.fill(c.transpose(c.new_tensor("f32", (3, 4), "a")), 0.0)
    """, "GGML_ASSERT(ggml_is_contiguous(a)) when ggml_fill is built"),
    "soft_max_sinks_per_head": ("ShapeError", """
        with gh.Context() as c:
            c.soft_max(c.new_tensor("f32", (4, 2, 8), "kq"), sinks=c.new_tensor("f32", (3,), "sinks"))
    """, "GGML_ASSERT(a->src[0]->ne[2] == sinks->ne[0]) in ggml_soft_max_add_sinks"),
    "flash_attn_sinks_f16": ("DTypeError", """
        with gh.Context() as c:
            q, k = c.new_tensor("f32", (2, 1, 16), "q"), c.new_tensor("f16", (1, 4, 16), "k")
            c.flash_attn(q, k, k, sinks=c.new_tensor("f16", (2,), "sinks"))
    """, "GGML_ASSERT(sinks->type == GGML_TYPE_F32) in ggml_flash_attn_ext_add_sinks"),
    "hadamard_not_power_of_two": ("ShapeError", """
        out = compute(cpu, lambda c, t: c.mul_mat_hadamard(t["r"], t["x"]),
                      consts={"r": np.zeros((6, 6), np.float32), "x": np.ones((1, 6), np.float32)})
    """, "GGML_ASSERT((n & (n - 1)) == 0) in the CPU fast Walsh-Hadamard transform"),
}


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_crashing_call_raises_typed_error(name):
    expected, code, _ = CRASHES[name]
    assert_typed_error_isolated(code, expected)


def test_existing_checks_for_non_contiguous_inputs(run):
    """Where the package does check layouts, a typed error comes back (contrast with CRASHES)."""
    with gh.Context() as c:
        a = c.new_tensor("f32", (3, 4), "a")
        with pytest.raises(E.ShapeError, match="contiguous"):
            c.swiglu(c.transpose(a), c.transpose(a))
        with pytest.raises(E.ShapeError, match="contiguous"):
            c.soft_max(c.transpose(a))
        with pytest.raises(E.ShapeError, match="transposed"):
            c.mul_mat(c.transpose(a), c.new_tensor("f32", (2, 3), "b"))
        with pytest.raises(E.ShapeError, match="contiguous"):
            c.reshape(c.transpose(a), (12,))
    still_works(run)


def test_unsupported_node_is_a_backend_error(cpu_backend, run):
    """A node no backend can run is refused before GGML would abort on it: by the op's own check when it is built
    through the API, and by the scheduler's support check when it was built around it (a raw GGML call)."""
    t = gh.GGMLType.IQ2_XXS
    consts = {"a": np.ones((1, 256), F32), "b": Raw(t, (1, 256), np.zeros(t.row_size(256), np.uint8))}
    with pytest.raises(E.DTypeError, match="does not copy F32 into IQ2_XXS"):
        run(lambda c, tt: c.cpy(tt["a"], tt["b"]), consts=consts)
    with pytest.raises(E.BackendError, match="supports"):
        run(lambda c, tt: c._node(gh.lib.ggml_cpy(c.ptr, tt["a"].ptr, tt["b"].ptr)), consts=consts)
    still_works(run)


def test_graph_computed_ids_must_fit_what_they_select_from():
    """ids from top_k/argsort over n entries can reach n-1: selecting from fewer rows is refused at build."""
    with gh.Context() as c:
        probs = c.new_tensor("f32", (2, 16), "probs")
        experts = c.new_tensor("f32", (8, 4, 32), "experts")
        x = c.new_tensor("f32", (2, 1, 32), "x")
        with pytest.raises(E.IndexRangeError, match="over rows of 16"):
            c.mul_mat_id(experts, x, c.top_k(probs, 2))
        with pytest.raises(E.IndexRangeError, match="over rows of 16"):
            c.get_rows(c.new_tensor("f32", (8, 32), "table"), c.argsort(c.new_tensor("f32", (16,), "s")))
        assert c.mul_mat_id(c.new_tensor("f32", (16, 4, 32), "e16"), x, c.top_k(probs, 2)).shape == (2, 2, 4)


def test_views_of_index_tensors_are_read_only(cpu_backend):
    with gh.Context(n_tensors=8, mem_size=1 << 16, no_alloc=False) as c:
        table = c.tensor(np.ones((3, 4), np.float32), "table")
        rows = c.tensor(np.zeros(2, np.int32), "rows")
        c.get_rows(table, rows)
        view = rows.view_numpy()
        assert not view.flags.writeable  # writes must go through set(), which checks the range
        with pytest.raises(E.IndexRangeError):
            rows.set(np.array([0, 3], np.int32))


def test_clamp_and_fill_take_infinite_but_not_nan_values():
    with gh.Context() as c:
        a = c.new_tensor("f32", (2, 3), "a")
        c.clamp(a, 6.103515625e-5, float("inf"))
        c.fill(a, float("-inf"))
        with pytest.raises(gh.errors.ArgumentError, match="NaN"):
            c.clamp(a, float("nan"), 1.0)
        with pytest.raises(gh.errors.ArgumentError, match="NaN"):
            c.fill(a, float("nan"))
        # a cast quantizes whole blocks, and only to types with a CPU quantizer
        with pytest.raises(gh.errors.ShapeError, match="whole Q8_0 blocks"):
            c.cast(a, "q8_0")
        with pytest.raises(gh.errors.DTypeError, match="IQ2_XXS"):
            c.cast(c.new_tensor("f32", (2, 256), "w"), "iq2_xxs")
