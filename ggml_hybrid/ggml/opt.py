"""Training through GGML's optimizer (ggml-opt.h): datasets, epochs, AdamW or SGD, a loss, accuracy.

::

    trainer = Trainer([cpu], x, lambda c: c.add(c.mul_mat(w, x), b), loss="cross_entropy", optimizer=AdamW(1e-3))
    history = trainer.fit(Dataset(train_x, train_y), epochs=10, validation=Dataset(test_x, test_y), shuffle=rng)

The model's parameters (:meth:`~ggml_hybrid.ggml.tensor.Tensor.set_param`) and its input batch ``x`` [batch,
features] live in a context the caller allocated; the forward pass is built by a function of a compute context
the trainer owns. Each epoch GGML runs the batches in C (``ggml_opt_epoch``: forward, backward and the optimizer step
in one graph per batch); Python only writes the epoch's data order and reads the metrics, plus one call per batch
when a progress bar is shown. Every rule GGML would abort on (shapes, types, sizes, hyperparameters) is checked
before a run starts, and reported as a :class:`~ggml_hybrid.errors.TrainingError`.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np
import numpy.typing as npt

from .._native import CData, ffi, lib
from .._native.callbacks import escaped, take_escaped
from .._native.managed import Managed
from ..checks import check_int, check_real
from ..errors import GradientError, TrainingError
from . import autograd
from .backend import Backend
from .context import Context
from .dtypes import GGMLType
from .sched import Scheduler
from .tensor import Tensor

LOSSES = {"cross_entropy": lib.GGML_OPT_LOSS_TYPE_CROSS_ENTROPY, "mse": lib.GGML_OPT_LOSS_TYPE_MEAN_SQUARED_ERROR,
          "mean": lib.GGML_OPT_LOSS_TYPE_MEAN, "sum": lib.GGML_OPT_LOSS_TYPE_SUM}
_LABELLED = frozenset({"cross_entropy", "mse"})
# ggml_opt_init builds its graphs (forward, gradients, optimizer) with GGML_DEFAULT_GRAPH_SIZE nodes and gradients
_OPT_GRAPH_SIZE = 2048
_OPT_GRAPHS = 3


@dataclass(frozen=True)
class AdamW:
    """AdamW (decoupled weight decay): ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``, then
    ``w = w (1 - lr weight_decay) - lr m^ / (sqrt(v^) + eps)`` with the bias corrections ``m^ = m / (1 - beta1^t)``,
    ``v^ = v / (1 - beta2^t)`` at step t (GGML's opt_step_adamw)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def check(self) -> None:
        check_real(self.lr, "AdamW: lr", 0.0, lo_open=True, error=TrainingError)
        check_real(self.beta1, "AdamW: beta1", 0.0, 1.0, error=TrainingError)
        check_real(self.beta2, "AdamW: beta2", 0.0, 1.0, error=TrainingError)
        check_real(self.eps, "AdamW: eps", 0.0, error=TrainingError)
        check_real(self.weight_decay, "AdamW: weight_decay", 0.0, 1.0, error=TrainingError)


@dataclass(frozen=True)
class SGD:
    """Plain gradient descent with decoupled weight decay: ``w = w (1 - lr weight_decay) - lr g``."""

    lr: float = 1e-3
    weight_decay: float = 0.0

    def check(self) -> None:
        check_real(self.lr, "SGD: lr", 0.0, lo_open=True, error=TrainingError)
        check_real(self.weight_decay, "SGD: weight_decay", 0.0, 1.0, error=TrainingError)


@dataclass(frozen=True)
class Metrics:
    """One pass over a dataset: the mean of its batches' losses (with its standard error) and the accuracy (the
    share of rows whose largest output is their label's, cross-entropy only; NaN otherwise)."""

    loss: float
    loss_err: float
    accuracy: float
    n: int


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    train: Metrics
    validation: Metrics | None
    seconds: float


def _float_rows(what: str, arr: npt.ArrayLike, width: int, n: int | None = None) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype != np.float32:
        raise TrainingError(f"{what}: must be float32 (the model's input and output are F32), got {a.dtype}")
    if a.ndim < 1 or a.shape[0] == 0:
        raise TrainingError(f"{what}: must hold at least one row, got shape {a.shape}")
    rows = a.reshape(a.shape[0], -1)
    if rows.shape[1] != width:
        raise TrainingError(f"{what}: each row must hold {width} values (the model's), got shape {a.shape}")
    if n is not None and rows.shape[0] != n:
        raise TrainingError(f"{what}: must have one row per data row ({n}), got {rows.shape[0]}")
    if not np.isfinite(rows).all():
        raise TrainingError(f"{what}: holds NaN or infinite values")
    return np.ascontiguousarray(rows)


class Dataset(Managed):
    """Rows of data (and labels) for a :class:`Trainer`: ``data`` [n, *features] and ``labels`` [n, *outputs],
    float32 (cross-entropy labels one-hot or probabilities). GGML keeps them in host memory (ggml_opt_dataset)."""

    _kind = "opt dataset"

    def __init__(self, data: npt.ArrayLike, labels: npt.ArrayLike | None = None) -> None:
        d = np.asarray(data)
        if d.ndim < 2:
            raise TrainingError(f"Dataset: data must be [rows, features], got shape {d.shape}")
        x = _float_rows("Dataset: data", d, int(np.prod(d.shape[1:])))
        y = None
        if labels is not None:
            lab = np.asarray(labels)
            if lab.ndim < 2:
                raise TrainingError(f"Dataset: labels must be [rows, outputs], got shape {lab.shape}")
            y = _float_rows("Dataset: labels", lab, int(np.prod(lab.shape[1:])), x.shape[0])
        self.n, self.features = x.shape
        self.outputs = 0 if y is None else y.shape[1]
        ptr = lib.ggml_opt_dataset_init(GGMLType.F32, GGMLType.F32, self.features, self.outputs, self.n, 1)
        super().__init__(ptr, lib.ggml_opt_dataset_free)
        self.write(x, y)

    def write(self, data: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Replace the rows (same shapes): how a trainer sets each epoch's order."""
        x = _float_rows("Dataset.write: data", data, self.features, self.n)
        lib.ggml_backend_tensor_set(lib.ggml_opt_dataset_data(self.ptr), ffi.from_buffer(x), 0, x.nbytes)
        if self.outputs:
            if labels is None:
                raise TrainingError("Dataset.write: this dataset has labels: give them with the data")
            y = _float_rows("Dataset.write: labels", labels, self.outputs, self.n)
            lib.ggml_backend_tensor_set(lib.ggml_opt_dataset_labels(self.ptr), ffi.from_buffer(y), 0, y.nbytes)

    def read(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The rows as GGML holds them now."""
        x = np.empty((self.n, self.features), np.float32)
        lib.ggml_backend_tensor_get(lib.ggml_opt_dataset_data(self.ptr), ffi.from_buffer(x), 0, x.nbytes)
        if not self.outputs:
            return x, None
        y = np.empty((self.n, self.outputs), np.float32)
        lib.ggml_backend_tensor_get(lib.ggml_opt_dataset_labels(self.ptr), ffi.from_buffer(y), 0, y.nbytes)
        return x, y


class _Result(Managed):
    _kind = "opt result"

    def __init__(self) -> None:
        super().__init__(lib.ggml_opt_result_init(), lib.ggml_opt_result_free)

    def metrics(self) -> Metrics:
        n = ffi.new("int64_t *")
        loss, err, acc, acc_err = (ffi.new("double *") for _ in range(4))
        lib.ggml_opt_result_ndata(self.ptr, n)
        lib.ggml_opt_result_loss(self.ptr, loss, err)
        lib.ggml_opt_result_accuracy(self.ptr, acc, acc_err)
        return Metrics(float(loss[0]), float(err[0]), float(acc[0]), int(n[0]))

    def predictions(self, n: int) -> np.ndarray:
        out = np.empty(n, np.int32)
        lib.ggml_opt_result_pred(self.ptr, ffi.from_buffer("int32_t[]", out))
        return out


class Progress:
    """A one-line progress bar on a text stream, redrawn at most ``hz`` times a second."""

    def __init__(self, stream: IO[str] | None = None, hz: float = 10.0, width: int = 24) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.period = 1.0 / hz
        self.width = width
        self._last = 0.0
        self.label = ""

    def update(self, done: int, total: int, metrics: Metrics | None = None) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.period:
            return
        self._last = now
        full = self.width * done // max(total, 1)
        tail = f" loss {metrics.loss:.4f}" if metrics is not None and metrics.n else ""
        if metrics is not None and metrics.n and not math.isnan(metrics.accuracy):
            tail += f" acc {100 * metrics.accuracy:.1f}%"
        self.stream.write(f"\r{self.label} [{'#' * full}{'.' * (self.width - full)}] {done}/{total}{tail}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


# the progress bar of each running epoch, by its optimization context (the callback has no user data); epochs run on
# the caller's thread, several trainers may run on several threads
_progress: dict[int, tuple[Progress, _Result]] = {}
_progress_lock = threading.Lock()


@ffi.def_extern(onerror=escaped)
def _hy_opt_progress(train: bool, opt_ctx: CData, dataset: CData, result: CData, ibatch: int, ibatch_max: int,
                     t_start_us: int) -> None:
    with _progress_lock:
        entry = _progress.get(int(ffi.cast("uintptr_t", opt_ctx)))
    if entry is not None:
        bar, res = entry
        bar.update(int(ibatch), int(ibatch_max), res.metrics())


class Trainer(Managed):
    """Trains the parameters of a model with GGML's optimizer.

    ``inputs``: the model's input batch, a 2-D F32 tensor [batch, features] of an allocated context (its rows are
    overwritten from the dataset each step). ``forward(ctx)`` builds the model in the trainer's compute context
    ``ctx`` and returns its 2-D F32 output [batch, outputs] (for ``cross_entropy``: logits). ``loss``:
    ``cross_entropy`` (softmax cross-entropy with the labels), ``mse`` (mean squared error), ``mean`` or ``sum`` (of
    the outputs themselves, no labels). The parameters are the leaves marked with ``set_param()`` that the outputs
    depend on. ``backends``: the last must be a CPU; GGML keeps gradients and optimizer states on the first.
    """

    _kind = "opt context"

    def __init__(self, backends: Sequence[Backend], inputs: Tensor, forward: Callable[[Context], Tensor],
                 loss: str = "cross_entropy", optimizer: AdamW | SGD | None = None, n_tensors: int = 4096) -> None:
        if loss not in LOSSES:
            raise TrainingError(f"Trainer: loss must be one of {sorted(LOSSES)}, got {loss!r}")
        self.optimizer = optimizer if optimizer is not None else AdamW()
        if not isinstance(self.optimizer, (AdamW, SGD)):
            raise TrainingError(f"Trainer: optimizer must be AdamW or SGD, got {type(self.optimizer).__name__}")
        self.optimizer.check()
        self._check_inputs(inputs)
        self.loss = loss
        self.inputs = inputs
        n_tensors = check_int(n_tensors, "Trainer: n_tensors", 64)
        extra = _OPT_GRAPHS * lib.ggml_graph_overhead_custom(_OPT_GRAPH_SIZE, True)
        self._ctx = Context(n_tensors=n_tensors, mem_size=extra + 4096)
        outputs = forward(self._ctx)
        self._check_outputs(outputs)
        self.outputs = outputs
        self._check_model(outputs, n_tensors)
        self._sched = Scheduler(list(backends), graph_size=4 * _OPT_GRAPH_SIZE)
        self._pars = ffi.new("struct ggml_opt_optimizer_params *")
        self.set_optimizer(self.optimizer)
        p = lib.ggml_opt_default_params(self._sched.ptr, LOSSES[loss])
        p.ctx_compute = self._ctx.ptr
        p.inputs = inputs.ptr
        p.outputs = outputs.ptr
        p.opt_period = 1
        p.get_opt_pars = lib.ggml_opt_get_constant_optimizer_params
        p.get_opt_pars_ud = self._pars
        p.optimizer = (lib.GGML_OPT_OPTIMIZER_TYPE_ADAMW if isinstance(self.optimizer, AdamW)
                       else lib.GGML_OPT_OPTIMIZER_TYPE_SGD)
        super().__init__(lib.ggml_opt_init(p), lib.ggml_opt_free)
        self._results = (_Result(), _Result())

    def _check_model(self, outputs: Tensor, n_tensors: int) -> None:
        """The model's forward pass as GGML's optimizer will differentiate it: room for its graphs, parameters in
        backend memory, and every op on the way differentiable (autograd's walk, from the outputs)."""
        with Context(n_tensors=0, graph_size=_OPT_GRAPH_SIZE) as scratch:
            graph = scratch.new_graph().expand(outputs)
            nodes = [n.ptr for n in graph.nodes]
            if 12 * len(nodes) + 64 > min(_OPT_GRAPH_SIZE, n_tensors):
                raise TrainingError(f"Trainer: a forward pass of {len(nodes)} nodes may need more than GGML's "
                                    f"{_OPT_GRAPH_SIZE}-node optimizer graphs or the compute context's {n_tensors} "
                                    "tensors (n_tensors)")
            try:
                params = autograd.walk(nodes, outputs.ptr)
            except GradientError as exc:
                raise TrainingError(f"Trainer: the model cannot be trained: {exc}") from None
            for p in params:
                if p.buffer == ffi.NULL:
                    raise TrainingError(f"Trainer: parameter {Tensor(p, self._ctx).name!r} has no backend memory "
                                        "(allocate its context in a backend buffer)")

    @staticmethod
    def _check_inputs(inputs: Tensor) -> None:
        if inputs.dtype != GGMLType.F32 or inputs.ndim != 2 or not inputs.is_contiguous:
            raise TrainingError(f"Trainer: inputs must be a contiguous 2-D F32 tensor [batch, features], got "
                                f"{inputs!r}")
        if inputs.ptr.buffer == ffi.NULL or inputs.is_view:
            raise TrainingError(f"Trainer: inputs {inputs.name!r} must have backend memory of its own (allocate its "
                                "context in a backend buffer before building the trainer)")

    def _check_outputs(self, outputs: Tensor) -> None:
        if not isinstance(outputs, Tensor) or outputs.context is not self._ctx:
            raise TrainingError("Trainer: forward(ctx) must return a node it built in ctx")
        if outputs.dtype != GGMLType.F32 or len(outputs.ne) != 4 or outputs.ne[2] != 1 or outputs.ne[3] != 1:
            raise TrainingError(f"Trainer: the outputs must be a 2-D F32 tensor [batch, outputs], got {outputs!r}")
        if outputs.ne[1] != self.inputs.ne[1]:
            raise TrainingError(f"Trainer: the outputs {outputs.shape} must have one row per input row "
                                f"({self.inputs.shape[0]})")

    @property
    def batch_size(self) -> int:
        return int(self.inputs.ne[1])

    def set_optimizer(self, optimizer: AdamW | SGD) -> None:
        """Change the hyperparameters (e.g. the learning rate between epochs); the kind of optimizer is fixed."""
        if type(optimizer) is not type(self.optimizer):
            raise TrainingError(f"Trainer: this trainer runs {type(self.optimizer).__name__}, not "
                                f"{type(optimizer).__name__}")
        optimizer.check()
        self.optimizer = optimizer
        if isinstance(optimizer, AdamW):
            self._pars.adamw.alpha, self._pars.adamw.beta1, self._pars.adamw.beta2 = (
                optimizer.lr, optimizer.beta1, optimizer.beta2)
            self._pars.adamw.eps, self._pars.adamw.wd = optimizer.eps, optimizer.weight_decay
        else:
            self._pars.sgd.alpha, self._pars.sgd.wd = optimizer.lr, optimizer.weight_decay

    def _check_dataset(self, what: str, ds: Dataset) -> None:
        if not isinstance(ds, Dataset):
            raise TrainingError(f"{what}: must be a Dataset, got {type(ds).__name__}")
        if ds.features != self.inputs.ne[0]:
            raise TrainingError(f"{what}: rows of {ds.features} values, but the model's input rows hold "
                                f"{self.inputs.ne[0]} ({self.inputs.shape})")
        want = self.outputs.ne[0] if self.loss in _LABELLED else 0
        if ds.outputs != want:
            raise TrainingError(f"{what}: labels of {ds.outputs} values per row, but the loss {self.loss!r} needs "
                                f"{want} (the model's outputs: {self.outputs.shape})")
        if ds.n % self.batch_size:
            raise TrainingError(f"{what}: {ds.n} rows is not a multiple of the batch size {self.batch_size} "
                                f"(GGML runs whole batches; use {ds.n - ds.n % self.batch_size} rows)")

    def _epoch(self, ds: Dataset, train: bool, progress: Progress | None) -> Metrics:
        res = self._results[0 if train else 1]
        lib.ggml_opt_result_reset(res.ptr)
        cb = lib._hy_opt_progress if progress is not None else ffi.NULL
        key = int(ffi.cast("uintptr_t", self.ptr))
        if progress is not None:
            with _progress_lock:
                _progress[key] = (progress, res)
        try:
            if train:
                lib.ggml_opt_epoch(self.ptr, ds.ptr, res.ptr, ffi.NULL, -1, cb, ffi.NULL)
            else:
                lib.ggml_opt_epoch(self.ptr, ds.ptr, ffi.NULL, res.ptr, 0, ffi.NULL, cb)
        finally:
            with _progress_lock:
                _progress.pop(key, None)
        stray = take_escaped()
        if stray is not None:
            raise stray
        return res.metrics()

    def fit(self, train: Dataset, epochs: int, validation: Dataset | None = None,
            shuffle: np.random.Generator | None = None, progress: bool | Progress = False,
            on_epoch: Callable[[EpochResult], object] | None = None) -> list[EpochResult]:
        """Train for ``epochs`` passes over ``train`` (in batches of the input's rows, one optimizer step each),
        measuring ``validation`` after each. ``shuffle``: the rows are put in the order of ``shuffle.permutation``
        before each epoch (else kept as given). ``progress``: a bar on stderr (or the Progress given). Returns
        (and passes ``on_epoch``) each epoch's metrics."""
        epochs = check_int(epochs, "Trainer.fit: epochs", 1, error=TrainingError)
        self._check_dataset("Trainer.fit: train", train)
        if validation is not None:
            self._check_dataset("Trainer.fit: validation", validation)
        bar = progress if isinstance(progress, Progress) else (Progress() if progress else None)
        x, y = train.read() if shuffle is not None else (None, None)
        history = []
        for e in range(1, epochs + 1):
            t0 = time.perf_counter()
            if shuffle is not None and x is not None:
                order = shuffle.permutation(train.n)
                train.write(x[order], None if y is None else y[order])
            if bar is not None:
                bar.label = f"epoch {e}/{epochs} train"
            m_train = self._epoch(train, True, bar)
            m_val = None
            if validation is not None:
                if bar is not None:
                    bar.label = f"epoch {e}/{epochs} valid"
                m_val = self._epoch(validation, False, bar)
            result = EpochResult(e, m_train, m_val, time.perf_counter() - t0)
            history.append(result)
            if on_epoch is not None:
                on_epoch(result)
        return history

    def evaluate(self, ds: Dataset) -> Metrics:
        """The loss and accuracy of the current parameters on ``ds`` (no training)."""
        self._check_dataset("Trainer.evaluate", ds)
        return self._epoch(ds, False, None)

    def predict(self, ds: Dataset) -> np.ndarray:
        """Each row's predicted class (the index of its largest output; cross-entropy models)."""
        if self.loss != "cross_entropy":
            raise TrainingError("Trainer.predict: predictions are the arg-max of a cross-entropy model's outputs")
        self.evaluate(ds)
        return self._results[1].predictions(ds.n)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        for r in self._results:
            r.close()
        self._sched.close()
        self._ctx.close()
