"""``plan``'s text: a plan's figures per device and host, its warnings, recommendations and combination, as the
command prints them (``--format json`` is :meth:`Plan.to_dict`)."""

from __future__ import annotations

from ..units import format_bytes
from .host_advice import planned_devices
from .planner import DensePlan, Plan


def format_text(p: Plan | DensePlan) -> str:
    g = format_bytes
    lines = [f"{p.model}: {p.architecture}{' (MoE)' if p.moe else ' (dense)'}; options: "
             f"{' '.join(p.options) or '(defaults)'}"]
    if isinstance(p, Plan):
        planned = planned_devices(p)
        for d, v in p.devices.items():
            fit = "" if v.fits is None else (f"  of {g(v.vram or 0)}: " + ("fits" if v.fits else "DOES NOT FIT"))
            rs = f" | recurrent {g(v.recurrent)}" if v.recurrent else ""
            name = f"{d} (planned: --vram)" if d in planned else d  # a hypothetical device: no such GPU here
            lines.append(f"  {name:<6} weights {g(v.weights)} | experts {g(v.experts)} | kv {g(v.kv_cache)}{rs} | "
                         f"compute {g(v.compute)} | total {g(v.total)}{fit}")
        h = p.host
        lines.append(f"  host   memory-mapped {g(h.mapped_total)} ("
                     + ", ".join(f"{k} {g(v)}" for k, v in h.mapped.items()) + ")"
                     + (f" | repacked {g(h.repacked_total)}" if h.repacked_total else "")
                     + f" | kv {g(h.kv_cache)}"
                     + (f" | recurrent {g(h.recurrent)}" if h.recurrent else "")
                     + f" | compute {g(h.compute)}"
                     + (f" | host tier {g(h.host_tier)}" if h.host_tier else "")
                     + f" | resident {g(h.resident_total)}"
                     + ("" if h.ram is None else f"  of {g(h.ram)}"))
        k = p.kv
        lines.append(f"  KV cache: n_ctx {k.n_ctx} ({k.type_k}/{k.type_v}): {g(k.per_sequence)} "
                     f"per sequence, {g(k.total)} for {k.parallel}")
        rec = p.recurrent
        if rec is not None:
            lines.append(f"  recurrent state: {g(rec.per_sequence)} per sequence (F32, any n_ctx), {g(rec.total)} held "
                         f"for {rec.parallel} (two per sequence, so that a failed eval changes nothing, and one of "
                         "zeros)")
        lines.append(f"  layers: {' '.join(p.layout.layers)}; experts: {' '.join(p.layout.experts)}")
        if p.slot_choice is not None:
            lines.append(f"  {p.slot_choice.describe()}")
    else:
        lines.append(f"  {g(p.layer_bytes)} per layer, {g(p.other_bytes)} other; KV "
                     f"{g(p.kv.per_layer)} per layer at n_ctx {p.kv.n_ctx}")
    for w in p.warnings:
        lines.append(f"  warning: {w}")
    for r in p.recommendations:
        lines.append(f"  recommend: {r.options}: {r.buys}")
    c = p.combination if isinstance(p, Plan) else None
    if c is not None and c.fits:
        lines.append(f"  best combination: {c.options}: " + "; ".join(c.changes) + "; "
                     + ", ".join(f"{d} {g(t)}" + (f" of {g(c.device_vram[d])}" if d in c.device_vram else "")
                                 for d, t in c.device_total.items()))
    elif c is not None:
        lines.append(f"  nothing fits: the smallest configuration ({c.options}) needs "
                     + ", ".join(f"{d} {g(t)} (given {g(c.device_vram[d])})" for d, t in c.device_total.items())
                     + "; fewer layers on the devices (-ngl N) or more devices go further")
    return "\n".join(lines)


__all__ = ["format_text"]
