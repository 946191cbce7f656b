#!/usr/bin/env python3
"""Eviction policies and the CPU share's rule on real routing: every shared trace, replayed.

Reads the traces of ``../shared/traces`` (real router decisions of Qwen1.5-MoE-A2.7B and Mixtral-8x7B; they are
not part of the project and stay where they are) and replays each through the runtime's own cache and CPU share
rule (``ggml_hybrid.moe.traces.replay``) at 1/8, 1/4 and 1/2 of the experts as slots:

1. share 0: loads of Belady's optimum, LRU, LFU and ``freq`` (the runtime's default), each against Belady and LRU;
   the issue's goal summarised (geometric mean of freq/LRU over the traces at 1/8..1/4 with more slots than
   ``n_expert_used``, and the worst ratio anywhere); beside them the candidates that lost to ``freq`` and
   are not in the runtime: LRU-2 (victim: the oldest second-to-last request) and LRFU (victim: the least
   sum of 2^(-lambda * age) over its requests) at three lambdas, simulated here under the cache's round
   rules (the simulation of LRU and freq is checked against the runtime's replay on every trace);
2. a CPU share (0.25, 0.5) under the default eviction and LRU: loads and CPU-run misses of the reuse-aware
   rule against the rule before it (``rows``); where the reuse rule has both fewer loads and no more CPU-run
   misses it dominates (the rule before, brought down to the same CPU count by a lower share, could only load
   more). An exact match of CPU counts by share does not exist: a share rounds per call, so the CPU counts
   it reaches jump;
3. the modeled time per token for shares 0, 0.25, 0.5, 0.75, 1 and ``auto`` (each layer's cost model fixed to
   the link cost), and auto against the best fixed share.

Expert sizes are one Q4_K expert of each model (Qwen1.5-MoE: 3 x 2048 x 1408; Mixtral: 3 x 4096 x 14336);
the link cost is the cost model's priors (a PCIe 4 bus, a DDR host; ``cpu_share.DEFAULT_PRIOR``). Loads and
bytes are counts; the time is a model, not a measurement.

    python tools/bench/bench_cache_policy.py [--traces ../shared/traces] [--json OUT]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from ggml_hybrid.moe.cpu_share import DEFAULT_PRIOR
from ggml_hybrid.moe.traces import LinkCost, Trace, read_trace, replay
from ggml_hybrid.options import SessionOptions

DEFAULT = SessionOptions().expert_eviction
POLICIES = ("belady", "lru", "lfu", "freq")
CANDIDATES = ("lru2", "lrfu0.01", "lrfu0.03", "lrfu0.1")
SHARES = (0.25, 0.5)
TIME_SHARES: tuple[float | str, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, "auto")
Q4K = 144 / 256  # bytes per weight


def expert_bytes(tr: Trace) -> int:
    n_embd, n_ff = (4096, 14336) if tr.n_expert == 8 else (2048, 1408)  # Mixtral-8x7B, else Qwen1.5-MoE-A2.7B
    return int(3 * n_embd * n_ff * Q4K)


def link_cost(B: int) -> LinkCost:
    p = DEFAULT_PRIOR
    return LinkCost(bus_bytes_per_s=1 / p["load_per_byte"], cpu_bytes_per_s=1 / p["cpu_per_byte"],
                    device_s_per_row=p["device_per_row_per_byte"] * B, cpu_s_per_row=p["cpu_per_row_per_byte"] * B,
                    cpu_s_per_job=p["cpu_per_job"], expert_bytes=B)


def simulate(tr: Trace, n_slots: int, kind: str) -> int:
    """Loads of a history-keeping policy under SlotCache's rules (hits protected, misses most rows first, rounds)."""
    lam = float(kind[4:]) if kind.startswith("lrfu") else 0.0
    layers: dict[int, dict[str, Any]] = {}
    loads = 0
    for layer, ids in tr.calls:
        s = layers.setdefault(layer, dict(res={}, last={}, prev={}, cnt={}, crf={}, tick=0))
        s["tick"] += 1
        t = s["tick"]
        experts, counts = np.unique(ids, return_counts=True)
        rows = dict(zip(experts.tolist(), counts.tolist()))
        for e in rows:  # the call's requests, as SlotCache records them before choosing victims
            if e in s["last"]:
                s["prev"][e] = s["last"][e]
            old, when = s["crf"].get(e, (0.0, t))
            s["crf"][e] = (old * 2.0 ** (-lam * (t - when)) + 1.0, t)
            s["cnt"][e] = s["cnt"].get(e, 0) + 1
            s["last"][e] = t

        def key(slot: int, s: dict[str, Any] = s, t: int = t) -> tuple[float, ...]:
            e = s["res"][slot]
            if kind == "lru":
                return (s["computed"][e], slot)
            if kind == "freq":
                return (s["cnt"][e], s["last"][e], slot)
            if kind == "lru2":
                return (s["prev"].get(e, -1), s["last"][e], slot)
            crf, when = s["crf"][e]
            return (crf * 2.0 ** (-lam * (t - when)), s["last"][e], slot)

        s.setdefault("computed", {})
        where = {e: slot for slot, e in s["res"].items()}
        hits = [e for e in rows if e in where]
        misses = sorted((e for e in rows if e not in where), key=lambda e: (-rows[e], e))
        for e in hits:
            s["computed"][e] = t
        protected, cap, pos, first = {where[e] for e in hits}, n_slots - len(hits), 0, True
        while first or pos < len(misses):
            batch = misses[pos:pos + cap]
            pos += len(batch)
            free = [i for i in range(n_slots) if i not in s["res"]]
            victims = sorted((i for i in s["res"] if i not in protected), key=key)
            targets = (free + victims)[:len(batch)]
            for e, slot in zip(batch, targets):
                s["res"][slot] = e
                s["computed"][e] = t
            loads += len(batch)
            protected, cap, first = set(), n_slots, False  # later rounds may evict anything computed before
    return loads


