"""A MoE language model loaded from GGUF: weights placed per the session options, a KV cache, logits.

    with MoEModel("model.gguf", SessionOptions.parse(["moe_cpu_share=0.5", "disk_experts=1",
                                                      "expert_cache_slots=16"])) as m:
        logits = m.eval(m.tokenizer.encode("Hello"))   # [1, n_vocab]: the last position

:class:`MoEModel` is the :class:`~ggml_hybrid.runtime.session.Session` that loads its own
:class:`~ggml_hybrid.runtime.loaded_model.LoadedModel` and closes it with itself: one object for one run, as the
command line, the server and most scripts use it. The model it loaded is :attr:`MoEModel.model`; a second session
over the same weights is ``Session(m.model, ...)`` (docs/api.md, "A model and its sessions").

Dense weights (attention, norms, routers, shared experts, embeddings, output)
go to the device; routed experts are placed by :class:`ExpertLayers` (resident,
``cpu_moe``/``n_cpu_moe``, or disk-backed with the expert cache and its
CPU share). ``eval`` appends tokens to a sequence's KV slot (sequence 0 unless
``seq`` is given), ``reset`` starts over. With ``n_parallel=N`` the model holds N
sequences (one KV slot each) and ``decode`` computes one token of each of several
of them in one ubatch; each sequence's logits are bit-identical to evaluating it
alone on the CPU (docs/serve.md, "Concurrent sequences").
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from ..ggml.backend import Backend
from ..machine import available_memory, default_threads
from ..model.hparams import HParams
from ..moe.host_tier import auto_budget, check_tier_budget, memory_available
from ..options import OptionError, SessionOptions
from ..placement.devices import device_free_memory, device_names
from ..units import MiB, format_bytes
from .cache_size import SlotChoice, choose_slots
from .loaded_model import LoadedModel, check_load_arguments, check_options
from .session import MAX_GRAPHS, MAX_STEP_GRAPHS, Checkpoint, Session, context_warning
from .tier_size import TierChoice, session_host_bytes


def auto_cache_slots(path: str | os.PathLike[str], opts: SessionOptions, devices: list[str] | None = None,
                     free: list[int] | None = None) -> SlotChoice:
    """The slots ``expert_cache_slots=auto`` takes for ``path`` with ``opts`` (runtime/cache_size.py: the rule).

    ``devices``: the device names (default: the session's own); ``free``: their free bytes, in order (default:
    what they report now; CPU instances playing devices share the host's available memory).
    """
    if not opts.disk_experts:
        raise OptionError("expert_cache_slots=auto: the slots belong to the expert cache, which needs "
                          "disk_experts=true (--disk-experts; --expert-cache-slots implies it)")
    names = device_names(opts) if devices is None else list(devices)
    if free is None:
        free = device_free_memory(opts)
        if free is None or len(free) != len(names):  # no accelerator says: CPU instances allocate from the host
            host = available_memory()
            if host is None:
                raise OptionError("expert_cache_slots=auto: this system does not say how much memory is available; "
                                  "give a number of slots")
            free = [host // max(1, len(names))] * len(names)
    if len(free) != len(names):
        raise OptionError(f"expert_cache_slots=auto: {len(free)} free sizes for the {len(names)} devices "
                          f"({', '.join(names)})")

    def totals(slots: int) -> tuple[dict[str, int], HParams]:
        with MoEModel(path, opts.merged(expert_cache_slots=slots), dry_run_devices=names) as m:
            return {d: sum(m.device_memory(d).values()) for d in names}, m.hp

    t1, hp = totals(1)
    t2 = totals(2)[0] if hp.n_expert >= 2 else t1
    room = dict(zip(names, free))
    choice = choose_slots(t1, t2, room, hp.n_expert, hp.n_used)
    for _ in range(4):  # the linear model checked by a dry run at the chosen count, one slot less per miss
        if choice.slots <= 2:
            break
        tn = totals(choice.slots)[0]
        if all(tn[d] <= room[d] - choice.margin[d] for d in choice.per_device):
            break
        if choice.slots - 1 < max(1, hp.n_used):
            raise OptionError(f"expert_cache_slots=auto: a dry run at {choice.slots} slots does not fit ("
                              f"{choice.describe()}), and fewer than the {hp.n_used} experts used per token would; "
                              "free device memory or lower n_ctx / n_parallel / ubatch_size")
        choice = dataclasses.replace(choice, slots=choice.slots - 1)
    return choice


def auto_host_tier(path: str | os.PathLike[str], opts: SessionOptions, available: int | None = None) -> TierChoice:
    """The budget ``host_tier_bytes=auto`` takes for ``path`` with ``opts`` (runtime/tier_size.py: the rule): a dry
    run of the session gives what it holds in host memory besides the tier; ``available``: the memory available
    (default: now, :func:`~ggml_hybrid.moe.host_tier.memory_available`). Less than one layer's experts is refused,
    naming the figures."""
    avail = memory_available() if available is None else available
    names = device_names(opts)
    with MoEModel(path, opts, dry_run_devices=names) as m:
        parts, least, every = session_host_bytes(m), m.experts.tier_least, m.experts.tier_need
    choice = TierChoice(min(auto_budget(avail, sum(parts.values())), every), avail, parts)
    if choice.budget < least:
        size = os.path.getsize(path)
        what = ("`ggml-hybrid plan FILE --ram SIZE`, SIZE the memory the run gets, prints a configuration that fits"
                if size > avail else f"the file ({format_bytes(size)}) fits in the memory: leave --host-tier out")
        raise OptionError(f"host_tier_bytes=auto: {choice.describe()} leaves {format_bytes(choice.budget)}, less "
                          f"than one layer's experts ({format_bytes(least)}, the least tier a call can use): give the "
                          f"run more memory, a smaller context (-c) or physical batch (-ub) ({what}), or a size "
                          f"(--host-tier {-(-least // MiB)}M or more) if the buffers will not fill")
    check_tier_budget(choice.budget, least, "auto")
    return choice

def check_copies_fit(path: str | os.PathLike[str], opts: SessionOptions) -> None:
    """Refuse before loading a file larger than the memory available whose repacked weights (``repack=true``,
    llama.cpp's CPU_REPACK: gpt-oss's MXFP4 experts, Q4_0, ...) would be copied into it: the copies are anonymous
    memory, which a memory limit kills rather than evicts (the file's pages used in place are page cache, which it
    evicts). Only the file's size is read unless it is larger than the memory; then a dry run counts the copies."""
    try:
        size, avail = os.path.getsize(path), memory_available()
    except (OSError, TypeError, ValueError, OptionError):  # a bad path (the load says why), or no figure
        return
    if not opts.repack or size <= avail:
        return
    with MoEModel(path, opts, dry_run_devices=device_names(opts)) as m:
        names = [n for n in m.model.repacked | m.experts.repacked if n in m.store]
        copied = sum(m.store.info(n).nbytes for n in names)
        kinds = sorted({m.store.info(n).dtype.name for n in names})
        parts = session_host_bytes(m)
    buffers = parts["kv_cache"] + parts["compute"]
    if copied and copied + buffers > avail:
        raise OptionError(
            f"{os.fspath(path)!r} ({format_bytes(size)}) is larger than the {format_bytes(avail)} available (the "
            f"memory, or what this process's memory cgroup allows), and this configuration copies "
            f"{format_bytes(copied)} of repacked weights ({', '.join(kinds)}) into memory beside "
            f"{format_bytes(buffers)} of KV cache and compute buffers (repack=true, llama.cpp's CPU_REPACK): the "
            "process would be killed. Give --no-repack (repack=false: the weights used in place from the file), or "
            "read the experts through the host tier (--host-tier auto, or the size `plan --ram SIZE` advises)")


class MoEModel(Session):
    """A session that loads its own model (:class:`LoadedModel`) from ``path`` and closes it with itself."""

    model: LoadedModel

    def __init__(self, path: str | os.PathLike[str], options: SessionOptions | None = None,
                 device: Backend | None = None, progress: Callable[[int, int], object] | None = None,
                 dry_run_devices: list[str] | None = None, benchmark: bool = False) -> None:
        """Load ``path``; ``progress(done, total)`` is called as tensors are loaded.

        ``benchmark``: a benchmark's session, the only kind that may replace the routing by a trace
        (``moe_route_trace``; its output is then not the model's own, :attr:`route_trace` says so).

        ``dry_run_devices`` (planning): allocate everything as a load would, on CPU backend
        instances standing in for the named devices, but read no tensor data; such a model
        must not be evaluated.
        """
        self._closed = False
        opts, dry_run_devices = check_load_arguments(options, device, progress, dry_run_devices)
        t0 = time.perf_counter()
        #: what expert_cache_slots=auto chose and why (None when the slots were given)
        self.slot_choice: SlotChoice | None = None
        if opts.expert_cache_slots == "auto":
            if device is not None or dry_run_devices is not None:
                raise OptionError("expert_cache_slots=auto: sizes the cache on the session's own devices; with a "
                                  "device or a dry run, give a number (auto_cache_slots() chooses one)")
            self.slot_choice = auto_cache_slots(path, opts)
            opts = opts.merged(expert_cache_slots=self.slot_choice.slots)
        #: what host_tier_bytes=auto chose and why (None when a size was given, or for a dry run or a given device)
        self.tier_choice: TierChoice | None = None
        if opts.host_tier_bytes == "auto" and opts.disk_experts and device is None and dry_run_devices is None:
            self.tier_choice = auto_host_tier(path, opts)
            opts = opts.merged(host_tier_bytes=self.tier_choice.budget)
        if device is None and dry_run_devices is None:
            check_copies_fit(path, opts)
        threads = None if opts.n_threads or dry_run_devices is not None else default_threads()
        model = LoadedModel(path, opts, device, progress, dry_run_devices, benchmark, threads)
        try:
            super().__init__(model)
        except BaseException:
            model.close()
            raise
        self.load_seconds = time.perf_counter() - t0

    def close(self) -> None:
        """Release everything, the model included; safe twice, and on a model whose load failed half way."""
        super().close()
        model = getattr(self, "model", None)
        if model is not None:
            model.close()

    def __enter__(self) -> MoEModel:
        return self


__all__ = ["MAX_GRAPHS", "MAX_STEP_GRAPHS", "Checkpoint", "MoEModel", "TierChoice", "auto_cache_slots",
           "auto_host_tier", "check_copies_fit", "check_options", "context_warning"]
