#!/usr/bin/env python3
"""A model larger than memory: llama.cpp's mmap against ggml-hybrid's expert cache, mapped and with the host tier.

Each run is a fresh process in a cgroup v1 memory group (``/sys/fs/cgroup/memory/hy_host_tier``) whose limit
(--limit, about a third of the model) counts its page cache too, started from a cold page cache (``echo 3 >
/proc/sys/vm/drop_caches`` before each). Sides (--sides), alternated in order then in reverse order per round:

- ``llama``: llama.cpp through llama-cpp-python (``_llama_worker.py`` under --llama-python), CPU, the file
  memory-mapped (its default) and ``--no-repack`` (llama.cpp's default repacks Q4_K experts into anonymous
  memory at load: the whole model would be copied into RAM, which the cgroup kills);
- ``resident``: ggml-hybrid's default path with ``repack=0``, every expert resident on the CPU playing the
  device: the file memory-mapped, so that in the cgroup its experts are read back through the page cache again
  and again (repacked, the experts would be copied into anonymous memory, which the cgroup kills, as llama's);
- ``mapped``: ggml-hybrid, disk experts behind --slots expert cache slots per layer on the CPU playing the
  device, loads copied from the mapping (the page cache) as before the host tier;
- ``tier``: the same with ``host_tier_bytes`` = --tier (whole experts read by I/O threads, O_DIRECT), loads
  copied from the tier into the slots (repacked Q4_K slots where the CPU repacks, as resident experts are);
- ``tier-cpu``: the CPU-only tier: every expert computed straight from the tier's frames, no slot and no copy,
  the file's experts unmapped; ``repack=0``, since the frames are plain memory (Q4_K is repacked otherwise);
- ``tier-share``: the tier with a CPU share (``moe_cpu_share`` = --share, ``repack=0``): the CPU worker's rows
  from the tier's frames, the rest through the slots; the worker is a second thread (1 + 1).

A ggml-hybrid side takes modifiers (``--sides tier,tier+ahead,tier@1/4+ahead+trace,mapped+trace``):

- ``@SIZE``: this side's tier budget instead of --tier: a size (``450M``) or a fraction of the routed experts as
  the tier holds them (``1/4``, ``1/2``; ``1/1`` is the whole model's);
- ``+ahead``: the lookahead prefetch (``moe_prefetch=true``): the next layer's predicted experts are read ahead
  into the tier (and loaded into free slots where the tier holds them already);
- ``+trace``: ``moe_route_trace`` = --trace (a real model's routing replayed; the model must have the trace's
  experts and top-k, e.g. 60 and 4 for the Qwen1.5-MoE traces). With ``+ahead`` the prediction is then the trace's
  own next rows: an oracle, the most a prediction can give.

Each run: load, then a prompt of --prompt tokens in one eval and --n - 1 decode steps one token each, 1 thread;
the decoded tokens are a fixed varied sequence (``force``; --greedy: the greedy ones), because a random-weight
model's greedy loop repeats one token and its routing with it, which flatters every side's caches; the greedy
picks are returned either way and must agree across the sides.
Reported per run: prompt and decode tok/s, bytes the process read from disk (``/proc/PID/io`` read_bytes) in
the request, peak RSS (``VmHWM``) and the cgroup's peak (RSS + page cache), and for ggml-hybrid the bytes read in
the decode alone and the tier's counters. Before the runs the disk's read bandwidth is measured on the model
file itself (2 MiB O_DIRECT reads at random aligned offsets, 4 in flight, as the tier reads), which with the
bytes read per decoded token gives the disk's bound on decode tok/s.

    sudo python tools/bench/bench_host_tier.py MODEL --llama-python /opt/llref/bin/python --limit 700M \\
        --slots 8 --tier 192M [--tier-cpu 420M] [--share 0.5] [--sides llama,mapped,tier,tier-cpu,tier-share] \\
        [--rounds 2] [--prompt 8] [--n 9] [--trace ../shared/traces/qwen1.5-moe-a2.7b_4bit_mlx_ml_moe_1.ghtrace] \\
        [--cgroup NAME]
"""

