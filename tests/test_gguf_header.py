"""The GGUF header check (issue 18, items 6 and 10): every tensor's type, size, alignment and bounds, every
metadata value's declared type and length, checked against the file before anything reads it; plus
check_tensors and the stop on non-finite logits.

Files are small generated models with one field edited in place (the fuzz suite's field map locates it).
"""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from ggfuzz.gguf_cases import FileMap, encode_value, map_file, splice_kv

from ggml_hybrid.cli import main
from ggml_hybrid.errors import ArgumentError, ModelFileError, NonFiniteError
from ggml_hybrid.gguf.header import read_header
from ggml_hybrid.gguf.store import GGUFStore
from ggml_hybrid.moe.stack_session import MoEStackSession
from ggml_hybrid.options import SessionOptions
from ggml_hybrid.runtime.generate import complete
from ggml_hybrid.runtime.moe_model import MoEModel
from ggml_hybrid.synthetic import ModelSpec, write_model, write_moe_stack

SPEC = ModelSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff_exp=32, n_expert=4, n_used=2,
                 vocab_size=320, weight_type="q8_0", seed=5)
ONE = SessionOptions(n_threads=1)
U32, U64, STR, ARR = 4, 10, 8, 9


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> FileMap:
    return map_file(write_model(tmp_path_factory.mktemp("hdr") / "base.gguf", SPEC))


