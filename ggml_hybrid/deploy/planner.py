"""What a model needs, per device and in host memory, under given options, before loading it (``plan``).

The planner opens the model as a *dry run*: the loader's own code places every tensor and
allocates every buffer (weights, expert cache slots, KV cache) on CPU backend instances standing
in for the devices, and reserves the compute buffers by building the largest ubatch graph, but
no tensor data is read and nothing is computed. Its figures are therefore the loader's, buffer
for buffer (compute buffers are measured with the CPU backend; a CUDA backend's differ somewhat).
Host RAM pages behind the untouched buffers are never committed.
"""

from __future__ import annotations

import os

from ..model.gguf_store import GGUFStore
from ..model.hparams import NotMoEError, read_hparams
from ..model.moe_model import MoEModel
from ..options import MAX_DEVICES, OptionError, SessionOptions
from ..units import GiB, format_bytes
from .model_info import describe


def _measure(path, opts: SessionOptions, devices: list[str]) -> dict:
    with MoEModel(path, opts, dry_run_devices=devices) as m:
        per_dev = {d: m.device_memory(d) for d in devices}
        host_kv = m.kv.nbytes(m.host)
        host_compute = m.sched.buffer_size(m.host)
        report = m.layout_report()
        return {"devices": per_dev, "host_kv": host_kv, "host_compute": host_compute, "layout": report,
                "hp": m.hp, "n_ctx": m.n_ctx}


def plan(path, opts: SessionOptions | None = None, vram: list[int] | None = None, ram: int | None = None,
         parallel: int = 1) -> dict:
    """The plan for ``path``: bytes per device and host, KV for ``parallel`` sequences, advice, warnings."""
    opts = opts or SessionOptions()
    if vram is not None and not 1 <= len(vram) <= MAX_DEVICES:
        raise OptionError(f"vram: {len(vram)} device sizes given; a plan takes 1..{MAX_DEVICES} devices (a GGML "
                          f"scheduler holds at most {MAX_DEVICES + 1} backends, the host CPU included)")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise OptionError(f"parallel={parallel!r}: must be an integer >= 1")
    if opts.rpc is not None and vram is None:
        from .devices import device_free_memory

        vram = device_free_memory(opts)  # each RPC server says what its devices have free
    info = describe(path)
    store = GGUFStore(path)
    try:
        try:
            read_hparams(store)
        except NotMoEError:
            return _plan_dense(info, store, opts, vram, ram, parallel)
    finally:
        store.close()
    p = _plan_moe(path, info, opts, vram, ram, parallel)
    recs = _recommend(p, opts, p["hp"], list(p["devices"])) if vram and not all(
        d["fits"] for d in p["devices"].values()) else []
    p["recommendations"] = [r for r in (_verify(path, info, opts, vram, ram, parallel, r) for r in recs) if r]
    del p["hp"]
    return p


def _plan_moe(path, info: dict, opts: SessionOptions, vram, ram, parallel: int) -> dict:
    """One dry run and the figures from it (``info``: the file's description, read once per plan)."""
    from .devices import plan_device_names

    devices = plan_device_names(opts, vram)
    meas = _measure(path, opts, devices)
    hp, n_ctx = meas["hp"], meas["n_ctx"]
    kv_seq = sum(meas["devices"][d]["kv_cache"] for d in devices) + meas["host_kv"]
    out_devices = {}
    for i, d in enumerate(devices):
        m = dict(meas["devices"][d])
        m["kv_cache"] *= parallel
        m["total"] = sum(m.values())
        m["vram"] = vram[i] if vram else None
        m["fits"] = None if not vram else m["total"] <= vram[i]
        out_devices[d] = m
    tensors = meas["layout"]["tensors"]
    mapped = tensors.get("mapped", {})
    host_resident = meas["host_kv"] * parallel + meas["host_compute"]
    plan_ = {
        "model": str(path), "architecture": hp.arch, "moe": True, "options": opts.to_items(),
        "devices": out_devices,
        "host": {"mapped": mapped, "mapped_total": sum(mapped.values()), "kv_cache": meas["host_kv"] * parallel,
                 "compute": meas["host_compute"], "resident_total": host_resident, "ram": ram,
                 "fits": None if ram is None else host_resident <= ram},
        "kv": {"n_ctx": n_ctx, "type_k": opts.cache_type_k, "type_v": opts.cache_type_v,
               "per_sequence": kv_seq, "per_token": kv_seq // n_ctx, "parallel": parallel,
               "total": kv_seq * parallel},
        "layout": {k: meas["layout"][k] for k in ("layers", "kv", "experts", "output")},
        "experts": {"count": hp.n_expert, "used": hp.n_used,
                    "bytes_per_expert": info["experts"]["bytes_per_expert"],
                    "bytes_per_layer": info["experts"]["bytes_per_layer"]},
        "threads": opts.n_threads or os.cpu_count() or 1,
    }
    plan_["warnings"] = _warnings(plan_, opts, hp)
    plan_["hp"] = hp
    return plan_