from __future__ import annotations

import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.moe.host_tier import entry_bytes
from ggml_hybrid.units import format_bytes, parse_size

HERE = Path(__file__).resolve().parent
CGROUP = Path("/sys/fs/cgroup/memory/hy_host_tier")


def tier_need(model: str) -> int:
    """Bytes every routed expert of the file takes in the tier (each tensor's rows rounded out to 4 KiB reads; the
    matrices and, gpt-oss's, the biases)."""
    store = GGUFStore(model)
    try:
        layers: dict[str, list] = {}
        for t in store.tensors():
            if "_exps." in t.name:
                layers.setdefault(t.name.split(".")[1], []).append(t)
        return sum(entry_bytes([t.nbytes // t.shape[0] for t in ts]) * ts[0].shape[0] for ts in layers.values())
    finally:
        store.close()


def parse_side(spec: str, default_tier: int, default_tier_cpu: int, need: int) -> dict:
    """``NAME[@BUDGET][+ahead][+trace]`` as a dict: kind, tier budget (tier sides), ahead, trace."""
    head, *mods = spec.split("+")
    kind, _, budget = head.partition("@")
    kinds = ("llama", "resident", "mapped", "tier", "tier-cpu", "tier-share")
    if kind not in kinds or any(m not in ("ahead", "trace") for m in mods):
        raise click.BadParameter(f"{spec!r}: a side is one of {', '.join(kinds)} (a tier side with @SIZE or "
                                 "@FRACTION), then +ahead, +trace", param_hint="--sides")
    if kind in ("llama", "resident") and mods or budget and not kind.startswith("tier"):
        raise click.BadParameter(f"{spec!r}: only ggml-hybrid's expert cache takes +ahead/+trace, only a tier side a "
                                 "budget",
                                 param_hint="--sides")
    tier = 0
    if kind.startswith("tier"):
        if not budget:
            tier = default_tier_cpu if kind == "tier-cpu" else default_tier
        elif "/" in budget:
            num, _, den = budget.partition("/")
            tier = int(need * int(num) / int(den))
        else:
            tier = parse_size(budget)
    return dict(kind=kind, tier=tier, ahead="ahead" in mods, trace="trace" in mods)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cgroup_reset(limit: int) -> None:
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.force_empty").write_text("0\n")
    (CGROUP / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (CGROUP / "memory.max_usage_in_bytes").write_text("0\n")


def proc_io(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def disk_bandwidth(path: str, seconds: float = 3.0, block: int = 2 << 20, inflight: int = 4) -> float:
    """Bytes per second of random aligned O_DIRECT reads of ``block`` bytes from ``path``, ``inflight`` at once."""
    size = os.path.getsize(path)
    block = min(block, size // 4096 * 4096 // 2 or 4096)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rng = random.Random(0)
    done = [0]
    end = time.perf_counter() + seconds

    def reader(_: int) -> None:
        buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT wants
        while time.perf_counter() < end:
            off = rng.randrange(0, max(1, (size - block) // 4096)) * 4096
            done[0] += os.preadv(fd, [buf], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(reader, range(inflight)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return done[0] / dt


def run_side(side: str, ns: dict) -> dict:
    drop_caches()
    cgroup_reset(ns["limit"])
    spec = ns["specs"][side]
    if spec["kind"] == "llama":
        cmd = [ns["llama_python"], str(HERE / "_llama_worker.py"), ns["model"], "1", "256", "--no-repack"]
    elif spec["kind"] == "resident":
        cmd = [sys.executable, str(HERE / "_tier_worker.py"), ns["model"], "n_threads=1", "n_ctx=256", "repack=0"]
    else:
        items = ["n_threads=1", "n_ctx=256", "disk_experts=1", f"expert_cache_slots={ns['slots']}"]
        if spec["kind"].startswith("tier"):
            items.append(f"host_tier_bytes={spec['tier']}")
        if spec["kind"] == "tier-cpu":
            items.append("repack=0")
        if spec["kind"] == "tier-share":
            items += ["repack=0", f"moe_cpu_share={ns['share']}"]
        if spec["ahead"]:
            items.append("moe_prefetch=1")
        if spec["trace"]:
            items.append(f"moe_route_trace={ns['trace']}")
        cmd = [sys.executable, str(HERE / "_tier_worker.py"), ns["model"], *items]
    # the process joins the cgroup before it execs the worker: everything it maps or reads is charged there
    shell = f"echo $$ > {CGROUP}/cgroup.procs && exec " + " ".join(f"'{c}'" for c in cmd)
    t0 = time.perf_counter()
    p = subprocess.Popen(["sh", "-c", shell], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = p.stdout.readline()
        if not ready:
            return {"side": side, "failed": f"exited {p.wait()} while loading (killed by the cgroup?)"}
        load_s = time.perf_counter() - t0
        r0 = proc_io(p.pid)
        p.stdin.write(json.dumps({"tokens": ns["tokens"], "n": ns["n"], "force": ns["force"]}) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            return {"side": side, "failed": f"exited {p.wait()} while running (killed by the cgroup?)"}
        rep = json.loads(line)
        rep.update(side=side, load_s=load_s, read_request=proc_io(p.pid) - r0, rss_peak=vm_hwm(p.pid),
                   cgroup_peak=int((CGROUP / "memory.max_usage_in_bytes").read_text()))
        return rep
    finally:
        p.kill()
        p.wait()


@click.command(help=__doc__)
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--llama-python", default="/opt/llref/bin/python", show_default=True)
@click.option("--limit", default="700M", show_default=True, help="The cgroup's memory limit.")
@click.option("--slots", default=8, show_default=True)
@click.option("--tier", default="192M", show_default=True, help="host_tier_bytes of the tier side.")
@click.option("--rounds", default=2, show_default=True)
@click.option("--prompt", default=8, show_default=True)
@click.option("--n", default=9, show_default=True, help="Greedy tokens (the first from the prompt's logits).")
@click.option("--sides", default="llama,mapped,tier,tier-cpu,tier-share", show_default=True,
              help="Comma-separated: llama, resident, mapped, tier, tier-cpu, tier-share, with ggml-hybrid's modifiers "
                   "@BUDGET, "
                   "+ahead, +trace.")
@click.option("--share", default=0.5, show_default=True, help="moe_cpu_share of the tier-share side.")
@click.option("--tier-cpu", "tier_cpu", default=None,
              help="host_tier_bytes of the tier-cpu side (default: --tier); it has no slots, so giving it the slots' "
                   "memory too compares equal footprints.")
@click.option("--trace", "trace", type=click.Path(exists=True, dir_okay=False),
              help="The routing trace of +trace sides (moe_route_trace), e.g. ../shared/traces/*.ghtrace.")
@click.option("--cgroup", default="hy_host_tier", show_default=True,
              help="The memory cgroup's name under /sys/fs/cgroup/memory (another bench may use the default).")
@click.option("--greedy", is_flag=True, help="Decode greedy tokens instead of a fixed varied sequence.")
@click.option("--json-out", type=click.Path(dir_okay=False), help="Also write every run here.")
def main(model, llama_python, limit, slots, tier, rounds, prompt, n, sides, share, tier_cpu, trace, cgroup, greedy,
         json_out) -> None:
    global CGROUP
    CGROUP = CGROUP.parent / cgroup
    order = sides.split(",")
    need = tier_need(model)
    specs = {s: parse_side(s, parse_size(tier), parse_size(tier_cpu or tier), need) for s in order}
    if any(s["trace"] for s in specs.values()) and not trace:
        raise click.BadParameter("a +trace side needs --trace PATH", param_hint="--trace")
    ns = dict(model=model, llama_python=llama_python, limit=parse_size(limit), slots=slots, specs=specs,
              share=share, trace=trace, n=n, tokens=[1 + (i * 37) % 300 for i in range(prompt)],
              # decoded tokens forced to a varied sequence (a random model's greedy loop repeats one token, whose
              # routing then repeats too, which flatters every side's caches); --greedy decodes greedily
              force=None if greedy else [1 + (i * 101 + 7) % 300 for i in range(n - 1)])
    print(f"model {format_bytes(os.path.getsize(model))}, routed experts in the tier's form {format_bytes(need)}, "
          f"cgroup {CGROUP} limit {format_bytes(ns['limit'])}, load average: "
          f"{Path('/proc/loadavg').read_text().strip()}", flush=True)
    for s, spec in specs.items():
        if spec["kind"].startswith("tier"):
            print(f"  {s}: tier budget {format_bytes(spec['tier'])} ({spec['tier'] / need:.2f} of the routed experts)")
    drop_caches()
    bw = disk_bandwidth(model)
    print(f"disk: random 2 MiB O_DIRECT reads, 4 in flight: {bw / 1e6:.0f} MB/s", flush=True)
    runs: list[dict] = []
    for r in range(rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            rep = run_side(side, ns)
            runs.append(rep)
            print(json.dumps(rep), flush=True)
    print()
    print("| side | prompt tok/s | decode tok/s | read in request | read per decoded token | peak RSS | cgroup peak |"
          " tier hits / misses, waits | read ahead (used / wasted) | recall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for side in order:
        ok = [x for x in runs if x["side"] == side and "failed" not in x]
        if not ok:
            print(f"| {side} | failed: {[x.get('failed') for x in runs if x['side'] == side]} |")
            continue
        ptps = statistics.median(prompt / x["prompt_s"] for x in ok)
        dtps = statistics.median((n - 1) / x["decode_s"] for x in ok)
        req = statistics.median(x["read_request"] for x in ok)
        per_tok = statistics.median(x["read_decode"] / (n - 1) for x in ok) if "read_decode" in ok[0] else None
        t = ok[-1].get("tier")
        look = ok[-1].get("lookahead") or {}
        summary[side] = dict(prompt_tps=ptps, decode_tps=dtps, read_request=req, read_per_token=per_tok)
        ahead = f"{t['ahead']} ({t['ahead_used']} / {t['ahead_wasted']})" if t and t.get("ahead") else "-"
        recall = f"{look['predicted_right'] / look['predicted_of']:.2f}" if look.get("predicted_of") else "-"
        print(f"| {side} | {ptps:.2f} | {dtps:.2f} | {format_bytes(req)} | "
              f"{format_bytes(per_tok) if per_tok is not None else '-'} | "
              f"{format_bytes(statistics.median(x['rss_peak'] for x in ok))} | "
              f"{format_bytes(statistics.median(x['cgroup_peak'] for x in ok))} | "
              f"{(str(t['hits']) + ' / ' + str(t['misses']) + ', ' + str(t['waits'])) if t else '-'} | "
              f"{ahead} | {recall} |")
    if "llama" in summary:
        for side in summary:
            if side != "llama":
                print(f"decode {side} / llama: {summary[side]['decode_tps'] / summary['llama']['decode_tps']:.2f}x")
    def per_run(side: str) -> list[float]:
        return [round((n - 1) / x["decode_s"], 3) for x in runs if x["side"] == side and "failed" not in x]

    for side in summary:  # what the read-ahead changes: each +ahead side against the same side without it
        base = "+".join(p for p in side.split("+") if p != "ahead")
        if base != side and base in summary:
            print(f"decode {side} / {base}: {summary[side]['decode_tps'] / summary[base]['decode_tps']:.2f}x "
                  f"(per-run: {per_run(side)} vs {per_run(base)})")
    for side, s in summary.items():
        if s["read_per_token"]:
            bound = bw / s["read_per_token"]
            print(f"{side}: disk bound {bound:.2f} tok/s (read per token / bandwidth); measured "
                  f"{s['decode_tps']:.2f} = {s['decode_tps'] / bound:.2f} of it")
    if json_out:
        Path(json_out).write_text(json.dumps(dict(bandwidth=bw, runs=runs), indent=1))


if __name__ == "__main__":
    main()
