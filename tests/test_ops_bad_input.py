"""Bad input to every op: a typed error naming the op, or a graph that computes; never an abort inside GGML.

For each method's example call (tests/test_ops_catalog.py's EXAMPLES), each tensor it makes is replaced in turn by
one of another type (I32, F16, BF16, Q8_0 where its rows allow), or by one whose every dimension is one larger; the
call must either raise a GgmlHybridError that names the op, or build a graph that allocates and computes (its leaves
zero-filled). The cases run in a child process, which prints each case before it runs it: a case that kills GGML
names itself.
"""

from __future__ import annotations

from helpers import run_isolated

CHILD = r'''
import sys
import numpy as np
from test_ops_catalog import EXAMPLES
from ggml_hybrid.errors import GgmlHybridError

MUTATIONS = ["i32", "f16", "bf16", "q8_0", "grow"]
real_new = gh.Context.new_tensor


def run_case(build, k, how):
    calls = [0]

    def new_tensor(self, dtype, shape, name=None):
        i = calls[0]
        calls[0] += 1
        if i == k:
            if how == "grow":
                shape = tuple(s + 1 for s in shape)
            else:
                if how == "q8_0" and tuple(shape)[-1] % 32:
                    return real_new(self, dtype, shape, name)
                dtype = how
        return real_new(self, dtype, shape, name)

    gh.Context.new_tensor = new_tensor
    try:
        with gh.Context(n_tensors=256, graph_size=256) as c, gh.Scheduler([cpu], graph_size=256) as sched:
            try:
                node = build(c)
            except GgmlHybridError as e:
                return "refused", str(e)
            gh.Context.new_tensor = real_new
            graph = c.new_graph().expand(node)
            leaves = [t for t in graph.leafs if not t.is_allocated and not t.is_view]
            for t in leaves:
                t.set_input()
            try:
                sched.alloc(graph)
                for t in leaves:
                    if t.is_allocated:
                        if t.dtype.is_quantized:
                            t.set(np.zeros(t.nbytes, np.uint8))
                        else:
                            t.set(np.zeros(t.shape, t.dtype.numpy_dtype))
                sched.compute(graph)
            except GgmlHybridError as e:
                return "refused at run", str(e)
            return "computed", ""
    finally:
        gh.Context.new_tensor = real_new


count = {"refused": 0, "refused at run": 0, "computed": 0}
for method, build in sorted(EXAMPLES.items()):
    n = [0]

    def counting(self, dtype, shape, name=None):
        n[0] += 1
        return real_new(self, dtype, shape, name)

    gh.Context.new_tensor = counting
    with gh.Context(n_tensors=256) as c:
        build(c)
    gh.Context.new_tensor = real_new
    for k in range(n[0]):
        for how in MUTATIONS:
            print("CASE", method, k, how, flush=True)
            verdict, msg = run_case(build, k, how)
            count[verdict] += 1
            if verdict.startswith("refused") and ":" not in msg:
                print("UNNAMED", method, k, how, msg, flush=True)
print("DONE", count, flush=True)
'''


def test_every_op_refuses_or_computes_bad_input_and_never_aborts():
    p = run_isolated(CHILD, timeout=600)
    lines = p.stdout.splitlines()
    last = next((line for line in reversed(lines) if line.startswith("CASE")), "no case")
    assert p.returncode == 0 and lines and lines[-1].startswith("DONE"), (
        f"the child died (exit {p.returncode}) in {last}: {p.stderr[-1500:]}")
    unnamed = [line for line in lines if line.startswith("UNNAMED")]
    assert not unnamed, unnamed[:5]
    assert "'refused': 0" not in lines[-1]