def put(fm: FileMap, path, edits: list[tuple[int, int, int]]) -> str:
    b = bytearray(fm.raw)
    for pos, size, value in edits:
        b[pos:pos + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    Path(path).write_bytes(bytes(b))
    return str(path)


def tensor(fm: FileMap, name: str) -> dict:
    return next(t for t in fm.tensors if t["name"] == name)


def with_kv(fm: FileMap, path, key: str, vtype: int, value, declared=None) -> str:
    """The file with ``key`` set to a GGUF value (replaced, or added when absent)."""
    payload = struct.pack("<I", vtype) + encode_value(vtype, value if vtype != ARR else (*value, declared))
    exists = any(k == key for k, _, _ in fm.kv_spans)
    Path(path).write_bytes(splice_kv(fm, key if exists else None, payload, None if exists else key))
    return str(path)


def refused(path: str, *fragments: str) -> str:
    """The file is refused with one ModelFileError naming ``fragments``, by the store and by each command."""
    with pytest.raises(ModelFileError) as ei:
        GGUFStore(path).close()
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    for cmd in (["inspect", path], ["run", path, "-p", "hi", "-n", "1", "-t", "1"], ["plan", path]):
        r = CliRunner().invoke(main, cmd)
        lines = r.stderr.splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (cmd, r.exit_code, r.stderr)
        assert all(f in lines[0] for f in fragments), (cmd, lines[0])
    return msg


# -- valid files: the walk agrees with the gguf package ------------------------------------------------

@pytest.mark.parametrize("arch,wtype,tied", [("qwen3moe", "q8_0", False), ("qwen2moe", "f16", False),
                                              ("llama", "f32", True), ("qwen3moe", "q4_K", True)])
def test_header_agrees_with_the_gguf_reader(tmp_path, arch, wtype, tied):
    n = 256 if wtype == "q4_K" else 32
    path = write_model(tmp_path / "m.gguf", SPEC, arch=arch, weight_type=wtype, tie_embeddings=tied, n_embd=n,
                       n_ff_exp=n, n_ff_shexp=n, n_head=2, head_dim=n // 2)
    h, r = read_header(path), gguf.GGUFReader(path)
    assert h.data_offset == r.data_offset and h.alignment == r.alignment == 32
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for mine, theirs in zip(h.tensors, r.tensors):
        assert (mine.offset, mine.nbytes, int(mine.dtype)) == (theirs.data_offset, theirs.n_bytes,
                                                               int(theirs.tensor_type))
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
    for key, f in r.fields.items():
        if not key.startswith("GGUF."):
            k = h.keys[key]
            assert (k.type, k.item_type) == (int(f.types[0]), int(f.types[-1]))
            assert k.length == (len(f.data) if k.type == ARR else 1)


def test_stack_file_passes(tmp_path):
    path = write_moe_stack(tmp_path / "s.gguf", n_layer=2, n_embd=32, n_ff=32, n_expert=4, n_used=2)
    assert len(read_header(path).tensors) == 10


# -- item 6: tensor types, sizes, alignment, bounds ------------------------------------------------

def test_unaligned_offset(base, tmp_path):
    t = tensor(base, "blk.0.ffn_up_exps.weight")
    refused(put(base, tmp_path / "m.gguf", [(t["offset_pos"], 8, t["offset"] + 4)]),
            "blk.0.ffn_up_exps.weight", "not a multiple of the alignment 32")


def test_overlapping_offset(base, tmp_path):
    t, prev = base.tensors[5], base.tensors[4]
    refused(put(base, tmp_path / "m.gguf", [(t["offset_pos"], 8, prev["offset"])]), t["name"],
            "overlaps the tensor before it")


@pytest.mark.parametrize("offset", [2**64 - 1, 2**64 - 32, 2**63])
def test_wrapping_offsets(base, tmp_path, offset):
    t = base.tensors[-1]
    refused(put(base, tmp_path / "m.gguf", [(t["offset_pos"], 8, offset)]), t["name"])


def test_offset_past_the_end(base, tmp_path):
    t = base.tensors[-1]
    refused(put(base, tmp_path / "m.gguf", [(t["offset_pos"], 8, t["offset"] + 1024)]), t["name"])


@pytest.mark.parametrize("gtype,why", [(4, "unknown GGML type 4"), (40, "unknown GGML type 40"),
                                        (2**32 - 1, "unknown GGML type")])
def test_unknown_type(base, tmp_path, gtype, why):
    t = tensor(base, "blk.0.attn_q.weight")
    refused(put(base, tmp_path / "m.gguf", [(t["type_pos"], 4, gtype)]), "blk.0.attn_q.weight", why)


def test_type_too_small_for_the_next_offset(base, tmp_path):
    """Q8_0 -> Q4_0 halves the tensor: the next tensor's offset no longer follows it (this once ran, all NaN)."""
    i = next(i for i, t in enumerate(base.tensors) if t["name"] == "blk.0.ffn_gate_exps.weight")
    t = base.tensors[i]
    refused(put(base, tmp_path / "m.gguf", [(t["type_pos"], 4, int(gguf.GGMLQuantizationType.Q4_0))]),
            base.tensors[i + 1]["name"], "leaves a gap")


def test_row_not_a_whole_number_of_blocks(base, tmp_path):
    t = tensor(base, "blk.0.attn_norm.weight")  # F32 [32] -> Q8_0: fine; Q4_K needs 256 per row
    refused(put(base, tmp_path / "m.gguf", [(t["type_pos"], 4, int(gguf.GGMLQuantizationType.Q4_K))]),
            "blk.0.attn_norm.weight", "not a multiple of the block size 256")


def test_dimensions(base, tmp_path):
    f = next(f for f in base.of("n_dims") if f.label == "output_norm.weight")
    refused(put(base, tmp_path / "a.gguf", [(f.pos, 4, 5)]), "output_norm.weight", "at most 4")
    d = next(f for f in base.of("dim") if f.label.startswith("token_embd.weight dim 1"))
    refused(put(base, tmp_path / "b.gguf", [(d.pos, 8, 2**63)]), "token_embd.weight", "below 2^63")
    refused(put(base, tmp_path / "c.gguf", [(d.pos, 8, 2**62)]), "token_embd.weight", "more than GGML can count")


def test_duplicate_tensor_name(base, tmp_path):
    a, b = (next(f for f in base.of("name_len") if f.label == n) for n in ("blk.0.attn_k.weight",
                                                                            "blk.0.attn_v.weight"))
    raw = bytearray(base.raw)
    raw[b.pos + 8:b.pos + 8 + len("blk.0.attn_k.weight")] = b"blk.0.attn_k.weight"
    Path(tmp_path / "m.gguf").write_bytes(bytes(raw))
    refused(str(tmp_path / "m.gguf"), "blk.0.attn_k.weight", "appears twice")
    assert a.pos != b.pos


@pytest.mark.parametrize("vtype,value,why", [(U64, 32, "must be UINT32"), (U32, 0, "not a power of two"),
                                              (U32, 48, "not a power of two")])
def test_alignment_key(base, tmp_path, vtype, value, why):
    refused(with_kv(base, tmp_path / "m.gguf", "general.alignment", vtype, value), "general.alignment", why)


def test_bigger_alignment_moves_every_offset(base, tmp_path):
    """general.alignment = 64 on a file packed at 32: offsets that are odd multiples of 32 are refused."""
    refused(with_kv(base, tmp_path / "m.gguf", "general.alignment", U32, 64), "alignment 64")


# -- item 10: metadata bounded and typed before use ---------------------------------------------------

def cli_in_child(path: str, *cmd: str) -> subprocess.CompletedProcess:
    """``ggml-hybrid CMD PATH`` in a child with a 2 GiB address space and a time limit: a loop or a runaway
    allocation fails the test instead of taking the machine."""
    lim = 2 << 30
    extra = list(cmd[1:]) or (["-p", "hi", "-n", "1", "-t", "1"] if cmd[0] == "run" else [])
    return subprocess.run([sys.executable, "-c", "import sys; from ggml_hybrid.cli import main; main()", cmd[0],
                           path, *extra], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (lim, lim)),
                          env=dict(os.environ, GGML_NO_BACKTRACE="1"))


def one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.returncode, p.stderr[-2000:])
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("key,value,why", [
    ("qwen3moe.block_count", 2**32, "..512"),
    ("qwen3moe.block_count", 513, "..512"),
    ("qwen3moe.context_length", 2**32, "..2147483647"),
    ("qwen3moe.expert_count", 2**31, "0..1024"),
    ("qwen3moe.embedding_length", 2**40, "..2147483647"),
])
def test_huge_counts(base, tmp_path, key, value, why):
    path = with_kv(base, tmp_path / "m.gguf", key, U64, value)
    for cmd in ("run", "plan"):
        one_line_error(cli_in_child(path, cmd), key, why)


