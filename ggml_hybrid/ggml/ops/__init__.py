"""The graph operations, checked before GGML sees them: one method of :class:`OpsMixin` per GGML op (and a few
compositions), which :class:`~ggml_hybrid.ggml.context.Context` inherits, so nodes are created in the context the
method is called on.

Every rule mirrors a ``GGML_ASSERT`` of ggml.c or a CPU kernel (or a type a CPU kernel aborts on): breaking it in
C would kill the process, so it is raised here as a typed exception naming the op, the rule and the tensors.
One module per kind of op; :mod:`.catalog` maps each of the pin's ops to its methods.
"""

from __future__ import annotations

from .arith import BINARY_TYPES, ArithOps
from .attention import AttentionOps
from .conv import ConvOps
from .layout import LayoutOps
from .loss import LossOps
from .matmul import MatmulOps
from .norm import NormOps
from .pool import PoolOps
from .recurrent import RecurrentOps
from .reduce import ReduceOps
from .rules import FLOATS, MATMUL_WEIGHTS, QUANT_WRITABLE
from .shape import ShapeOps
from .unary import GLU_KINDS, GLU_OPS, UNARY_KINDS, UnaryOps


class OpsMixin(ConvOps, MatmulOps, ArithOps, LayoutOps, ShapeOps, UnaryOps, ReduceOps, NormOps, AttentionOps,
               PoolOps, RecurrentOps, LossOps):
    """Every graph-building operation; ``self`` is the context that owns the new nodes."""


__all__ = ["BINARY_TYPES", "FLOATS", "GLU_KINDS", "GLU_OPS", "MATMUL_WEIGHTS", "QUANT_WRITABLE", "UNARY_KINDS",
           "OpsMixin"]
