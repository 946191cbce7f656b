"""Where every tensor of a model goes, from llama.cpp-style layout options; computed from metadata alone.

The rules, in llama.cpp's order and with its meanings:

1. ``n_gpu_layers`` (``-ngl``, -1 = all): the output layer counts as layer ``n_blocks`` (every block of the
   file, next-token-prediction blocks included, loaded or not, as llama.cpp counts them) and the
   last N of the ``n_blocks + 1`` are offloaded (so ``-ngl 1`` offloads the output head only, and a
   large N means everything). The token embeddings always stay on the CPU (llama.cpp's input
   layer); a tied output head gets its own copy on the output device.
2. Offloaded layers go to the accelerators: ``split_mode=layer`` splits them (output included)
   into contiguous ranges in ``tensor_split`` proportions (default: equal); ``split_mode=none``
   puts them all on the first.
3. ``override_tensor`` (``-ot REGEX=DEVICE,...``): the first pattern that *searches* (not
   matches) a tensor name decides its device; then ``cpu_moe`` / ``n_cpu_moe`` add
   ``blk.N.ffn_*_exps.{weight,bias}`` -> CPU (the routed experts only, as llama.cpp's pattern matches
   them: shared experts and dense layers stay where they are).
4. ``no_kv_offload`` (``-nkvo``): every layer's KV cache and attention stay on the CPU.

The routed experts of a layer are *resident* where their tensors are, *cpu* when those are on the
CPU (used in place from the memory-mapped file), or *disk* (``disk_experts``: streamed into an
expert cache on the layer's device). :func:`plan_layout` is used both by the loader and by the
planner, which is what makes the planner's numbers the loader's.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from ..gguf.names import LAYER as _LAYER
from ..gguf.names import is_expert_tensor, layer_of, tensor_class
from ..moe.expert_layers import ExpertMode
from ..options import OptionError, SessionOptions, override_items, tensor_split_parts

CPU = "CPU"
def parse_overrides(text: str | None) -> list[tuple[str, re.Pattern[str], str]]:
    """``"re1=DEV,re2=DEV"`` -> [(pattern text, compiled, device)]; bad items raise OptionError."""
    try:
        return override_items(text)
    except Exception as exc:  # the options module's internal rejection
        raise OptionError(f"override_tensor={text}: {exc}") from None


def parse_split(text: str | None, n_devices: int) -> list[float]:
    """The ``tensor_split`` proportions for ``n_devices`` devices (equal when not given)."""
    if not text:
        return [1.0] * n_devices
    parts = tensor_split_parts(text)  # the option's own rule: validated when the option was set
    if len(parts) != n_devices:
        alone = ("; with one device there is nothing to split: leave -ts out, or give more devices (-dev, --rpc, "
                 "--virtual-devices N)") if n_devices == 1 else ""
        raise OptionError(f"tensor_split={text}: needs {n_devices} proportion(s), one per device, got "
                          f"{len(parts)}{alone}")
    return parts


@dataclass(frozen=True)
class Layout:
    devices: tuple[str, ...]       # accelerator names, in order
    tensors: dict[str, str]        # tensor name -> device name (or CPU)
    layer_device: tuple[str, ...]  # where each layer's own compute runs
    kv_device: tuple[str, ...]     # where each layer's KV cache lives
    expert_mode: tuple[ExpertMode, ...]  # per layer
    output_device: str

    def classes(self, infos: Mapping[str, int],
                host_copies: AbstractSet[str] = frozenset()) -> dict[str, dict[str, int]]:
        """Bytes per device, ``CPU`` (host RAM) or ``mapped`` per tensor class, from ``{name: nbytes}`` (with the
        tied copy). Tensors on the CPU and the routed experts of cpu and disk layers are used in place from the
        memory-mapped file, but for ``host_copies``, copied into host RAM (repacked weights)."""
        out: dict[str, dict[str, int]] = {}
        for name, nbytes in infos.items():
            dev = self.tensors[name]
            cls = tensor_class(name)
            layer = _LAYER.match(name)
            if cls == "routed_experts" and layer and self.expert_mode[int(layer.group(1))] != "resident":
                dev = CPU  # not in a device buffer (a disk layer's cache slots are counted apart)
            if dev == CPU and name not in host_copies:
                dev = "mapped"  # on the memory-mapped file, not in a RAM buffer
            d = out.setdefault(dev, {})
            d[cls] = d.get(cls, 0) + nbytes
        return out


def _offloaded(n_gpu_layers: int, blocks: int, devices: list[str]) -> tuple[int, int]:
    """``-ngl``'s layers offloaded, and the first of them."""
    if n_gpu_layers < -1:
        raise OptionError(f"n_gpu_layers={n_gpu_layers}: must be -1 (all) or >= 0")
    # llama.cpp's rule: the output layer counts as layer n_blocks; -ngl N offloads the last N of the
    # n_blocks + 1, so the output goes first and -ngl 99 simply means everything
    ngl = blocks + 1 if n_gpu_layers == -1 else min(n_gpu_layers, blocks + 1)
    if ngl and not devices:
        raise OptionError(f"n_gpu_layers={n_gpu_layers}: there is no device to offload to")
    return ngl, max(blocks + 1 - ngl, 0)


