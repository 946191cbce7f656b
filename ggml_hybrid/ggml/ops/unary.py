"""GGML's unary activations (``GGML_OP_UNARY``: one method per ``GGML_UNARY_OP_*`` kind) and gated linear units
(``GGML_OP_GLU``: one per ``GGML_GLU_OP_*`` kind), with silu_back (the derivative of silu).

The kind tables are generated from the library's own names (``ggml_unary_op_name`` / ``ggml_glu_op_name`` over
the enum's range): a kind the pin adds and no method covers fails tests/test_ops_catalog.py. Every kind computes in
float32 per element; F16 and BF16 tensors are widened and rounded back once.
"""

from __future__ import annotations

from collections.abc import Set

from ..._native import cstr, lib
from ...checks import check_choice
from ..dtypes import GGMLType
from ..tensor import Tensor
from .rules import (
    F16,
    F32,
    FLOATS,
    OpsBase,
    contiguous_1,
    finite,
    need,
    same_shape,
    same_type,
    types,
)

#: every GGML_UNARY_OP_* kind of the pin: lower-case name -> enum value
UNARY_KINDS: dict[str, int] = {cstr(lib.ggml_unary_op_name(i)).lower(): i for i in range(lib.GGML_UNARY_OP_COUNT)}
#: every GGML_GLU_OP_* kind of the pin: lower-case name -> enum value
GLU_KINDS: dict[str, int] = {cstr(lib.ggml_glu_op_name(i)).lower(): i for i in range(lib.GGML_GLU_OP_COUNT)}
# the GLU kinds that take only a and b (swiglu_oai and swiglu_clamp take clamping parameters: their own methods)
GLU_OPS = {k: v for k, v in GLU_KINDS.items() if k not in ("swiglu_oai", "swiglu_clamp")}


