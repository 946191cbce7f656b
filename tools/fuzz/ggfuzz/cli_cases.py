"""CLI and option values: random command lines over a valid model, many of them wrong.

A case is a command (mostly ``run`` and ``plan``), a model argument (the file, a symlink to it, a
missing path, a folder, a device, a config entry) and a handful of flags, each with a value drawn
from valid values, boundary values and garbage. It runs in a folder of its own holding a fresh copy
of the model; besides the exit status and stderr, the model file must be unchanged afterwards
(``data_loss`` otherwise) and an exit-0 ``--logits-out`` must hold finite numbers.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from typing import Any

from .proc import run_checked, worst

GARBAGE = ["", " ", "x", "-1", "0", "1", "2", "nan", "inf", "-inf", "1e309", "0x10", "1_000", "١", "9" * 30,
           "true", "none", "None", "auto", "=", ",", "a=b", "\u00e9\u4e00", "\t", "-", "--", "3.5", "1e3", "-0"]
KNOWN_VALUES: dict[str, list[Any]] = {
    "moe_cpu_share": [0, 0.5, 1, "auto", -0.1, 1.5, "0.25"],
    "expert_cache_slots": [0, 1, 2, 3, 4, 5, 2**31, 2**64],
    "expert_eviction": ["lru", "lfu", "LRU", "fifo"],
    "n_threads": [1, 2, 0, 512, 513, 64, "none"],
    "disk_experts": ["true", "false", "1", "0", "yes", "maybe"],
    "cpu_moe": ["true", "false", "on"],
    "n_cpu_moe": [0, 1, 2, 3, -1],
    "trace_path": ["trace.bin", "model.gguf", "sub/trace.bin", ".", "/dev/full", "none", "model-link.gguf",
                   "keep.bin"],
    "n_ctx": [0, 1, 2, 8, 64, 4096, 4097, 2**31, 2**40],
    "batch_size": [1, 2, 3, 512, 2048, 0, 2**31],
    "ubatch_size": [1, 2, 3, 512, 0, 4096],
    "cache_type_k": ["f32", "f16", "q8_0", "q4_0", "F16"],
    "cache_type_v": ["f32", "f16", "q8_0", "bf16"],
    "flash_attn": ["true", "false"],
    "n_gpu_layers": [-1, 0, 1, 2, 99, -2],
    "override_tensor": ["exps=CPU", "ffn_.*=DEV0", "(=CPU", "x=NOPE", "=CPU", "exps=", r"blk\.0\.=CPU,exps=DEV0"],
    "split_mode": ["layer", "none", "row"],
    "tensor_split": ["1,1", "3/1", "0", "-1,2", "nan", "1,0", "1e308,1e308"],
    "no_kv_offload": ["true", "false"],
    "check_tensors": ["true", "false"],
    "virtual_devices": [1, 2, 3, 15, 16, 17, 0],
}
UNKNOWN_KEYS = ["n_thread", "moe_share", "", "main.", ".n_threads", "main.n_threads", "draft.disk_experts", "a.b.c",
                "x" * 200]


def _val(rng: random.Random, pool: list[Any], garbage: float = 0.25) -> str:
    return str(rng.choice(pool)) if rng.random() >= garbage else rng.choice(GARBAGE)


def _option_item(rng: random.Random, garbage: float = 0.25) -> str:
    if garbage == 0:
        key = rng.choice(sorted(KNOWN_VALUES))
        return f"{key}={rng.choice(KNOWN_VALUES[key])}"
    if rng.random() < 0.85:
        key = rng.choice(sorted(KNOWN_VALUES))
        label = key if rng.random() < 0.85 else rng.choice(["main.", "draft.", "9bad.", "MAIN."]) + key
        return f"{label}={_val(rng, KNOWN_VALUES[key])}"
    return rng.choice([f"{rng.choice(UNKNOWN_KEYS)}={rng.choice(GARBAGE)}", rng.choice(GARBAGE)])


FLAGS: dict[str, list[Any]] = {
    "-n": [0, 1, 2, 3, 5, -1, 40],
    "--moe-cpu-share": [0, 0.5, 1, "auto", -0.1, 1.5],
    "--expert-cache-slots": [0, 1, 2, 4, 5, -1],
    "-t": [1, 2, 0, -1, 513, 64],
    "-ot": KNOWN_VALUES["override_tensor"],
    "-ngl": [-2, -1, 0, 1, 2, 99],
    "--n-cpu-moe": [0, 1, 2, 3, -1],
    "-ctk": KNOWN_VALUES["cache_type_k"],
    "-ctv": KNOWN_VALUES["cache_type_v"],
    "-c": [0, 1, 2, 16, 4096, 4097, 2**31, -1],
    "-b": [1, 2, 512, 0, -1],
    "-ub": [1, 2, 512, 0],
    "-sm": ["layer", "none", "row"],
    "-ts": KNOWN_VALUES["tensor_split"],
    "--seed": [0, 1, -1, 2**64, 2**32],
    "--temp": [0, 0.5, 1, -1, 1e308, 1e-300],
    "--top-k": [0, 1, 40, -1, 2**63],
    "--top-p": [0, 0.5, 1, 1.5, 1e-9],
    "--logits-out": ["out.npy", "out", "sub", "missing/out.npy", "model.gguf", "model-link.gguf", "/dev/null",
                     "/dev/full", ""],
    "--tokens": ["1,2,3", "0", "319", "320", "-1", "1,,2", "a,b", "", "99999999999999999999", " 5 , 6 "],
    "-p": ["Hello world", "", " ", "\u00e9\u4e00\U0001f600", "\x00", "x" * 3000, "<|im_start|>", "\n\n"],
    "--config": ["good.toml", "bad.toml", "deep.toml", "dup.toml", "missing.toml", "sub", "/dev/null",
                 "model.gguf"],
}
SWITCHES = ["--cpu-moe", "-nkvo", "-fa", "--ignore-eos", "--json", "--check-tensors", "--unknown-flag", "-h"]
PLAN_FLAGS: dict[str, list[Any]] = {
    "--vram": ["24G", "0", "1K,1K", "x", "-1G", "1G," * 15 + "1G", "1G," * 16 + "1G", "1.5G", "1e30G", "80G,80G"],
    "--ram": ["64G", "0", "x", "1T", "-5"],
    "--ctx": [1, 2, 4096, 0, -1, 2**40],
    "--parallel": [1, 2, 0, 64, 2**31],
    "--format": ["text", "json", "k8s", "yaml"],
}
MODELS = ["model.gguf"] * 8 + ["model-link.gguf", "missing.gguf", "sub", "/dev/null", "", "main", "m", "good.toml"]


def _flags(rng: random.Random, pool: dict[str, list[Any]], n: int, garbage: float) -> list[str]:
    out: list[str] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            out.append(rng.choice(SWITCHES[:6] if garbage == 0 else SWITCHES))
        elif r < 0.4:
            out += ["-o", _option_item(rng, garbage)]
        else:
            flag = rng.choice(sorted(pool))
            out += [flag, _val(rng, pool[flag], garbage)]
    return out


# command lines that once destroyed files or hung (issue 18), drawn on purpose now and then
DISK = ["-o", "disk_experts=1", "-o", "expert_cache_slots=2"]
SCENARIOS = [
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "1", "--logits-out", "model.gguf"],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "1", "--logits-out", "model-link.gguf"],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "1", *DISK, "-o", "trace_path=model.gguf"],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "1", *DISK, "-o", "trace_path=model-link.gguf"],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "1", *DISK, "-o", "moe_cpu_share=0.5", "-o",
     "trace_path=trace.bin", "--logits-out", "logits.npy"],
    ["plan", "model.gguf", *DISK, "-o", "trace_path=model.gguf"],
    ["plan", "model.gguf", *DISK, "-o", "trace_path=keep.bin"],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-o", "virtual_devices=15", "-t", "1"],
    ["plan", "model.gguf", "--vram", ",".join(["1G"] * 15)],
    ["run", "model.gguf", "-p", "Hi", "-n", "2", "-t", "512"],
    ["run", "model.gguf", "--config", "dup.toml", "-p", "Hi", "-n", "2", "-t", "1"],
    ["run", "m", "--config", "good.toml", "-p", "Hi", "-n", "2", "-t", "1", "--logits-out", "logits.npy"],
]


def make_args(rng: random.Random) -> list[str]:
    if rng.random() < 0.06:
        return list(rng.choice(SCENARIOS))
    # half the cases use valid values only, which get past the option checks into loading and running
    garbage = rng.choice([0.0, 0.25])
    cmd = rng.choice(["run"] * 6 + ["plan"] * 3 + ["inspect", "options", "devices", "bench"])
    model = rng.choice(MODELS) if garbage else "model.gguf"
    if cmd == "run":
        args = ["run", model]
        if rng.random() < 0.9:
            args += ["-p", "Hello world"] if rng.random() < 0.6 else ["--tokens", "1,2,3"]
        # -n given either way: its default (-1, as llama.cpp) runs to a full context, minutes per case
        args += ["-n", "2", "-t", "1", "--logits-out", "logits.npy"] if rng.random() < 0.7 else ["-n", "8"]
        args += _flags(rng, FLAGS, rng.choice([0, 1, 2, 3, 4, 6]), garbage)
    elif cmd == "plan":
        pool = {**{k: v for k, v in FLAGS.items() if k not in ("-n", "--tokens", "-p", "--logits-out")}, **PLAN_FLAGS}
        args = ["plan", model] + _flags(rng, pool, rng.choice([0, 1, 2, 3, 5]), garbage)
    elif cmd == "inspect":
        args = ["inspect", model] + rng.choice([[], ["--json"], ["--json", "--json"], ["-x"]])
    elif cmd == "options":
        args = ["options"] + rng.choice([[], ["--json"], ["extra"]])
    elif cmd == "devices":
        args = ["devices"] + rng.choice([[], ["--json"], ["--virtual-devices", _val(rng, [1, 2, 15, 16, 0])]])
    else:
        items = lambda: " ".join(_option_item(rng, garbage) for _ in range(rng.choice([0, 1, 2])))
        args = ["bench", model, "--a", items(), "--b", items(), "--runs", "1", "-n", "2"]
    if garbage and rng.random() < 0.05:  # a stray argument anywhere
        args.insert(rng.randrange(1, len(args) + 1), rng.choice(GARBAGE + ["--", "-", "--help"]))
    return args


CONFIGS = {
    "good.toml": '[models.m]\npath = "model.gguf"\nrole = "main"\n[models.m.session_options]\nn_threads = 1\n'
                 'main.n_ctx = 64\n',
    "bad.toml": "[models.m\npath = ",
    "deep.toml": "x = " + "[" * 5000 + "]" * 5000 + "\n",
    "dup.toml": '[models.m]\npath = "model.gguf"\n[models.m.session_options]\n"main.n_ctx" = 64\nmain.n_ctx = 128\n',
}


def setup(folder: str, model: str) -> str:
    """A fresh copy of the model (and a symlink, configs, a sub-folder) in ``folder``; returns its digest."""
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    dst = os.path.join(folder, "model.gguf")
    shutil.copy(model, dst)
    os.symlink("model.gguf", os.path.join(folder, "model-link.gguf"))
    for name, text in {**CONFIGS, "keep.bin": "a file that only run may overwrite (as asked)\n"}.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return _digest(dst)


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_case(seed: int, index: int, model: str, folder: str, timeout: float, how: str = "fork") -> dict[str, Any]:
    rng = random.Random(f"cli:{seed}:{index}")
    args = make_args(rng)
    digest = setup(folder, model)
    logits = None
    for flag, value in zip(args, args[1:]):
        if flag == "--logits-out":
            logits = value  # the last one given is the one click keeps
    res = run_checked(args, folder, timeout, how, logits=logits if logits and _plain(folder, logits) else None)
    results = {"cli": res}
    if _digest(os.path.join(folder, "model.gguf")) != digest:
        results["file"] = {"class": "data_loss", "rc": None, "stderr": "model.gguf changed", "args": args}
    with open(os.path.join(folder, "keep.bin"), "rb") as f:
        if args[0] != "run" and not f.read().startswith(b"a file that only run"):
            results["file"] = {"class": "data_loss", "rc": None, "stderr": f"{args[0]} wrote keep.bin", "args": args}
    return {"index": index, "args": args, "class": worst([r["class"] for r in results.values()]),
            "results": results}


def _plain(folder: str, name: str) -> bool:
    """Whether the logits path is a file of the case's own (not the model, a device or a folder)."""
    return bool(name) and not name.startswith("/") and "model" not in name and name not in ("sub", ".")


def keep_reproducer(folder: str, dest: str) -> None:
    for name in list(CONFIGS) + ["stderr.txt", "stdout.txt"]:
        src = os.path.join(folder, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(dest, name))


__all__ = ["make_args", "run_case", "setup"]
