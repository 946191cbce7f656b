"""The routed-expert FFN of an MoE layer, built the way llama.cpp builds it.

router logits -> softmax or sigmoid -> top-k ids and weights (optionally normalised)
-> mul_mat_id gate and up (or one fused gate_up) -> GLU -> mul_mat_id down
-> weighted sum over the selected experts.

The part from (x, ids, weights) to the summed output is returned as a region
description, so that a scheduler can hand it to an expert-cache executor. The
executor reuses :func:`expert_ffn` and :func:`weighted_sum` on its slot tensors,
which is what makes its output bit-identical to the resident path.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_choice
from ..errors import ShapeError
from ..ggml.tensor import Tensor

GATINGS = ("softmax", "sigmoid")
GLUS = ("swiglu", "geglu")


@dataclass
class ExpertWeights:
    """One layer's routed experts: [n_expert, rows, cols] tensors (gate_up fused, or gate and up)."""

    down: Tensor
    gate: Tensor | None = None
    up: Tensor | None = None
    gate_up: Tensor | None = None

    def __post_init__(self):
        if (self.gate_up is None) == (self.gate is None or self.up is None):
            raise ShapeError("ExpertWeights: give either gate_up, or both gate and up")

    @property
    def kinds(self) -> dict[str, Tensor]:
        names = ("gate_up", "down") if self.gate_up is not None else ("gate", "up", "down")
        return {k: getattr(self, k) for k in names}

    @property
    def n_expert(self) -> int:
        return self.down.ne[2]


@dataclass
class MoERegion:
    """Inputs and output of the part a region replaces."""

    x: Tensor        # [T, 1, n_embd]
    ids: Tensor      # [T, k] I32
    weights: Tensor  # [T, k, 1]
    out: Tensor      # [T, n_embd]

    @property
    def inputs(self) -> list[Tensor]:
        return [self.x, self.ids, self.weights]


def expert_ffn(ctx, experts: ExpertWeights, x3: Tensor, ids: Tensor, glu: str = "swiglu") -> Tensor:
    """Per-token expert outputs [T, k, n_embd] (unweighted)."""
    if experts.gate_up is not None:
        act = ctx.glu(ctx.mul_mat_id(experts.gate_up, x3, ids), kind=glu)
    else:
        act = ctx.glu(ctx.mul_mat_id(experts.gate, x3, ids), ctx.mul_mat_id(experts.up, x3, ids), kind=glu)
    return ctx.mul_mat_id(experts.down, act, ids)


def weighted_sum(ctx, expert_out: Tensor, weights: Tensor) -> Tensor:
    """sum_j weights[t, j] * expert_out[t, j]: llama.cpp's order (views added one by one)."""
    y = ctx.mul(expert_out, weights)
    n_embd, k, T = y.ne[0], y.ne[1], y.ne[2]
    row = y.nb[2]
    out = ctx.view(y, (T, n_embd), (row,), 0)
    for j in range(1, k):
        out = ctx.add(out, ctx.view(y, (T, n_embd), (row,), j * y.nb[1]))
    if k == 1:
        out = ctx.cont(out)  # a view cannot be a region output that the executor writes
    return out


def build_moe_ffn(ctx, graph, cur: Tensor, router: Tensor, experts: ExpertWeights, n_used: int,
                  gating: str = "softmax", norm_weights: bool = True, weights_scale: float = 1.0,
                  glu: str = "swiglu", name: str = "moe") -> MoERegion:
    """Build the routed-expert FFN for ``cur`` [T, n_embd] into ``graph``; returns its region."""
    check_choice(gating, "build_moe_ffn: gating", GATINGS)
    check_choice(glu, "build_moe_ffn: glu", GLUS)
    n_expert = experts.n_expert
    if not 1 <= n_used <= n_expert:
        raise ShapeError(f"build_moe_ffn: n_used={n_used} must be in 1..n_expert={n_expert}")
    if router.ne[1] != n_expert:
        raise ShapeError(f"build_moe_ffn: the router scores {router.shape[0]} experts, the layer has {n_expert}")
    n_embd, T = cur.ne[0], cur.ne[1]
    logits = ctx.mul_mat(router, cur)                                     # [T, E]
    probs = ctx.soft_max(logits) if gating == "softmax" else ctx.sigmoid(logits)
    # llama.cpp's selection: a descending argsort, so ids (and the weighted sum) come largest first
    ids = ctx.cont(ctx.argsort_top_k(probs, n_used))                      # [T, k]
    weights = ctx.get_rows(ctx.reshape(probs, (T, n_expert, 1)), ids)    # [T, k, 1]
    if norm_weights:
        w2 = ctx.reshape(weights, (T, n_used))
        weights = ctx.reshape(ctx.div(w2, ctx.sum_rows(w2)), (T, n_used, 1))
    if weights_scale != 1.0:
        weights = ctx.scale(weights, weights_scale)
    x3 = ctx.reshape(cur, (T, 1, n_embd))
    for t, suffix in ((x3, "x"), (ids, "ids"), (weights, "weights")):
        t.name = f"{name}.{suffix}"
    # the region's inputs go into the graph first, so that the region is contiguous
    graph.expand(x3, ids, weights)
    out = weighted_sum(ctx, expert_ffn(ctx, experts, x3, ids, glu), weights)
    out.name = f"{name}.out"
    return MoERegion(x3, ids, weights, out)
