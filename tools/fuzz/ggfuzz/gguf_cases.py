"""GGUF mutations: valid small models edited byte by byte and field by field, then run through the CLI.

A case is one to three mutations of one base model, drawn from ``(seed, index)`` alone, so any case
can be rebuilt from its number. The mutations know the file's structure (from a field map of the
valid file): header counts, metadata types, values, string and array lengths, tensor names, dims,
types and offsets, plus blind byte flips, weight bytes and truncations. Metadata pairs can be
replaced, added or dropped whole (the data section is moved to stay aligned), and a tensor can be
retyped with every offset after it re-packed, so that files llama.cpp would load with garbage in
them are made too.

Each mutated file goes through ``inspect --json``, ``run -n 2 --logits-out`` and ``plan``, with the
expert mode drawn per case; a stack file (FFN layers only) also goes through ``MoEStackSession``.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .proc import classify, run_checked, run_forked, worst

# GGUF value types: bytes per scalar and struct format
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_GGML_TYPE = 40


@dataclass
class Field:
    kind: str      # count | key_len | kv_type | kv_value | str_len | arr_type | arr_len | name_len | n_dims | dim |
    pos: int       # t_type | t_offset
    size: int
    label: str
    vtype: int = -1  # kv_value: its GGUF type


@dataclass
class FileMap:
    raw: bytes
    alignment: int
    data_start: int
    infos_start: int
    fields: list[Field] = field(default_factory=list)
    kv_spans: list[tuple[str, int, int]] = field(default_factory=list)     # key, start, end
    tensors: list[dict[str, Any]] = field(default_factory=list)           # name, dims, type, offset, pos fields
    arch: str = "qwen3moe"

    def of(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]


def map_file(path: str) -> FileMap:
    """Where every field of the valid GGUF file ``path`` lies."""
    import gguf

    r = gguf.GGUFReader(path)
    raw = open(path, "rb").read()
    infos_start = min(t.field.offset for t in r.tensors)
    fm = FileMap(raw, int(r.alignment), int(r.data_offset), infos_start,
                 arch=str(r.fields["general.architecture"].contents()))
    fm.fields += [Field("count", 4, 4, "version"), Field("count", 8, 8, "tensor count"),
                  Field("count", 16, 8, "kv count")]
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        size = sum(int(p.nbytes) for p in f.parts)
        fm.kv_spans.append((key, f.offset, f.offset + size))
        pos = f.offset
        types = [int(t) for t in f.types]
        for i, part in enumerate(f.parts):
            n = int(part.nbytes)
            if i == 0:
                kind = "key_len"
            elif i == 2:
                kind = "kv_type"
            elif i < 3:
                kind = None
            elif types[0] == STRING:
                kind = "str_len" if i == 3 else None
            elif types[0] != ARRAY:
                kind = "kv_value"
            elif i == 3:
                kind = "arr_type"
            elif i == 4:
                kind = "arr_len"
            elif types[-1] == STRING:
                kind = "str_len" if (i - 5) % 2 == 0 else None
            else:
                kind = "kv_value"
            if kind is not None:
                fm.fields.append(Field(kind, pos, n, f"{key} part {i}", types[-1] if kind == "kv_value" else -1))
            pos += n
    for t in r.tensors:
        pos = t.field.offset
        rec: dict[str, Any] = {"name": t.name, "type": int(t.tensor_type), "dims": [int(d) for d in t.shape],
                               "offset": int(t.data_offset) - fm.data_start, "nbytes": int(t.n_bytes)}
        for i, part in enumerate(t.field.parts):
            n = int(part.nbytes)
            if i == 0:
                fm.fields.append(Field("name_len", pos, n, t.name))
            elif i == 2:
                fm.fields.append(Field("n_dims", pos, n, t.name))
            elif i == 3:
                for k in range(0, n, 8):
                    fm.fields.append(Field("dim", pos + k, 8, f"{t.name} dim {k // 8}"))
            elif i == 4:
                fm.fields.append(Field("t_type", pos, n, t.name))
                rec["type_pos"] = pos
            elif i == 5:
                fm.fields.append(Field("t_offset", pos, n, t.name))
                rec["offset_pos"] = pos
            pos += n
        fm.tensors.append(rec)
    return fm


# -- values ---------------------------------------------------------------------------------------

def special_ints(size: int, old: int) -> list[int]:
    top = (1 << (8 * size)) - 1
    base = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 511, 512, 513, 1024, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**63 - 1, 2**63, top - 1, top, old - 1, old + 1, old * 2, old // 2, old + 32, old - 32]
    return sorted({v & top for v in base if v >= 0 or v & top})


def encode_value(vtype: int, value: Any) -> bytes:
    """The payload of a GGUF value of ``vtype`` (without the type word); arrays as (item type, [values])."""
    if vtype in SCALAR:
        return struct.pack(SCALAR[vtype], value)
    if vtype == STRING:
        b = value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(b)) + b
    if vtype == ARRAY:
        item, items, declared = value
        body = b"".join(encode_value(item, v) for v in items)
        return struct.pack("<IQ", item, len(items) if declared is None else declared) + body
    return b""  # an unknown type: no payload at all


def random_value(rng: random.Random, depth: int = 0) -> tuple[int, Any, str]:
    """(type, value, description) of a random metadata value, weird ones often."""
    vtype = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 9, 9, 10, 11, 12, 4, 10, 13, 2**32 - 1])
    if vtype in (6, 12):
        v = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, 1e38, 3.4e38, 1e6, 0.5])
        return vtype, v, f"{vtype}:{v!r}"
    if vtype == 7:
        v = rng.choice([0, 1, 2, 255])
        return vtype, v, f"bool:{v}"
    if vtype in SCALAR:
        size = struct.calcsize(SCALAR[vtype])
        signed = SCALAR[vtype].islower()
        v = rng.choice(special_ints(size, rng.randrange(0, 600)))
        if signed and v >= 1 << (8 * size - 1):
            v -= 1 << (8 * size)
        return vtype, v, f"{vtype}:{v}"
    if vtype == STRING:
        v = rng.choice(["", "qwen3moe", "qwen2moe", "llama", "gpt2", "qwen2", "llama-bpe", "none", "yarn", "x" * 5000,
                        b"\xff\xfe\x80", "a\x00b", "\u4e00\U0001f600"])
        return vtype, v, f"str:{v!r:.40}"
    if vtype == ARRAY and depth >= 2:
        return ARRAY, (0, [], None), "array[0] of UINT8"  # deep enough: an empty innermost array
    if vtype == ARRAY:
        item, first, desc = random_value(rng, depth + 1)
        while item == 13 or item == 2**32 - 1:
            item, first, desc = random_value(rng, depth + 1)
        n = rng.choice([0, 1, 2, 3, 5])
        items = [first] + [random_value_of(rng, item, depth + 1) for _ in range(n - 1)] if n else []
        declared = rng.choice([None, None, None, 2**32, 2**40, 2**64 - 1, n + 1])
        return ARRAY, (item, items, declared), f"array[{n} declared {declared}] of {desc}"
    return vtype, None, f"type {vtype}"  # an unknown type: no payload


def random_value_of(rng: random.Random, vtype: int, depth: int) -> Any:
    while True:
        t, v, _ = random_value(rng, depth)
        if t == vtype:
            return v


# -- mutations ------------------------------------------------------------------------------------

INTERESTING_KEYS = ["general.architecture", "general.alignment", "general.name", "tokenizer.ggml.model",
                    "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.add_bos_token"]
ARCH_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.freq_base",
             "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "expert_count", "expert_used_count",
             "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_weights_scale",
             "attention.layer_norm_rms_epsilon", "vocab_size"]


def _put(b: bytearray, pos: int, size: int, value: int) -> None:
    b[pos:pos + size] = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def splice_kv(fm: FileMap, key: str | None, payload: bytes | None, new_key: str | None = None) -> bytes:
    """The file with the pair ``key`` replaced by ``payload`` (type word + value), dropped (None), or a new pair
    ``new_key`` appended; the data section is moved to the next aligned offset after the header."""
    spans = {k: (s, e) for k, s, e in fm.kv_spans}
    kv_end = max(e for _, _, e in fm.kv_spans)
    n_kv = struct.unpack_from("<Q", fm.raw, 16)[0]
    if new_key is not None:
        kb = new_key.encode()
        head = fm.raw[:kv_end] + struct.pack("<Q", len(kb)) + kb + (payload or b"") + fm.raw[kv_end:fm.infos_start]
        n_kv += 1
    else:
        assert key is not None
        s, e = spans[key]
        klen = struct.unpack_from("<Q", fm.raw, s)[0]
        key_bytes = fm.raw[s:s + 8 + klen]
        head = fm.raw[:s] + (key_bytes + payload if payload is not None else b"") + fm.raw[e:fm.infos_start]
        if payload is None:
            n_kv -= 1
    infos = fm.raw[fm.infos_start:_infos_end(fm)]
    head = head + infos
    head += b"\0" * (-len(head) % fm.alignment)
    out = bytearray(head + fm.raw[fm.data_start:])
    _put(out, 16, 8, n_kv)
    return bytes(out)


def _infos_end(fm: FileMap) -> int:
    end = fm.infos_start
    for t in fm.tensors:
        end = max(end, t["offset_pos"] + 8)
    return end


def _repack(fm: FileMap, b: bytearray, t_index: int, new_type: int) -> None:
    """Retype tensor ``t_index`` and re-pack every offset (what a writer of that type would have produced)."""
    from ggml_hybrid.ggml.dtypes import GGMLType

    _put(b, fm.tensors[t_index]["type_pos"], 4, new_type)
    off = 0
    for i, t in enumerate(fm.tensors):
        ty = GGMLType(new_type if i == t_index else t["type"])
        n_el = int(np.prod(t["dims"]))
        nbytes = n_el // ty.block_size * ty.type_size
        _put(b, t["offset_pos"], 8, off)
        off += -(-nbytes // fm.alignment) * fm.alignment


def mutate(fm: FileMap, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of the file: (new bytes, description)."""
    b = bytearray(fm.raw)
    # weights ("data") and consistent retypes load and run: they reach the compute paths that refusals never do
    op = rng.choice(["flip", "flip", "int", "int", "int", "type", "type", "offset", "offset", "float", "data", "data",
                     "data", "truncate", "kv_set", "kv_set", "kv_add", "kv_drop", "retype", "retype"])
    if op == "flip":
        pos = rng.randrange(0, fm.data_start)
        v = rng.randrange(256)
        b[pos] = v
        return bytes(b), f"flip byte {pos} to {v:#04x}"
    if op == "int":
        kinds = ["count", "key_len", "str_len", "arr_len", "kv_value", "name_len", "n_dims", "dim", "dim"]
        kind = rng.choice([k for k in kinds if fm.of(k)])
        f = rng.choice([f for f in fm.of(kind) if f.vtype not in (6, 7, 12)])
        old = int.from_bytes(fm.raw[f.pos:f.pos + f.size], "little")
        v = rng.choice(special_ints(f.size, old) + [rng.randrange(1 << (8 * f.size))])
        _put(b, f.pos, f.size, v)
        return bytes(b), f"{f.kind} {f.label} at {f.pos}: {old} -> {v}"
    if op == "type":
        kinds = ["kv_type", "arr_type", "t_type"] if fm.of("arr_type") else ["kv_type", "t_type"]
        f = rng.choice(fm.of(rng.choice(kinds)))
        old = int.from_bytes(fm.raw[f.pos:f.pos + 4], "little")
        v = rng.choice(list(range(0, 14)) + [9, 8, 16, 30, 39, MAX_GGML_TYPE, 2**31, 2**32 - 1]
                       if f.kind != "t_type" else list(range(0, MAX_GGML_TYPE + 2)) + [2**31, 2**32 - 1])
        _put(b, f.pos, 4, v)
        return bytes(b), f"{f.kind} {f.label} at {f.pos}: {old} -> {v}"
    if op == "offset":
        t = rng.choice(fm.tensors)
        other = rng.choice(fm.tensors)["offset"]
        a = fm.alignment
        v = rng.choice([2**64 - 1, 2**63, 2**64 - a, other, t["offset"] + a, t["offset"] - a, t["offset"] + 1,
                        t["offset"] + 4, len(fm.raw), len(fm.raw) - fm.data_start, 0, rng.randrange(2**64)])
        _put(b, t["offset_pos"], 8, v)
        return bytes(b), f"offset of {t['name']}: {t['offset']} -> {v & (2**64 - 1)}"
    if op == "float":
        fl = [f for f in fm.of("kv_value") if f.vtype in (6, 12)]
        if fl:
            f = rng.choice(fl)
            v = rng.choice([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e38, 1e-45, 3e38])
            b[f.pos:f.pos + f.size] = struct.pack(SCALAR[f.vtype], v)
            return bytes(b), f"float {f.label}: -> {v!r}"
        op = "data"
    if op == "data":
        pos = rng.randrange(fm.data_start, len(fm.raw) - 4)
        v = rng.choice([b"\xff\x7f", b"\x00\x7c", b"\x00\xfc", b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f",
                        bytes(rng.randrange(256) for _ in range(4))])
        b[pos:pos + len(v)] = v
        return bytes(b), f"data bytes at {pos}: {v.hex()}"
    if op == "truncate":
        cut = rng.choice([rng.randrange(len(fm.raw)), fm.data_start, fm.data_start - 1, len(fm.raw) - 1,
                          fm.infos_start, rng.randrange(fm.data_start)])
        return fm.raw[:cut], f"truncate to {cut} of {len(fm.raw)} bytes"
    keys = [k for k, _, _ in fm.kv_spans]
    arch_name = fm.arch
    if op == "kv_set":
        key = rng.choice([k for k in keys if k in INTERESTING_KEYS or k.startswith(arch_name + ".")] or keys)
        vtype, value, desc = random_value(rng)
        return splice_kv(fm, key, struct.pack("<I", vtype & 0xFFFFFFFF) + encode_value(vtype, value)), \
            f"set {key} = {desc}"
    if op == "kv_add":
        key = rng.choice(INTERESTING_KEYS + [f"{arch_name}.{k}" for k in ARCH_KEYS] + ["x" * 300, "", "\u00e9"])
        if key in keys:
            return splice_kv(fm, key, None), f"drop {key}"
        vtype, value, desc = random_value(rng)
        return splice_kv(fm, None, struct.pack("<I", vtype & 0xFFFFFFFF) + encode_value(vtype, value), key), \
            f"add {key!r} = {desc}"
    if op == "kv_drop":
        key = rng.choice(keys)
        return splice_kv(fm, key, None), f"drop {key}"
    # retype: a consistent file (offsets re-packed) whose tensor bytes mean something else
    i = rng.randrange(len(fm.tensors))
    t = fm.tensors[i]
    from ggml_hybrid.ggml.dtypes import GGMLType

    fits = [int(ty) for ty in GGMLType if t["dims"] and t["dims"][0] % ty.block_size == 0 and int(ty) != t["type"]]
    new = rng.choice(fits)
    _repack(fm, b, i, new)
    return bytes(b), f"retype {t['name']} {GGMLType(t['type']).name} -> {GGMLType(new).name}, offsets re-packed"


