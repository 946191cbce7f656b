"""The numbers a run reports, as one dict (the ``--json`` schema) and as a short text block."""

from __future__ import annotations

from ..runtime.cache_size import SlotChoice
from ..runtime.generate import GenerationStats
from ..runtime.moe_model import MoEModel
from ..runtime.tier_size import TierChoice
from ..units import format_bytes

RUN_SCHEMA_KEYS = ("model", "architecture", "text", "tokens", "prompt_tokens", "generated_tokens", "stop_reason",
                   "load_seconds", "prompt_seconds", "decode_seconds", "prompt_tps", "decode_tps", "decode_steps",
                   "counters", "share_applied", "hybrid_offload_active", "device_memory", "peak_device_bytes",
                   "host_tier", "layout", "options", "slot_choice", "speculative",
                   "slots_unused", "tier_choice")


def spec_report(model: MoEModel, st: GenerationStats) -> dict | None:
    """Speculative decoding's settings and counters (None: plain decoding); ``benchmark_only`` when the drafts were
    replayed (not the model's own: speculation's speed at a staged acceptance)."""
    if st.spec is None:
        return None
    o = model.options
    return {"type": o.spec_type, "draft_max": o.draft_max, "draft_min": o.draft_min, "draft_p_min": o.draft_p_min,
            "backoff": o.draft_backoff, **st.spec.to_json(), "benchmark_only": st.benchmark_only}


def run_report(model: MoEModel, st: GenerationStats, text: str) -> dict:
    total = model.counters.total
    mem = model.device_memory()
    return {
        "model": model.store.path, "architecture": model.hp.arch, "text": text, "tokens": list(st.tokens),
        "prompt_tokens": st.prompt_tokens, "generated_tokens": st.generated_tokens, "stop_reason": st.stop_reason,
        "load_seconds": model.load_seconds, "prompt_seconds": st.prompt_seconds,
        "decode_seconds": st.decode_seconds, "prompt_tps": st.prompt_tps, "decode_tps": st.decode_tps,
        "decode_steps": st.decode_steps,
        "counters": total.to_dict(), "share_applied": total.share_applied,
        "hybrid_offload_active": model.cpu_experts_active, "device_memory": mem,
        "peak_device_bytes": sum(mem.values()),
        "host_tier": model.experts.tier.counters.to_dict() if model.experts.tier is not None else None,
        "layout": model.layout_report(),
        "options": model.options.to_dict(),
        # what --expert-cache-slots auto chose, and the free memory, margin and sizes that decided it
        "slot_choice": model.slot_choice.to_dict() if model.slot_choice is not None else None,
        "speculative": spec_report(model, st),
        # the host tier feeds a CPU playing the device directly: the slots' counters say nothing
        "slots_unused": model.experts.slots_unused,
        # what --host-tier auto chose, and the memory available and the session's own bytes that decided it
        "tier_choice": model.tier_choice.to_dict() if model.tier_choice is not None else None,
    }


def _decode_rate(r: dict) -> str:
    if not r["decode_steps"]:
        # the first generated token comes from the prompt's logits: no decode step ran, there is no rate
        return "no decode step"
    return f"{r['decode_tps']:.1f} tok/s"


def format_stats(r: dict) -> str:
    c = r["counters"]
    mem = r["device_memory"]
    lines = [
        f"load {r['load_seconds']:.2f} s | prompt {r['prompt_tokens']} tok, {r['prompt_tps']:.1f} tok/s | "
        f"decode {r['generated_tokens']} tok, {_decode_rate(r)} | stop: {r['stop_reason']}",
        ("experts: slots unused (the host tier feeds the compute directly)" if r.get("slots_unused")
         else f"experts: hits {c['hits']}, misses {c['misses']}")
        + f", cpu misses {c['cpu_misses']}, share applied {r['share_applied']:.2f} | hybrid_offload_active: "
        f"{str(r['hybrid_offload_active']).lower()}",
        f"peak device memory {format_bytes(r['peak_device_bytes'])} (weights {format_bytes(mem['weights'])}, experts "
        f"{format_bytes(mem['experts'])}, kv {format_bytes(mem['kv_cache'])}, "
        + (f"recurrent {format_bytes(mem['recurrent'])}, " if mem.get("recurrent") else "")
        + f"compute {format_bytes(mem['compute'])})",
    ]
    if r.get("speculative"):
        sp = r["speculative"]
        lines.append(f"speculative ({sp['type']}{', BENCHMARK ONLY: drafts replayed' if sp['benchmark_only'] else ''}):"
                     f" drafted {sp['drafted']}, accepted {sp['accepted']} ({100 * sp['acceptance_rate']:.1f}%), "
                     f"verify steps {sp['verify_steps']}, plain steps {sp['plain_steps']}, head steps "
                     f"{sp['draft_steps']}")
    if r.get("host_tier"):
        t = r["host_tier"]
        lines.append(f"host tier: hits {t['hits']}, misses {t['misses']}, read {format_bytes(t['bytes_read'])} in "
                     f"{t['read_ns'] / 1e9:.2f} s of I/O threads, {t['waits']} loads waited "
                     f"{t['wait_ns'] / 1e9:.2f} s, holds {format_bytes(t['bytes_held'])}"
                     + (f"; read ahead {t['ahead']} (used {t['ahead_used']}, wasted {t['ahead_wasted']})"
                        if t.get("ahead") else ""))
    if r.get("slot_choice"):
        lines.append(SlotChoice(**r["slot_choice"]).describe())
    if r.get("tier_choice"):
        t = r["tier_choice"]
        lines.append(f"host_tier_bytes=auto -> {format_bytes(t['budget'])}: "
                     + TierChoice(t["budget"], t["available"], t["parts"], t["slack"]).describe())
    lines += [
        "layout: " + "; ".join(f"{dev}: " + ", ".join(f"{cls} {format_bytes(n)}" for cls, n in classes.items())
                                  for dev, classes in r["layout"]["tensors"].items()),
    ]
    return "\n".join(lines)


__all__ = ["RUN_SCHEMA_KEYS", "format_stats", "run_report", "spec_report"]
