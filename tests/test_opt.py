"""Training through GGML's optimizer (ggml_hybrid.ggml.opt) against the same training in plain numpy.

The oracle is tools/digits.py's ``numpy_fit``: the same network, initial parameters, batch order and AdamW step in
float64. Bound per epoch: GGML trains in float32, so its curve drifts from float64's as numpy's own float32 run does;
the loss may differ by twice that float32 run's difference (measured alongside) plus 64 u of the loss, and the
held-out accuracy by one image. Devices (Vulkan's matrix products round their operands to F16 beyond a few rows,
graph.VULKAN_MAT_VEC_ROWS): 2 u16 = 2**-10 of the loss.
"""

from __future__ import annotations

import io

import digits as D
import numpy as np
import pytest

import ggml_hybrid as gh
from ggml_hybrid.errors import TrainingError
from ggml_hybrid.ggml.backend import gpu_device_names
from ggml_hybrid.ggml.opt import SGD, AdamW, Dataset, Progress, Trainer

U = 2.0 ** -24
EPOCHS = 3


@pytest.fixture(scope="module")
def data():
    pytest.importorskip("sklearn")
    return D.load(0)


@pytest.fixture(scope="module")
def reference(data):
    p0 = D.init_params(0)
    return p0, D.numpy_fit(data, p0, EPOCHS)[0], D.numpy_fit(data, p0, EPOCHS, dtype=np.float32)[0]


def check_curve(hist, ref, ref32, rel: float | None = None) -> None:
    assert [h.epoch for h in hist] == list(range(1, len(ref) + 1))
    for h, r, r32 in zip(hist, ref, ref32):
        for got, want, spread in ((h.train.loss, r.train_loss, abs(r32.train_loss - r.train_loss)),
                                  (h.validation.loss, r.test_loss, abs(r32.test_loss - r.test_loss))):
            tol = rel * abs(want) if rel is not None else 2 * spread + 64 * U * abs(want)
            assert abs(got - want) <= tol, f"epoch {h.epoch}: loss {got} vs numpy's {want} (tol {tol:.3g})"
        assert h.train.n == D.N_TRAIN and h.validation.n == D.N_TEST
        assert abs(h.train.accuracy - r.train_accuracy) <= 1 / D.N_TRAIN + 1e-12
        assert abs(h.validation.accuracy - r.test_accuracy) <= 1 / D.N_TEST + 1e-12


def test_digits_on_the_cpu_match_numpy(data, reference):
    p0, ref, ref32 = reference
    with gh.cpu(1) as cpu:
        hist, params = D.ggml_fit([cpu], data, p0, EPOCHS)
    check_curve(hist, ref, ref32)
    # the parameters themselves: float32 against float64 after 135 steps
    _, p64 = D.numpy_fit(data, p0, EPOCHS)
    for n, a in params.items():
        assert np.abs(a - p64[n]).max() <= 1e-5 * np.abs(p64[n]).max(), n


