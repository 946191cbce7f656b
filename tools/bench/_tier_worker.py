#!/usr/bin/env python3
"""ggml-hybrid side of bench_host_tier.py: loads a model with the given session options, then answers timing
requests on stdin (the protocol of _llama_worker.py).

    python _tier_worker.py MODEL OPTION=VALUE...

Request (one JSON line): {"tokens": [...], "n": N, "force": optional N-1 tokens decoded instead of the greedy
ones}. Reply: {"prompt_s", "decode_s", "tokens", "read_prompt",
"read_decode", "tier", "lookahead"}: the prompt in one eval, then N-1 greedy tokens one eval each; wall seconds of
each, the bytes this process read from disk in each (``/proc/self/io`` read_bytes: what reached the block device,
so page cache hits do not count), the host tier's counters (None without one) and the lookahead's, summed over the
layers (moe_prefetch; zeros without it). The model is a benchmark's (``benchmark=True``), so ``moe_route_trace``
is allowed.
"""

import json
import sys
import time

import click
import numpy as np

import ggml_hybrid as gh


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


@click.command(help=__doc__)
@click.argument("path")
@click.argument("items", nargs=-1)
def main(path: str, items: tuple[str, ...]) -> int:
    model = gh.MoEModel(path, gh.SessionOptions.parse(list(items)), benchmark=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        model.reset()
        r0, t0 = read_bytes(), time.perf_counter()
        logits = model.eval(req["tokens"])
        r1, t1 = read_bytes(), time.perf_counter()
        out = [int(np.argmax(logits[-1]))]
        force = req.get("force")  # as _llama_worker.py: tokens decoded instead of the greedy ones
        for i in range(req["n"] - 1):
            out.append(int(np.argmax(model.eval([force[i] if force else out[-1]])[-1])))
        r2, t2 = read_bytes(), time.perf_counter()
        tier = model.experts.tier
        look = {k: sum(getattr(c, k) for c in model.experts.counters)
                for k in ("predicted", "predicted_right", "predicted_of", "prefetched", "prefetch_used")}
        print(json.dumps({"prompt_s": t1 - t0, "decode_s": t2 - t1, "tokens": out, "read_prompt": r1 - r0,
                          "read_decode": r2 - r1, "tier": tier.counters.to_dict() if tier is not None else None,
                          "lookahead": look}), flush=True)
    model.close()
    return 0


if __name__ == "__main__":
    main()
