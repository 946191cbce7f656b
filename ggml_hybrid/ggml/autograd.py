"""Gradients: which ops GGML can differentiate, and the check that runs before ``ggml_build_backward_expand``.

GGML builds a backward graph op by op (ggml.c: ``ggml_compute_backward``) and aborts on an op it has no rule for,
on a parameter that is not F32/F16, on an in-place op, and when the graph or the context runs out of room. The walk
here follows GGML's own two passes over the forward graph (which nodes need a gradient, then which get one from the
loss) and refuses each of those by name first, with a :class:`~ggml_hybrid.errors.GradientError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._native import CData, cstr, ffi, lib
from ..errors import GradientError
from .dtypes import GGMLType
from .ops.catalog import OP_CODES
from .tensor import Tensor

if TYPE_CHECKING:
    from .graph import Graph

#: GGML ops with a backward rule (ggml.c's ggml_compute_backward); UNARY and GLU by kind below
DIFFERENTIABLE_OPS = frozenset({
    "NONE", "DUP", "ADD", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "LOG", "SIN", "COS", "SUM", "SUM_ROWS",
    "MEAN", "REPEAT", "REPEAT_BACK", "RMS_NORM", "MUL_MAT", "SCALE", "SET", "CPY", "CONT", "RESHAPE", "VIEW",
    "PERMUTE", "TRANSPOSE", "GET_ROWS", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "ROPE", "IM2COL", "POOL_2D",
    "UNARY", "CROSS_ENTROPY_LOSS", "GLU",
})
#: the unary kinds with a backward rule (sgn and step are piecewise constant: their gradient is zero)
DIFFERENTIABLE_UNARY = frozenset({"ABS", "SGN", "NEG", "STEP", "RELU", "SILU", "EXP", "EXPM1", "SOFTPLUS"})
#: the GLU kinds with a backward rule (swiglu with separate gate and up only)
DIFFERENTIABLE_GLU = frozenset({"SWIGLU"})

# sources whose gradient GGML never asks for (ggml_build_backward_expand's ignore_src): positions, row ids, the
# target of a copy, im2col's kernel (its shape only) and the input of piecewise-constant kinds
_IGNORED_SRC = {"IM2COL": {0}, "IM2COL_BACK": {0}, "CPY": {1}, "GET_ROWS": {1}, "GET_ROWS_BACK": {1}, "ROPE": {1}}
# ops GGML accepts as views in a backward pass (anything else made in place aborts it)
_VIEW_OPS = frozenset({"CPY", "SET_ROWS", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})
# new tensors one node's backward rule makes at most (mul_mat: out_prod, view, repeat_back, transpose, out_prod and
# the accumulating adds), and the nodes it adds to the graph
_TENSORS_PER_NODE = 10

_NAMES = {v: k for k, v in OP_CODES.items()}


def _key(p: CData) -> int:
    return int(ffi.cast("uintptr_t", p))


def op_name(p: CData) -> str:
    """GGML's name of a node's op, the unary or GLU kind for those ("UNARY:TANH")."""
    name = _NAMES[p.op]
    if name == "UNARY":
        return f"UNARY:{cstr(lib.ggml_unary_op_name(lib.ggml_get_unary_op(p)))}"
    if name == "GLU":
        return f"GLU:{cstr(lib.ggml_glu_op_name(lib.ggml_get_glu_op(p)))}"
    return name


def _describe(p: CData) -> str:
    name = cstr(p.name) or "<unnamed>"
    return f"{op_name(p).lower().replace(':', ' ')} node {name!r}"


def _ignored(p: CData) -> set[int]:
    name = _NAMES[p.op]
    if name == "UNARY" and op_name(p) in ("UNARY:SGN", "UNARY:STEP"):
        return {0}
    return _IGNORED_SRC.get(name, set())


def _srcs(p: CData) -> list[tuple[int, CData]]:
    return [(j, p.src[j]) for j in range(lib.GGML_MAX_SRC) if p.src[j] != ffi.NULL]


def needs_grad(nodes: Sequence[CData]) -> set[int]:
    """GGML's first pass: the nodes whose value depends on a parameter (or that are the loss), F32/F16 sources only."""
    needed: set[int] = set()
    for p in nodes:
        if p.type == GGMLType.I32:
            continue
        need = bool(p.flags & (lib.GGML_TENSOR_FLAG_PARAM | lib.GGML_TENSOR_FLAG_LOSS))
        ignored = _ignored(p)
        for j, s in _srcs(p):
            if j in ignored or _key(s) not in needed:
                continue
            if s.type not in (GGMLType.F32, GGMLType.F16):
                raise GradientError(f"backward: {_describe(p)} takes a {GGMLType(s.type).name} input that depends on a "
                                    "parameter; gradients flow through F32 and F16 tensors only")
            need = True
            break
        if need:
            if p.view_src != ffi.NULL and _NAMES[p.op] not in _VIEW_OPS:
                raise GradientError(f"backward: {_describe(p)} writes into its input in place; GGML cannot "
                                    "differentiate in-place ops")
            needed.add(_key(p))
    return needed


