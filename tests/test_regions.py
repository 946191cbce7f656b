"""Graph-region replacement in the patched scheduler (vendor/patches/0002)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggml_hybrid as gh
from ggml_hybrid import errors

REGION_OPS = ["silu", "scale", "mulz", "addpre", "matmul", "rms"]
EDGE_OPS = ["silu", "scale", "addpre", "rms"]


@pytest.fixture(scope="module")
def cpu():
    b = gh.cpu(2)
    yield b
    b.close()


class Net:
    """x -> pre ops -> [region: pre (, z) -> ops -> y] -> post ops -> out."""

    def __init__(self, cpu, T, n, pre_ops, region_ops, post_ops, seed=0):
        rng = np.random.default_rng(seed)
        self.T, self.n = T, n
        self.wctx = gh.Context(n_tensors=4)
        self.W = self.wctx.new_tensor("f32", (n, n), "W")
        self.wctx.allocate(cpu, "weights")
        self.W.set((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32))
        c = self.ctx = gh.Context(n_tensors=256, graph_size=512)
        self.x = c.new_tensor("f32", (T, n), "x").set_input()
        self.z = c.new_tensor("f32", (T, n), "z").set_input()
        self.g = c.new_graph(512)
        h = self.x
        for i, op in enumerate(pre_ops):
            h = self._apply(op, h, None, f"pre{i}")
        if h is self.x:
            h = c.scale(h, 1.0)
        self.pre = h
        self.g.expand(self.pre).expand(self.z)  # inputs first: the region must be contiguous
        r = self.pre
        self.interior = []
        for i, op in enumerate(region_ops):
            r = self._apply(op, r, self.pre, f"r{i}")
            self.interior.append(r)
        self.y = r
        self.uses_z = "mulz" in region_ops
        o = self.y
        for i, op in enumerate(post_ops):
            o = self._apply(op, o, self.pre, f"post{i}")
        self.out = c.add(o, self.pre)
        self.out.name = "out"
        self.out.set_output()
        self.g.expand(self.out)
        self.inputs = [self.pre, self.z] if self.uses_z else [self.pre]

    def _apply(self, op, h, pre, name):
        c = self.ctx
        t = {"silu": lambda: c.silu(h), "scale": lambda: c.scale(h, 0.75), "mulz": lambda: c.mul(h, self.z),
             "addpre": lambda: c.add(h, pre if pre is not None else self.x),
             "matmul": lambda: c.mul_mat(self.W, h), "rms": lambda: c.rms_norm(h, 1e-5)}[op]()
        t.name = name
        return t

    def run(self, sched, xv, zv):
        sched.alloc(self.g)
        self.x.set(xv)
        self.z.set(zv)
        sched.compute(self.g)
        return self.out.numpy()


def _data(T, n, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, n)).astype(np.float32), rng.standard_normal((T, n)).astype(np.float32)


net_params = dict(T=st.integers(1, 8), n=st.sampled_from([4, 8, 16, 32]),
                  pre_ops=st.lists(st.sampled_from(EDGE_OPS), max_size=3),
                  region_ops=st.lists(st.sampled_from(REGION_OPS), min_size=1, max_size=5),
                  post_ops=st.lists(st.sampled_from(EDGE_OPS), max_size=3), seed=st.integers(0, 2**16))


@settings(max_examples=25)
@given(**net_params)
def test_replaced_region_is_bit_identical(cpu, T, n, pre_ops, region_ops, post_ops, seed):
    xv, zv = _data(T, n, seed)
    net = Net(cpu, T, n, pre_ops, region_ops, post_ops, seed)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
        pre_ref = net.pre.numpy()  # the region input, as the default path computes it

    seen = {}

    def own_nodes(call):
        call.compute_own_nodes()
        # inputs must still be intact after the interior ran: nothing may alias them
        seen["inputs"] = [a.copy() for a in call.input_arrays()]
        seen["backend"] = call.backend

    for executor in (own_nodes, lambda call: gh.DECLINE):
        with gh.Scheduler([cpu], graph_size=1024) as s:
            region = s.add_region(net.inputs, [net.y], executor)
            got = net.run(s, xv, zv)
            assert region.calls == 1
            np.testing.assert_array_equal(got, ref)
            kinds = [d["region"] for d in s.splits()]
            assert kinds.count(0) == 1  # the region is exactly one split
    np.testing.assert_array_equal(seen["inputs"][0], pre_ref)
    assert seen["backend"] is cpu


@settings(max_examples=10)
@given(**net_params)
def test_numpy_executor_matches_default_path(cpu, T, n, pre_ops, region_ops, post_ops, seed):
    xv, zv = _data(T, n, seed)
    net = Net(cpu, T, n, pre_ops, region_ops, post_ops, seed)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
    W = net.W.numpy().astype(np.float64)

    def oracle(call):
        arrays = call.input_arrays()
        pre = arrays[0].astype(np.float64)
        z = arrays[1].astype(np.float64) if net.uses_z else None
        r = pre
        for op in region_ops:
            if op == "silu":
                r = r / (1 + np.exp(-r))
            elif op == "scale":
                r = r * 0.75
            elif op == "mulz":
                r = r * z
            elif op == "addpre":
                r = r + pre
            elif op == "matmul":
                r = r @ W.T
            elif op == "rms":
                r = r / np.sqrt((r * r).mean(axis=-1, keepdims=True) + 1e-5)
        call.write_output(0, r.astype(np.float32))

    with gh.Scheduler([cpu], graph_size=1024) as s:
        s.add_region(net.inputs, [net.y], oracle)
        got = net.run(s, xv, zv)
    # float32 kernels vs a float64 oracle through at most 5 ops and the post ops
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3 * (1 + np.abs(ref).max()))


def test_region_split_boundaries_and_no_optimization_across(cpu):
    net = Net(cpu, 4, 8, ["silu"], ["matmul", "silu", "scale"], ["silu"])
    with gh.Scheduler([cpu], graph_size=1024) as s:
        net.run(s, *_data(4, 8, 1))
        plain = s.splits()
        assert [d["region"] for d in plain] == [-1]
        s.add_region([net.pre], [net.y], lambda call: call.compute_own_nodes())
        net.run(s, *_data(4, 8, 1))
        splits = s.splits()
    assert [d["region"] for d in splits] == [-1, 0, -1]
    # the region split holds exactly the region's nodes, in graph order
    assert splits[1]["nodes"] == ["r0", "r1", "r2"]
    assert "pre0" in splits[0]["nodes"] and "post0" in splits[2]["nodes"]
    flat = [n for d in splits for n in d["nodes"]]
    assert flat == plain[0]["nodes"]  # nothing reordered


def test_graph_reuse_with_changing_inputs(cpu):
    net = Net(cpu, 3, 16, ["scale"], ["matmul", "silu"], ["rms"])
    twin = Net(cpu, 3, 16, ["scale"], ["matmul", "silu"], ["rms"])  # same weights, for the default path
    calls = []

    def executor(call):
        calls.append(1)
        call.compute_own_nodes()

    with gh.Scheduler([cpu], graph_size=1024) as plain, gh.Scheduler([cpu], graph_size=1024) as s:
        s.add_region([net.pre], [net.y], executor)
        s.alloc(net.g)
        for i in range(12):
            xv, zv = _data(3, 16, 100 + i)
            net.x.set(xv)
            net.z.set(zv)
            s.compute(net.g)  # same allocation, new data
            got = net.out.numpy()
            ref = twin.run(plain, xv, zv)
            np.testing.assert_array_equal(got, ref)
    assert len(calls) == 12


def test_executor_exception_reaches_caller_and_scheduler_recovers(cpu):
    net = Net(cpu, 2, 8, [], ["silu", "matmul"], [])
    xv, zv = _data(2, 8, 3)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
    state = {"fail": True}

    class Boom(Exception):
        pass

    def executor(call):
        if state["fail"]:
            raise Boom("executor failed on purpose")
        call.compute_own_nodes()

    with gh.Scheduler([cpu], graph_size=1024) as s:
        s.add_region([net.pre], [net.y], executor)
        with pytest.raises(Boom, match="on purpose"):
            net.run(s, xv, zv)
        state["fail"] = False
        net.x.set(xv)
        net.z.set(zv)
        s.compute(net.g)  # same allocation, next compute
        np.testing.assert_array_equal(net.out.numpy(), ref)


def test_tensors_of_a_call_are_invalid_after_it(cpu):
    net = Net(cpu, 2, 8, [], ["silu"], [])
    kept = []

    def executor(call):
        kept.append(call.outputs[0])
        call.compute_own_nodes()

    with gh.Scheduler([cpu], graph_size=1024) as s:
        s.add_region([net.pre], [net.y], executor)
        net.run(s, *_data(2, 8, 0))
    with pytest.raises(errors.ClosedError):
        kept[0].numpy()


def test_region_pinned_to_another_backend_than_its_inputs(cpu):
    other = gh.cpu(1)
    net = Net(cpu, 4, 8, ["silu", "scale"], ["matmul", "silu"], ["scale"])
    xv, zv = _data(4, 8, 5)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
    seen = []

    def executor(call):
        seen.append(call.backend)
        call.compute_own_nodes()

    with gh.Scheduler([other, cpu], graph_size=1024) as s:
        for t in (net.ctx.get("pre0"), net.pre):
            s.set_tensor_backend(t, cpu)  # the region's input is made on the last backend...
        s.add_region([net.pre], [net.y], executor, backend=other)  # ...and the region runs on the first
        got = net.run(s, xv, zv)
        splits = s.splits()
    np.testing.assert_array_equal(got, ref)
    assert seen == [other]
    region_split = next(d for d in splits if d["region"] == 0)
    assert region_split["backend"] == other.name
    other.close()


def test_eval_callback_sees_outputs_of_a_replaced_region(cpu):
    net = Net(cpu, 2, 8, ["silu"], ["matmul", "silu"], ["scale"])
    xv, zv = _data(2, 8, 9)

    def names_seen(executor):
        seen = []

        def cb(t, ask):
            if not ask:
                seen.append(t.name)
            return True

        with gh.Scheduler([cpu], graph_size=1024) as s:
            s.set_eval_callback(cb)
            if executor is not None:
                s.add_region([net.pre], [net.y], executor)
            out = net.run(s, xv, zv)
        return seen, out

    plain, ref = names_seen(None)
    replaced, got_r = names_seen(lambda call: call.compute_own_nodes())
    declined, got_d = names_seen(lambda call: gh.DECLINE)
    assert plain == declined  # a declined region runs its nodes, the callback sees each
    assert "r0" in plain and "r0" not in replaced and "r1" in replaced  # r1 is the output y
    np.testing.assert_array_equal(got_r, ref)
    np.testing.assert_array_equal(got_d, ref)


def test_eval_callback_exception_is_reraised(cpu):
    net = Net(cpu, 2, 8, [], ["silu"], [])

    def cb(t, ask):
        raise RuntimeError("callback broke")

    with gh.Scheduler([cpu], graph_size=1024) as s:
        s.set_eval_callback(cb)
        with pytest.raises(RuntimeError, match="callback broke"):
            net.run(s, *_data(2, 8, 0))
        s.set_eval_callback(None)
        net.x.set(_data(2, 8, 0)[0])
        net.z.set(_data(2, 8, 0)[1])
        s.compute(net.g)


# -- invalid registrations: each has its own exception; the process survives ----------


def _ctx_graph():
    c = gh.Context(n_tensors=64, graph_size=128)
    x = c.new_tensor("f32", (2, 8), "x").set_input()
    return c, x, c.new_graph(128)


def test_open_region_is_rejected(cpu):
    c, x, g = _ctx_graph()
    pre = c.scale(x, 2.0)
    g.expand(pre)
    a = c.silu(pre)
    a.name = "a"
    y = c.scale(a, 3.0)
    out = c.add(y, a)  # a is interior but read outside
    g.expand(out)
    with gh.Scheduler([cpu], graph_size=256) as s:
        s.add_region([pre], [y], lambda call: None)
        with pytest.raises(errors.RegionOpenError, match="'a'"):
            s.check_regions(g)
        with pytest.raises(errors.RegionOpenError):
            s.alloc(g)


def test_overlapping_regions_are_rejected(cpu):
    c, x, g = _ctx_graph()
    pre = c.scale(x, 2.0)
    g.expand(pre)
    a = c.silu(pre)
    y = c.scale(a, 3.0)
    g.expand(y)
    with gh.Scheduler([cpu], graph_size=256) as s:
        s.add_region([pre], [y], lambda call: None)
        s.add_region([pre], [a], lambda call: None)
        with pytest.raises(errors.RegionOverlapError):
            s.alloc(g)


def test_tensor_not_in_graph_is_rejected(cpu):
    c, x, g = _ctx_graph()
    pre = c.scale(x, 2.0)
    y = c.silu(pre)
    g.expand(y)
    stray = c.scale(y, 2.0)  # never added to the graph
    with gh.Scheduler([cpu], graph_size=256) as s:
        s.add_region([pre], [stray], lambda call: None)
        with pytest.raises(errors.RegionNotInGraphError, match="output"):
            s.alloc(g)
        s.clear_regions()
        s.add_region([c.new_tensor("f32", (2, 8), "ghost")], [y], lambda call: None)
        with pytest.raises(errors.RegionNotInGraphError, match="ghost"):
            s.alloc(g)


def test_interleaved_region_is_rejected(cpu):
    c, x, g = _ctx_graph()
    x2 = c.new_tensor("f32", (2, 8), "x2").set_input()
    pre = c.scale(x, 2.0)
    g.expand(pre)
    a = c.silu(pre)
    u = c.silu(x2)  # not expanded before the region: lands between its nodes
    u.name = "u"
    y = c.mul(a, u)
    g.expand(y)
    with gh.Scheduler([cpu], graph_size=256) as s:
        s.add_region([pre], [y], lambda call: None)
        with pytest.raises(errors.RegionNotContiguousError, match="'u'"):
            s.alloc(g)


def test_pipeline_parallel_scheduler_is_unsupported(cpu):
    c, x, g = _ctx_graph()
    pre = c.scale(x, 2.0)
    g.expand(pre)
    y = c.silu(pre)
    g.expand(y)
    with gh.Scheduler([cpu], graph_size=256, parallel=True) as s:
        assert s.n_copies > 1
        s.add_region([pre], [y], lambda call: None)
        with pytest.raises(errors.RegionUnsupportedError, match="n_copies"):
            s.alloc(g)


def test_region_without_nodes_is_rejected(cpu):
    c, x, g = _ctx_graph()
    pre = c.scale(x, 2.0)
    g.expand(pre)
    with gh.Scheduler([cpu], graph_size=256) as s:
        s.add_region([pre], [pre], lambda call: None)
        with pytest.raises(errors.RegionError, match="not computed from"):
            s.alloc(g)


def test_bad_arguments_are_rejected_before_c(cpu):
    c, x, g = _ctx_graph()
    y = c.silu(x)
    g.expand(y)
    with gh.Scheduler([cpu], graph_size=256) as s:
        with pytest.raises(ValueError, match="at least one input"):
            s.add_region([], [y], lambda call: None)
        with pytest.raises(TypeError, match="callable"):
            s.add_region([x], [y], "not a function")
        with pytest.raises(TypeError, match="Tensors"):
            s.add_region([np.zeros(3)], [y], lambda call: None)
        stranger = gh.cpu(1)
        with pytest.raises(errors.BackendError, match="not one of"):
            s.add_region([x], [y], lambda call: None, backend=stranger)
        stranger.close()
        assert s.regions == []


def test_region_survives_reset_and_realloc(cpu):
    net = Net(cpu, 2, 8, [], ["matmul"], [])
    xv, zv = _data(2, 8, 2)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
    with gh.Scheduler([cpu], graph_size=1024) as s:
        region = s.add_region([net.pre], [net.y], lambda call: call.compute_own_nodes())
        for _ in range(3):
            s.reset()
            np.testing.assert_array_equal(net.run(s, xv, zv), ref)
        assert region.calls == 3


def test_prepare_allocates_only_when_needed(cpu):
    net = Net(cpu, 2, 8, [], ["silu"], [])
    with gh.Scheduler([cpu], graph_size=1024) as s:
        assert s.prepare(net.g) is True
        assert s.prepare(net.g) is False  # still allocated: no split, no allocation
        s.add_region([net.pre], [net.y], lambda call: call.compute_own_nodes())
        assert s.prepare(net.g) is True  # regions changed the split
        xv, zv = _data(2, 8, 0)
        net.x.set(xv)
        net.z.set(zv)
        s.compute(net.g)
        with gh.Scheduler([cpu], graph_size=1024) as other:
            assert other.prepare(net.g) is True
        assert s.prepare(net.g) is True  # another scheduler allocated the graph in between


# -- callbacks and re-entrancy (hostile-run regressions) ------------------------------------------


def _own_nodes_executor(call):
    call.compute_own_nodes()


def _net_and_reference(cpu, seed=1):
    net = Net(cpu, 3, 32, ["silu"], ["matmul", "silu"], ["scale"], seed=seed)
    xv, zv = _data(3, 32, seed)
    with gh.Scheduler([cpu], graph_size=512) as s:
        ref = net.run(s, xv, zv)
    return net, xv, zv, ref


def test_an_exception_escaping_the_callback_fails_the_compute(cpu, monkeypatch):
    """Ctrl-C arriving at the callback's first bytecode (outside its try) must fail the region, not let the
    scheduler read cffi's default 0 as 'done' and go on without the layer output."""
    from ggml_hybrid.ggml import regions

    net, xv, zv, ref = _net_and_reference(cpu)

    class InterruptedFFI:  # a test double: the callback's very first call raises, as a signal would there
        def __getattr__(self, name):
            return getattr(regions.ffi, name)

        def from_handle(self, handle):
            raise KeyboardInterrupt

    with gh.Scheduler([cpu], graph_size=512) as s:
        s.add_region(net.inputs, [net.y], _own_nodes_executor)
        monkeypatch.setattr(regions, "ffi", InterruptedFFI())
        with pytest.raises(KeyboardInterrupt):
            net.run(s, xv, zv)
        monkeypatch.undo()
        np.testing.assert_array_equal(net.run(s, xv, zv), ref)  # the scheduler is usable and right again


