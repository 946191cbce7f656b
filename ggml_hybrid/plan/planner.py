"""What a model needs, per device and in host memory, under given options, before loading it (``plan``).

The planner opens the model as a *dry run*: the loader's own code places every tensor and
allocates every buffer (weights, expert cache slots, KV cache) on CPU backend instances standing
in for the devices, and reserves the compute buffers by building the largest ubatch graph, but
no tensor data is read and nothing is computed. Its figures are therefore the loader's, buffer
for buffer (compute buffers are measured with the CPU backend; a CUDA backend's differ somewhat).
Host RAM pages behind the untouched buffers are never committed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_int, check_type
from ..errors import NotMoEError
from ..ggml.backend import gpu_device_names
from ..gguf.metadata import meta_int
from ..gguf.store import GGUFStore
from ..model.families import read_hparams
from ..model.hparams import HParams
from ..model.kv_cache import KVCache
from ..moe.host_tier import auto_budget, memory_available, resolve_budget
from ..options import MAX_DEVICES, OptionError, SessionOptions
from ..placement.devices import device_free_memory, plan_device_names
from ..placement.layout import CPU
from ..runtime.cache_size import SlotChoice
from ..runtime.moe_model import MoEModel, auto_cache_slots, context_warning
from ..runtime.tier_size import session_host_bytes
from ..units import GiB, format_bytes
from .host_advice import larger_than_memory, memory_tight, memory_warnings, search_host, tier_items, tier_least
from .k8s import DEFAULT_IMAGE, DEFAULT_PORT, deployment, to_yaml
from .model_info import describe

# -- the results: dataclasses between modules, ``to_dict()`` for --format json (schema in docs/layout.md) ------


def _as_dict(obj: Any) -> Any:
    """A dataclass (or a structure of them) as JSON-ready plain values, in field order; None-valued
    fields marked ``omit_none`` are left out (a dense plan's recommendations have no device totals)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None and f.metadata.get("omit_none"):
                continue
            out[f.name] = _as_dict(v)
        return out
    if isinstance(obj, dict):
        return {k: _as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_as_dict(v) for v in obj]
    return obj


class _ToDict:
    def to_dict(self) -> dict[str, Any]:
        """The JSON schema of ``plan --format json``: plain dicts and lists, keys in field order."""
        out: dict[str, Any] = _as_dict(self)
        return out


@dataclass
class DevicePlan(_ToDict):
    """Bytes one device holds by purpose; ``vram``/``fits`` when a size was given."""

    weights: int
    experts: int
    kv_cache: int
    recurrent: int  # the recurrent states of a recurrent model's delta-net layers (0 for other models)
    compute: int
    total: int
    vram: int | None = None
    fits: bool | None = None


@dataclass
class HostPlan(_ToDict):
    """Host memory: what is used in place from the mapped file, and the buffers it allocates (``repacked``:
    CPU weights copied into GGML's repacked buffers, repack=true)."""

    mapped: dict[str, int]
    mapped_total: int
    repacked: dict[str, int]
    repacked_total: int
    kv_cache: int
    recurrent: int
    compute: int
    resident_total: int  # the host tier included
    ram: int | None = None
    fits: bool | None = None
    host_tier: int = 0  # the host expert tier's budget (host_tier_bytes, resolved: auto from --ram or available)
    # the session's host memory besides the tier, a CPU playing the device included (runtime/tier_size.py): what
    # host_tier_bytes=auto and plan's advice leave beside the tier
    held: int = 0


@dataclass
class KVPlan(_ToDict):
    n_ctx: int
    type_k: str
    type_v: str
    per_sequence: int
    per_token: int
    parallel: int
    total: int


@dataclass
class RecurrentPlan(_ToDict):
    """A recurrent model's recurrent states (F32, whatever the context): one sequence's, and what the memory holds
    for ``parallel`` of them (two rows per sequence slot and one of zeros, :mod:`ggml_hybrid.model.recurrent_state`)."""

    per_sequence: int
    parallel: int
    total: int


@dataclass
class LayoutPlan(_ToDict):
    """Per layer: the device of its compute, of its KV cache, its expert mode; the output's device."""

    layers: list[str]
    kv: list[str]
    experts: list[str]
    output: str


@dataclass
class ExpertPlan(_ToDict):
    count: int
    used: int
    bytes_per_expert: int
    bytes_per_layer: int
    host_tier: bool = True  # the tier holds every family's experts (gpt-oss's biases too): kept, the schema is stable
    host_tier_min: int = 0


@dataclass
class Recommendation(_ToDict):
    """Options that make the model fit, what they buy, and (verified by a plan with them) each device's total."""

    options: str
    buys: str
    device_total: dict[str, int] | None = field(default=None, metadata={"omit_none": True})


@dataclass
class Combination(_ToDict):
    """The combination search's answer: the largest configuration found that fits the given device memory
    (``fits``), or, when none does, the smallest one tried and what each device would need for it."""

    options: str                      # key=value items over the plan's options: one configuration
    fits: bool
    changes: list[str]                # what it changes from the plan's options, in words
    device_total: dict[str, int]      # each device's total under it (verified by a plan with it)
    device_vram: dict[str, int]


@dataclass
class Plan(_ToDict):
    """A MoE model's plan: per device, host, KV cache, layout, experts, warnings and recommendations."""

    model: str
    architecture: str
    moe: bool
    options: list[str]
    devices: dict[str, DevicePlan]
    host: HostPlan
    kv: KVPlan
    recurrent: RecurrentPlan | None  # None: no delta-net layers
    layout: LayoutPlan
    experts: ExpertPlan
    threads: int
    warnings: list[str] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    # expert_cache_slots=auto: the slots chosen and, per device, what decided them
    slot_choice: SlotChoice | None = field(default=None, metadata={"omit_none": True})
    combination: Combination | None = None  # with --vram when the options do not fit: the combination search


@dataclass
class DenseKVPlan(_ToDict):
    n_ctx: int
    per_layer: int
    parallel: int
    total: int


@dataclass
class DensePlan(_ToDict):
    """A dense model (which ggml-hybrid does not run): layer sizes and an ``n_gpu_layers`` suggestion."""

    model: str
    architecture: str
    options: list[str]
    ram: int | None
    kv: DenseKVPlan
    layer_bytes: int
    other_bytes: int
    file_bytes: int
    warnings: list[str]
    recommendations: list[Recommendation]
    threads: int
    moe: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = _as_dict(self)
        # the schema shared with MoE plans: devices (none measured) and host (the RAM given) come after options
        return {"model": d["model"], "architecture": d["architecture"], "moe": False, "options": d["options"],
                "devices": {}, "host": {"ram": d["ram"]}, **{k: d[k] for k in (
                    "kv", "layer_bytes", "other_bytes", "file_bytes", "warnings", "recommendations", "threads")}}


# -- planning ----------------------------------------------------------------------------------------------


@dataclass
class _Measured:
    """One dry run's figures (before the per-sequence and per-device arithmetic)."""

    devices: dict[str, dict[str, int]]
    host_kv: int
    host_recurrent: int
    host_compute: int
    layout: dict[str, Any]
    hp: HParams
    n_ctx: int
    tier_min: int  # the least host tier a run accepts
    held: int  # the session's host bytes besides the tier (session_host_bytes)


def _measure(path: str, opts: SessionOptions, devices: list[str]) -> _Measured:
    with MoEModel(path, opts, dry_run_devices=devices) as m:
        return _Measured({d: m.device_memory(d) for d in devices}, m.kv.nbytes(m.host),
                         m.rs.nbytes(m.host) if m.rs is not None else 0, m.sched.buffer_size(m.host),
                         m.layout_report(), m.hp, m.n_ctx, tier_least(m), sum(session_host_bytes(m).values()))


def plan(path: str | os.PathLike[str], opts: SessionOptions | None = None, vram: list[int] | None = None,
         ram: int | None = None, parallel: int | None = None) -> Plan | DensePlan:
    """The plan for ``path``: bytes per device and host, KV for ``parallel`` sequences, advice, warnings.

    ``parallel`` sets ``n_parallel`` (None: the options' own): the dry run holds that many sequence
    slots, so its KV and compute figures are the runtime's. Nothing is written: a trace path in
    ``opts`` is checked, not opened.
    """
    path = os.fspath(check_type(path, "plan: path", str, os.PathLike))
    opts = SessionOptions() if opts is None else check_type(opts, "plan: opts", SessionOptions, error=OptionError)
    if vram is not None:
        if not isinstance(vram, (list, tuple)):
            raise OptionError(f"vram: must be a list of device sizes in bytes, got {vram!r}")
        if not 1 <= len(vram) <= MAX_DEVICES:
            raise OptionError(f"vram: {len(vram)} device sizes given; a plan takes 1..{MAX_DEVICES} devices (a GGML "
                              f"scheduler holds at most {MAX_DEVICES + 1} backends, the host CPU included)")
        vram = [check_int(v, "vram: a device size in bytes", 0, error=OptionError) for v in vram]
    if ram is not None:
        ram = check_int(ram, "ram: host memory in bytes", 0, error=OptionError)
    if parallel is not None:
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise OptionError(f"parallel={parallel!r}: must be an integer >= 1")
        opts = opts.merged(n_parallel=parallel)
    parallel = opts.n_parallel
    if vram is None and (opts.rpc is not None or gpu_device_names()):
        vram = device_free_memory(opts)  # each RPC server and GPU (CUDA, Vulkan) says what its devices have free
    info = describe(path)
    store = GGUFStore(path)
    try:
        try:
            read_hparams(store)
        except NotMoEError:
            return _plan_dense(info, store, opts, vram, ram, parallel)
    finally:
        store.close()
    choice = None
    if opts.expert_cache_slots == "auto":  # sized from the given sizes, or what the devices have free now
        choice = auto_cache_slots(path, opts, plan_device_names(opts, vram), vram)
        opts = opts.merged(expert_cache_slots=choice.slots)
    p, hp = _plan_moe(path, info, opts, vram, ram, parallel)
    p.slot_choice = choice
    if vram and not all(d.fits for d in p.devices.values()):
        recs = _recommend(p, opts, hp)
        p.recommendations = [r for r in (_verify(path, info, opts, vram, ram, parallel, c) for c in recs) if r]
        p.combination = _search(path, info, opts, vram, ram, parallel, p, hp)
    _advise_memory(path, info, opts, vram, ram, parallel, p, hp)
    return p


def _advise_memory(path: str, info: dict[str, Any], opts: SessionOptions, vram: list[int] | None,
                   ram: int | None, parallel: int, p: Plan, hp: HParams) -> None:
    """A file larger than the memory (``--ram``, or what is available): on a CPU-only machine the host tier's
    configuration is the plan's combination (``search_host``); either way a warning says where the advice is."""
    memory = memory_tight(path, opts, ram)
    if memory is None:
        return
    if not vram:
        found = search_host(_try_plan(path, info, _bare(opts), None, ram, parallel), _base_ladder(opts, p, hp),
                            hp.n_used, p.experts.host_tier_min, memory)
        if found is not None:
            c, q = _combination(found[0], found[1], opts, p, hp), found[1]
            p.combination = dataclasses.replace(c, fits=q.host.held + q.host.host_tier <= memory, device_vram={})
    done = p.combination
    p.warnings.append(larger_than_memory(p, memory, done is not None and done.fits
                                         and "host_tier_bytes=" in done.options))


def _bare(opts: SessionOptions) -> SessionOptions:
    """The options with the experts' placement left to a search."""
    return opts.merged(disk_experts=False, expert_cache_slots=0, expert_eviction=SessionOptions().expert_eviction,
                       moe_cpu_share=0.0, cpu_moe=False, n_cpu_moe=0)


def _try_plan(path: str, info: dict[str, Any], base: SessionOptions, vram: list[int] | None, ram: int | None,
              parallel: int) -> Callable[[list[str]], Plan | None]:
    """A search's dry run of ``key=value`` items over ``base``: its plan, or None when the options are refused."""
    def try_plan(items: list[str]) -> Plan | None:
        try:
            return _plan_moe(path, info, SessionOptions.parse(items, base=base), vram, ram, parallel)[0]
        except OptionError:
            return None

    return try_plan


def _plan_moe(path: str, info: dict[str, Any], opts: SessionOptions, vram: list[int] | None, ram: int | None,
              parallel: int) -> tuple[Plan, HParams]:
    """One dry run and the figures from it (``info``: the file's description, read once per plan)."""
    devices = plan_device_names(opts, vram)
    meas = _measure(path, opts, devices)
    hp = meas.hp
    # the dry run holds every sequence's slot, each exactly one sequence's bytes
    kv_total = sum(meas.devices[d]["kv_cache"] for d in devices) + meas.host_kv
    kv_seq = kv_total // parallel
    out_devices = {}
    for i, d in enumerate(devices):
        m = meas.devices[d]
        total = m["weights"] + m["experts"] + m["kv_cache"] + m["recurrent"] + m["compute"]
        out_devices[d] = DevicePlan(m["weights"], m["experts"], m["kv_cache"], m["recurrent"], m["compute"], total,
                                    vram[i] if vram else None, None if not vram else total <= vram[i])
    mapped = meas.layout["tensors"].get("mapped", {})
    copies = meas.layout["tensors"].get(CPU, {})  # CPU weights copied into RAM: the repacked ones (repack=true)
    host_resident = meas.host_kv + meas.host_recurrent + meas.host_compute + sum(copies.values())
    tier = 0
    if opts.host_tier_bytes != 0 and opts.disk_experts:
        routed = info["experts"]["bytes_per_layer"] * info["experts"]["moe_layers"]
        if opts.host_tier_bytes == "auto":  # what a run takes: the RAM given (or available) less what it holds
            tier = min(routed, auto_budget(memory_available() if ram is None else ram, meas.held))
        else:
            tier = resolve_budget(opts.host_tier_bytes, routed)
    host_resident += tier
    dn = hp.delta_net
    p = Plan(
        model=path, architecture=hp.arch, moe=True, options=opts.to_items(), devices=out_devices,
        host=HostPlan(mapped, sum(mapped.values()), copies, sum(copies.values()), meas.host_kv, meas.host_recurrent,
                      meas.host_compute, host_resident, ram, None if ram is None else host_resident <= ram, tier,
                      meas.held),
        kv=KVPlan(meas.n_ctx, opts.cache_type_k, opts.cache_type_v, kv_seq, kv_seq // meas.n_ctx, parallel,
                  kv_total),
        recurrent=None if dn is None else RecurrentPlan(
            dn.state_bytes(), parallel, meas.host_recurrent + sum(v.recurrent for v in out_devices.values())),
        layout=LayoutPlan(*(meas.layout[k] for k in ("layers", "kv", "experts", "output"))),
        experts=ExpertPlan(hp.n_expert, hp.n_used, info["experts"]["bytes_per_expert"],
                           info["experts"]["bytes_per_layer"], True, meas.tier_min),
        threads=opts.n_threads or os.cpu_count() or 1,
    )
    p.warnings = _warnings(p, opts, hp)
    ctx_warning = context_warning(opts, hp)
    if ctx_warning:
        p.warnings.insert(0, ctx_warning)
    return p, hp


def _overflow(p: Plan) -> int:
    return max(v.total - (v.vram or 0) for v in p.devices.values())


@dataclass
class _Candidate:
    """An unverified recommendation: options, and how to say what they buy from the plan that verifies them."""

    options: str
    explain: Callable[[Plan, dict[str, str]], str]


def _verify(path: str, info: dict[str, Any], opts: SessionOptions, vram: list[int], ram: int | None, parallel: int,
            cand: _Candidate, tries: int = 6) -> Recommendation | None:
    """Plan again with the candidate applied; shrink the cache, move more layers or halve a batch until it fits.

    The arithmetic ignores how the options change the compute buffers (the expert cache adds graphs
    sized by the physical batch); the dry run does not. When the cache cannot shrink further, the
    physical batch is halved. Returns the recommendation as verified (its figures from the fitting
    plan), or None.
    """
    items = cand.options.split()
    for _ in range(tries):
        p, _hp = _plan_moe(path, info, SessionOptions.parse(items, base=opts), vram, ram, parallel)
        over = _overflow(p)
        if over <= 0:
            chosen = dict(x.split("=", 1) for x in items)
            buys = cand.explain(p, chosen)
            if "ubatch_size" in chosen and "ubatch_size" not in cand.options:
                buys += (f" ubatch_size={chosen['ubatch_size']} (-ub) makes room: the compute buffers, the expert "
                         "cache's graphs included, are sized for that many tokens.")
            return Recommendation(" ".join(items), buys, {d: v.total for d, v in p.devices.items()})
        layers_per_dev = max(sum(1 for x in p.layout.layers if x == d) for d in p.devices)
        for i, item in enumerate(items):
            key, _, val = item.partition("=")
            if key == "expert_cache_slots":
                new = int(val) - max(1, -(-over // (p.experts.bytes_per_expert * max(1, layers_per_dev))))
                if new < 1:
                    if any(x.startswith("ubatch_size=") for x in items):
                        continue  # halved below
                    items.append(f"ubatch_size={min(opts.ubatch_size, p.kv.n_ctx) // 2}")
                    if int(items[-1].split("=")[1]) < _MIN_BATCH["ubatch_size"]:
                        return None
                    break
            elif key == "n_cpu_moe":
                new = int(val) + max(1, -(-over // p.experts.bytes_per_layer))
                if new > len(p.layout.layers):
                    return None
            elif key in ("ubatch_size", "n_ctx"):
                new = int(val) // 2
                if new < _MIN_BATCH[key]:
                    return None
            else:
                continue
            items[i] = f"{key}={new}"
            break
        else:
            return None
    return None


# -- the combination search ---------------------------------------------------------------------------------

EXPERT_KEYS = ("disk_experts", "expert_cache_slots", "expert_eviction", "moe_cpu_share", "cpu_moe", "n_cpu_moe")


def _base_ladder(opts: SessionOptions, p: Plan, hp: HParams) -> list[list[str]]:
    """Configurations of context, physical batch, KV type and KV placement, from the given one down to the
    smallest worth running, each a step smaller than the one before (cumulative): the physical batch down to
    128, an 8-bit KV cache (unless the KV cache is in host memory already), then context and batch halved in
    turn down to 512 and 32, then the KV cache on the host."""
    ctx, ub = p.kv.n_ctx, min(opts.ubatch_size, p.kv.n_ctx)
    kv: list[str] = []
    out: list[list[str]] = []

    def step() -> None:
        items = [f"n_ctx={ctx}"] + ([f"ubatch_size={ub}"] if ub != opts.ubatch_size else []) + kv
        if not out or out[-1] != items:
            out.append(items)

    step()
    while ub > 128:
        ub //= 2
        step()
    head_ok = hp.head_dim % 32 == 0 and hp.head_dim_v % 32 == 0
    if head_ok and not opts.no_kv_offload and (opts.cache_type_k, opts.cache_type_v) != ("q8_0", "q8_0"):
        kv = ["cache_type_k=q8_0", "cache_type_v=q8_0", "flash_attn=true"]  # a q8_0 V cache needs flash attention
        step()
    while ctx // 2 >= _MIN_BATCH["n_ctx"] or ub // 2 >= _MIN_BATCH["ubatch_size"]:
        if ctx // 2 >= _MIN_BATCH["n_ctx"]:
            ctx //= 2
            ub = min(ub, ctx)
            step()
        if ub // 2 >= _MIN_BATCH["ubatch_size"]:
            ub //= 2
            step()
    if not opts.no_kv_offload:
        out.append(out[-1] + ["no_kv_offload=true"])
    return out


def _fits(p: Plan) -> bool:
    return all(d.fits for d in p.devices.values())


def _search(path: str, info: dict[str, Any], opts: SessionOptions, vram: list[int], ram: int | None, parallel: int,
            p0: Plan, hp: HParams) -> Combination | None:
    """The largest configuration that fits, as one set of options: the largest context, batch and KV cache that
    fit with every routed expert on the CPU, then as many experts on the devices as still fit (resident, or
    the larger of an expert cache with a CPU share and resident layers after ``n_cpu_moe``). When even the
    smallest configuration does not fit, that configuration and what it needs."""
    try_plan = _try_plan(path, info, _bare(opts), vram, ram, parallel)
    base: list[str] | None = None
    last: tuple[list[str], Plan] | None = None
    for items in _base_ladder(opts, p0, hp):
        q = try_plan(items + ["cpu_moe=true"])
        if q is None:
            continue
        last = (items, q)
        if _fits(q):
            base = items
            break
    if last is None:
        return None
    if base is None:  # nothing fits: the smallest configuration and what it needs
        items, q = last
        return _combination(items + ["cpu_moe=true"], q, opts, p0, hp)
    best: tuple[list[str], Plan] | None = None
    resident = try_plan(base)
    if resident is not None and _fits(resident):
        best = (base, resident)
    else:
        tried = []
        cpu_plan = try_plan(base + ["cpu_moe=true"])
        assert cpu_plan is not None
        free = min((d.vram or 0) - d.total for d in cpu_plan.devices.values())
        layers_on = max(1, max(sum(1 for x in cpu_plan.layout.layers if x == d) for d in cpu_plan.devices))
        slots = min(hp.n_expert, free // layers_on // max(1, cpu_plan.experts.bytes_per_expert))
        memory = memory_tight(path, opts, ram)
        while slots >= 1:  # the cache's graphs cost room the arithmetic leaves out: fewer slots until it fits
            items = base + [f"expert_cache_slots={slots}", "disk_experts=true", "moe_cpu_share=auto"]
            tier = tier_items(try_plan, items, p0.experts.host_tier_min, memory)  # [] or the tier the slots read
            q = try_plan(items + tier)
            if q is not None and _fits(q):
                tried.append((items + tier, q))
                break
            slots = slots - max(1, slots // 4)
        n = next((k for k in range(hp.n_layer + 1) if _fits_with_cpu_layers(
            cpu_plan, k, {d: v.total for d, v in cpu_plan.devices.items()})), hp.n_layer)
        while n < hp.n_layer:
            items = base + [f"n_cpu_moe={n}"]
            q = try_plan(items)
            if q is not None and _fits(q):
                tried.append((items, q))
                break
            n += 1
        tried.append((base + ["cpu_moe=true"], cpu_plan))
        # the host tier's line first (it reads a file larger than RAM), then the most expert bytes on the devices
        best = max(tried, key=lambda t: (t[0][-1].startswith("host_tier_bytes="),
                                         sum(v.experts for v in t[1].devices.values())))
    return _combination(best[0], best[1], opts, p0, hp)


def _combination(items: list[str], q: Plan, opts: SessionOptions, p0: Plan, hp: HParams) -> Combination:
    kv = dict(x.split("=", 1) for x in items)
    changes = []
    if int(kv["n_ctx"]) != p0.kv.n_ctx:
        changes.append(f"context {p0.kv.n_ctx} -> {kv['n_ctx']} tokens (-c)")
    if "ubatch_size" in kv:
        changes.append(f"physical batch {opts.ubatch_size} -> {kv['ubatch_size']} tokens (-ub)")
    if "cache_type_k" in kv:
        changes.append("8-bit KV cache (-ctk q8_0 -ctv q8_0, with flash attention)")
    if "no_kv_offload" in kv:
        changes.append("KV cache in host memory, attention on the CPU (-nkvo)")
    if "expert_cache_slots" in kv:
        changes.append(f"routed experts on disk behind {kv['expert_cache_slots']} device cache slots per layer of "
                       f"{hp.n_expert}" + (", the CPU running the share of misses that finishes soonest"
                                           if kv.get("moe_cpu_share") == "auto" else ""))
        if "host_tier_bytes" in kv:
            changes.append(f"a host tier of {kv['host_tier_bytes']} reading the misses (the file exceeds the RAM)")
    elif "n_cpu_moe" in kv:
        changes.append(f"routed experts of the first {kv['n_cpu_moe']} layers on the CPU")
    elif "cpu_moe" in kv:
        changes.append("every routed expert on the CPU")
    return Combination(" ".join(items), _fits(q), changes, {d: v.total for d, v in q.devices.items()},
                       {d: v.vram or 0 for d, v in q.devices.items()})


# smallest values a recommendation halves -ub / -c to: below them prompt speed or context is not worth it
_MIN_BATCH = {"ubatch_size": 32, "n_ctx": 512}


def _warnings(p: Plan, opts: SessionOptions, hp: HParams) -> list[str]:
    w = []
    h = p.host
    if h.ram is not None and h.resident_total > h.ram:
        w.append(f"host buffers ({format_bytes(h.resident_total)}: repacked CPU weights, KV cache and compute on the "
                 "CPU) exceed --ram "
                 f"{format_bytes(h.ram)}")
    mapped_experts = h.mapped.get("routed_experts", 0)
    if h.ram is not None and mapped_experts and mapped_experts + h.resident_total > h.ram:
        w.append(f"experts used from host memory ({format_bytes(mapped_experts)}, memory-mapped) plus host buffers "
                 f"exceed --ram {format_bytes(h.ram)}: they will be re-read from disk as pages are evicted")
    w += memory_warnings(p, opts, hp)
    if opts.disk_experts and isinstance(opts.expert_cache_slots, int) and opts.expert_cache_slots < hp.n_used:
        w.append(f"expert_cache_slots={opts.expert_cache_slots} is smaller than the {hp.n_used} experts used per "
                 "token: every token needs several load rounds; use more slots or moe_cpu_share")
    devs = p.devices
    # even with no routed expert on the device, the dense part and the KV cache are too much
    base = {k: d.total - d.experts for k, d in devs.items()}
    if any(d.vram is not None and base[k] > d.vram for k, d in devs.items()) and not opts.no_kv_offload:
        if all(base[k] - d.kv_cache <= (d.vram or 0) for k, d in devs.items()):
            w.append(f"the context (n_ctx={p.kv.n_ctx}, {format_bytes(p.kv.total)} of KV cache) only fits "
                     "with no_kv_offload=true (KV cache in host memory, attention on the CPU)")
    return w


def _recommend(p: Plan, opts: SessionOptions, hp: HParams) -> list[_Candidate]:
    """Candidate options that make the model fit the given VRAM (arithmetic on the plan; verified later)."""
    recs = []
    devs = p.devices
    vram = {d: v.vram or 0 for d, v in devs.items()}
    per_expert = p.experts.bytes_per_expert
    layers_on = {d: sum(1 for x in p.layout.layers if x == d) for d in devs}
    kv = {d: v.kv_cache for d, v in devs.items()}
    # what each device holds besides routed experts and cache slots
    base = {d: v.total - v.experts for d, v in devs.items()}
    prefix = ""
    if any(base[d] > vram[d] for d in devs) and not opts.no_kv_offload:
        if all(base[d] - kv[d] <= vram[d] for d in devs):
            prefix = "no_kv_offload=true "  # the experts can only go anywhere once the KV cache has left
            base = {d: base[d] - kv[d] for d in devs}
    free = {d: vram[d] - base[d] for d in devs}
    nkvo = " The KV cache moves to host memory and attention runs on the CPU." if prefix else ""

    def cache(q: Plan, o: dict[str, str]) -> str:
        slots = int(o["expert_cache_slots"])
        cache_bytes = sum(v.experts for v in q.devices.values())
        text = (f"keeps {slots} of {hp.n_expert} experts per layer ({slots / hp.n_expert:.0%}) in device caches of "
                f"{format_bytes(cache_bytes)} in all; misses stream from the memory-mapped file")
        if o.get("moe_cpu_share") == "auto":
            text += "; the CPU runs the share of the misses that finishes each layer soonest (measured costs)"
        return text + "." + nkvo

    def cpu_layers(q: Plan, o: dict[str, str]) -> str:
        n = int(o["n_cpu_moe"])
        moe = sum(1 for x in p.layout.experts[:n] if x != "dense")  # leading dense layers have no experts
        return (f"the routed experts of the first {n} layers ({format_bytes(moe * p.experts.bytes_per_layer)}) "
                f"stay in host memory (memory-mapped, or repacked copies with repack=true where the type allows) and "
                f"run on the CPU, as llama.cpp's --n-cpu-moe {n}." + nkvo)

    if all(free[d] > 0 for d in devs):
        slots = int(min(min(free[d] // max(1, layers_on[d]) // per_expert - 1 for d in devs), hp.n_expert))
        if slots >= 1:
            opt = prefix + f"disk_experts=true expert_cache_slots={slots}"
            if slots >= hp.n_used:
                recs.append(_Candidate(opt, cache))
            recs.append(_Candidate(opt + " moe_cpu_share=auto", cache))
        n = 0
        while n < hp.n_layer and not _fits_with_cpu_layers(p, n, base):
            n += 1
        recs.append(_Candidate(prefix + f"n_cpu_moe={n}", cpu_layers))
    total_kv = sum(kv.values())
    if total_kv and not opts.no_kv_offload and not prefix:
        recs.append(_Candidate("no_kv_offload=true", lambda q, o: (
            f"moves the KV cache ({format_bytes(total_kv)}) to host memory; attention runs on the CPU.")))
    recs += _smaller_batches(p, opts)
    return recs


def _smaller_batches(p: Plan, opts: SessionOptions) -> list[_Candidate]:
    """Where the compute buffer is a device's largest item: a smaller physical batch, then a smaller context."""
    over = [d for d in p.devices.values() if not d.fits]
    if not over or not all(d.compute >= max(d.weights, d.experts, d.kv_cache) for d in over):
        return []
    was = {d: v.compute for d, v in p.devices.items()}

    def smaller(what: str, before: int) -> Callable[[Plan, dict[str, str]], str]:
        def explain(q: Plan, o: dict[str, str]) -> str:
            key = "ubatch_size" if what == "-ub" else "n_ctx"
            now = sum(v.compute for v in q.devices.values())
            text = (f"{what} {o[key]} (from {before}) shrinks the compute buffers from "
                    f"{format_bytes(sum(was.values()))} to {format_bytes(now)}")
            return text + ("; prompts are processed in smaller pieces." if what == "-ub" else
                           "; the context holds fewer tokens.")
        return explain

    out = []
    ub = min(opts.ubatch_size, p.kv.n_ctx)
    if ub // 2 >= _MIN_BATCH["ubatch_size"]:
        out.append(_Candidate(f"ubatch_size={ub // 2}", smaller("-ub", ub)))
    if p.kv.n_ctx // 2 >= _MIN_BATCH["n_ctx"]:
        # a physical batch cannot exceed the context
        ub_item = f" ubatch_size={p.kv.n_ctx // 2}" if opts.ubatch_size > p.kv.n_ctx // 2 else ""
        out.append(_Candidate(f"n_ctx={p.kv.n_ctx // 2}{ub_item}", smaller("-c", p.kv.n_ctx)))
    return out


def _fits_with_cpu_layers(p: Plan, n: int, base: dict[str, int]) -> bool:
    """Whether every device fits once the experts of the first ``n`` layers are on the CPU."""
    layers, modes = p.layout.layers, p.layout.experts
    per_layer = p.experts.bytes_per_layer
    for d, v in p.devices.items():
        kept = sum(1 for i, x in enumerate(layers) if x == d and i >= n and modes[i] != "dense") * per_layer
        if base[d] + kept > (v.vram or 0):
            return False
    return True


def _plan_dense(info: dict[str, Any], store: GGUFStore, opts: SessionOptions, vram: list[int] | None,
                ram: int | None, parallel: int) -> DensePlan:
    """A dense model (which ggml-hybrid does not run): layer sizes and an n_gpu_layers suggestion."""
    arch = info["architecture"]
    n_layer = max(1, info["n_layer"])
    per_layer: dict[int, int] = {}
    for t in store.tensors():
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isascii() and parts[1].isdigit():
            per_layer[int(parts[1])] = per_layer.get(int(parts[1]), 0) + t.nbytes
    layer_bytes = max(per_layer.values()) if per_layer else 0
    head_kv = info["n_head_kv"] or info["n_head"]
    head_dim = meta_int(store, f"{arch}.attention.key_length", (info["n_embd"] // max(1, info["n_head"])) or 1,
                        per_layer="max")
    n_ctx = opts.n_ctx or min(info["n_ctx_train"] or 4096, 4096)
    kv_layer = KVCache.layer_bytes(n_ctx, head_kv * head_dim, opts.cache_type_k, opts.cache_type_v) * parallel
    other = info["total_bytes"] - sum(per_layer.values())
    recs, warnings = [], ["dense model: ggml-hybrid runs MoE models only; these figures are for llama.cpp-style "
                          "placement (compute buffers not measured)"]
    if vram:
        budget = sum(vram) - other
        ngl = max(0, min(n_layer, int(budget // max(1, layer_bytes + kv_layer))))
        recs.append(Recommendation(f"n_gpu_layers={ngl}", f"offloads {ngl} of {n_layer} layers "
                    f"({ngl * layer_bytes / GiB:.2f} GiB of weights, {ngl * kv_layer / GiB:.2f} GiB of KV cache)"))
        ngl_nkvo = max(0, min(n_layer, int(budget // max(1, layer_bytes))))
        if ngl_nkvo > ngl:
            recs.append(Recommendation(f"n_gpu_layers={ngl_nkvo} no_kv_offload=true",
                                       f"offloads {ngl_nkvo} layers by keeping the KV cache in host memory"))
    return DensePlan(info["path"], arch, opts.to_items(), ram, DenseKVPlan(n_ctx, kv_layer // parallel, parallel,
                     kv_layer * n_layer), layer_bytes, other, info["total_bytes"], warnings, recs,
                     opts.n_threads or os.cpu_count() or 1)


def k8s_resources(p: Plan | DensePlan, overhead: int = GiB) -> dict[str, Any]:
    """A pod ``resources`` stanza: GPUs, host memory (experts + KV + buffers + overhead), CPU threads.

    Devices played by CPU instances (no GPU planned) live in host memory and are counted there; RPC
    devices live on their servers and are not counted.
    """
    if isinstance(p, Plan):
        gpus = sum(1 for d, v in p.devices.items() if d.startswith("CUDA") and v.total > 0)
        memory = p.host.mapped_total + p.host.resident_total + overhead
        memory += sum(v.total for d, v in p.devices.items() if d.startswith("DEV"))
    else:  # a dense plan: the whole file mapped plus the KV cache
        gpus = 0
        memory = p.file_bytes + p.kv.total + overhead
    mem_gi = -(-memory // GiB)
    res: dict[str, dict[str, str | int]] = {"requests": {"memory": f"{mem_gi}Gi", "cpu": str(p.threads)},
                                            "limits": {"memory": f"{mem_gi}Gi"}}
    if gpus:
        res["limits"]["nvidia.com/gpu"] = gpus
        res["requests"]["nvidia.com/gpu"] = gpus
    return {"resources": res}


def format_k8s(p: Plan | DensePlan, image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
               name: str | None = None, api_key_secret: str | None = None) -> str:
    """A Deployment running ``ggml-hybrid serve`` under the plan's options, resources and probes (YAML)."""
    if not isinstance(p, Plan):
        raise OptionError(f"{p.model}: a dense model cannot be served by ggml-hybrid (MoE models only)")
    return to_yaml(deployment(p, k8s_resources(p)["resources"], image, port, name, api_key_secret))


__all__ = ["EXPERT_KEYS", "Combination", "DensePlan", "DevicePlan", "ExpertPlan", "HostPlan", "KVPlan", "LayoutPlan",
           "Plan", "Recommendation", "RecurrentPlan", "format_k8s", "k8s_resources", "plan"]