# -- cases ----------------------------------------------------------------------------------------

MODES = [[], [], ["-o", "disk_experts=1", "-o", "expert_cache_slots=2", "-o", "moe_cpu_share=0.5"],
         ["-o", "disk_experts=1", "-o", "expert_cache_slots=1"], ["--cpu-moe"], ["-ngl", "0"], ["--check-tensors"]]


@dataclass
class GGUFCase:
    index: int
    base: str
    mutations: list[str]
    mode: list[str]


def make_case(seed: int, index: int, maps: dict[str, FileMap], folder: str) -> tuple[GGUFCase, str]:
    """Case ``index``: writes the mutated file into ``folder``; returns the case and the file's path."""
    rng = random.Random(f"gguf:{seed}:{index}")
    base = rng.choice(sorted(maps))
    fm = maps[base]
    data, descs = fm.raw, []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            data, desc = mutate(fm if data is fm.raw else _remap(fm, data), rng)
        except (struct.error, IndexError, ValueError, OverflowError):  # a field of the original past a cut file
            pos = rng.randrange(max(1, len(data)))
            data, desc = data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1:], f"flip byte {pos}"
        descs.append(desc)
    path = os.path.join(folder, "model.gguf")
    with open(path, "wb") as f:
        f.write(data)
    return GGUFCase(index, base, descs, rng.choice(MODES)), path


