"""The ops an RPC server computes without ``--unchecked-ops``: the project's list (the model families' ops,
``_native/src/rpc_server.c: hy_rpc_server_ops``), given to GGML's server through the call vendor patch 0012 adds,
against the rules the server has (patch 0011).

Oracle: GGML's own answer. ``ggml_backend_rpc_server_set_ops`` accepts a list only when the server has shape rules
for every op in it, so asking it about each op one at a time lists the ops with rules. The project's list must be
exactly those: an op with rules missing from it would be refused by a server that checked and ran it before the
list moved out of GGML, and an op without rules in it would be refused by GGML (the server would not start). What
a server does with the list (an op outside it refused, every op with ``--unchecked-ops``) is
``tests/test_rpc.py::test_ops_without_shape_rules_run_only_when_the_server_allows_them``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ggml_hybrid import ffi, lib
from ggml_hybrid._native import CData

# ops that compute nothing run whatever the list says (a graph's views and reshapes)
COMPUTES_NOTHING = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"}


def _op_names() -> dict[str, int]:
    return {ffi.string(lib.ggml_op_name(op)).decode(): op for op in range(lib.GGML_OP_COUNT)}


def _listed() -> list[int]:
    n = ffi.new("size_t *")
    ops = lib.hy_rpc_server_ops(n)
    return [int(ops[i]) for i in range(n[0])]


@pytest.fixture
def set_ops() -> Iterator[Callable[[list[int]], bool]]:
    """GGML's ggml_backend_rpc_server_set_ops, taking a list; the list lifted again afterwards (no server runs in
    this process, but the test leaves GGML as it found it)."""
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    assert reg != ffi.NULL
    ptr = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_server_set_ops")
    assert ptr != ffi.NULL, "this GGML has no ggml_backend_rpc_server_set_ops (vendor patch 0012)"
    fn: CData = ffi.cast("bool (*)(const enum ggml_op *, size_t)", ptr)

    def call(ops: list[int]) -> bool:
        return bool(fn(ffi.new("enum ggml_op[]", ops) if ops else ffi.NULL, len(ops)))

    yield call
    assert call([])


def test_ggml_accepts_the_projects_list(set_ops):
    listed = _listed()
    assert len(listed) == len(set(listed)) == 30
    assert set_ops(listed)


def test_the_list_is_exactly_the_ops_the_server_has_rules_for(set_ops):
    names = _op_names()
    with_rules = {name for name, op in names.items() if set_ops([op])} - COMPUTES_NOTHING
    listed = {name for name, op in names.items() if op in set(_listed())}
    assert with_rules == listed, f"rules but not listed: {sorted(with_rules - listed)}; " \
                                 f"listed without rules: {sorted(listed - with_rules)}"
    assert {"MUL_MAT_ID", "FLASH_ATTN_EXT", "GATED_DELTA_NET", "ROPE"} <= listed  # the families' own ops


def test_a_list_with_an_op_without_rules_or_out_of_range_is_refused(set_ops):
    names = _op_names()
    assert set_ops([names["ADD"]])
    assert not set_ops([names["ADD"], names["CONV_TRANSPOSE_1D"]])  # the op the RPC tests send unchecked
    assert not set_ops([lib.GGML_OP_COUNT])
    assert set_ops([names["VIEW"], names["ADD"]])  # an op that computes nothing may be listed