def test_an_executor_cannot_close_or_recompute_what_is_running(cpu):
    net, xv, zv, ref = _net_and_reference(cpu, seed=2)
    attempts = []

    def hostile(call):
        for what, act in (("scheduler", call.sched.close), ("weights", net.wctx.close), ("graph", net.ctx.close),
                          ("backend", cpu.close), ("compute", lambda: call.sched.compute(net.g)),
                          ("alloc", lambda: call.sched.alloc(net.g)), ("regions", call.sched.clear_regions)):
            with pytest.raises((errors.ClosedError, errors.BackendError)) as info:
                act()
            attempts.append((what, str(info.value)))
        call.compute_own_nodes()

    with gh.Scheduler([cpu], graph_size=512) as s:
        s.add_region(net.inputs, [net.y], hostile)
        np.testing.assert_array_equal(net.run(s, xv, zv), ref)
        assert [w for w, _ in attempts] == ["scheduler", "weights", "graph", "backend", "compute", "alloc",
                                            "regions"]
        assert "computing" in attempts[0][1] and "region executors" in attempts[4][1]
        np.testing.assert_array_equal(net.run(s, xv, zv), ref)
    assert not cpu.closed and not net.wctx.closed
    net.wctx.close()
    net.ctx.close()


@settings(max_examples=10)
@given(**net_params)
def test_a_step_computes_what_compute_does_and_raises_what_an_executor_raises(cpu, T, n, pre_ops, region_ops,
                                                                             post_ops, seed):
    """Scheduler.step (inputs, compute and the output in one native call) against set + compute + numpy, with a
    region replaced: the same bits, and an executor's exception surfaces from the step as from a compute."""
    xv, zv = _data(T, n, seed)
    net = Net(cpu, T, n, pre_ops, region_ops, post_ops, seed)
    with gh.Scheduler([cpu], graph_size=1024) as plain:
        ref = net.run(plain, xv, zv)
    fail = {"now": False}

    def executor(call):
        if fail["now"]:
            raise ValueError("executor says no")
        call.compute_own_nodes()

    with gh.Scheduler([cpu], graph_size=1024) as s:
        s.add_region(net.inputs, [net.y], executor)
        x_in, z_in = np.empty_like(xv), np.empty_like(zv)
        io = gh.StepIO([(net.x, x_in), (net.z, z_in)], net.out)
        x_in[:], z_in[:] = xv, zv  # rewritten in place after binding, as a decode step does
        np.testing.assert_array_equal(s.step(net.g, io), ref)
        fail["now"] = True
        with pytest.raises(ValueError, match="executor says no"):
            s.step(net.g, io)
        fail["now"] = False
        np.testing.assert_array_equal(s.step(net.g, io), ref)
