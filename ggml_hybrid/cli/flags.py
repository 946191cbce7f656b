"""What the commands share: llama.cpp's layout flags, session options from flags, model names, progress."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ..errors import OptionError
from ..options import SessionOptions
from .config import load_config, pick


def _progress(enabled: bool):
    """A loading progress bar on a terminal; (callback, finish)."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    state: dict[str, Any] = {}

    def cb(done, total):
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = click.progressbar(length=total, label="loading", file=sys.stderr)
            bar.__enter__()
        bar.update(done - bar.pos)

    def finish():
        if "bar" in state:
            state["bar"].__exit__(None, None, None)

    return cb, finish


# llama.cpp's layout flags, each shorthand for a session option
_LAYOUT_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-ot", "--override-tensor", "override_tensor"),
     dict(multiple=True, metavar="REGEX=DEVICE[,...]", help="Tensor layout by regex (searched, first match wins).")),
    (("-ngl", "--n-gpu-layers", "n_gpu_layers"),
     dict(type=click.IntRange(-1), help="Layers on the devices; -1 = all.")),
    (("--cpu-moe", "cpu_moe"), dict(is_flag=True, default=None, help="All routed expert weights on the CPU.")),
    (("--n-cpu-moe", "n_cpu_moe"),
     dict(type=click.IntRange(0), help="Routed expert weights of the first N layers on the CPU.")),
    (("-nkvo", "--no-kv-offload", "no_kv_offload"), dict(is_flag=True, default=None,
                                                          help="KV cache in host memory, attention on the CPU.")),
    (("-ctk", "--cache-type-k", "cache_type_k"), dict(type=click.Choice(["f32", "f16", "q8_0"]))),
    (("-ctv", "--cache-type-v", "cache_type_v"), dict(type=click.Choice(["f32", "f16", "q8_0"]))),
    (("-c", "--ctx-size", "n_ctx"), dict(type=click.IntRange(0), help="Context size (0 = model's, at most 4096).")),
    (("-b", "--batch-size", "batch_size"), dict(type=click.IntRange(1))),
    (("-ub", "--ubatch-size", "ubatch_size"), dict(type=click.IntRange(1))),
    (("-fa", "--flash-attn", "flash_attn"), dict(is_flag=True, default=None)),
    (("-sm", "--split-mode", "split_mode"), dict(type=click.Choice(["layer", "none"]))),
    (("-ts", "--tensor-split", "tensor_split"), dict(help="Proportions of layers per device, e.g. 3,1.")),
    (("--rpc", "rpc"), dict(metavar="HOST:PORT[,...]", help="RPC servers (ggml-hybrid rpc-server) whose devices "
                                                             "to use, named RPC0, RPC1, ...")),
]


def _layout_flags(fn):
    for decls, kw in reversed(_LAYOUT_FLAGS):
        fn = click.option(*decls, **kw)(fn)
    return fn


def _layout_items(values: dict) -> dict:
    out = {}
    for key, v in values.items():
        if key == "override_tensor":
            out[key] = ",".join(v) if v else None
        elif isinstance(v, bool):
            out[key] = "true" if v else None
        else:
            out[key] = v
    return out


def _options(items, role, base, explicit: dict) -> SessionOptions:
    shorthand = [f"{k}={v}" for k, v in explicit.items() if v is not None]
    return SessionOptions.parse(list(items) + shorthand, role=role, base=base)


def _resolve_model(model: str, config):
    """(path, role, base options) from a path or a config entry name/role."""
    if config is None:
        return model, None, None
    entry = pick(load_config(config), model)
    if entry is None:
        if os.path.exists(model):
            return model, None, None
        raise OptionError(f"model {model!r} is neither a file nor a model name or role in {config}")
    return entry.path, entry.role, entry.options
