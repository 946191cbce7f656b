#!/usr/bin/env python3
"""The expert cache on a Vulkan device (issue 30's figures): staged uploads against plain ``tensor_set``, and the
price of the cache at a 100% hit rate.

The 16-layer stack of bench_expert_cache.py (64 experts, top-8, Q4_K, 256 wide), its device ``Vulkan0``, 1 CPU
thread, share 0 (every expert computed on the device). Alternating order, fresh input per step, warmed; medians;
every output is checked bit-identical to the same stack with every expert resident on Vulkan0.

1. ``loads``: 8 slots (misses every call): the native executor's staged loads (the device's host buffer type,
   two buffers: expert N+1 is read from the mapping into one while expert N uploads from the other with
   ``tensor_set_async``, an event each) against plain ``tensor_set`` (the same executor, ``use_plain_loads``), at 1
   and 64 tokens (``--tokens``): time per layer, load time and staging wait per call, MB/s loaded, bytes staged.
2. ``hits``: 64 slots, filled before measuring (every call is a pure hit): the cache path's time over resident.

On Mesa's lavapipe (a Vulkan driver on the CPU) set ``GGML_VK_VISIBLE_DEVICES=0``; its "device memory" is host
memory, so the upload figures are a memory copy through Vulkan's transfer path, not a bus.

    GGML_VK_VISIBLE_DEVICES=0 python tools/bench/bench_vulkan.py [--part loads|hits|all] [--steps 12] [--warmup 3]
        [--tokens 1 --tokens 64]
"""

from __future__ import annotations

import click
import numpy as np
from bench_expert_cache import SHAPE, model_path
from bench_native_executor import _run

import ggml_hybrid as gh
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions

DEVICE = "Vulkan0"


def _sessions(path: str, modes: dict[str, list[str]]) -> tuple[dict[str, MoEStackSession], list[gh.Backend]]:
    backends = [gh.gpu(DEVICE) for _ in modes]
    sessions = {k: MoEStackSession(path, SessionOptions.parse([*v, "n_threads=1"]), device=b)
                for (k, v), b in zip(modes.items(), backends)}
    return sessions, backends


def loads(steps: int, warmup: int, token_counts: tuple[int, ...]) -> None:
    path, n_layer = model_path(), SHAPE["n_layer"]
    print(f"device {DEVICE} ({next(d.description for d in gh.devices() if d.name == DEVICE)}), 8 slots, share 0, "
          "native executor, 1 thread")
    print(f"{'tokens':>6} {'loads':<7} {'ms/layer':>9} {'ratio':>6} {'load ms/call':>12} {'wait ms/call':>12} "
          f"{'MB/s':>7} {'MiB staged':>10}")
    for n_tokens in token_counts:
        items = ["disk_experts=1", "expert_cache_slots=8"]
        sessions, backends = _sessions(path, {"staged": items, "copy": items})
        for ex in sessions["copy"].executors:
            ex.use_plain_loads()
        assert {ex.load_mode for ex in sessions["staged"].executors} == {"staged"}
        refs, ref_backends = _sessions(path, {"resident": []})
        for s in sessions.values():
            # the executors' compute memory at its size for this token count at once, as MoEModel reserves at load:
            # grown call by call, a device buffer freed and another allocated between graphs of other row counts
            # corrupted the heap in GGML's Vulkan backend on lavapipe (docs/vulkan.md)
            s.layers.reserve(n_tokens)
        med, d = _run(sessions, refs["resident"], n_tokens, steps, warmup, seed=5 + n_tokens)
        for k, s in sessions.items():
            row = d[k]
            staged = s.counters.total.bytes_staged / 2**20
            print(f"{n_tokens:>6} {k:<7} {med[k] * 1e3 / n_layer:>9.3f} {med[k] / med['copy']:>6.3f} "
                  f"{row['load_ms']:>12.3f} {row['wait_ms']:>12.3f} {row['bytes'] / row['load_s'] / 1e6:>7.1f} "
                  f"{staged:>10.1f}")
        for s in [*sessions.values(), *refs.values()]:
            s.close()
        for b in [*backends, *ref_backends]:
            b.close()
    print(f"every output bit-identical to every expert resident on {DEVICE}: True")


def hits(steps: int, warmup: int) -> None:
    path, n_layer = model_path(), SHAPE["n_layer"]
    sessions, backends = _sessions(path, {"resident": [], "cache 64 slots": ["disk_experts=1",
                                                                              "expert_cache_slots=64"]})
    warm = np.random.default_rng(0).standard_normal((256, SHAPE["n_embd"])).astype(np.float32)
    for s in sessions.values():
        s.forward(warm)  # 256 tokens route to every expert: the 64-slot caches are full from here on
    print(f"decode on {DEVICE}, {n_layer} layers, 64 slots (every expert), {steps} steps after {warmup}")
    print(f"{'mode':<16} {'us/layer':>9} {'vs resident':>11} {'hit rate':>8} {'orchestration us/call':>22}")
    med, d = _run(sessions, None, 1, steps, warmup, seed=1)
    for k, m in med.items():
        row = d.get(k)
        print(f"{k:<16} {m * 1e6 / n_layer:>9.1f} {m / med['resident']:>11.3f} "
              f"{'-' if row is None else format(row['hit'], '.2f'):>8} "
              f"{'-' if row is None else format(row['orch_us'], '.1f'):>22}")
    for s in sessions.values():
        s.close()
    for b in backends:
        b.close()
    print("outputs bit-identical at every step: True")


@click.command(help=__doc__)
@click.option("--part", type=click.Choice(["loads", "hits", "all"]), default="all", show_default=True)
@click.option("--steps", type=click.IntRange(1), default=12, show_default=True, help="measured steps per mode")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True)
@click.option("--tokens", "token_counts", type=click.IntRange(1), multiple=True, default=(1, 64), show_default=True,
              help="token counts of the loads part (repeat the option for several)")
def main(part: str, steps: int, warmup: int, token_counts: tuple[int, ...]) -> None:
    if not gh.vulkan_available():
        raise SystemExit("no Vulkan device: build with `python -m ggml_hybrid_build --vulkan`; on lavapipe set "
                         "GGML_VK_VISIBLE_DEVICES=0")
    if part in ("loads", "all"):
        loads(steps, warmup, token_counts)
    if part in ("hits", "all"):
        hits(steps, warmup)


if __name__ == "__main__":
    main()