def test_architecture_array(base, tmp_path):
    path = with_kv(base, tmp_path / "m.gguf", "general.architecture", ARR, (STR, ["qwen3moe", "llama"]))
    for cmd in ("inspect", "run", "plan"):
        one_line_error(cli_in_child(path, cmd), "general.architecture", "an array of 2 STRING, expected str")


def test_nested_token_array(base, tmp_path):
    """Arrays of arrays: refused from the declared element type, before one element is read."""
    path = with_kv(base, tmp_path / "m.gguf", "tokenizer.ggml.tokens", ARR, (ARR, [(0, [1, 2], None)] * 3))
    one_line_error(cli_in_child(path, "inspect"), "tokenizer.ggml.tokens", "array of arrays")


def test_token_array_turned_nested_in_place(base, tmp_path):
    """The hostile case: the element type of the 320-token array edited to ARRAY, its strings read as arrays."""
    f = next(f for f in base.of("arr_type") if f.label.startswith("tokenizer.ggml.tokens"))
    path = put(base, tmp_path / "m.gguf", [(f.pos, 4, ARR)])
    for cmd in ("inspect", "run"):
        one_line_error(cli_in_child(path, cmd), "tokenizer.ggml.tokens", "array of arrays")


@pytest.mark.parametrize("declared", [2**31, 2**40, 2**64 - 1])
def test_declared_array_length_beyond_the_file(base, tmp_path, declared):
    f = next(f for f in base.of("arr_len") if f.label.startswith("tokenizer.ggml.token_type"))
    path = put(base, tmp_path / "m.gguf", [(f.pos, 8, declared)])
    one_line_error(cli_in_child(path, "inspect"), "tokenizer.ggml.token_type")


def test_scalar_array_longer_than_the_file(base, tmp_path):
    """What made the gguf package loop: a scalar array declared longer than the bytes left (it reads nothing
    past the end and goes on)."""
    f = next(f for f in base.of("arr_len") if f.label.startswith("tokenizer.ggml.token_type"))
    path = put(base, tmp_path / "m.gguf", [(f.pos, 8, 2**30)])
    one_line_error(cli_in_child(path, "run", "-p", "hi"), "tokenizer.ggml.token_type", "past the end")


@pytest.mark.parametrize("which,value", [("string", 2**62), ("key", 2**40), ("count", 2**40)])
def test_lengths_and_counts_beyond_the_file(base, tmp_path, which, value):
    f = {"string": lambda: next(f for f in base.of("str_len") if f.label.startswith("general.architecture")),
         "key": lambda: base.of("key_len")[3], "count": lambda: base.fields[2]}[which]()
    refused(put(base, tmp_path / "m.gguf", [(f.pos, f.size, value)]))


def test_unknown_value_type(base, tmp_path):
    f = next(f for f in base.of("kv_type") if f.label.startswith("general.name"))
    refused(put(base, tmp_path / "m.gguf", [(f.pos, 4, 13)]), "general.name", "unknown value type 13")


