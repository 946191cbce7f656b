"""The routed-expert FFN of an MoE layer, built the way llama.cpp builds it (``build_moe_ffn``).

router logits (+ bias) -> softmax, sigmoid, or the logits themselves -> (+ selection bias)
-> (grouped routing) -> top-k ids -> weights (softmax over the k, or normalised, or scaled)
-> mul_mat_id gate and up (or one fused gate_up) (+ per-expert biases) -> GLU
-> mul_mat_id down (+ bias) -> weighted sum over the selected experts.

The part from (x, ids, weights) to the summed output is returned as a region
description, so that a scheduler can hand it to an expert-cache executor. The
region covers exactly the routed experts. The executor reuses :func:`expert_ffn`
and :func:`weighted_sum` on its slot tensors, which is what makes its output
bit-identical to the resident path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_choice, check_int
from ..errors import ShapeError
from ..ggml.graph import Graph
from ..ggml.ops import OpsMixin
from ..ggml.tensor import Tensor

GATINGS = ("softmax", "sigmoid", "softmax_weight")
GLUS = ("swiglu", "geglu", "swiglu_oai")
# gpt-oss's clamped SwiGLU: alpha and limit are constants of llama.cpp's graph (llama-graph.cpp)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
# the normalised weights' sum is clamped to the smallest normal float16 before dividing (llama.cpp)
WEIGHTS_SUM_MIN = 6.103515625e-5


@dataclass
class ExpertWeights:
    """One layer's routed experts: [n_expert, rows, cols] tensors (gate_up fused, or gate and up), and the
    optional per-expert biases [n_expert, rows] (gpt-oss)."""

    down: Tensor
    gate: Tensor | None = None
    up: Tensor | None = None
    gate_up: Tensor | None = None
    gate_b: Tensor | None = None
    up_b: Tensor | None = None
    down_b: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.gate_up is None) == (self.gate is None or self.up is None):
            raise ShapeError("ExpertWeights: give either gate_up, or both gate and up")
        if self.gate_up is not None and (self.gate_b is not None or self.up_b is not None):
            raise ShapeError("ExpertWeights: gate and up biases need separate gate and up tensors")

    @property
    def kinds(self) -> dict[str, Tensor]:
        names = ("gate_up", "down") if self.gate_up is not None else ("gate", "up", "down")
        out = {k: getattr(self, k) for k in names}
        out.update({k: t for k in ("gate_b", "up_b", "down_b") if (t := getattr(self, k)) is not None})
        return out

    @property
    def n_expert(self) -> int:
        return self.down.ne[2]


@dataclass(frozen=True)
class Routing:
    """How a MoE layer picks its experts and weighs them (llama.cpp's ``build_moe_ffn`` arguments); a model's
    family reads it from the file (``HParams.routing``)."""

    gating: str = "softmax"     # softmax | sigmoid over all experts, or softmax_weight (over the k picked logits)
    norm_weights: bool = True   # renormalise the k weights to sum to 1 (the sum clamped at 2**-14 first)
    weights_scale: float = 0.0  # routed scaling factor; llama.cpp applies it only when it is not 0 or 1
    n_group: int = 0            # grouped routing: experts in n_group groups ...
    n_group_used: int = 0       # ... of which the best n_group_used (by their top-2 score sum) stay eligible
    glu: str = "swiglu"         # the experts' gated unit: swiglu, or gpt-oss's clamped swiglu_oai


@dataclass
class Router:
    """A MoE layer's router: its weight [n_expert, n_embd], an optional bias of the logits, and an optional selection
    bias (``exp_probs_b``), which only chooses the experts: the weights come from the unbiased probabilities."""

    weight: Tensor
    bias: Tensor | None = None
    selection_bias: Tensor | None = None


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


def _biased(ctx: OpsMixin, t: Tensor, bias: Tensor | None, ids: Tensor) -> Tensor:
    return t if bias is None else ctx.add_id(t, bias, ids)


def expert_ffn(ctx: OpsMixin, experts: ExpertWeights, x3: Tensor, ids: Tensor, glu: str = "swiglu") -> Tensor:
    """Per-token expert outputs [T, k, n_embd] (unweighted)."""
    if experts.gate_up is not None:
        act = ctx.glu(ctx.mul_mat_id(experts.gate_up, x3, ids), kind=glu)
        return _biased(ctx, ctx.mul_mat_id(experts.down, act, ids), experts.down_b, ids)
    assert experts.gate is not None and experts.up is not None  # __post_init__: one or the other
    if glu == "swiglu_oai":
        up = _biased(ctx, ctx.mul_mat_id(experts.up, x3, ids), experts.up_b, ids)
        gate = _biased(ctx, ctx.mul_mat_id(experts.gate, x3, ids), experts.gate_b, ids)
        act = ctx.swiglu_oai(gate, up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
    else:
        gate = _biased(ctx, ctx.mul_mat_id(experts.gate, x3, ids), experts.gate_b, ids)
        act = ctx.glu(gate, _biased(ctx, ctx.mul_mat_id(experts.up, x3, ids), experts.up_b, ids), kind=glu)
    return _biased(ctx, ctx.mul_mat_id(experts.down, act, ids), experts.down_b, ids)


def weighted_sum(ctx: OpsMixin, expert_out: Tensor, weights: Tensor) -> Tensor:
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


def _group_mask(ctx: OpsMixin, sel: Tensor, n_group: int, n_group_used: int) -> Tensor:
    """Grouped routing: every expert outside the ``n_group_used`` groups with the largest sum of their two
    best scores gets -inf (llama.cpp's DeepSeek-V3 selection, ``build_moe_ffn``)."""
    T, X = sel.ne[1], sel.ne[0]
    n = X // n_group
    groups = ctx.reshape(sel, (T, n_group, n))
    top2 = ctx.argsort_top_k(groups, 2)                                            # [T, G, 2]
    scores = ctx.get_rows(ctx.reshape(groups, (T, n_group, n, 1)), top2)          # [T, G, 2, 1]
    scores = ctx.reshape(ctx.sum_rows(ctx.reshape(scores, (T, n_group, 2))), (T, n_group))
    kept = ctx.argsort_top_k(scores, n_group_used)                                 # [T, g_used]
    rows = ctx.get_rows(groups, kept)                                              # [T, g_used, n]
    masked = ctx.set_rows(ctx.fill(groups, -math.inf), rows, kept)               # [T, G, n]
    return ctx.reshape(masked, (T, X))


def build_moe_ffn(ctx: OpsMixin, graph: Graph, cur: Tensor, router: Router | Tensor, experts: ExpertWeights,
                  n_used: int, routing: Routing = Routing(), name: str = "moe") -> MoERegion:
    """Build the routed-expert FFN for ``cur`` [T, n_embd] into ``graph``; returns its region.

    ``router``: a :class:`Router`, or its weight alone. ``routing`` (:class:`Routing`): ``weights_scale`` multiplies
    the weights unless it is 0 or 1 (llama.cpp's rule); grouped routing applies when ``n_group`` > 1.
    """
    if isinstance(router, Tensor):
        router = Router(router)
    gating, glu = routing.gating, routing.glu
    n_group, n_group_used = routing.n_group, routing.n_group_used
    check_choice(gating, "build_moe_ffn: gating", GATINGS)
    check_choice(glu, "build_moe_ffn: glu", GLUS)
    n_expert = experts.n_expert
    if not 1 <= n_used <= n_expert:
        raise ShapeError(f"build_moe_ffn: n_used={n_used} must be in 1..n_expert={n_expert}")
    if router.weight.ne[1] != n_expert:
        raise ShapeError(f"build_moe_ffn: the router scores {router.weight.shape[0]} experts, the layer has "
                         f"{n_expert}")
    if n_group > 1:
        check_int(n_group_used, "build_moe_ffn: n_group_used", 1, n_group - 1, error=ShapeError)
        if n_expert % n_group or n_used > n_group_used * (n_expert // n_group):
            raise ShapeError(f"build_moe_ffn: {n_expert} experts in {n_group} groups, of which {n_group_used} are "
                             f"kept, cannot supply {n_used} experts per token")
    n_embd, T = cur.ne[0], cur.ne[1]
    logits = ctx.mul_mat(router.weight, cur)                              # [T, E]
    if router.bias is not None:
        logits = ctx.add(logits, router.bias)
    probs = ctx.soft_max(logits) if gating == "softmax" else ctx.sigmoid(logits) if gating == "sigmoid" else logits
    sel = probs if router.selection_bias is None else ctx.add(probs, router.selection_bias)
    if n_group > 1:
        sel = _group_mask(ctx, sel, n_group, n_group_used)
    # llama.cpp's selection: a descending argsort, so ids (and the weighted sum) come largest first
    top = ctx.argsort_top_k(sel, n_used)                                  # [T, k], a view of the argsort
    weights = ctx.get_rows(ctx.reshape(probs, (T, n_expert, 1)), top)    # [T, k, 1]
    if gating == "softmax_weight":
        weights = ctx.reshape(ctx.soft_max(ctx.reshape(weights, (T, n_used))), (T, n_used, 1))
    if routing.norm_weights:
        w2 = ctx.reshape(weights, (T, n_used))
        total = ctx.clamp(ctx.sum_rows(w2), WEIGHTS_SUM_MIN, math.inf)
        weights = ctx.reshape(ctx.div(w2, total), (T, n_used, 1))
    if routing.weights_scale not in (0.0, 1.0):
        weights = ctx.scale(weights, routing.weights_scale)
    graph.expand(weights)
    ids = ctx.cont(top)
    x3 = ctx.reshape(cur, (T, 1, n_embd))
    for t, suffix in ((x3, "x"), (ids, "ids"), (weights, "weights")):
        t.name = f"{name}.{suffix}"
    # the region's inputs go into the graph first, so that the region is contiguous
    graph.expand(x3, ids, weights)
    out = weighted_sum(ctx, expert_ffn(ctx, experts, x3, ids, glu), weights)
    out.name = f"{name}.out"
    return MoERegion(x3, ids, weights, out)


__all__ = ["ExpertWeights", "GATINGS", "GLUS", "MoERegion", "Router", "Routing", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT",
           "WEIGHTS_SUM_MIN", "build_moe_ffn", "expert_ffn", "weighted_sum"]