def slot_counts(tr: Trace) -> list[tuple[str, int]]:
    E = tr.n_expert
    return [("1/8", max(1, round(E / 8))), ("1/4", E // 4), ("1/2", E // 2)]


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--traces", "folder", type=click.Path(file_okay=False), default="../shared/traces", show_default=True)
@click.option("--json", "out", type=click.Path(dir_okay=False), default=None, help="also write every figure here")
def main(folder: str, out: str | None) -> None:
    paths = sorted(Path(folder).glob("*.ghtrace"))
    if not paths:
        click.echo(f"bench_cache_policy: no *.ghtrace in {folder}", err=True)
        sys.exit(2)
    doc: dict[str, list[dict[str, object]]] = {"eviction": [], "share": [], "time": []}
    print(f"runtime default eviction: {DEFAULT}\n")
    print("## 1. share 0: loads (and their ratio to Belady's), per trace and slots")
    print(f"{'trace':<32} {'slots':>9} " + " ".join(f"{p:>14}" for p in POLICIES) + f" {'freq/lru':>9}  "
          + " ".join(f"{c:>8}" for c in CANDIDATES) + "  (candidates / lru)")
    goal, worst = [], 0.0
    for path in paths:
        tr = read_trace(str(path), warn=False)
        B = expert_bytes(tr)
        for frac, n in slot_counts(tr):
            loads = {p: replay(tr, n, p).misses for p in POLICIES}
            assert simulate(tr, n, "lru") == loads["lru"] and simulate(tr, n, "freq") == loads["freq"], path
            cand = {c: simulate(tr, n, c) for c in CANDIDATES}
            ratio = loads["freq"] / loads["lru"]
            worst = max(worst, ratio)
            if frac in ("1/8", "1/4") and n > tr.n_used:
                goal.append(ratio)
            cells = " ".join(f"{loads[p]:>6} ({loads[p] / loads['belady']:.2f}x)" for p in POLICIES)
            print(f"{path.stem[:32]:<32} {frac:>3} = {n:>3} {cells} {ratio:>9.3f}  "
                  + " ".join(f"{cand[c] / loads['lru']:>8.3f}" for c in CANDIDATES))
            doc["eviction"].append({"trace": path.stem, "fraction": frac, "slots": n, "expert_bytes": B,
                                    "loads": {**loads, **cand}, "bytes": {p: v * B for p, v in loads.items()}})
    gm = math.exp(sum(math.log(r) for r in goal) / len(goal)) if goal else float("nan")
    print(f"\nfreq / LRU loads: geometric mean {gm:.3f} over {len(goal)} (trace, slots) at 1/8..1/4 with slots > "
          f"n_expert_used (goal <= 0.96); worst anywhere {worst:.3f} (goal <= 1)\n")

    print("## 2. CPU share: loads / CPU-run misses, reuse-aware rule vs the rule before")
    print(f"{'trace':<32} {'policy':>6} {'slots':>9} {'share':>5} {'reuse':>13} {'rows':>13} {'loads':>6} "
          f"{'cpu':>6} dominates")
    tally = [0, 0, 0]
    for path in paths:
        tr = read_trace(str(path), warn=False)
        for policy in dict.fromkeys((DEFAULT, "lru")):
            for frac, n in slot_counts(tr):
                for share in SHARES:
                    a = replay(tr, n, policy, share=share)
                    b = replay(tr, n, policy, share=share, cpu_rule="rows")
                    dom = a.misses <= b.misses and a.cpu <= b.cpu and (a.misses, a.cpu) != (b.misses, b.cpu)
                    tally[0] += 1
                    tally[1] += a.misses < b.misses
                    tally[2] += dom
                    print(f"{path.stem[:32]:<32} {policy:>6} {frac:>3} = {n:>3} {share:>5g} {a.misses:>6}/{a.cpu:<6} "
                          f"{b.misses:>6}/{b.cpu:<6} {a.misses / b.misses:>6.3f} {a.cpu / max(1, b.cpu):>6.3f} "
                          f"{'yes' if dom else 'NO'}")
                    doc["share"].append({"trace": path.stem, "policy": policy, "fraction": frac, "slots": n,
                                         "share": share, "reuse": [a.misses, a.cpu], "rows": [b.misses, b.cpu]})
    print(f"\nreuse-aware rule: fewer loads in {tally[1]} of {tally[0]}, dominates (fewer loads or CPU-run misses, "
          f"neither more) in {tally[2]} of {tally[0]}")

    print(f"\n## 3. modeled us per token under '{DEFAULT}' (link cost: the cost model's priors)")
    print(f"{'trace':<32} {'slots':>9} " + " ".join(f"{str(s):>8}" for s in TIME_SHARES) + f" {'auto/best':>9}")
    for path in paths:
        tr = read_trace(str(path), warn=False)
        cost = link_cost(expert_bytes(tr))
        for frac, n in slot_counts(tr):
            us = {s: replay(tr, n, DEFAULT, share=s, cost=cost).modeled_s_per_token * 1e6 for s in TIME_SHARES}
            best = min(v for s, v in us.items() if s != "auto")
            print(f"{path.stem[:32]:<32} {frac:>3} = {n:>3} " + " ".join(f"{us[s]:>8.0f}" for s in TIME_SHARES)
                  + f" {us['auto'] / best:>9.3f}")
            doc["time"].append({"trace": path.stem, "fraction": frac, "slots": n,
                                "us_per_token": {str(s): v for s, v in us.items()}})
    if out:
        Path(out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
