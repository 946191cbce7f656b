"""Train a digit classifier with GGML's optimizer from ggml_hybrid, and check it against plain numpy.

    python tools/example_train_digits.py                      # the CPU, one thread, 20 epochs
    GGML_VK_VISIBLE_DEVICES=0 python tools/example_train_digits.py   # and Vulkan (lavapipe) when present

scikit-learn's 8x8 digits (1,440 training and 352 held-out images), a 64-128-10 network with ReLU, softmax
cross-entropy, AdamW (lr 1e-3), batches of 32 (tools/digits.py). For each backend: the loss and held-out accuracy of
each epoch, next to the same training in plain numpy (float64: the same initial parameters, batch order and AdamW
arithmetic), and whether they agree within tests/test_opt.py's bound. Exits non-zero if they do not, or if the
held-out accuracy stays under 95%.
"""

from __future__ import annotations

import sys
import time

import click
import digits as D
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.ggml.backend import gpu_device_names

U = 2.0 ** -24


@click.command(help=__doc__)
@click.option("--epochs", default=20, show_default=True, help="training epochs")
@click.option("--progress", is_flag=True, help="a progress bar per epoch")
def main(epochs: int, progress: bool) -> None:

    data = D.load(seed=0)
    params = D.init_params(seed=0)
    t0 = time.perf_counter()
    ref, _ = D.numpy_fit(data, params, epochs)
    ref32, _ = D.numpy_fit(data, params, epochs, dtype=np.float32)
    print(f"numpy reference: {epochs} epochs in {time.perf_counter() - t0:.1f} s")

    ok = True
    cpu = gh.cpu(n_threads=1)
    runs: list[tuple[str, list[gh.Backend], float | None]] = [("CPU, 1 thread", [cpu], None)]
    for name in gpu_device_names():
        dev = gh.vulkan(int(name[6:])) if name.startswith("Vulkan") else gh.cuda(int(name[4:]))
        runs.append((name, [dev, cpu], 2.0 ** -10))
    for label, backends, rel in runs:
        t0 = time.perf_counter()
        hist, _ = D.ggml_fit(backends, data, params, epochs, progress=progress)
        secs = time.perf_counter() - t0
        print(f"\n{label}: {epochs} epochs in {secs:.2f} s")
        print(" epoch |  train loss: ggml    numpy  |  held-out loss: ggml  numpy  |  held-out accuracy: ggml  numpy")
        for h, r, r32 in zip(hist, ref, ref32):
            agree = True
            for got, want, spread in ((h.train.loss, r.train_loss, abs(r32.train_loss - r.train_loss)),
                                      (h.validation.loss, r.test_loss, abs(r32.test_loss - r.test_loss))):
                tol = rel * abs(want) if rel is not None else 2 * spread + 64 * U * abs(want)
                agree = agree and abs(got - want) <= tol
            agree = agree and abs(h.validation.accuracy - r.test_accuracy) <= 1 / D.N_TEST + 1e-12
            ok = ok and agree
            print(f" {h.epoch:5d} |  {h.train.loss:16.6f}  {r.train_loss:.6f} |  {h.validation.loss:19.6f}  "
                  f"{r.test_loss:.6f} |  {100 * h.validation.accuracy:22.2f}%  {100 * r.test_accuracy:.2f}%"
                  f"{'' if agree else '  <- outside the bound'}")
        final = hist[-1].validation.accuracy
        ok = ok and final >= 0.95
        print(f"held-out accuracy {100 * final:.2f}% ({'>=' if final >= 0.95 else '<'} 95%)")
        for b in backends[:-1]:
            b.close()
    cpu.close()
    print("\nggml and numpy agree within the bound" if ok else "\nFAILED: see the marks above", file=sys.stderr)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
