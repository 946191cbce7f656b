"""The index cases of ``test_index_faults.py``, importable by its child interpreters (which lack the fuzzer's
package): one op whose index tensor a graph computes, and each bad value then a good compute on one backend."""

from __future__ import annotations

import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.errors import ComputeError, GraphIndexError, IndexRangeError

F32 = np.float32
OPS = ("get_rows", "set_rows", "mul_mat_id", "add_id")
GGML_NAME = {"get_rows": "GET_ROWS", "set_rows": "SET_ROWS", "mul_mat_id": "MUL_MAT_ID", "add_id": "ADD_ID"}
BOUND = {"get_rows": 4, "set_rows": 4, "mul_mat_id": 3, "add_id": 3}  # the rows (experts) an index selects from
BAD = ("-1", "bound", "2**31-1")


def bad_values(op: str) -> list[int]:
    return [-1, BOUND[op], 2**31 - 1]


def run_op(backend: gh.Backend, op: str, index: list[int], cpu: gh.Backend | None = None) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """Compute ``op`` on ``backend`` (a scheduler over it, and ``cpu`` last when it is not the CPU) with its index
    tensor computed in the graph: ``index`` is gathered from an I32 table by a GET_ROWS. Returns (the result, the
    numpy oracle); the oracle only makes sense for in-range indices."""
    rng = np.random.default_rng(len(index) * 7 + BOUND[op])
    n = len(index)
    table = np.array(index, np.int64).astype(np.int32).reshape(n, 1)
    arrays: dict[str, np.ndarray] = {"table": table, "sel": np.arange(n, dtype=np.int32)}
    if op == "get_rows":
        arrays["a"] = rng.standard_normal((4, 3)).astype(F32)
    elif op == "set_rows":
        arrays["a"] = rng.standard_normal((4, 3)).astype(F32)
        arrays["b"] = rng.standard_normal((n, 3)).astype(F32)
    elif op == "mul_mat_id":  # 3 experts [2, 4], tokens of 2 used experts each
        arrays["e"] = rng.standard_normal((3, 2, 4)).astype(F32)
        arrays["x"] = rng.standard_normal((n // 2, 1, 4)).astype(F32)
    else:  # add_id: rows [3, 4] added to a [tokens, 2, 4]
        arrays["a"] = rng.standard_normal((n // 2, 2, 4)).astype(F32)
        arrays["b"] = rng.standard_normal((3, 4)).astype(F32)
    backends = [backend] if cpu is None else [backend, cpu]
    with gh.Context(n_tensors=len(arrays) + 1) as w, gh.Context(n_tensors=16, graph_size=32) as c, \
            gh.Scheduler(backends, graph_size=32) as s:
        t = {k: w.new_tensor(v.dtype, v.shape, k) for k, v in arrays.items()}
        w.allocate(backend, "weights")
        for k, v in arrays.items():
            t[k].set(v)
        idx = c.get_rows(t["table"], t["sel"])
        if op == "get_rows":
            y = c.get_rows(t["a"], c.reshape(idx, (n,)))
        elif op == "set_rows":
            y = c.set_rows(t["a"], t["b"], c.reshape(idx, (n,)))
        elif op == "mul_mat_id":
            y = c.mul_mat_id(t["e"], t["x"], c.reshape(idx, (n // 2, 2)))
        else:
            y = c.add_id(t["a"], t["b"], c.reshape(idx, (n // 2, 2)))
        if op != "set_rows":  # set_rows gives a view of the weights it writes: those are read back
            y.set_output()
        g = c.new_graph(32).expand(y)
        for node in g.nodes:
            s.set_tensor_backend(node, backend)
        s.compute(g)
        got = t["a"].numpy() if op == "set_rows" else y.numpy()
    ix = table.ravel().astype(np.int64)
    if op == "get_rows":
        ref = arrays["a"][np.clip(ix, 0, 3)]
    elif op == "set_rows":
        ref = arrays["a"].copy()
        ref[np.clip(ix, 0, 3)] = arrays["b"]
    elif op == "mul_mat_id":
        ids = np.clip(ix, 0, 2).reshape(n // 2, 2)
        ref = np.einsum("tjnk,tk->tjn", arrays["e"][ids].astype(np.float64), arrays["x"][:, 0].astype(np.float64))
    else:
        ref = arrays["a"] + arrays["b"][np.clip(ix, 0, 2).reshape(n // 2, 2)]
    return got, ref


def attempt(backend: gh.Backend, op: str, cpu: gh.Backend | None = None) -> dict:
    """Each bad value in turn (in the middle of good ones), then good indices, on the same backend: the errors'
    types and messages, and whether the good compute matched numpy."""
    out: dict = {"errors": []}
    for v in bad_values(op):
        try:
            run_op(backend, op, [0, v, 1, 2], cpu)
            out["errors"].append(["none", ""])
        except Exception as exc:
            out["errors"].append([type(exc).__name__, str(exc), isinstance(exc, GraphIndexError),
                                  isinstance(exc, IndexRangeError), isinstance(exc, ComputeError)])
    good = [2, 0, 1, 1]
    got, ref = run_op(backend, op, good, cpu)
    got = np.asarray(got, np.float64).reshape(ref.shape)
    out["good"] = bool(np.array_equal(got, ref) if op != "mul_mat_id" else np.allclose(got, ref, rtol=1e-5,
                                                                                        atol=1e-5))
    return out


def check(op: str, result: dict) -> None:
    assert len(result["errors"]) == 3
    for v, (kind, msg, *flags) in zip(bad_values(op), result["errors"]):
        assert kind == "GraphIndexError", (v, kind, msg)
        assert flags == [True, True, True]  # also an IndexRangeError (IndexError) and a ComputeError
        assert GGML_NAME[op] in msg and f"index {v} " in msg and f"outside 0..{BOUND[op] - 1}" in msg, msg
    assert result["good"], "the compute after the failed ones must give numpy's result"