@pytest.mark.parametrize("key,vtype,value,kind", [
    ("tokenizer.ggml.add_bos_token", STR, "false", "expected bool"),
    ("tokenizer.ggml.bos_token_id", STR, "1", "expected int"),
    ("tokenizer.ggml.model", U32, 2, "expected str"),
    ("tokenizer.ggml.tokens", ARR, (U32, [1, 2]), "expected strs"),
    ("qwen3moe.rope.freq_base", STR, "1e4", "expected number"),
    ("qwen3moe.block_count", ARR, (U32, [1] * 600), "600 per-layer entries; 1..512"),
])
def test_declared_type_checked_before_use(base, tmp_path, key, vtype, value, kind):
    path = with_kv(base, tmp_path / "m.gguf", key, vtype, value)
    with pytest.raises(ModelFileError, match=kind):
        MoEModel(path, ONE)


def test_metadata_reads_check_their_arguments(tmp_path):
    s = GGUFStore(write_model(tmp_path / "args.gguf", SPEC))
    try:
        with pytest.raises(ArgumentError):
            s.meta(1)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError):
            s.meta("general.name", kind="float")
        with pytest.raises(ArgumentError):
            s.info(["blk.0.attn_q.weight"])  # type: ignore[arg-type]
        assert s.meta("qwen3moe.block_count", kind="int") == 1
        assert s.meta("absent.key", 7, kind="int") == 7
    finally:
        s.close()
    with pytest.raises(ArgumentError):
        GGUFStore(3)  # type: ignore[arg-type]


# -- check_tensors, and non-finite logits -----------------------------------------------------------

@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> str:
    """A NaN in one norm weight: the load accepts it, every logit after layer 0 is NaN."""
    fm = map_file(write_model(tmp_path_factory.mktemp("nan") / "ok.gguf", SPEC))
    t = tensor(fm, "blk.0.ffn_norm.weight")
    b = bytearray(fm.raw)
    b[fm.data_start + t["offset"] + 12:fm.data_start + t["offset"] + 16] = np.float32(np.nan).tobytes()
    path = tmp_path_factory.getbasetemp() / "nan.gguf"
    path.write_bytes(bytes(b))
    return str(path)


def test_nan_logits_stop_generation(nan_model):
    with MoEModel(nan_model, ONE) as m, pytest.raises(NonFiniteError, match="position 2"):
        complete(m, [1, 2, 3], 2)


def test_nan_logits_stop_the_run(nan_model, tmp_path):
    r = CliRunner().invoke(main, ["run", nan_model, "--tokens", "1,2,3", "-n", "2", "-t", "1",
                                  "--logits-out", str(tmp_path / "l.npy")])
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "non-finite logits" in lines[0] and "position 0" in lines[0]
    assert not (tmp_path / "l.npy").exists()  # nothing written for a failed run


def test_check_tensors_names_the_tensor(nan_model):
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_norm\.weight.*NaN or infinite"):
        MoEModel(nan_model, ONE.merged(check_tensors=True))
    r = CliRunner().invoke(main, ["run", nan_model, "-p", "hi", "-n", "1", "-t", "1", "--check-tensors"])
    assert r.exit_code == 2 and "error: " in r.stderr and "blk.0.ffn_norm.weight" in r.stderr


def test_check_tensors_finds_a_nan_quantized_scale(tmp_path):
    fm = map_file(write_model(tmp_path / "ok.gguf", SPEC))
    t = tensor(fm, "blk.0.ffn_down_exps.weight")  # Q8_0: each block starts with its F16 scale
    b = bytearray(fm.raw)
    pos = fm.data_start + t["offset"] + 34 * 5
    b[pos:pos + 2] = np.float16(np.inf).tobytes()
    (tmp_path / "bad.gguf").write_bytes(bytes(b))
    with pytest.raises(ModelFileError, match="blk.0.ffn_down_exps.weight"):
        MoEModel(str(tmp_path / "bad.gguf"), ONE.merged(check_tensors=True, disk_experts=True, expert_cache_slots=1))
    with MoEModel(str(tmp_path / "ok.gguf"), ONE.merged(check_tensors=True)) as m:  # no false alarm
        assert np.isfinite(m.eval([1, 2])).all()


def test_check_tensors_in_stack_sessions(tmp_path):
    path = write_moe_stack(tmp_path / "s.gguf", n_layer=1, n_embd=32, n_ff=32, n_expert=4, n_used=2)
    fm = map_file(path)
    t = tensor(fm, "blk.0.ffn_gate_inp.weight")
    b = bytearray(fm.raw)
    b[fm.data_start + t["offset"]:fm.data_start + t["offset"] + 4] = np.float32(-np.inf).tobytes()
    (tmp_path / "bad.gguf").write_bytes(bytes(b))
    with pytest.raises(ModelFileError, match="blk.0.ffn_gate_inp.weight"):
        MoEStackSession(str(tmp_path / "bad.gguf"), ONE.merged(check_tensors=True))
