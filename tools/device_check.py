#!/usr/bin/env python3
"""The measuring half of tools/device_check.sh: GPU-vs-CPU parity and the hybrid benchmark, one JSON report.

The GPU is the first device of the install's GPU backends: CUDA0 (a CUDA bundle) or Vulkan0 (a Vulkan bundle, on
NVIDIA's or any other Vulkan driver; Mesa's lavapipe with GGML_VK_VISIBLE_DEVICES=0).

1. Environment: the GPU GGML registered, the optional backends' status, the CPU library in use.
2. Parity: generated models (F32 and Q8_0 weights), a prompt plus greedy tokens, on the GPU against two oracles:
   the same model resident on the CPU, and (for the expert cache at share 0 on the GPU) every expert resident on
   the GPU. Each passes by tools/parity.py's rule for the GPU's backend, oracle and weight type: bit-identical where
   that holds, else a bound measured on a device (max|Δlogits| / max|logits|, the same greedy tokens) with the
   reason it is not bit-identical; the report gives the rule and the reason beside each figure.
3. Hybrid benchmark, the method of the hybrid-execution seed (same binary, one process, warmed, sequential
   blocks in mirrored order, mean wall time of the measured requests per block): moe_cpu_share 0, 0.5 and
   auto on disk experts behind a device cache that holds a tenth of a layer's experts. Blocks run
   A,B,C,C,B,A (the three-arm form of A,B,B,A), each arm's session opened for its block, warmed with one
   short request, then ``--requests`` measured requests (prompt plus ``--n-predict`` greedy tokens, EOS
   ignored). Peak VRAM per arm: the most the process held on the GPU after any of its requests (NVML's
   per-process figure when the driver gives one, else the device's used memory as GGML reports it: cudaMemGetInfo,
   or Vulkan's memory budget).
4. The pytest results of the device tests (tests/test_gpu.py, tests/test_gpu_experts.py, and for Vulkan its own),
   from the JUnit file device_check.sh wrote.

Writes ``--out``/device_report.json and device_report.md. Without a GPU it stops, unless ``--allow-cpu``
(a logic check: a CPU backend instance, DEV0, plays the device; no figure means anything then).

    python tools/device_check.py --out build/device_out [--junit FILE] [--allow-cpu] [--small]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from parity import greedy_run, parity_rule  # noqa: E402  (tools/parity.py, shared with test_gpu.py)

import ggml_hybrid as gh  # noqa: E402
from ggml_hybrid._native.backends import optional_backends  # noqa: E402
from ggml_hybrid.ggml.backend import cpu_features, cpu_instance, cpu_library, gpu_device_names  # noqa: E402
from ggml_hybrid.options import SessionOptions  # noqa: E402
from ggml_hybrid.runtime.generate import complete  # noqa: E402
from ggml_hybrid.runtime.moe_model import MoEModel  # noqa: E402
from ggml_hybrid.synthetic import write_model  # noqa: E402

ARMS = ["0", "0.5", "auto"]
# experts do not fit the cache: 64 experts per layer, 6 slots (a token routes to 8)
BENCH_MODEL = dict(n_layer=8, n_embd=1024, n_head=8, n_head_kv=2, head_dim=128, n_ff_exp=512, n_expert=64,
                   n_used=8, vocab_size=384, weight_type="q4_K", seed=11)
SMALL_MODEL = dict(n_layer=2, n_embd=256, n_head=2, n_head_kv=1, head_dim=128, n_ff_exp=256, n_expert=16,
                   n_used=4, vocab_size=384, weight_type="q4_K", seed=11)


def log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict:
    env: dict = {"python": platform.python_version(), "ggml": gh.GGML_VERSION, "cpu_library": cpu_library(),
                 "cpu_features": cpu_features(), "cpu_count": os.cpu_count(),
                 "backends": {k: vars(v) for k, v in optional_backends().items()},
                 "devices": [vars(d) for d in gh.devices()]}
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    try:
        env["vulkaninfo"] = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True,
                                           timeout=60).stdout.strip()[-3000:]
    except (OSError, subprocess.SubprocessError) as exc:
        env["vulkaninfo"] = f"unavailable: {exc}"
    env["vulkan_env"] = {k: v for k, v in os.environ.items() if k.startswith(("VK_", "GGML_VK_"))}
    return env


# -- parity ---------------------------------------------------------------------------------------------------

def parity(workdir: Path, n_predict: int) -> list[dict]:
    """Each weight type's model on the GPU against two oracles, by tools/parity.py's rules for the GPU's backend:
    the CPU (resident there), and every expert resident on the GPU (against the expert cache at share 0)."""
    prompt = [5, 17, 42, 101, 7, 250, 33, 64]
    out = []
    for weight_type in ("f32", "q8_0"):
        path = write_model(workdir / f"parity_{weight_type}.gguf", n_layer=4, n_expert=16, n_used=4,
                           weight_type=weight_type, seed=3)
        with MoEModel(path) as m:
            device = m.device.name
            ref = greedy_run(m, prompt, n_predict)
        runs = {}
        host = cpu_instance(0, os.cpu_count() or 1)
        try:
            with MoEModel(path, device=host) as m:
                runs["cpu"] = greedy_run(m, prompt, n_predict)
        finally:
            host.close()
        # 2 slots for 4 experts a token: every step loads, every expert is computed on the device from slots
        with MoEModel(path, SessionOptions.parse(["disk_experts=1", "expert_cache_slots=2"])) as m:
            runs["resident"] = greedy_run(m, prompt, n_predict)
        backend = device.rstrip("0123456789")
        for oracle, (tokens, logits) in runs.items():
            # the device's run is what is checked; the oracle's run is the reference
            got, want = (ref, (tokens, logits)) if oracle == "cpu" else ((tokens, logits), ref)
            rule = parity_rule(backend, oracle, weight_type)
            passed, rel = rule.check(got[1], want[1], got[0], want[0])
            out.append({"weights": weight_type, "device": device, "oracle": oracle, "n_predict": n_predict,
                        "relative_diff": rel, "bit_identical": bool(np.array_equal(got[1], want[1])),
                        "same_tokens": got[0] == want[0], "rule": rule.text, "rtol": rule.rtol, "why": rule.why,
                        "tokens_device": got[0], "tokens_oracle": want[0], "passed": passed})
            log(f"parity {weight_type} against {oracle}: relative diff {rel:.3g}, same tokens {got[0] == want[0]}; "
                f"rule {rule.text}: {'passed' if passed else 'FAILED'}")
    return out


# -- hybrid benchmark -----------------------------------------------------------------------------------------

def vram_used() -> tuple[int | None, str]:
    """Bytes this process holds on GPU 0, and how that was read."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory:
                return int(proc.usedGpuMemory), "nvml per-process"
    except Exception:  # no NVML, no driver support for the process list (containers): the device's figure
        pass
    gpus = gpu_device_names()
    for d in gh.devices():
        if gpus and d.name == gpus[0]:
            how = "cudaMemGetInfo" if d.name.startswith("CUDA") else "Vulkan memory budget"
            return d.memory_total - d.memory_free, f"{d.name} used ({how})"
    return None, "none (no GPU)"