class UnaryOps(OpsBase):
    """Activations: ``a`` -> ``f(a)`` elementwise, same shape and type; gated units ``act(gate) * up``."""

    def unary(self, a: Tensor, kind: str) -> Tensor:
        """GGML's unary op ``kind`` (a key of :data:`UNARY_KINDS`, e.g. ``"tanh"``) of ``a``: F32, F16 or BF16,
        contiguous in its rows."""
        check_choice(kind, "unary: kind", sorted(k for k in UNARY_KINDS if k != "xielu"))
        self._own(kind, a)
        types(kind, a, FLOATS)
        contiguous_1(kind, a)
        return self._node(lib.ggml_unary(self.ptr, a.ptr, UNARY_KINDS[kind]))

    def abs(self, a: Tensor) -> Tensor:
        """``|a|``."""
        return self.unary(a, "abs")

    def sgn(self, a: Tensor) -> Tensor:
        """``sign(a)``: 1 above 0, -1 below, 0 at 0."""
        return self.unary(a, "sgn")

    def neg(self, a: Tensor) -> Tensor:
        """``-a``."""
        return self.unary(a, "neg")

    def step(self, a: Tensor) -> Tensor:
        """1 where a > 0, else 0 (Heaviside, 0 at 0)."""
        return self.unary(a, "step")

    def tanh(self, a: Tensor) -> Tensor:
        """``tanhf(a)``."""
        return self.unary(a, "tanh")

    def elu(self, a: Tensor) -> Tensor:
        """``a`` above 0, ``expm1f(a)`` elsewhere."""
        return self.unary(a, "elu")

    def relu(self, a: Tensor) -> Tensor:
        """``max(a, 0)`` (0 at 0)."""
        return self.unary(a, "relu")

    def sigmoid(self, a: Tensor) -> Tensor:
        """``1 / (1 + exp(-a))``."""
        return self.unary(a, "sigmoid")

    def gelu(self, a: Tensor) -> Tensor:
        """GELU, tanh form: ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``; for F32 GGML reads it from an
        fp16 table of 65536 entries (a rounded to fp16) within |a| < 10."""
        return self.unary(a, "gelu")

    def gelu_quick(self, a: Tensor) -> Tensor:
        """``a * sigmoid(1.702 a)``; for F32 from an fp16 table as :meth:`gelu`."""
        return self.unary(a, "gelu_quick")

    def gelu_erf(self, a: Tensor) -> Tensor:
        """GELU, exact form: ``0.5 a (1 + erf(a / sqrt(2)))``."""
        return self.unary(a, "gelu_erf")

    def silu(self, a: Tensor) -> Tensor:
        """``a * sigmoid(a)`` (swish)."""
        return self.unary(a, "silu")

    def hardswish(self, a: Tensor) -> Tensor:
        """``a * min(1, max(0, (a + 3) / 6))``."""
        return self.unary(a, "hardswish")

    def hardsigmoid(self, a: Tensor) -> Tensor:
        """``min(1, max(0, (a + 3) / 6))``."""
        return self.unary(a, "hardsigmoid")

    def exp(self, a: Tensor) -> Tensor:
        """``expf(a)``."""
        return self.unary(a, "exp")

    def expm1(self, a: Tensor) -> Tensor:
        """``expf(a) - 1`` (GGML's formula: not the cancellation-free expm1)."""
        return self.unary(a, "expm1")

    def softplus(self, a: Tensor) -> Tensor:
        """``log(1 + exp(a))`` (a itself above 20), GGML's float32 formula."""
        return self.unary(a, "softplus")

    def floor(self, a: Tensor) -> Tensor:
        """``floorf(a)``."""
        return self.unary(a, "floor")

    def ceil(self, a: Tensor) -> Tensor:
        """``ceilf(a)``."""
        return self.unary(a, "ceil")

    def round(self, a: Tensor) -> Tensor:
        """``roundf(a)``: halves away from zero (not numpy's ties to even)."""
        return self.unary(a, "round")

    def trunc(self, a: Tensor) -> Tensor:
        """``truncf(a)``: toward zero."""
        return self.unary(a, "trunc")

    def xielu(self, a: Tensor, alpha_n: float = 0.8, alpha_p: float = 0.8, beta: float = 0.5,
              eps: float = -1e-6) -> Tensor:
        """xIELU: with ``an = beta + softplus(alpha_n)`` and ``ap = softplus(alpha_p)``, ``ap a^2 + beta a`` for
        a > 0, else ``(expm1(min(a, eps)) - a) an + beta a``."""
        op = "xielu"
        self._own(op, a)
        types(op, a, FLOATS)
        contiguous_1(op, a)
        vals = [finite(op, n, v) for n, v in (("alpha_n", alpha_n), ("alpha_p", alpha_p), ("beta", beta),
                                              ("eps", eps))]
        return self._node(lib.ggml_xielu(self.ptr, a.ptr, *vals))

    def glu(self, a: Tensor, b: Tensor | None = None, kind: str = "swiglu", swapped: bool = False) -> Tensor:
        """Gated unit ``act(gate) * up``: with ``b``, gate = a and up = b (swapped: the other way round); without,
        the halves of each row of a, gate the first (swapped: the second). ``kind``: reglu (relu), geglu (gelu,
        tanh form), swiglu (silu), geglu_erf, geglu_quick."""
        op = kind
        check_choice(kind, "glu: kind", sorted(GLU_OPS))
        self._own(op, a, *([b] if b is not None else []))
        self._glu_check(op, a, b, FLOATS)
        if b is None:
            return self._node(lib.ggml_glu(self.ptr, a.ptr, GLU_OPS[kind], bool(swapped)))
        if swapped:
            a, b = b, a
        return self._node(lib.ggml_glu_split(self.ptr, a.ptr, b.ptr, GLU_OPS[kind]))

    def _glu_check(self, op: str, a: Tensor, b: Tensor | None, allowed: Set[GGMLType]) -> None:
        types(op, a, allowed, "gate")
        contiguous_1(op, a, "gate")
        if b is None:
            need(a.ne[0] % 2 == 0, op, "a fused gate/up row must have even length", a)
            return
        same_type(op, a, b, "gate and up")
        same_shape(op, a, b, "gate and up")
        contiguous_1(op, b, "up")

    def reglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``relu(gate) * up`` (see :meth:`glu`)."""
        return self.glu(a, b, "reglu")

    def swiglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``silu(gate) * up`` (see :meth:`glu`)."""
        return self.glu(a, b, "swiglu")

    def geglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``gelu(gate) * up``, gelu's tanh form (see :meth:`glu`)."""
        return self.glu(a, b, "geglu")

    def geglu_erf(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``gelu_erf(gate) * up`` (see :meth:`glu`)."""
        return self.glu(a, b, "geglu_erf")

    def geglu_quick(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        """``gelu_quick(gate) * up`` (see :meth:`glu`)."""
        return self.glu(a, b, "geglu_quick")

    def swiglu_oai(self, gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
        """gpt-oss's clamped SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``,
        ``g * sigmoid(alpha * g) * (u + 1)``. F32."""
        op = "swiglu_oai"
        self._own(op, gate, up)
        self._glu_check(op, gate, up, {F32})
        return self._node(lib.ggml_swiglu_oai(self.ptr, gate.ptr, up.ptr, finite(op, "alpha", alpha),
                                              finite(op, "limit", limit)))

    def swiglu_clamp(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        """Clamped SwiGLU: ``g = min(gate, limit)``, ``u = clip(up, -limit, limit)``, ``silu(g) * u``. F32 or F16."""
        op = "swiglu_clamp"
        self._own(op, gate, up)
        self._glu_check(op, gate, up, {F32, F16})
        return self._node(lib.ggml_swiglu_clamp(self.ptr, gate.ptr, up.ptr, finite(op, "limit", limit)))

    def silu_back(self, grad: Tensor, x: Tensor) -> Tensor:
        """The gradient of ``silu`` at ``x`` times ``grad``: ``grad * s (1 + x (1 - s))`` with ``s =
        sigmoid(x)``. F32 or F16, one shape."""
        op = "silu_back"
        self._own(op, grad, x)
        types(op, x, {F32, F16}, "x")
        same_type(op, grad, x, "grad and x")
        same_shape(op, grad, x, "grad and x")
        contiguous_1(op, grad, "grad")
        contiguous_1(op, x, "x")
        return self._node(lib.ggml_silu_back(self.ptr, grad.ptr, x.ptr))