def _overflow(p: dict) -> int:
    return max(v["total"] - v["vram"] for v in p["devices"].values())


def _verify(path, info: dict, opts: SessionOptions, vram, ram, parallel, rec: dict, tries: int = 4) -> dict | None:
    """Plan again with the recommendation applied; shrink the cache or move more layers until it fits.

    The arithmetic ignores how the options change the compute buffers; the dry run does not.
    Returns the recommendation as verified (its figures from the fitting plan), or None.
    """
    items = rec["options"].split()
    for _ in range(tries):
        p = _plan_moe(path, info, SessionOptions.parse(items, base=opts), vram, ram, parallel)
        over = _overflow(p)
        if over <= 0:
            return {"options": " ".join(items), "buys": rec["explain"](p, dict(x.split("=", 1) for x in items)),
                    "device_total": {d: v["total"] for d, v in p["devices"].items()}}
        layers_per_dev = max(sum(1 for x in p["layout"]["layers"] if x == d) for d in p["devices"])
        for i, item in enumerate(items):
            key, _, val = item.partition("=")
            if key == "expert_cache_slots":
                new = int(val) - max(1, -(-over // (p["experts"]["bytes_per_expert"] * max(1, layers_per_dev))))
                if new < 1:
                    return None
            elif key == "n_cpu_moe":
                new = int(val) + max(1, -(-over // p["experts"]["bytes_per_layer"]))
                if new > len(p["layout"]["layers"]):
                    return None
            else:
                continue
            items[i] = f"{key}={new}"
            break
        else:
            return None
    return None


def _warnings(p: dict, opts: SessionOptions, hp) -> list[str]:
    w = []
    h = p["host"]
    if h["ram"] is not None and h["resident_total"] > h["ram"]:
        w.append(f"host buffers ({format_bytes(h['resident_total'])}: KV cache and compute on the CPU) exceed --ram "
                 f"{format_bytes(h['ram'])}")
    mapped_experts = p["host"]["mapped"].get("routed_experts", 0)
    if p["host"]["ram"] is not None and mapped_experts and mapped_experts + p["host"]["resident_total"] > \
            p["host"]["ram"]:
        w.append(f"experts used from host memory ({format_bytes(mapped_experts)}, memory-mapped) plus host buffers "
                 f"exceed --ram {format_bytes(p['host']['ram'])}: they will be re-read from disk as pages are evicted")
    if opts.disk_experts and opts.expert_cache_slots < hp.n_used:
        w.append(f"expert_cache_slots={opts.expert_cache_slots} is smaller than the {hp.n_used} experts used per "
                 "token: every token needs several load rounds; use more slots or moe_cpu_share")
    devs = p["devices"]
    # even with no routed expert on the device, the dense part and the KV cache are too much
    base = {k: d["total"] - d["experts"] for k, d in devs.items()}
    if any(d["vram"] is not None and base[k] > d["vram"] for k, d in devs.items()) and not opts.no_kv_offload:
        if all(base[k] - d["kv_cache"] <= d["vram"] for k, d in devs.items()):
            w.append(f"the context (n_ctx={p['kv']['n_ctx']}, {format_bytes(p['kv']['total'])} of KV cache) only fits "
                     "with no_kv_offload=true (KV cache in host memory, attention on the CPU)")
    return w


def _recommend(p: dict, opts: SessionOptions, hp, devices: list[str]) -> list[dict]:
    """Candidate options that make the model fit the given VRAM (arithmetic on the plan; verified later)."""
    recs = []
    devs = p["devices"]
    per_expert = p["experts"]["bytes_per_expert"]
    layers_on = {d: sum(1 for x in p["layout"]["layers"] if x == d) for d in devs}
    kv = {d: v["kv_cache"] for d, v in devs.items()}
    # what each device holds besides routed experts and cache slots
    base = {d: v["total"] - v["experts"] for d, v in devs.items()}
    prefix = ""
    if any(base[d] > devs[d]["vram"] for d in devs) and not opts.no_kv_offload:
        if all(base[d] - kv[d] <= devs[d]["vram"] for d in devs):
            prefix = "no_kv_offload=true "  # the experts can only go anywhere once the KV cache has left
            base = {d: base[d] - kv[d] for d in devs}
    free = {d: devs[d]["vram"] - base[d] for d in devs}
    nkvo = " The KV cache moves to host memory and attention runs on the CPU." if prefix else ""

    def cache(q, o):
        slots = int(o["expert_cache_slots"])
        cache_bytes = sum(v["experts"] for v in q["devices"].values())
        text = (f"keeps {slots} of {hp.n_expert} experts per layer ({slots / hp.n_expert:.0%}) in device caches of "
                f"{format_bytes(cache_bytes)} in all; misses stream from the memory-mapped file")
        if o.get("moe_cpu_share") == "auto":
            text += "; the CPU runs the share of the misses that finishes each layer soonest (measured costs)"
        return text + "." + nkvo

    def cpu_layers(q, o):
        n = int(o["n_cpu_moe"])
        moe = sum(1 for x in p["layout"]["experts"][:n] if x != "dense")  # leading dense layers have no experts
        return (f"the routed experts of the first {n} layers ({format_bytes(moe * p['experts']['bytes_per_layer'])}) "
                f"stay in host memory (memory-mapped) and run on the CPU, as llama.cpp's --n-cpu-moe {n}." + nkvo)

    if all(free[d] > 0 for d in devs):
        slots = int(min(min(free[d] // max(1, layers_on[d]) // per_expert - 1 for d in devs), hp.n_expert))
        if slots >= 1:
            opt = prefix + f"disk_experts=true expert_cache_slots={slots}"
            if slots >= hp.n_used:
                recs.append({"options": opt, "explain": cache})
            recs.append({"options": opt + " moe_cpu_share=auto", "explain": cache})
        n = 0
        while n < hp.n_layer and not _fits_with_cpu_layers(p, n, base):
            n += 1
        recs.append({"options": prefix + f"n_cpu_moe={n}", "explain": cpu_layers})
    total_kv = sum(kv.values())
    if total_kv and not opts.no_kv_offload and not prefix:
        recs.append({"options": "no_kv_offload=true", "explain": lambda q, o: (
            f"moves the KV cache ({format_bytes(total_kv)}) to host memory; attention runs on the CPU.")})
    return recs


def _fits_with_cpu_layers(p: dict, n: int, base: dict) -> bool:
    """Whether every device fits once the experts of the first ``n`` layers are on the CPU."""
    layers, modes = p["layout"]["layers"], p["layout"]["experts"]
    per_layer = p["experts"]["bytes_per_layer"]
    for d, v in p["devices"].items():
        kept = sum(1 for i, x in enumerate(layers) if x == d and i >= n and modes[i] != "dense") * per_layer
        if base[d] + kept > v["vram"]:
            return False
    return True


def _plan_dense(info: dict, store: GGUFStore, opts, vram, ram, parallel) -> dict:
    """A dense model (which ggml-hybrid does not run): layer sizes and an n_gpu_layers suggestion."""
    arch = info["architecture"]
    n_layer = max(1, info["n_layer"])
    per_layer: dict[int, int] = {}
    for t in store.tensors():
        if t.name.startswith("blk."):
            i = int(t.name.split(".")[1])
            per_layer[i] = per_layer.get(i, 0) + t.nbytes
    layer_bytes = max(per_layer.values()) if per_layer else 0
    head_kv = info["n_head_kv"] or info["n_head"]
    head_dim = store.meta(f"{arch}.attention.key_length", (info["n_embd"] // max(1, info["n_head"])) or 1)
    n_ctx = opts.n_ctx or min(info["n_ctx_train"] or 4096, 4096)
    from ..model.kv_cache import KVCache

    kv_layer = KVCache.layer_bytes(n_ctx, head_kv * head_dim, opts.cache_type_k, opts.cache_type_v) * parallel
    other = info["total_bytes"] - sum(per_layer.values())
    recs, warnings = [], ["dense model: ggml-hybrid runs MoE models only; these figures are for llama.cpp-style "
                          "placement (compute buffers not measured)"]
    if vram:
        budget = sum(vram) - other
        ngl = max(0, min(n_layer, int(budget // max(1, layer_bytes + kv_layer))))
        recs.append({"options": f"n_gpu_layers={ngl}", "buys": f"offloads {ngl} of {n_layer} layers "
                     f"({ngl * layer_bytes / GiB:.2f} GiB of weights, {ngl * kv_layer / GiB:.2f} GiB of KV cache)"})
        ngl_nkvo = max(0, min(n_layer, int(budget // max(1, layer_bytes))))
        if ngl_nkvo > ngl:
            recs.append({"options": f"n_gpu_layers={ngl_nkvo} no_kv_offload=true",
                         "buys": f"offloads {ngl_nkvo} layers by keeping the KV cache in host memory"})
    return {"model": info["path"], "architecture": arch, "moe": False, "options": opts.to_items(), "devices": {},
            "host": {"ram": ram}, "kv": {"n_ctx": n_ctx, "per_layer": kv_layer // parallel, "parallel": parallel,
                                         "total": kv_layer * n_layer},
            "layer_bytes": layer_bytes, "other_bytes": other, "file_bytes": info["total_bytes"],
            "warnings": warnings, "recommendations": recs,
            "threads": opts.n_threads or os.cpu_count() or 1}


def format_text(p: dict) -> str:
    g = format_bytes
    lines = [f"{p['model']}: {p['architecture']}{' (MoE)' if p['moe'] else ' (dense)'}; options: "
             f"{' '.join(p['options']) or '(defaults)'}"]
    for d, v in p["devices"].items():
        fit = "" if v["fits"] is None else (f"  of {g(v['vram'])}: " + ("fits" if v["fits"] else "DOES NOT FIT"))
        lines.append(f"  {d:<6} weights {g(v['weights'])} | experts {g(v['experts'])} | kv {g(v['kv_cache'])} | "
                     f"compute {g(v['compute'])} | total {g(v['total'])}{fit}")
    if p["moe"]:
        h = p["host"]
        lines.append(f"  host   memory-mapped {g(h['mapped_total'])} ("
                     + ", ".join(f"{k} {g(v)}" for k, v in h["mapped"].items()) + f") | kv {g(h['kv_cache'])}"
                     f" | compute {g(h['compute'])} | resident {g(h['resident_total'])}"
                     + ("" if h["ram"] is None else f"  of {g(h['ram'])}"))
        k = p["kv"]
        lines.append(f"  KV cache: n_ctx {k['n_ctx']} ({k['type_k']}/{k['type_v']}): {g(k['per_sequence'])} "
                     f"per sequence, {g(k['total'])} for {k['parallel']}")
        lines.append(f"  layers: {' '.join(p['layout']['layers'])}; experts: {' '.join(p['layout']['experts'])}")
    else:
        lines.append(f"  {g(p['layer_bytes'])} per layer, {g(p['other_bytes'])} other; KV "
                     f"{g(p['kv']['per_layer'])} per layer at n_ctx {p['kv']['n_ctx']}")
    for w in p["warnings"]:
        lines.append(f"  warning: {w}")
    for r in p["recommendations"]:
        lines.append(f"  recommend: {r['options']}: {r['buys']}")
    return "\n".join(lines)


def k8s_resources(p: dict, overhead: int = GiB) -> dict:
    """A pod ``resources`` stanza: GPUs, host memory (experts + KV + buffers + overhead), CPU threads.

    Devices played by CPU instances (no GPU planned) live in host memory and are counted there; RPC
    devices live on their servers and are not counted.
    """
    gpus = sum(1 for d, v in p["devices"].items() if d.startswith("CUDA") and v["total"] > 0)
    host = p.get("host", {})
    if p["moe"]:
        memory = host.get("mapped_total", 0) + host.get("resident_total", 0) + overhead
        memory += sum(v["total"] for d, v in p["devices"].items() if d.startswith("DEV"))
    else:  # a dense plan: the whole file mapped plus the KV cache
        memory = p["file_bytes"] + p["kv"]["total"] + overhead
    mem_gi = -(-memory // GiB)
    res: dict[str, dict[str, str | int]] = {"requests": {"memory": f"{mem_gi}Gi", "cpu": str(p["threads"])},
           "limits": {"memory": f"{mem_gi}Gi"}}
    if gpus:
        res["limits"]["nvidia.com/gpu"] = gpus
        res["requests"]["nvidia.com/gpu"] = gpus
    return {"resources": res}


def format_k8s(p: dict) -> str:
    r = k8s_resources(p)["resources"]
    lines = ["resources:"]
    for section in ("requests", "limits"):
        lines.append(f"  {section}:")
        for k, v in r[section].items():
            lines.append(f"    {k}: {v if isinstance(v, int) else repr(str(v)).replace(chr(39), chr(34))}")
    return "\n".join(lines)


__all__ = ["format_k8s", "format_text", "k8s_resources", "plan"]