@pytest.mark.gpu
@pytest.mark.parametrize("device", gpu_device_names() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no CUDA or Vulkan device in this build"))])
def test_digits_on_a_device_match_numpy(data, reference, device):
    p0, ref, ref32 = reference
    with gh.cpu(1) as cpu, (gh.vulkan(int(device[6:])) if device.startswith("Vulkan")
                            else gh.cuda(int(device[4:]))) as dev:
        hist, _ = D.ggml_fit([dev, cpu], data, p0, EPOCHS)
    check_curve(hist, ref, ref32, rel=2.0 ** -10)


def test_progress_bar_and_shuffled_order_are_reproducible(data):
    """Two fits with the same seed give the same curve (the order is numpy's), and the bar reaches every batch."""
    p0 = D.init_params(1)
    stream = io.StringIO()
    bar = Progress(stream, hz=1e9)
    with gh.cpu(1) as cpu:
        a, _ = D.ggml_fit([cpu], data, p0, 2, seed=7, progress=bar)
        b, _ = D.ggml_fit([cpu], data, p0, 2, seed=7)
    assert [(h.train.loss, h.validation.accuracy) for h in a] == [(h.train.loss, h.validation.accuracy) for h in b]
    text = stream.getvalue()
    assert text.count(f"{D.N_TRAIN // D.BATCH}/{D.N_TRAIN // D.BATCH}") == 2
    assert "epoch 2/2 valid" in text and "acc" in text


def test_sgd_with_mean_squared_error_matches_numpy():
    """A linear model y = x W^T, SGD on the mean squared error (no labels' softmax): one epoch of 4 batches."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 5)).astype(np.float32)
    y = rng.standard_normal((16, 3)).astype(np.float32)
    w0 = rng.standard_normal((3, 5)).astype(np.float32)
    lr = 0.05
    with gh.cpu(1) as cpu, gh.Context(n_tensors=4) as wc:
        w = wc.new_tensor("f32", (3, 5), "w")
        xin = wc.new_tensor("f32", (4, 5), "x")
        wc.allocate(cpu)
        w.set(w0)
        w.set_param()
        with Trainer([cpu], xin, lambda c: c.mul_mat(w, xin), loss="mse", optimizer=SGD(lr=lr)) as tr, \
                Dataset(x, y) as ds:
            (res,) = tr.fit(ds, 1)
        got = w.numpy()
    ww = w0.astype(np.float64)
    losses = []
    for i in range(0, 16, 4):
        err = x[i:i + 4] @ ww.T - y[i:i + 4]
        losses.append((err ** 2).mean())
        ww = ww - lr * 2 * err.T @ x[i:i + 4] / err.size  # GGML's mse: sum of squares / elements
    assert abs(res.train.loss - np.mean(losses)) <= 64 * U * np.mean(losses)
    assert np.abs(got - ww).max() <= 64 * U * np.abs(ww).max()
    assert np.isnan(res.train.accuracy)


# -- bad input: said before a run starts --------------------------------------------------------------------------

@pytest.fixture
def model():
    with gh.cpu(1) as cpu, gh.Context(n_tensors=8) as wc:
        w = wc.new_tensor("f32", (3, 4), "w")
        x = wc.new_tensor("f32", (2, 4), "x")
        wc.allocate(cpu)
        w.set(np.ones((3, 4), np.float32))
        w.set_param()
        yield cpu, w, x


def test_training_data_of_the_wrong_shape_or_type_is_refused(model):
    cpu, w, x = model
    with Trainer([cpu], x, lambda c: c.mul_mat(w, x)) as tr:
        ones = np.ones((6, 4), np.float32)
        with pytest.raises(TrainingError, match="float32"):
            Dataset(ones.astype(np.float64), np.ones((6, 3), np.float32))
        with pytest.raises(TrainingError, match="one row per data row"):
            Dataset(ones, np.ones((5, 3), np.float32))
        with pytest.raises(TrainingError, match="NaN"):
            Dataset(np.full((6, 4), np.nan, np.float32))
        with Dataset(np.ones((6, 5), np.float32), np.ones((6, 3), np.float32)) as wide:
            with pytest.raises(TrainingError, match="rows of 5 values, but the model's input rows hold 4"):
                tr.fit(wide, 1)
        with Dataset(ones, np.ones((6, 2), np.float32)) as few:
            with pytest.raises(TrainingError, match="labels of 2 values per row"):
                tr.fit(few, 1)
        with Dataset(np.ones((5, 4), np.float32), np.ones((5, 3), np.float32)) as odd:
            with pytest.raises(TrainingError, match="not a multiple of the batch size 2"):
                tr.fit(odd, 1)
        with Dataset(ones, np.ones((6, 3), np.float32)) as ok:
            with pytest.raises(TrainingError, match="epochs"):
                tr.fit(ok, 0)
            tr.fit(ok, 1)  # and the trainer still works


@pytest.mark.parametrize("make, match", [
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.tanh(c.mul_mat(w, x))), "no gradient for unary tanh"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.mul_mat(w, x), loss="hinge"), "loss must be one of"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.mul_mat(w, x), optimizer=AdamW(lr=0.0)), "lr"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.mul_mat(w, x), optimizer=AdamW(beta1=1.5)), "beta1"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.mul_mat(w, x), optimizer=SGD(weight_decay=2)),
     "weight_decay"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.sum(c.mul_mat(w, x))), "one row per input row"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: w), "a node it built in ctx"),
    (lambda cpu, w, x: Trainer([cpu], x, lambda c: c.mul_mat(c.transpose(c.transpose(w)), c.scale(x, 1.0))),
     None),
])
def test_models_the_optimizer_cannot_train_are_refused(model, make, match):
    cpu, w, x = model
    if match is None:  # a valid model (views of a parameter, ops on the input) builds and closes
        make(cpu, w, x).close()
        return
    with pytest.raises(TrainingError, match=match):
        make(cpu, w, x)


def test_inputs_and_parameters_need_backend_memory():
    with gh.cpu(1) as cpu, gh.Context(n_tensors=8) as wc:
        w = wc.new_tensor("f32", (3, 4), "w").set_param()
        x = wc.new_tensor("f32", (2, 4), "x")
        with pytest.raises(TrainingError, match="backend memory"):
            Trainer([cpu], x, lambda c: c.mul_mat(w, x))
        with gh.Context(n_tensors=2) as xc:
            x2 = xc.new_tensor("f32", (2, 4), "x2")
            xc.allocate(cpu)
            with pytest.raises(TrainingError, match="parameter 'w' has no backend memory"):
                Trainer([cpu], x2, lambda c: c.mul_mat(w, x2))
