"""The device-parity rule and the greedy loop, shared by tests/test_gpu.py and tools/device_check.py (both find
this module on their path: pytest's ``pythonpath`` setting, and the script's own folder)."""

from __future__ import annotations

import numpy as np

#: the largest relative difference allowed between two backends' logits: max|a - b| / max|b|
PARITY_RTOL = 1e-3


def greedy_run(model, prompt, n: int) -> tuple[list[int], np.ndarray]:
    """The prompt, then ``n`` greedy tokens one eval each: (the tokens, the logits of every eval, [n + 1, vocab])."""
    logits = [model.eval(prompt)[-1]]
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(model.eval([tokens[-1]])[-1])
    return tokens, np.stack(logits)


def relative_diff(got: np.ndarray, ref: np.ndarray) -> float:
    """max|got - ref| / max|ref| over logits, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


__all__ = ["PARITY_RTOL", "greedy_run", "relative_diff"]
