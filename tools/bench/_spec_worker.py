#!/usr/bin/env python3
"""ggml-hybrid side of bench_speculative.py: loads a model, then answers one timing request per line on stdin.

    python _spec_worker.py MODEL OPTION=VALUE...

The model with the options given; with ``spec_type=draft-mtp`` another without it for the plain side. Request
(one JSON line): {"side": "plain" | "replay" | "mtp" | "nodraft", "start": token, "n": N, "k": drafts per step,
"accept": P, "tokens": the plain run's tokens (replay), "p_min": P, "backoff": bool, "force": a token sequence
decoded instead of the greedy one (:class:`ForcedSampler`)}. Reply: {"seconds", "cpu_seconds" (the process's CPU
time: what a loaded machine's waits for a core do not add to), "tokens", "steps" (target steps: decode or verify),
"loaded" (bytes copied into expert cache slots), "tier_read" (bytes the host tier read from the file), "io_read"
(bytes this process read from the block device), "spec" (the speculative counters)}: one greedy generation of ``n``
evaluated positions from ``start`` (a tgN test), timed whole.
"""

import json
import sys
import time

import click
import numpy as np

import ggml_hybrid as gh
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.sampling import Sampler
from ggml_hybrid.runtime.speculative import ReplayDrafts, Speculator


class ForcedSampler(Sampler):
    """The target's "choice" at position p is ``tokens[p]`` (a point mass): a fixed varied sequence decoded as if
    generated (a random-weight model's greedy loop repeats one token and its routing, which flatters every cache);
    drafts replayed from the same sequence are then kept exactly as a model's own greedy tokens would be."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__()
        self.tokens = tokens
        self.n = 0

    def accept(self, token: int) -> None:
        self.n += 1

    def reset(self) -> None:
        self.n = 0

    def candidates(self, logits):  # type: ignore[no-untyped-def]
        return np.array([self.tokens[self.n]]), np.array([1.0])


class NoDrafts:
    """A draft source that proposes nothing: every step a plain decode step through the speculator."""

    benchmark_only = True

    def propose(self, model, requests, counters):  # type: ignore[no-untyped-def]
        return [[] for _ in requests]


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def loaded(m: gh.MoEModel) -> tuple[int, int]:
    tot = m.counters.total
    tier = m.experts.tier
    return tot.bytes_loaded, tier.counters.to_dict()["bytes_read"] if tier is not None else 0


@click.command(help=__doc__)
@click.argument("path")
@click.argument("items", nargs=-1)
def main(path: str, items: tuple[str, ...]) -> int:
    opts = gh.SessionOptions.parse(list(items))
    # a replay model's graphs are the plain model's (no hidden state, no head): it runs the plain side too (one model
    # in a memory cgroup); a draft-mtp model computes its hidden states, so plain decoding gets a model of its own
    models = {"spec": gh.MoEModel(path, opts, benchmark=True)}
    models["plain"] = models["spec"] if opts.spec_type != "draft-mtp" else \
        gh.MoEModel(path, opts.merged(spec_type="none"), benchmark=True)
    print(json.dumps({"ready": True, "spec_type": opts.spec_type}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        side = req["side"]
        m = models["plain" if side == "plain" else "spec"]
        sp = None
        if side == "replay":
            drafts = ReplayDrafts([req["start"]] + req["tokens"], accept=req["accept"], seed=req.get("seed", 0))
            sp = Speculator(m, drafts, draft_max=req["k"], backoff=False)
        elif side == "mtp":
            sp = Speculator(m, draft_max=req["k"], p_min=req.get("p_min", 0.0), backoff=req.get("backoff", True))
        elif side == "nodraft":  # speculation's path (the speculator's steps, the head's rows kept) without drafts
            sp = Speculator(m, NoDrafts(), draft_max=req["k"], backoff=False)
        b0, t0r, io0 = *loaded(m), read_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        force = req.get("force")
        sampler = ForcedSampler([req["start"]] + force) if force else Sampler()
        _, st = complete(m, [req["start"]], req["n"] - 1, sampler, stop_at_eos=False, speculator=sp)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        b1, t1r, io1 = *loaded(m), read_bytes()
        spec = st.spec.to_json() if st.spec is not None else None
        steps = (spec["verify_steps"] + spec["plain_steps"]) if spec is not None else st.decode_steps
        print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "tokens": st.tokens, "steps": steps, "loaded": b1 - b0,
                          "tier_read": t1r - t0r, "io_read": io1 - io0, "spec": spec}), flush=True)
    for m in {id(m): m for m in models.values()}.values():
        m.close()
    return 0


if __name__ == "__main__":
    main()