def _remap(fm: FileMap, data: bytes) -> FileMap:
    """A second mutation works on the bytes of the first, with the positions of the original file
    (the structure-aware operators then hit fields that may have moved: that is fine for a fuzzer)."""
    return FileMap(data, fm.alignment, fm.data_start, fm.infos_start, fm.fields, fm.kv_spans, fm.tensors, fm.arch)


def commands(case: GGUFCase, path: str) -> dict[str, list[str]]:
    mode = case.mode
    return {
        "inspect": ["inspect", path, "--json"],
        "run": ["run", path, "-p", "Hello world", "-n", "2", "-t", "1", "--ignore-eos", "--logits-out",
                "logits.npy", *mode],
        "plan": ["plan", path, *mode],
    }


def stack_target(path: str):
    def target() -> int:
        import numpy as np

        from ggml_hybrid.errors import GgmlHybridError
        from ggml_hybrid.moe.stack_session import MoEStackSession
        from ggml_hybrid.options import SessionOptions

        try:
            # the stack returns what it computes: finite weights can still overflow (a norm weight of 1e36), so
            # non-finite outputs are recorded, not failures (the logits contract is generate's)
            with MoEStackSession(path, SessionOptions(n_threads=1, check_tensors=True)) as s:
                y = s.forward(np.random.default_rng(0).standard_normal((3, s.n_embd)).astype(np.float32))
                print("finite" if np.isfinite(y).all() else "nonfinite")
        except GgmlHybridError as exc:
            print(f"error: {exc}", file=__import__("sys").stderr)
            return 2
        return 0

    return target