def plan_layout(names: Iterable[str], n_layer: int, opts: SessionOptions, devices: list[str],
                tied_output: bool, n_blocks: int | None = None) -> Layout:
    """Place every tensor in ``names`` (GGUF names) on one of ``devices`` or the CPU.

    ``n_layer``: the layers that run (the per-layer lists have one entry each: the graph's, then a loaded draft
    head's block); ``n_blocks``: the blocks of the file (default ``n_layer``), which llama.cpp's offload rule
    counts."""
    devices = list(devices)
    known = set(devices) | {CPU}
    blocks = n_layer if n_blocks is None else n_blocks
    ngl, i_gpu_start = _offloaded(opts.n_gpu_layers, blocks, devices)
    if opts.split_mode == "none" or len(devices) <= 1:
        split = [1.0] + [0.0] * (len(devices) - 1)
        if opts.tensor_split and len(devices) > 1:
            raise OptionError(f"tensor_split={opts.tensor_split}: needs split_mode=layer")
        if opts.tensor_split:
            parse_split(opts.tensor_split, len(devices))  # one device: proportions for more are refused, not ignored
    else:
        split = parse_split(opts.tensor_split, len(devices))
    total = sum(split)
    bounds, acc = [], 0.0
    for p in split:
        acc += p
        bounds.append(acc / total)

    def device_of(il: int) -> str:
        if il < i_gpu_start:
            return CPU
        frac = (il - i_gpu_start) / ngl
        # std::upper_bound over the cumulative split points, as llama.cpp picks the device
        return devices[min(bisect.bisect_right(bounds, frac), len(devices) - 1)]

    layer_device = [device_of(i) for i in range(n_layer)]
    output_device = device_of(blocks)
    rules = parse_overrides(opts.override_tensor)
    for pattern, _, dev in rules:
        if dev not in known:
            raise OptionError(f"override_tensor: device {dev!r} (for {pattern!r}) is not one of "
                              f"{', '.join(sorted(known))}; see `ggml-hybrid devices`")
    cpu_moe = opts.cpu_moe
    if opts.n_cpu_moe > n_layer:
        raise OptionError(f"n_cpu_moe={opts.n_cpu_moe}: the model has only {n_layer} layers")
    tensors = {}
    for name in names:
        m = _LAYER.match(name)
        if name.startswith("token_embd."):
            dev = CPU
        elif name.startswith("output"):
            dev = output_device
        elif m:
            dev = layer_device[int(m.group(1))]
        else:
            dev = CPU
        for _, rx, target in rules:
            if rx.search(name):
                dev = target
                break
        else:
            if is_expert_tensor(name) and (cpu_moe or (layer_of(name) or 0) < opts.n_cpu_moe):
                dev = CPU
        tensors[name] = dev
    if tied_output:
        tensors["output.weight(tied)"] = output_device
    modes: list[ExpertMode] = []
    for i in range(n_layer):
        devs = {d for n, d in tensors.items() if is_expert_tensor(n) and n.startswith(f"blk.{i}.")}
        if not devs:
            modes.append("dense")  # a leading dense layer: no routed experts
        elif devs == {CPU}:
            modes.append("cpu")
        elif opts.disk_experts:
            if len(devs) != 1:
                raise OptionError(f"disk_experts: the expert tensors of layer {i} are split over {sorted(devs)}; "
                                  "the expert cache needs them on one device")
            modes.append("disk")
        else:
            modes.append("resident")
    if opts.disk_experts and "disk" not in modes:
        raise OptionError("disk_experts=true: every layer's routed experts are placed on the CPU (cpu_moe, n_cpu_moe "
                          "or override_tensor), so no layer would use the expert cache")
    kv = tuple(CPU if opts.no_kv_offload else d for d in layer_device)
    return Layout(tuple(devices), tensors, tuple(layer_device), kv, tuple(modes), output_device)


__all__ = ["CPU", "Layout", "parse_overrides", "parse_split", "plan_layout"]
