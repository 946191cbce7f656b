"""Synthetic routing traces with controllable skew and temporal reuse (for replays and benchmarks)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import TraceError
from .format import Trace, _check_shape, _int

__all__ = ["synthetic_trace"]



def _fraction(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TraceError(f"synthetic_trace: {what} must be a number in [0, 1], got {value!r}")
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise TraceError(f"synthetic_trace: {what}={value} must be in [0, 1]")
    return value


def synthetic_trace(n_layer: int, n_expert: int, n_used: int, n_calls: int, tokens_per_call: int = 1,
                    hot_fraction: float = 0.2, hot_traffic: float = 0.8, reuse: float = 0.5, seed: int = 0) -> Trace:
    """A random trace with skewed expert popularity and temporal reuse, deterministic in ``seed``.

    * Calls cycle through the layers in order: call ``c`` is layer ``c % n_layer`` (a decode).
    * Skew: each layer has its own random hot set of ``n_hot = floor(hot_fraction * n_expert + 0.5)``
      experts. A token takes ``h`` hot experts and ``n_used - h`` cold ones, each group uniform
      within itself, where ``h`` is ``n_used * hot_traffic`` rounded stochastically (``floor`` or
      ``ceil``, with the expected value ``n_used * hot_traffic``), clipped to what the groups can
      supply (``max(0, n_used - n_cold) <= h <= min(n_used, n_hot)``). Unless clipped, the hot
      experts take ``hot_traffic`` of the traffic in expectation, whatever ``reuse`` is.
    * Reuse: token ``t`` of a call starts from token ``t`` of the previous call of the same layer
      (think of ``tokens_per_call`` parallel sequences): each of its previous experts is kept with
      probability ``reuse``, the kept ones are cut down at random to the ``h`` hot / ``n_used - h``
      cold wanted, and the rest is drawn from the skewed distribution. ``reuse=0`` draws every call
      afresh; ``reuse=1`` repeats the previous set up to the changes ``h`` forces.
    * Expert ids of a token are distinct. ``trace.meta`` holds the parameters and ``"hot"``: the
      sorted hot set of each layer.
    """
    n_layer, n_expert, n_used = _check_shape(n_layer, n_expert, n_used, "synthetic_trace")
    n_calls = _int(n_calls, "synthetic_trace: n_calls")
    tokens_per_call = _int(tokens_per_call, "synthetic_trace: tokens_per_call")
    seed = _int(seed, "synthetic_trace: seed")
    if n_calls < 0:
        raise TraceError(f"synthetic_trace: n_calls={n_calls} must be >= 0")
    if not 1 <= tokens_per_call <= 1 << 20:
        raise TraceError(f"synthetic_trace: tokens_per_call={tokens_per_call} must be in 1..{1 << 20}")
    hot_fraction = _fraction(hot_fraction, "hot_fraction")
    hot_traffic = _fraction(hot_traffic, "hot_traffic")
    reuse = _fraction(reuse, "reuse")

    rng = np.random.default_rng(seed)
    k = n_used
    n_hot = min(n_expert, int(math.floor(hot_fraction * n_expert + 0.5)))
    n_cold = n_expert - n_hot
    hot_sets = [np.sort(rng.choice(n_expert, n_hot, replace=False)).astype(np.int32) for _ in range(n_layer)]
    is_hot = np.zeros((n_layer, n_expert), dtype=bool)
    pools = []
    for layer, hs in enumerate(hot_sets):
        is_hot[layer, hs] = True
        pools.append((hs, np.flatnonzero(~is_hot[layer]).astype(np.int32)))
    h_lo, h_hi = max(0, k - n_cold), min(k, n_hot)
    target = k * hot_traffic
    base = math.floor(target)
    frac = target - base

    def pick(pool: np.ndarray, kept: np.ndarray, want: int) -> np.ndarray:
        if kept.size > want:
            kept = rng.permutation(kept)[:want]
        need = want - kept.size
        if need == 0:
            return kept
        avail = pool[~np.isin(pool, kept)] if kept.size else pool
        return np.concatenate([kept, rng.choice(avail, need, replace=False)])

    empty = np.zeros(0, dtype=np.int32)
    prev: list[np.ndarray | None] = [None] * n_layer
    calls = []
    for c in range(n_calls):
        layer = c % n_layer
        hot_pool, cold_pool = pools[layer]
        ids = np.empty((tokens_per_call, k), dtype=np.int32)
        for t in range(tokens_per_call):
            h = min(h_hi, max(h_lo, base + int(rng.random() < frac)))
            last = prev[layer]
            if last is None or reuse == 0.0:
                kept_hot = kept_cold = empty
            else:
                kept = last[t][rng.random(k) < reuse]
                mask = is_hot[layer, kept]
                kept_hot, kept_cold = kept[mask], kept[~mask]
            row = np.concatenate([pick(hot_pool, kept_hot, h), pick(cold_pool, kept_cold, k - h)])
            ids[t] = rng.permutation(row)
        prev[layer] = ids
        calls.append((layer, ids))
    trace = Trace(n_layer, n_expert, n_used, calls)
    trace.meta = dict(generator="synthetic_trace", n_calls=n_calls, tokens_per_call=tokens_per_call,
                      hot_fraction=hot_fraction, hot_traffic=hot_traffic, reuse=reuse, seed=seed, n_hot=n_hot,
                      hot=[hs.tolist() for hs in hot_sets])
    return trace