def hybrid_bench(path: Path, slots: int, threads: int, prompt_len: int, n_predict: int, requests: int,
                 rounds: int) -> dict:
    rng = np.random.default_rng(5)
    prompt = rng.integers(4, 380, prompt_len).tolist()
    order = (ARMS + ARMS[::-1]) * rounds  # A,B,C,C,B,A
    arms: dict[str, dict] = {a: {"block_means_s": [], "positions": [], "decode_tps": [], "prompt_tps": [],
                                 "vram_peak_bytes": 0, "session_device_bytes": 0, "counters": None}
                             for a in ARMS}
    method = ""
    complete_runs = 0
    for pos, arm in enumerate(order):
        opts = SessionOptions.parse(["disk_experts=1", f"expert_cache_slots={slots}", f"moe_cpu_share={arm}",
                                     f"n_threads={threads}"])
        with MoEModel(path, opts) as m:
            complete(m, prompt[:8], 4, stop_at_eos=False)  # short warm-up: graphs built, pages and slots warm
            walls = []
            for _ in range(requests):
                t0 = time.perf_counter()
                _, st = complete(m, prompt, n_predict, stop_at_eos=False)
                walls.append(time.perf_counter() - t0)
                arms[arm]["decode_tps"].append(st.decode_tps)
                arms[arm]["prompt_tps"].append(st.prompt_tps)
                used, method = vram_used()
                if used is not None:
                    arms[arm]["vram_peak_bytes"] = max(arms[arm]["vram_peak_bytes"], used)
                complete_runs += 1
            arms[arm]["block_means_s"].append(statistics.fmean(walls))
            arms[arm]["positions"].append(pos)
            arms[arm]["session_device_bytes"] = sum(m.device_memory().values())
            arms[arm]["counters"] = m.counters.total.to_dict()
        log(f"block {pos + 1}/{len(order)}: share {arm}: mean {arms[arm]['block_means_s'][-1]:.3f} s per request")
    base = statistics.fmean(arms["0"]["block_means_s"])
    for a in arms.values():
        a["mean_s"] = statistics.fmean(a["block_means_s"])
        a["reduction_vs_share0_pct"] = 100.0 * (base - a["mean_s"]) / base
        a["decode_tps_mean"] = statistics.fmean(a["decode_tps"])
        a["prompt_tps_mean"] = statistics.fmean(a["prompt_tps"])
    return {"order": order, "requests_per_block": requests, "prompt_tokens": prompt_len, "n_predict": n_predict,
            "expert_cache_slots": slots, "n_threads": threads, "vram_method": method, "arms": arms,
            "requests_measured": complete_runs}