# per op, what its backward rule needs of its sources (source index -> tensor, the sources that need a gradient)
_RULES: dict[str, tuple[Callable[[CData, dict[int, CData], set[int]], bool], str]] = {
    "SOFT_MAX": (lambda p, srcs, needs: 1 not in needs and 2 not in srcs and ffi.cast("float *", p.op_params)[1] == 0,
                 "soft_max's gradient ignores its mask and sinks: the mask may not depend on a parameter, and a "
                 "soft_max with sinks or ALiBi (max_bias) has no gradient"),
    "ADD1": (lambda p, srcs, needs: 1 not in needs,
             "GGML's backward rule for add1's b takes the mean of the output's gradient along rows where the "
             "gradient is its sum: wrong, and for more than one row of the wrong shape (GGML aborts); use add with a "
             "broadcast b"),
    "ROPE": (lambda p, srcs, needs: 2 not in needs, "rope's frequency factors have no gradient"),
    "CROSS_ENTROPY_LOSS": (lambda p, srcs, needs: 1 not in needs, "cross_entropy_loss has no gradient for its labels"),
    "GLU": (lambda p, srcs, needs: 1 in srcs, "only swiglu with separate gate and up (swiglu(a, b)) has a gradient"),
    "MUL_MAT": (lambda p, srcs, needs: 0 not in needs or srcs[0].ne[3] == srcs[1].ne[3],
                "mul_mat's gradient for a broadcast over the outermost dim is not implemented"),
}


def _check_rule(p: CData, needed: set[int]) -> None:
    """Refuse ``p``'s backward rule where GGML has none (or one that would abort or be wrong)."""
    name = op_name(p)
    base = name.split(":")[0]
    supported = base in DIFFERENTIABLE_OPS and (
        base != "UNARY" or name[6:] in DIFFERENTIABLE_UNARY) and (base != "GLU" or name[4:] in DIFFERENTIABLE_GLU)
    if not supported:
        raise GradientError(f"backward: GGML has no gradient for {_describe(p)} (op {name}); ops GGML differentiates: "
                            f"{', '.join(sorted(DIFFERENTIABLE_OPS - {'NONE', 'UNARY', 'GLU'}))}, the unary kinds "
                            f"{', '.join(sorted(DIFFERENTIABLE_UNARY))} and split SWIGLU")
    srcs = dict(_srcs(p))
    needs = {j for j, s in srcs.items() if _key(s) in needed and j not in _ignored(p)}
    if p.type != GGMLType.F32:
        raise GradientError(f"backward: {_describe(p)} is {GGMLType(p.type).name}; gradients flow through F32 "
                            "nodes only")
    rule = _RULES.get(base)
    if rule is not None and not rule[0](p, srcs, needs):
        raise GradientError(f"backward: {_describe(p)}: {rule[1]}")


def check_backward(graph: Graph, loss: Tensor) -> list[CData]:
    """Walk ``graph`` as ggml_build_backward_expand will and refuse what it would abort on; returns the
    parameters that get a gradient."""
    nodes = [n.ptr for n in graph.nodes]
    lp = loss.ptr
    if not graph.grads:
        raise GradientError("backward: the graph was made without gradients; use Context.new_graph(grads=True)")
    if not any(_key(p) == _key(lp) for p in nodes):
        raise GradientError(f"backward: the loss {loss.name!r} is not a node of the graph (expand the graph with it)")
    if loss.nelements != 1 or loss.dtype != GGMLType.F32:
        raise GradientError(f"backward: the loss must be one F32 value, got {loss!r}")
    return walk(nodes, lp)


def walk(nodes: Sequence[CData], root: CData) -> list[CData]:
    """GGML's passes over ``nodes`` (in graph order) from the gradient of ``root``: the parameters that get a
    gradient, or a GradientError naming what GGML would abort on or get wrong."""
    if not any(p.flags & lib.GGML_TENSOR_FLAG_PARAM for p in nodes):
        raise GradientError("backward: no parameter in the graph; mark the tensors to differentiate with set_param()")
    needed = needs_grad(nodes)
    has_grad = {_key(root)}
    params = []
    for p in reversed(nodes):
        if _key(p) not in has_grad:
            continue
        _check_rule(p, needed)
        if p.flags & lib.GGML_TENSOR_FLAG_PARAM:
            params.append(p)
        for j, s in _srcs(p):
            if _key(s) in needed and j not in _ignored(p):
                has_grad.add(_key(s))
    return params


def room_needed(graph: Graph) -> int:
    """New tensors (and graph nodes) the backward pass may add at most."""
    return _TENSORS_PER_NODE * max(graph.n_nodes, 1)
