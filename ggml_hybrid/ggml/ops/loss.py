"""The ops of training: cross_entropy_loss, cross_entropy_loss_back, opt_step_adamw, opt_step_sgd.

:mod:`ggml_hybrid.ggml.opt` drives them through GGML's optimizer (ggml-opt); they are here for graphs built by
hand. F32 throughout.
"""

from __future__ import annotations

from ..._native import lib
from ..tensor import Tensor
from .rules import F32, OpsBase, contiguous, need, same_shape, types


class LossOps(OpsBase):
    """Losses and optimizer steps."""

    def cross_entropy_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The mean over rows of ``-sum(labels * log_softmax(logits))`` (rows along the innermost axis) as a
        1-element tensor. F32, one shape, contiguous."""
        op = "cross_entropy_loss"
        self._own(op, logits, labels)
        types(op, logits, {F32}, "logits")
        types(op, labels, {F32}, "labels")
        same_shape(op, logits, labels, "logits and labels")
        contiguous(op, logits, role="logits")
        contiguous(op, labels, role="labels")
        return self._node(lib.ggml_cross_entropy_loss(self.ptr, logits.ptr, labels.ptr))

    def cross_entropy_loss_back(self, grad: Tensor, logits: Tensor, labels: Tensor) -> Tensor:
        """The gradient of :meth:`cross_entropy_loss` with respect to the logits, for its output gradient ``grad``
        (one value): ``(softmax(logits) - labels) * grad / rows``. F32, contiguous."""
        op = "cross_entropy_loss_back"
        self._own(op, grad, logits, labels)
        for t, role in ((grad, "grad"), (logits, "logits"), (labels, "labels")):
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
        need(grad.nelements == 1, op, "grad must hold one value (the loss's gradient)", grad)
        same_shape(op, logits, labels, "logits and labels")
        return self._node(lib.ggml_cross_entropy_loss_back(self.ptr, grad.ptr, logits.ptr, labels.ptr))

    def _step_operands(self, op: str, param: Tensor, *others: tuple[Tensor, str]) -> None:
        need(bool(param.ptr.flags & lib.GGML_TENSOR_FLAG_PARAM), op,
             "the tensor to update must be marked as a parameter (Tensor.set_param())", param)
        types(op, param, {F32}, "param")
        contiguous(op, param, role="param")
        for t, role in others:
            types(op, t, {F32}, role)
            contiguous(op, t, role=role)
            same_shape(op, param, t, f"param and {role}")

    def _step_params(self, op: str, hyper: Tensor, n: int) -> None:
        types(op, hyper, {F32}, "hyperparameters")
        contiguous(op, hyper, role="hyperparameters")
        need(hyper.nelements == n, op, f"the hyperparameters must be {n} values", hyper)
        need(hyper.is_host or not hyper.is_allocated, op, "the hyperparameters must live in host memory (the CPU "
             "kernel reads them directly)", hyper)

    def opt_step_adamw(self, param: Tensor, grad: Tensor, m: Tensor, v: Tensor, hyper: Tensor) -> Tensor:
        """One AdamW step on ``param`` in place (returns a view of it to expand): with ``hyper`` = [alpha, beta1,
        beta2, eps, wd, beta1h, beta2h] (beta1h = 1 / (1 - beta1^t), beta2h = 1 / (1 - beta2^t) at step t),
        ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``, ``param = param (1 - alpha wd) - alpha
        (m beta1h) / (sqrt(v beta2h) + eps)``. F32, contiguous; param marked with set_param()."""
        op = "opt_step_adamw"
        self._own(op, param, grad, m, v, hyper)
        self._step_operands(op, param, (grad, "grad"), (m, "m"), (v, "v"))
        self._step_params(op, hyper, 7)
        return self._node(lib.ggml_opt_step_adamw(self.ptr, param.ptr, grad.ptr, m.ptr, v.ptr, hyper.ptr))

    def opt_step_sgd(self, param: Tensor, grad: Tensor, hyper: Tensor) -> Tensor:
        """One SGD step on ``param`` in place: with ``hyper`` = [alpha, wd], ``param = param (1 - alpha wd) - alpha
        grad``. F32, contiguous; param marked with set_param()."""
        op = "opt_step_sgd"
        self._own(op, param, grad, hyper)
        self._step_operands(op, param, (grad, "grad"))
        self._step_params(op, hyper, 2)
        return self._node(lib.ggml_opt_step_sgd(self.ptr, param.ptr, grad.ptr, hyper.ptr))
