"""What a GGUF model file holds, from its header alone: architecture, experts, bytes per tensor class."""

from __future__ import annotations

from collections import Counter

from ..model.gguf_store import GGUFStore
from ..model.hparams import architecture, meta_int
from ..units import format_bytes

CLASSES = ("dense", "routed_experts", "shared_experts", "embeddings", "output")


def tensor_class(name: str) -> str:
    if "_exps." in name:
        return "routed_experts"
    if "_shexp." in name:
        return "shared_experts"
    if name.startswith("token_embd."):
        return "embeddings"
    if name.startswith("output."):
        return "output"
    return "dense"


def describe(path) -> dict:
    store = GGUFStore(path)
    try:
        arch = architecture(store)

        def meta(key, d=0):
            return meta_int(store, f"{arch}.{key}", d, lo=0, per_layer="max")

        n_expert = meta("expert_count", 0)
        by_class = dict.fromkeys(CLASSES, 0)
        types: dict[str, Counter] = {c: Counter() for c in CLASSES}
        for info in store.tensors():
            c = tensor_class(info.name)
            by_class[c] += info.nbytes
            types[c][info.dtype.name] += 1
        is_moe = bool(n_expert) and "blk.0.ffn_gate_inp.weight" in store
        out = {
            "path": store.path, "architecture": arch, "name": str(store.meta("general.name", "")),
            "moe": is_moe, "n_layer": meta("block_count", 0), "n_embd": meta("embedding_length", 0),
            "n_head": meta("attention.head_count", 0), "n_head_kv": meta("attention.head_count_kv", 0),
            "n_ctx_train": meta("context_length", 0),
            "n_vocab": store.info("token_embd.weight").shape[0] if "token_embd.weight" in store else 0,
            "tensors": len(store.tensors()), "bytes": by_class, "total_bytes": sum(by_class.values()),
            "types": {c: dict(sorted(t.items())) for c, t in types.items() if t},
        }
        if is_moe:
            down = store.info("blk.0.ffn_down_exps.weight") if "blk.0.ffn_down_exps.weight" in store else None
            n_layer = max(1, out["n_layer"])
            out["experts"] = {
                "count": n_expert, "used": meta("expert_used_count", 0),
                "shared_ff": meta("expert_shared_feed_forward_length", 0),
                "ff": meta("expert_feed_forward_length", down.shape[2] if down else 0),
                "bytes_per_expert": by_class["routed_experts"] // (n_layer * n_expert),
                "bytes_per_layer": by_class["routed_experts"] // n_layer,
            }
        return out
    finally:
        store.close()


def format_text(d: dict) -> str:
    lines = [f"{d['path']}", f"  architecture  {d['architecture']}" + (f" ({d['name']})" if d["name"] else ""),
             f"  layers {d['n_layer']}, embd {d['n_embd']}, heads {d['n_head']}/{d['n_head_kv']} kv, "
             f"vocab {d['n_vocab']}, trained context {d['n_ctx_train']}"]
    if d["moe"]:
        e = d["experts"]
        lines.append(f"  MoE: {e['count']} experts, {e['used']} used per token, expert ff {e['ff']}"
                     + (f", shared expert ff {e['shared_ff']}" if e["shared_ff"] else "")
                     + f"; {format_bytes(e['bytes_per_expert'])} per expert, "
                       f"{format_bytes(e['bytes_per_layer'])} per layer")
    else:
        lines.append("  not a MoE model (no routed experts)")
    lines.append(f"  {d['tensors']} tensors, {format_bytes(d['total_bytes'])}:")
    for c in CLASSES:
        if d["bytes"][c]:
            types = ", ".join(f"{t} x{n}" for t, n in d["types"][c].items())
            lines.append(f"    {c:<15} {format_bytes(d['bytes'][c]):>14}   {types}")
    return "\n".join(lines)


__all__ = ["CLASSES", "describe", "format_text", "tensor_class"]