def run_case(seed: int, index: int, maps: dict[str, FileMap], folder: str, timeout: float,
             how: str = "fork") -> dict[str, Any]:
    os.makedirs(folder, exist_ok=True)
    case, path = make_case(seed, index, maps, folder)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    results: dict[str, Any] = {}
    for name, args in commands(case, path).items():
        work = os.path.join(folder, name)
        os.makedirs(work, exist_ok=True)
        results[name] = run_checked(args, work, timeout, how, logits="logits.npy" if name == "run" else None)
    if case.base.startswith("stack"):
        work = os.path.join(folder, "stack")
        os.makedirs(work, exist_ok=True)
        o = run_forked(stack_target(path), work, timeout)
        results["stack"] = {"class": classify(o), "rc": o.rc, "seconds": round(o.seconds, 3),
                            "stderr": o.stderr[-1500:], "finite": "nonfinite" not in o.stdout,
                            "args": ["<MoEStackSession.forward>", path]}
    if hashlib.sha256(open(path, "rb").read()).hexdigest() != digest:
        results["file"] = {"class": "data_loss", "rc": None, "stderr": "the model file changed", "args": []}
    return {"index": index, "base": case.base, "mutations": case.mutations, "mode": case.mode,
            "class": worst([r["class"] for r in results.values()]), "results": results}


def keep_reproducer(folder: str, dest: str) -> None:
    """The mutated file of a failing case, next to its report."""
    src = os.path.join(folder, "model.gguf")
    if os.path.exists(src):
        shutil.copy(src, os.path.join(dest, "model.gguf"))


__all__ = ["FileMap", "GGUFCase", "commands", "encode_value", "keep_reproducer", "make_case", "map_file", "mutate",
           "random_value", "run_case", "splice_kv"]
