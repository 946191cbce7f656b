"""The ``demo`` command: a generated MoE model run resident, from disk through the cache, and with CPU offload.

Nothing is downloaded: a small qwen3moe is written to a temporary folder (or, with ``--keep DIR``, to DIR), the
same prompt is run greedily under four configurations, and every evaluated
position's logits are compared with the resident run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import click
import numpy as np

from ..files import check_output
from ..options import SessionOptions
from ..runtime.generate import complete
from ..runtime.moe_model import MoEModel
from ..synthetic import ModelSpec, write_model
from ..units import format_bytes
from .main import main

DEMO_SPEC = ModelSpec(arch="qwen3moe", n_layer=4, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff_exp=128,
                      n_expert=32, n_used=4, weight_type="q8_0", seed=7)
PROMPT = "Once upon a time there was a little model that lived on a disk"


def configurations(n_expert: int, n_threads: int | None) -> list[tuple[str, SessionOptions]]:
    slots = max(1, n_expert // 4)
    resident = SessionOptions(n_threads=n_threads)
    cache = resident.merged(disk_experts=True, expert_cache_slots=slots)
    return [("resident", resident),
            (f"cache {slots} slots, share 0", cache),
            (f"cache {slots} slots, share 0.5", cache.merged(moe_cpu_share=0.5)),
            (f"cache {slots} slots, share auto", cache.merged(moe_cpu_share="auto"))]


def run_demo(n_predict: int = 24, n_threads: int | None = None, echo=print, keep: str | None = None) -> dict:
    """The demo's figures; ``keep``: a folder (made if missing) that keeps the model, instead of a temporary one."""
    with contextlib.ExitStack() as stack:
        if keep is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ggml-hybrid-demo-"))
        else:
            if os.path.exists(keep) and not os.path.isdir(keep):
                raise click.BadParameter(f"{keep!r} exists and is not a folder", param_hint="--keep")
            os.makedirs(keep, exist_ok=True)
            folder = keep
        path = write_model(check_output(os.path.join(folder, "demo-qwen3moe.gguf"), [], "--keep"), DEMO_SPEC)
        echo(f"generated {os.path.basename(path)}: {DEMO_SPEC.n_layer} layers, {DEMO_SPEC.n_expert} experts "
             f"(top-{DEMO_SPEC.n_used}), {DEMO_SPEC.weight_type}, {format_bytes(os.path.getsize(path))}")
        rows, texts, logits = [], [], []
        for label, opts in configurations(DEMO_SPEC.n_expert, n_threads):
            with MoEModel(path, opts) as m:
                text, st = complete(m, m.tokenizer.encode(PROMPT), n_predict, keep_logits=True, stop_at_eos=False)
                c = m.counters.total
                rows.append({"config": label, "load_s": m.load_seconds,
                             "seconds": st.prompt_seconds + st.decode_seconds, "prompt_tps": st.prompt_tps,
                             "decode_tps": st.decode_tps, "hits": c.hits, "misses": c.misses,
                             "cpu_misses": c.cpu_misses, "share_applied": c.share_applied,
                             "hybrid_offload_active": m.cpu_experts_active})
                texts.append(text)
                logits.append(st.all_logits())
        identical = [bool(np.array_equal(lg, logits[0])) for lg in logits]
    for row, same in zip(rows, identical):
        row["identical_logits"] = same
    return {"prompt": PROMPT, "text": texts[0], "rows": rows, "all_identical": all(identical),
            "same_text": all(t == texts[0] for t in texts), "model": None if keep is None else path}


def format_demo(r: dict) -> str:
    head = f"{'configuration':<30}{'time s':>8}{'prompt tok/s':>14}{'decode tok/s':>14}{'hits':>7}{'misses':>8}" \
           f"{'cpu misses':>12}{'share':>7}  logits"
    lines = [f"prompt: {r['prompt']!r}", f"output: {r['text']!r}", "", head]
    for row in r["rows"]:
        lines.append(f"{row['config']:<30}{row['seconds']:>8.3f}{row['prompt_tps']:>14.1f}{row['decode_tps']:>14.1f}"
                     f"{row['hits']:>7}{row['misses']:>8}{row['cpu_misses']:>12}{row['share_applied']:>7.2f}  "
                     f"{'identical' if row['identical_logits'] else 'DIFFERENT'}")
    verdict = ("parity: every configuration's logits are bit-identical to the resident run"
               if r["all_identical"] else "parity: FAILED, some configuration's logits differ from the resident run")
    lines += ["", verdict]
    if r.get("model"):
        slots = max(1, DEMO_SPEC.n_expert // 4)
        lines += [f"model kept: {r['model']}",
                  f"  try: ggml-hybrid run {r['model']} -p \"Hello\" -n 16 --expert-cache-slots {slots} "
                  "--moe-cpu-share auto"]
    return "\n".join(lines)


@main.command()
@click.option("-n", "--n-predict", default=24, show_default=True, type=click.IntRange(1))
@click.option("-t", "--threads", type=int, metavar="N",
              help="CPU threads (default: all cores; N <= 0 = all).")
@click.option("--keep", metavar="DIR", type=click.Path(file_okay=False),
              help="Keep the generated model in DIR (made if missing) to run it again, plan or serve it.")
@click.option("--json", "as_json", is_flag=True)
def demo(n_predict, threads, keep, as_json):
    """Generate a small MoE model and run it resident, cached and with CPU offload; check the logits agree."""

    r = run_demo(n_predict=n_predict, n_threads=threads if threads and threads > 0 else None,
                 echo=(lambda s: None) if as_json else click.echo, keep=keep)
    click.echo(json.dumps(r) if as_json else format_demo(r))
    if not r["all_identical"]:
        sys.exit(1)


__all__ = ["DEMO_SPEC", "demo", "format_demo", "run_demo"]
