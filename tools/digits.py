"""A small classifier of scikit-learn's 8x8 handwritten digits, trained by GGML's optimizer through ggml_hybrid, and
the same network trained by plain numpy (the oracle of tests/test_opt.py and docs/scripting.md).

The model: 64 pixels -> 128 (ReLU) -> 10 logits, softmax cross-entropy, AdamW, batches of 32. The data: the 1,797
images of ``sklearn.datasets.load_digits``, pixels scaled to [0, 1], split by a seeded permutation into 1,440
training and 352 held-out images (the last 5 dropped: GGML runs whole batches). ``numpy_fit`` repeats GGML's
arithmetic step for step (the same initial parameters, the same order of batches, the loss and accuracy of each batch
measured before its update, AdamW's bias-corrected step) in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.ggml.opt import AdamW, Dataset, EpochResult, Trainer

HIDDEN, CLASSES, BATCH, N_TRAIN, N_TEST = 128, 10, 32, 1440, 352


@dataclass
class Split:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load(seed: int = 0) -> Split:
    """The digits, scaled to [0, 1], one-hot labels, split by ``seed``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = np.eye(CLASSES, dtype=np.float32)[d.target]
    order = np.random.default_rng(seed).permutation(len(x))
    tr, te = order[:N_TRAIN], order[N_TRAIN:N_TRAIN + N_TEST]
    return Split(x[tr], y[tr], x[te], y[te])


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    """Glorot-uniform weights, zero biases (float32)."""
    rng = np.random.default_rng(seed)

    def glorot(n_out: int, n_in: int) -> np.ndarray:
        lim = np.sqrt(6.0 / (n_in + n_out))
        return rng.uniform(-lim, lim, (n_out, n_in)).astype(np.float32)

    return {"w1": glorot(HIDDEN, 64), "b1": np.zeros(HIDDEN, np.float32), "w2": glorot(CLASSES, HIDDEN),
            "b2": np.zeros(CLASSES, np.float32)}


class GgmlModel:
    """The network's parameters and input batch in a context on ``backends[0]``, and its trainer."""

    def __init__(self, backends: Sequence[gh.Backend], params: dict[str, np.ndarray], lr: float = 1e-3) -> None:
        self.weights = gh.Context(n_tensors=8)
        w = {n: self.weights.new_tensor("f32", a.shape, n) for n, a in params.items()}
        self.x = self.weights.new_tensor("f32", (BATCH, 64), "images")
        self.weights.allocate(backends[0], "weights")
        for n, a in params.items():
            w[n].set(a)
            w[n].set_param()
        self.w = w

        def forward(c: gh.Context) -> gh.Tensor:
            h = c.relu(c.add(c.mul_mat(w["w1"], self.x), w["b1"]))
            return c.add(c.mul_mat(w["w2"], h), w["b2"])

        self.trainer = Trainer(list(backends), self.x, forward, loss="cross_entropy", optimizer=AdamW(lr=lr))

    def params(self) -> dict[str, np.ndarray]:
        return {n: t.numpy() for n, t in self.w.items()}

    def close(self) -> None:
        self.trainer.close()
        self.weights.close()


def ggml_fit(backends: Sequence[gh.Backend], data: Split, params: dict[str, np.ndarray], epochs: int, seed: int = 1,
             lr: float = 1e-3, progress: bool = False, on_epoch=None) -> tuple[list[EpochResult], dict]:
    """Train with GGML; the epochs' batch order is ``np.random.default_rng(seed)``'s permutations."""
    model = GgmlModel(backends, params, lr)
    try:
        with Dataset(data.x_train, data.y_train) as train, Dataset(data.x_test, data.y_test) as test:
            hist = model.trainer.fit(train, epochs, validation=test, shuffle=np.random.default_rng(seed),
                                     progress=progress, on_epoch=on_epoch)
        return hist, model.params()
    finally:
        model.close()


@dataclass
class NumpyEpoch:
    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float


def _forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z1 = x @ p["w1"].T + p["b1"]
    h = np.maximum(z1, 0)
    return z1, h, h @ p["w2"].T + p["b2"]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _correct(logits: np.ndarray, y: np.ndarray) -> int:
    # GGML's argmax takes the last of equal maxima
    last = logits.shape[1] - 1 - np.argmax(logits[:, ::-1], axis=1)
    return int((last == np.argmax(y, axis=1)).sum())


def numpy_fit(data: Split, params: dict[str, np.ndarray], epochs: int, seed: int = 1, lr: float = 1e-3,
              dtype: type = np.float64) -> tuple[list[NumpyEpoch], dict]:
    """The same training in plain numpy: the batches in the same order, AdamW as GGML's opt_step_adamw."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    p = {n: a.astype(dtype) for n, a in params.items()}
    m = {n: np.zeros_like(a) for n, a in p.items()}
    v = {n: np.zeros_like(a) for n, a in p.items()}
    xt, yt = data.x_train.astype(dtype), data.y_train.astype(dtype)
    xe, ye = data.x_test.astype(dtype), data.y_test.astype(dtype)
    rng = np.random.default_rng(seed)
    out, step = [], 0
    for e in range(1, epochs + 1):
        order = rng.permutation(len(xt))
        x_ep, y_ep = xt[order], yt[order]
        losses, correct = [], 0
        for i in range(0, len(x_ep), BATCH):
            x, y = x_ep[i:i + BATCH], y_ep[i:i + BATCH]
            z1, h, logits = _forward(p, x)
            losses.append(float(-(y * _log_softmax(logits)).sum() / len(x)))
            correct += _correct(logits, y)
            d = (np.exp(_log_softmax(logits)) - y) / len(x)
            dh = d @ p["w2"]
            dz1 = dh * (z1 > 0)
            grads = {"w2": d.T @ h, "b2": d.sum(axis=0), "w1": dz1.T @ x, "b1": dz1.sum(axis=0)}
            step += 1
            for n, g in grads.items():
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                mh = m[n] / (1 - b1 ** step)
                vh = np.sqrt(v[n] / (1 - b2 ** step)) + eps
                p[n] = p[n] - lr * mh / vh
        test_losses, test_correct = [], 0
        for i in range(0, len(xe), BATCH):
            logits = _forward(p, xe[i:i + BATCH])[2]
            test_losses.append(float(-(ye[i:i + BATCH] * _log_softmax(logits)).sum() / BATCH))
            test_correct += _correct(logits, ye[i:i + BATCH])
        out.append(NumpyEpoch(e, float(np.mean(losses)), correct / len(xt), float(np.mean(test_losses)),
                              test_correct / len(xe)))
    return out, p
