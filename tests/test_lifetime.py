"""Ownership of native objects: nothing leaks, close() is idempotent, dependents keep their owners alive."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from helpers import run_isolated

import ggml_hybrid as gh
from ggml_hybrid import errors as E

F32 = np.float32


def live() -> dict[str, int]:
    gc.collect()
    return gh.live_objects()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def build_and_run(n_threads: int = 1) -> np.ndarray:
    """Create a backend, two contexts, a buffer, a graph and a scheduler; compute; drop them all on return."""
    backend = gh.cpu(n_threads)
    w = gh.Context()
    W = w.new_tensor("f32", (3, 4), "W")
    w.allocate(backend, "weights")
    W.set(np.arange(12, dtype=F32).reshape(3, 4))
    c = gh.Context(graph_size=64)
    x = c.new_tensor("f32", (2, 4), "x").set_input()
    y = c.mul_mat(W, x).set_output()
    g = c.new_graph(64).expand(y)
    s = gh.Scheduler([backend], graph_size=64)
    s.alloc(g)
    x.set(np.ones((2, 4), F32))
    s.compute(g)
    counts = live()
    # while in use, every kind is accounted for
    for kind in ("backend", "context", "buffer", "scheduler"):
        assert counts.get(kind, 0) >= 1, counts
    return y.numpy()


def test_dropping_everything_returns_live_objects_to_before():
    before = live()
    for _ in range(3):
        out = build_and_run()
        assert np.array_equal(out, np.array([[6, 22, 38], [6, 22, 38]], F32))
        assert live() == before, delta(before, live())


def test_live_objects_count_what_exists():
    before = live()
    ctxs = [gh.Context() for _ in range(3)]
    assert delta(before, live()) == {"context": 3}
    del ctxs
    assert live() == before


def test_close_twice_is_safe_and_counts_once(cpu_backend):
    before = live()
    backend = gh.cpu(1)
    ctx = gh.Context()
    ctx.new_tensor("f32", (8,), "t")
    buf = backend.alloc_buffer(1024)
    sched = gh.Scheduler([backend], graph_size=8)
    d = delta(before, live())
    assert {k: d.get(k) for k in ("backend", "context", "buffer", "scheduler")} == {
        "backend": 1, "context": 1, "buffer": 1, "scheduler": 1}, d  # (a CPU backend may add a threadpool)
    for obj in (sched, buf, ctx, backend):
        assert not obj.closed
        obj.close()
        assert obj.closed
        obj.close()  # a second close is a no-op (no double free, no double count)
        assert obj.closed
    assert live() == before, delta(before, live())


def test_closing_the_backend_first(cpu_backend):
    """After backend.close(), a scheduler built on it refuses with ClosedError; its CPU buffers stay readable."""
    before = live()
    backend = gh.cpu(1)
    w = gh.Context()
    t = w.new_tensor("f32", (4,), "t")
    w.allocate(backend)
    t.set(np.arange(4, dtype=F32))
    c = gh.Context(graph_size=16)
    g = c.new_graph(16).expand(c.scale(t, 2.0))
    sched = gh.Scheduler([backend], graph_size=16)
    backend.close()
    with pytest.raises(gh.errors.ClosedError):
        _ = backend.name
    with pytest.raises(gh.errors.ClosedError):
        sched.alloc(g)
    assert np.array_equal(t.numpy(), np.arange(4, dtype=F32))
    sched.close()
    c.close()
    w.close()
    assert live() == before, delta(before, live())


def test_context_manager_closes_even_on_error(cpu_backend):
    before = live()
    with gh.Context() as c:
        c.new_tensor("f32", (2,), "a")
        c.allocate(cpu_backend)
        assert delta(before, live()) == {"context": 1, "buffer": 1}
    assert c.closed
    assert live() == before
    with pytest.raises(RuntimeError, match="boom"):
        with gh.Context() as c2, gh.Scheduler([cpu_backend], graph_size=4) as s2:
            raise RuntimeError("boom")
    assert c2.closed and s2.closed
    assert live() == before


def test_closing_a_context_frees_its_buffers(cpu_backend):
    before = live()
    c = gh.Context()
    c.new_tensor("f32", (1024,), "a")
    buf = c.allocate(cpu_backend)
    assert buf.size >= 4096
    assert delta(before, live()) == {"context": 1, "buffer": 1}
    c.close()
    assert buf.closed
    assert live() == before


def _view_of_a_fresh_context(backend, values):
    ctx = gh.Context()
    t = ctx.new_tensor("f32", values.shape, "kept")
    ctx.allocate(backend)
    t.set(values)
    return t.view_numpy()  # ctx and t go out of scope here


def test_numpy_view_keeps_the_context_alive(cpu_backend):
    before = live()
    values = np.random.default_rng(0).standard_normal((64, 33)).astype(F32)
    view = _view_of_a_fresh_context(cpu_backend, values)
    gc.collect()
    assert delta(before, live()) == {"context": 1, "buffer": 1}  # nothing was freed under the view
    # fill the heap with other allocations that would reuse freed memory
    junk = [gh.Context() for _ in range(4)]
    for j in junk:
        j.new_tensor("f32", values.shape, "junk")
        j.allocate(cpu_backend).clear(0xFF)
    assert np.array_equal(view, values)
    assert view.shape == values.shape and view.dtype == F32
    view[0, 0] = 123.0  # writable by default, and it is the tensor's memory
    assert view[0, 0] == 123.0
    for j in junk:
        j.close()
    del view, junk
    assert live() == before, delta(before, live())


def test_a_tensor_keeps_its_context_alive(cpu_backend):
    before = live()

    def make():
        ctx = gh.Context()
        t = ctx.new_tensor("f32", (5,), "t")
        ctx.allocate(cpu_backend)
        t.set(np.arange(5, dtype=F32))
        return t

    t = make()
    assert delta(before, live()) == {"context": 1, "buffer": 1}
    assert np.array_equal(t.numpy(), np.arange(5, dtype=F32))
    assert not t.context.closed
    del t
    assert live() == before


def test_scheduler_keeps_its_backends_alive():
    before = live()
    backend = gh.cpu(1)
    sched = gh.Scheduler([backend], graph_size=8)
    del backend
    assert delta(before, live()).get("backend") == 1
    assert sched.backends[0].name  # usable
    del sched
    assert live() == before


def test_explicit_close_with_a_live_numpy_view():
    p = run_isolated("""
        n = 1 << 20  # 4 MiB: a buffer the allocator returns to the OS when freed
        c = gh.Context()
        t = c.new_tensor("f32", (n,), "t")
        c.allocate(cpu)
        t.set(np.arange(n, dtype=np.float32))
        v = t.view_numpy()
        try:
            c.close()
        except gh.errors.GgmlHybridError as exc:
            print("close refused:", exc)
        ok = np.array_equal(v, np.arange(n, dtype=np.float32))
        print("view intact" if ok else "view reads freed memory", flush=True)
    """)
    assert p.returncode == 0 and ("view intact" in p.stdout or "close refused" in p.stdout), (
        p.returncode, p.stdout[-300:], p.stderr[-300:])


def test_scheduler_memory_never_dangles(cpu_backend):
    """Nodes a scheduler allocated lose their memory when it closes or allocates another graph."""
    w = gh.Context(n_tensors=4)
    W = w.new_tensor("f32", (4, 4), "W")
    w.allocate(cpu_backend)
    W.set(np.eye(4, dtype=np.float32))

    def graph():
        c = gh.Context(n_tensors=8, graph_size=16)
        x = c.new_tensor("f32", (2, 4), "x").set_input()
        y = c.mul_mat(W, x)
        return c, x, y, c.new_graph(16).expand(y)

    c1, x1, y1, g1 = graph()
    c2, x2, y2, g2 = graph()
    s = gh.Scheduler([cpu_backend], graph_size=64)
    s.alloc(g1)
    x1.set(np.ones((2, 4), np.float32))
    s.compute(g1)
    assert y1.is_allocated
    s.alloc(g2)  # shares (and may regrow) the compute buffers
    assert not y1.is_allocated and not x1.is_allocated
    with pytest.raises(E.BackendError, match="no memory"):
        y1.numpy()
    s.close()
    assert not y2.is_allocated
    with pytest.raises(E.BackendError, match="no memory"):
        x2.set(np.ones((2, 4), np.float32))
    # a graph whose weights' context was closed is refused before GGML reads freed memory
    w.close()
    with gh.Scheduler([cpu_backend], graph_size=64) as s2:
        with pytest.raises(E.ClosedError, match="closed context"):
            s2.alloc(g1)
    c1.close()
    c2.close()


@pytest.mark.parametrize("opts", [["n_threads=1"], ["disk_experts=1", "expert_cache_slots=2", "n_threads=1"],
                                  ["disk_experts=1", "expert_cache_slots=2", "moe_cpu_share=0.5", "n_threads=1"]])
def test_models_dropped_without_close_release_everything(tmp_path, opts):
    """A model nobody closes is freed with its last reference: its CPU worker thread too (it used to keep
    the model alive through the last job it ran)."""
    import threading

    from ggml_hybrid.synthetic import ModelSpec, write_model

    path = write_model(tmp_path / "m.gguf", ModelSpec(n_layer=2, n_expert=8, n_used=2, weight_type="q8_0"))
    gc.collect()
    before, threads = gh.live_objects(), threading.active_count()
    for _ in range(4):
        m = gh.MoEModel(path, gh.SessionOptions.parse(opts))
        m.eval([1, 2, 3])
        m.eval([4])
    del m
    gc.collect()
    assert gh.live_objects() == before
    assert threading.active_count() == threads


def test_a_leaf_without_memory_is_refused_by_name(cpu_backend):
    """A leaf that no buffer holds and that is not an input would be computed from garbage: the scheduler refuses
    the graph naming that leaf, whichever leaf it is (the check runs natively over every leaf at each alloc)."""
    w = gh.Context(n_tensors=4)
    W = w.new_tensor("f32", (4, 4), "W")
    w.allocate(cpu_backend)
    W.set(np.eye(4, dtype=np.float32))
    c = gh.Context(n_tensors=8, graph_size=16)
    x = c.new_tensor("f32", (2, 4), "x").set_input()
    bias = c.new_tensor("f32", (2, 4), "the_bias")  # neither allocated nor an input
    g = c.new_graph(16).expand(c.add(c.mul_mat(W, x), bias))
    s = gh.Scheduler([cpu_backend], graph_size=64)
    with pytest.raises(E.AllocationError, match="leaf 'the_bias' has no memory"):
        s.alloc(g)
    bias.set_input()  # marked as an input, the same graph allocates
    s.alloc(g)
    s.close()
