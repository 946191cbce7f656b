"""The graphs keep the node patterns GGML's Vulkan backend fuses, as llama.cpp's graphs do (no Vulkan needed).

GGML's Vulkan backend fuses runs of consecutive nodes (``ggml_vk_can_fuse``, the patterns of
``src/ggml-vulkan/ggml-vulkan-types.h``); a fused kernel rounds differently from the ops one by one, so a graph
whose nodes are ordered otherwise than llama.cpp's gets other logits on Vulkan than llama.cpp (docs/vulkan.md,
tests/test_vulkan_parity.py). These are the patterns that differed: checked on the CPU, where the graphs are built.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggml_hybrid.ggml.context import Context
from ggml_hybrid.ggml.graph import Graph
from ggml_hybrid.moe.ffn import ExpertWeights, Routing, build_moe_ffn
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import write_model

# ggml-vulkan-types.h: topk_moe_early_softmax_norm and rope_view_set_rows_pattern
TOPK_MOE_EARLY_SOFTMAX_NORM = ["SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP",
                               "DIV", "RESHAPE"]
TOPK_MOE_EARLY_SOFTMAX = TOPK_MOE_EARLY_SOFTMAX_NORM[:5]
ROPE_VIEW_SET_ROWS = ["ROPE", "VIEW", "SET_ROWS"]


def _ops(g: Graph) -> list[str]:
    return [n.op.upper() for n in g.nodes]


def _count(ops: list[str], pattern: list[str]) -> int:
    return sum(ops[i:i + len(pattern)] == pattern for i in range(len(ops)))


@pytest.mark.parametrize("n_tokens", [1, 5])
def test_argsort_top_k_keeps_the_argsort_row_stride(n_tokens):
    # ggml_argsort_top_k: a view with the argsort's strides in every dimension; the Vulkan top-k MoE kernel requires
    # the row stride to be the expert count, also for a single row (it asserted on one before)
    c = Context(n_tensors=8)
    a = c.new_tensor("f32", (n_tokens, 8), "a")
    top = c.argsort_top_k(a, 2)
    order = top.src[0]
    assert order.op == "ARGSORT" and top.ne[:2] == (2, n_tokens)
    assert top.nb[1:] == order.nb[1:] and top.nb[1] == 8 * 4


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("n_tokens", [1, 7])
def test_router_nodes_are_in_llama_cpp_order(norm, n_tokens):
    # llama.cpp expands the weights before anything else uses the top-k ids ("call early so that topk-moe can be
    # used"): the ids' cont, which the region needs, comes after the pattern
    c = Context(n_tensors=96, graph_size=96)
    x = c.new_tensor("f32", (n_tokens, 32), "x")
    router = c.new_tensor("f32", (8, 32), "router")
    experts = ExpertWeights(down=c.new_tensor("f32", (8, 32, 16), "down"), gate=c.new_tensor("f32", (8, 16, 32), "g"),
                            up=c.new_tensor("f32", (8, 16, 32), "u"))
    g = c.new_graph(96)
    region = build_moe_ffn(c, g, x, router, experts, 2, Routing(norm_weights=norm))
    g.expand(region.out)
    ops = _ops(g)
    assert _count(ops, TOPK_MOE_EARLY_SOFTMAX_NORM if norm else TOPK_MOE_EARLY_SOFTMAX) == 1, ops
    assert region.ids.op == "CONT" and region.ids.src[0].op == "VIEW"


def test_the_key_store_follows_its_rope_through_a_view(tmp_path):
    # llama.cpp's cpy_k stores ggml_view_2d(k_cur) and expands q, v, then k: each layer's K rope is followed by a view
    # and its set_rows (Vulkan's ROPE_VIEW_SET_ROWS), the V store comes after
    path = write_model(tmp_path / "m.gguf", n_layer=2, seed=5)
    with MoEModel(path, SessionOptions(n_threads=1)) as m:
        m.eval([1, 2, 3], "last")
        ops = _ops(m._active_entry.graph)
    assert _count(ops, ROPE_VIEW_SET_ROWS) == 2, ops
    assert np.count_nonzero(np.array(ops) == "SET_ROWS") == 4