# -- pytest results -------------------------------------------------------------------------------------------

def junit_summary(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {"available": False}
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        state = "passed"
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                state = kind if kind != "failure" else "failed"
                message = (el.get("message") or "")[:300]
                break
        else:
            message = ""
        cases.append({"name": f"{tc.get('classname')}::{tc.get('name')}", "state": state, "message": message,
                      "seconds": float(tc.get("time") or 0)})
    counts = {s: sum(c["state"] == s for c in cases) for s in ("passed", "failed", "error", "skipped")}
    return {"available": True, "counts": counts, "cases": cases}


# -- report ---------------------------------------------------------------------------------------------------

def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"# Device check, {r['date']}", "",
             f"GPU: {env.get('nvidia_smi') or 'none'}; Python {env['python']}; GGML {env['ggml']}; "
             f"CPU library {Path(env['cpu_library']).name} ({env['cpu_features']}); {env['cpu_count']} CPUs.", ""]
    for st in env["backends"].values():
        lines.append(f"- backend {st['name']}: loaded={st['loaded']}, devices={st['devices']} {st['detail']}")
    t = r["tests"]
    if t.get("available"):
        c = t["counts"]
        lines += ["", f"## Device tests: {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
                      f"{c['skipped']} skipped", ""]
        lines += [f"- {x['state']}: {x['name']} {x['message']}" for x in t["cases"] if x["state"] != "passed"]
    lines += ["", "## Parity (tools/parity.py's rules)", "",
              "| weights | device | against | relative diff | bit-identical | same tokens | rule | passed | why |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {p['weights']} | {p['device']} | {p['oracle']} | {p['relative_diff']:.3g} | {p['bit_identical']} | "
              f"{p['same_tokens']} | {p['rule']} | {p['passed']} | {p['why']} |" for p in r["parity"]]
    b = r.get("bench")
    if b:
        m = r["bench_model"]
        lines += ["", "## Hybrid benchmark", "",
                  f"Model: qwen3moe {m['n_layer']} layers, n_embd {m['n_embd']}, {m['n_expert']} experts top-"
                  f"{m['n_used']}, {m['weight_type']}, {r['bench_model_bytes'] / 2**20:.0f} MiB; disk experts, "
                  f"{b['expert_cache_slots']} cache slots per layer, {b['n_threads']} CPU threads. Blocks "
                  f"{','.join(b['order'])}; per block a short warm-up, then {b['requests_per_block']} requests of "
                  f"{b['prompt_tokens']} prompt + {b['n_predict']} greedy tokens. VRAM: {b['vram_method']}.", "",
                  "| moe_cpu_share | mean wall s/request | per block (in order) | vs share 0 | decode tok/s | "
                  "peak VRAM MiB | session device MiB |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for arm, a in b["arms"].items():
            blocks = ", ".join(f"{x:.3f}" for x in a["block_means_s"])
            lines.append(f"| {arm} | {a['mean_s']:.3f} | {blocks} | {a['reduction_vs_share0_pct']:+.1f}% | "
                         f"{a['decode_tps_mean']:.1f} | {a['vram_peak_bytes'] / 2**20:.0f} | "
                         f"{a['session_device_bytes'] / 2**20:.0f} |")
    lines += ["", f"Total {r['seconds']:.0f} s for this script."]
    return "\n".join(lines) + "\n"


@click.command(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for device_report.json, device_report.md and the scratch models.")
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The device tests' JUnit XML, to include.")
@click.option("--allow-cpu", is_flag=True, help="Run without a GPU (logic check only).")
@click.option("--small", is_flag=True, help="A small benchmark model (logic check).")
@click.option("--slots", default=6, show_default=True, type=click.IntRange(1), help="Cache slots per layer.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1), help="CPU threads.")
@click.option("--prompt-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--n-predict", default=32, show_default=True, type=click.IntRange(1))
@click.option("--requests", default=3, show_default=True, type=click.IntRange(1),
              help="Measured requests per block.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1), help="Repetitions of A,B,C,C,B,A.")
def main(**kw: object) -> None:
    sys.exit(_check(SimpleNamespace(**kw)))


def _check(ns: SimpleNamespace) -> int:
    t0 = time.perf_counter()
    ns.out.mkdir(parents=True, exist_ok=True)
    work = ns.out / "work"
    work.mkdir(exist_ok=True)
    if not gpu_device_names() and not ns.allow_cpu:
        why = "; ".join(st.summary() for st in optional_backends().values()) or "no GPU backend in this install"
        print(f"no GPU device: {why}", file=sys.stderr)
        return 2
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment(),
                    "cuda_available": gh.cuda_available(), "gpu_devices": gpu_device_names(),
                    "tests": junit_summary(ns.junit)}
    report["parity"] = parity(work, 8)
    spec = SMALL_MODEL if ns.small else BENCH_MODEL
    log(f"writing the benchmark model {spec}")
    path = Path(write_model(work / "bench.gguf", **spec))
    report["bench_model"] = spec
    report["bench_model_bytes"] = path.stat().st_size
    report["bench"] = hybrid_bench(path, ns.slots, min(ns.threads, os.cpu_count() or 1), ns.prompt_tokens,
                                   ns.n_predict, ns.requests, ns.rounds)
    path.unlink()  # large; the report holds what matters
    report["seconds"] = time.perf_counter() - t0
    (ns.out / "device_report.json").write_text(json.dumps(report, indent=1, default=str))
    (ns.out / "device_report.md").write_text(markdown(report))
    log(f"wrote {ns.out / 'device_report.json'} and device_report.md")
    ok = all(p["passed"] for p in report["parity"])
    tests = report["tests"]
    if tests.get("available"):
        ok = ok and tests["counts"]["failed"] == 0 and tests["counts"]["error"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    main()
