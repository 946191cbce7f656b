"""What a GGUF model file holds, from its header alone: architecture, experts, bytes per tensor class, and
for the families ggml-hybrid runs, their layers and KV cache per token."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from ..errors import ModelFileError
from ..gguf.metadata import INT32_MAX, MAX_EXPERTS, MAX_LAYERS, architecture, meta_int, meta_str
from ..gguf.names import CLASSES, tensor_class
from ..gguf.store import GGUFStore
from ..model.families import read_hparams
from ..model.hparams import HParams
from ..model.kv_cache import KVCache
from ..units import format_bytes


def describe(path) -> dict:
    store = GGUFStore(path)
    try:
        arch = architecture(store)

        def meta(key, d=0, hi=INT32_MAX):
            return meta_int(store, f"{arch}.{key}", d, lo=0, per_layer="max", hi=hi)

        n_expert = meta("expert_count", 0, MAX_EXPERTS)
        by_class = dict.fromkeys(CLASSES, 0)
        types: dict[str, Counter] = {c: Counter() for c in CLASSES}
        for info in store.tensors():
            c = tensor_class(info.name)
            by_class[c] += info.nbytes
            types[c][info.dtype.name] += 1
        # the layers the graph runs: next-token-prediction layers (after them) are skipped
        trunk = meta("block_count", 0, MAX_LAYERS) - meta("nextn_predict_layers", 0)
        def layer(name: str) -> int:
            m = re.match(r"blk\.(\d+)\.", name)
            return int(m.group(1)) if m else -1

        routers = sorted(layer(t.name) for t in store.tensors()
                         if re.fullmatch(r"blk\.\d+\.ffn_gate_inp\.weight", t.name) and layer(t.name) < trunk)
        by_layer: dict[int, int] = {}
        for t in store.tensors():
            if tensor_class(t.name) == "routed_experts" and 0 <= layer(t.name) < trunk:
                by_layer[layer(t.name)] = by_layer.get(layer(t.name), 0) + t.nbytes
        routed = sum(by_layer.values())
        # next-token-prediction layers (GLM-4.5's, Qwen3-Next's and Qwen3.5's converted files carry one): in the
        # file, never loaded
        nextn = sum(t.nbytes for t in store.tensors() if layer(t.name) >= trunk > 0)
        is_moe = bool(n_expert) and bool(routers)
        out = {
            "path": store.path, "architecture": arch, "name": meta_str(store, "general.name", ""),
            "moe": is_moe, "n_layer": meta("block_count", 0, MAX_LAYERS), "n_embd": meta("embedding_length", 0),
            "n_head": meta("attention.head_count", 0), "n_head_kv": meta("attention.head_count_kv", 0),
            "n_ctx_train": meta("context_length", 0),
            "n_vocab": store.info("token_embd.weight").shape[0] if "token_embd.weight" in store else 0,
            "tensors": len(store.tensors()), "bytes": by_class, "total_bytes": sum(by_class.values()),
            "nextn_bytes": nextn,
            "types": {c: dict(sorted(t.items())) for c, t in types.items() if t},
        }
        if is_moe:
            down_name = f"blk.{routers[0]}.ffn_down_exps.weight"
            down = store.info(down_name) if down_name in store else None
            ff = down.shape[2] if down is not None and len(down.shape) == 3 else meta("expert_feed_forward_length", 0)
            n_moe = len(routers)  # layers with routed experts (leading dense layers and MTP layers aside)
            out["experts"] = {
                "count": n_expert, "used": meta("expert_used_count", 0),
                "shared_ff": meta("expert_shared_feed_forward_length", 0) or meta("expert_shared_count", 0) * ff,
                "ff": ff, "moe_layers": n_moe,
                "bytes_per_expert": routed // (n_moe * n_expert), "bytes_per_layer": routed // n_moe,
                # each MoE layer's routed experts (what the expert cache and the host tier move), by layer number
                "bytes_by_layer": {str(i): by_layer.get(i, 0) for i in routers},
            }
            out["family"] = _family(store)
        return out
    finally:
        store.close()


def kv_bytes_per_token(hp: HParams, type_k: str = "f16", type_v: str = "f16") -> int:
    """KV cache bytes per token over the layers that have one (latent attention: the compressed KV only; recurrent
    models: the attention layers, not the delta-net ones)."""
    return len(hp.kv_layers) * KVCache.layer_bytes(1, hp.kv_k, type_k, type_v, hp.kv_v)


def _family(store: GGUFStore) -> dict[str, Any]:
    """What ggml-hybrid reads from a family it runs; or why it does not run the file."""
    try:
        hp = read_hparams(store)
    except ModelFileError as exc:
        return {"supported": False, "reason": str(exc)}
    r = hp.routing
    fam: dict[str, Any] = {
        "supported": True, "layers": hp.n_layer, "dense_layers": hp.n_dense_lead,
        "nextn_layers": (hp.n_layer_all or hp.n_layer) - hp.n_layer,
        "attention": "latent (MLA)" if hp.mla is not None else
        "gated delta-net + grouped-query" if hp.delta_net is not None else "grouped-query",
        "head_dim": hp.head_dim, "n_rot": hp.rope.n_rot, "rope_scaling": hp.rope.scaling,
        "gating": r.gating, "norm_weights": r.norm_weights, "weights_scale": r.weights_scale,
        "groups": [r.n_group, r.n_group_used] if r.n_group > 1 else None,
        "kv_bytes_per_token": {t: kv_bytes_per_token(hp, t, t) for t in ("f16", "q8_0")},
    }
    if hp.mla is not None:
        fam["kv_lora_rank"], fam["qk_rope"] = hp.mla.kv_lora_rank, hp.mla.qk_rope
    dn = hp.delta_net
    if dn is not None:
        # per sequence, whatever its length: each delta-net layer's convolution history and delta-rule matrices
        fam.update({"delta_net_layers": len(dn.layers), "attention_layers": len(hp.kv_layers),
                    "delta_net": {"d_conv": dn.d_conv, "d_state": dn.d_state, "k_heads": dn.n_k_heads,
                                  "v_heads": dn.n_v_heads, "conv_floats": dn.conv_state, "ssm_floats": dn.ssm_state},
                    "recurrent_bytes_per_sequence": dn.state_bytes()})
        if hp.rope.sections:
            fam["rope_sections"] = list(hp.rope.sections)
    if hp.swa is not None:
        # llama.cpp's own tools keep only window + ubatch cells for these layers; ggml-hybrid, like
        # llama-cpp-python, keeps full-size caches (see docs/models.md)
        fam["sliding_window"] = {"n_swa": hp.swa.n_swa, "layers": sum(hp.swa.layers)}
    return fam


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
        sizes = e["bytes_by_layer"]
        if len(set(sizes.values())) == 1:
            lines.append(f"  routed experts by layer: {len(sizes)} layers x {format_bytes(next(iter(sizes.values())))}")
        else:
            lines.append("  routed experts by layer: " + ", ".join(f"{i}: {format_bytes(n)}" for i, n in sizes.items()))
        f = d["family"]
        if not f["supported"]:
            lines.append(f"  not run by ggml-hybrid: {f['reason']}")
        else:
            layers = f"{f['layers']} layers" + (f", {f['dense_layers']} dense" if f["dense_layers"] else "") + (
                f", {f['nextn_layers']} next-token-prediction (not run)" if f["nextn_layers"] else "")
            rope = f"rope {f['n_rot']} of {f['head_dim']} dims" + (
                f", {f['rope_scaling']} scaling" if f["rope_scaling"] not in ("none", "linear") else "")
            routing = f"{f['gating']} gating" + (", normalised" if f["norm_weights"] else "") + (
                f", scale {f['weights_scale']:g}" if f["weights_scale"] not in (0, 1) else "") + (
                f", groups {f['groups'][1]} of {f['groups'][0]}" if f["groups"] else "")
            lines.append(f"  {layers}; {f['attention']} attention, {rope}; {routing}")
            kv = f["kv_bytes_per_token"]
            text = f"  KV cache per token: {format_bytes(kv['f16'])} (F16), {format_bytes(kv['q8_0'])} (Q8_0)"
            if "kv_lora_rank" in f:
                text += f": compressed, {f['kv_lora_rank']} + {f['qk_rope']} values per layer"
            if "sliding_window" in f:
                sw = f["sliding_window"]
                text += (f"; {sw['layers']} of {f['layers']} layers attend to a sliding window of {sw['n_swa']} "
                         "(their caches are full-size here, as in llama-cpp-python)")
            lines.append(text)
            if "delta_net" in f:
                dn = f["delta_net"]
                lines.append(f"  recurrent state per sequence: {format_bytes(f['recurrent_bytes_per_sequence'])} (F32, "
                             f"any context length): {f['delta_net_layers']} gated delta-net layers of "
                             f"{dn['k_heads']}/{dn['v_heads']} key/value heads of {dn['d_state']}, convolution width "
                             f"{dn['d_conv']}; KV cache in the {f['attention_layers']} attention layers only")
    else:
        lines.append("  not a MoE model (no routed experts)")
    lines.append(f"  {d['tensors']} tensors, {format_bytes(d['total_bytes'])}" + (
        f" ({format_bytes(d['nextn_bytes'])} in next-token-prediction layers, not loaded)" if d["nextn_bytes"]
        else "") + ":")
    for c in CLASSES:
        if d["bytes"][c]:
            types = ", ".join(f"{t} x{n}" for t, n in d["types"][c].items())
            lines.append(f"    {c:<15} {format_bytes(d['bytes'][c]):>14}   {types}")
    return "\n".join(lines)


__all__ = ["CLASSES", "describe", "format_text", "kv_bytes_per_token", "tensor_class"]
