"""Signals: Ctrl-C (SIGINT to the process group, as a terminal sends it) at a random moment of a run.

Each expert mode is first run undisturbed for its reference logits and duration. A case starts the
real ``ggml-hybrid run`` (a fresh interpreter: the signal may land in the imports too), waits a random
time up to the reference duration and a little past it, sends SIGINT (and sometimes a second one),
and gives the process ``grace`` seconds to end. Fine: it finished (with the reference logits), stopped
with exit status 130 (the CLI's Ctrl-C exit, after the stats of what ran) or with an ``error:`` line and
exit status 2, or died of SIGINT itself. A traceback, another signal, a
process still alive after ``grace`` (a deadlock), or an exit 0 whose logits differ from the reference
(a swallowed Ctrl-C) is a failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import numpy as np

from .proc import classify, finish_subprocess, run_subprocess, start_subprocess

PROMPT = "Once upon a time there was a little model"
MODES = {
    "resident": (["-t", "2"], 32),
    "disk": (["-t", "2", "-o", "disk_experts=1", "-o", "expert_cache_slots=4"], 8),
    "disk-share": (["-t", "2", "-o", "disk_experts=1", "-o", "expert_cache_slots=4", "-o", "moe_cpu_share=0.5"], 8),
    "disk-auto": (["-t", "2", "-o", "disk_experts=1", "-o", "expert_cache_slots=4", "-o", "moe_cpu_share=auto"], 8),
}


def args_of(model: str, mode: str) -> list[str]:
    extra, n = MODES[mode]
    return ["run", model, "-p", PROMPT, "-n", str(n), "--ignore-eos", "--logits-out", "logits.npy", *extra]


def references(model: str, folder: str, timeout: float, modes: list[str]) -> dict[str, dict[str, Any]]:
    """Each mode run undisturbed once: its logits file and its duration (cached in ``folder``)."""
    index = os.path.join(folder, "references.json")
    refs: dict[str, dict[str, Any]] = {}
    if os.path.exists(index):
        with open(index) as f:
            refs = json.load(f)
    if all(m in refs for m in modes):
        return {m: refs[m] for m in modes}
    for mode in modes:
        if mode in refs:
            continue
        work = os.path.join(folder, f"ref-{mode}")
        os.makedirs(work, exist_ok=True)
        o = run_subprocess(args_of(model, mode), work, timeout)
        if o.rc != 0:
            raise RuntimeError(f"the reference run of mode {mode} failed ({o.rc}): {o.stderr[-2000:]}")
        refs[mode] = {"logits": os.path.join(work, "logits.npy"), "seconds": o.seconds}
    with open(index, "w") as f:
        json.dump(refs, f)
    return {m: refs[m] for m in modes}


def run_case(seed: int, index: int, model: str, refs: dict[str, dict[str, Any]], folder: str,
             grace: float = 20.0) -> dict[str, Any]:
    rng = random.Random(f"signals:{seed}:{index}")
    mode = rng.choice(sorted(refs))
    ref = refs[mode]
    delay = rng.uniform(0.0, 1.1 * ref["seconds"])
    second = rng.uniform(0.0, 0.5) if rng.random() < 0.25 else None
    os.makedirs(folder, exist_ok=True)
    args = args_of(model, mode)
    t0 = time.monotonic()
    p = start_subprocess(args, folder)
    time.sleep(delay)
    sent = []
    for wait in [0.0] + ([second] if second is not None else []):
        time.sleep(wait)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)
                sent.append(round(time.monotonic() - t0, 3))
            except ProcessLookupError:
                pass
    t_sig = time.monotonic()
    o = finish_subprocess(p, folder, t_sig, grace)
    cls = classify(o, os.path.join(folder, "logits.npy"), interrupted=bool(sent))
    if cls == "fine" and o.rc == 0 and sent:
        got = os.path.join(folder, "logits.npy")
        if not (os.path.exists(got) and np.array_equal(np.load(got), np.load(ref["logits"]))):
            cls = "wrong_output"
    return {"index": index, "mode": mode, "delay": round(delay, 3), "sigint_at": sent, "class": cls,
            "exit_seconds_after_sigint": round(time.monotonic() - t_sig, 3) if sent else None,
            "results": {"run": {"class": cls, "rc": o.rc, "stderr": o.stderr[-1500:], "args": args}}}


__all__ = ["MODES", "references", "run_case"]
