"""The GGUF header walked and checked against the file before anything else reads it.

The ``gguf`` package's reader trusts the file: an array of 2^40 scalars makes it loop
and grow without end, a nested array is read element by element, a tensor offset of
2^64-1 or a type too small for its neighbours' offsets is accepted. So the header is
walked here first, with every count and length bounded by the bytes that remain, and
every tensor checked as ggml's ``gguf_init_from_file`` and llama.cpp's loader check it:

- the value types are known, arrays are flat (no arrays of arrays) and at most 2^30 long,
  strings at most 2^30 bytes, keys and tensor names UTF-8 and unique;
- ``general.alignment``, when present, is a UINT32 power of two (else 32);
- a tensor has at most 4 dimensions, each below 2^63, and fewer than 2^63 elements; its type
  is a GGML type of this build; each row is a whole number of blocks;
- its data offset is the running sum of the tensors before it, each padded to the alignment
  (which makes offsets aligned, in order, non-overlapping and free of wrap-around), and its
  bytes (``ggml_row_size`` per row) end inside the file.

Anything else is refused with one :class:`ModelFileError` naming the key or tensor.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from ..errors import ModelFileError
from ..ggml.dtypes import GGMLType

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING = 1 << 30        # gguf.cpp's GGUF_MAX_STRING_LENGTH
MAX_ARRAY = 1 << 30         # gguf.cpp's GGUF_MAX_ARRAY_ELEMENTS
MAX_NAME = 64               # GGML_MAX_NAME, the terminating zero included
MAX_DIMS = 4                # GGML_MAX_DIMS
INT64_MAX = (1 << 63) - 1

# GGUF value types -> bytes per scalar (8: STRING and 9: ARRAY are variable-sized)
STRING, ARRAY = 8, 9
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
              8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
UINT32 = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: GGMLType
    shape: tuple[int, ...]  # numpy order
    offset: int             # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class KeyInfo:
    """What the header declares for one metadata key, known before any value is decoded."""

    type: int        # a GGUF value type
    item_type: int   # the element type of an ARRAY (else equal to ``type``)
    length: int      # elements of an ARRAY (else 1)


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    data_offset: int
    keys: dict[str, KeyInfo]
    tensors: list[TensorInfo]


class _Cursor:
    """Little-endian reads from the mapped file that never pass its end."""

    def __init__(self, buf: mmap.mmap, where: str) -> None:
        self.buf, self.pos, self.size, self.where = buf, 0, len(buf), where

    def fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.where}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, past the end of the "
                            f"{self.size}-byte file (truncated?)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return int(v)

    def skip_string(self, what: str) -> None:
        n = self.u64(what)
        if n > MAX_STRING:
            raise self.fail(f"{what} is {n} bytes long, more than the {MAX_STRING} a GGUF string may hold")
        self.need(n, what)
        self.pos += n

    def text(self, what: str) -> str:
        start = self.pos + 8
        self.skip_string(what)
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not UTF-8 text") from None


def read_header(path: str) -> Header:
    """The checked header of the GGUF file ``path``; a :class:`ModelFileError` for anything malformed."""
    where = repr(os.fspath(path))
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelFileError(f"{where} is not a readable GGUF file: it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Cursor(buf, where))
    except OSError as exc:
        raise ModelFileError(f"{where} cannot be read: {exc.strerror or exc}") from None


def _walk(c: _Cursor) -> Header:
    if c.size < 4:
        raise ModelFileError(f"{c.where} is not a readable GGUF file: it has only {c.size} bytes")
    if c.buf[0:4] != GGUF_MAGIC:
        raise ModelFileError(f"{c.where} is not a readable GGUF file: it starts with {bytes(c.buf[0:4])!r}, "
                             f"not the magic {GGUF_MAGIC!r}")
    c.pos = 4
    version = c.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise c.fail("the file was written on a big-endian machine, which is not supported")
    if version not in VERSIONS:
        raise c.fail(f"GGUF version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})")
    n_tensors = c.u64("the tensor count")
    n_kv = c.u64("the metadata count")
    # each key-value pair takes at least 13 bytes, each tensor info at least 24: a cheap bound on both counts
    if n_kv * 13 > c.size - c.pos:
        raise c.fail(f"{n_kv} metadata pairs cannot fit in the {c.size}-byte file")
    if n_tensors * 24 > c.size - c.pos:
        raise c.fail(f"{n_tensors} tensor infos cannot fit in the {c.size}-byte file")
    keys: dict[str, KeyInfo] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.text(f"the name of metadata pair {i}")
        if key in keys:
            raise c.fail(f"metadata key {key!r} appears twice")
        info = _skip_value(c, key)
        keys[key] = info
        if key == "general.alignment":
            if info.type != UINT32:
                raise c.fail(f"general.alignment is {TYPE_NAMES[info.type]}, must be UINT32")
            (alignment,) = struct.unpack_from("<I", c.buf, c.pos - 4)
            if alignment == 0 or alignment & (alignment - 1):
                raise c.fail(f"general.alignment = {alignment} is not a power of two")
    raw = [_tensor_info(c, i) for i in range(n_tensors)]
    names = set()
    for name, *_ in raw:
        if name in names:
            raise c.fail(f"tensor {name!r} appears twice")
        names.add(name)
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version, alignment, data_offset, keys, _place(c, raw, data_offset, alignment))


def _skip_value(c: _Cursor, key: str) -> KeyInfo:
    what = f"metadata {key!r}"
    vtype = c.u32(f"the type of {what}")
    if vtype in SCALAR_SIZES:
        c.need(SCALAR_SIZES[vtype], what)
        c.pos += SCALAR_SIZES[vtype]
        return KeyInfo(vtype, vtype, 1)
    if vtype == STRING:
        c.skip_string(what)
        return KeyInfo(vtype, vtype, 1)
    if vtype != ARRAY:
        raise c.fail(f"{what} has the unknown value type {vtype}")
    item = c.u32(f"the element type of {what}")
    n = c.u64(f"the length of {what}")
    if item == ARRAY:
        raise c.fail(f"{what} is an array of arrays, which GGUF readers do not accept")
    if item != STRING and item not in SCALAR_SIZES:
        raise c.fail(f"{what} is an array of the unknown value type {item}")
    if n > MAX_ARRAY:
        raise c.fail(f"{what} has {n} elements, more than the {MAX_ARRAY} a GGUF array may hold")
    if item == STRING:
        c.need(8 * n, f"{what} ({n} strings)")  # each string has at least its 8-byte length
        for j in range(n):
            c.skip_string(f"{what}[{j}]")
    else:
        c.need(SCALAR_SIZES[item] * n, f"{what} ({n} x {TYPE_NAMES[item]})")
        c.pos += SCALAR_SIZES[item] * n
    return KeyInfo(ARRAY, item, n)


def _tensor_info(c: _Cursor, i: int) -> tuple[str, list[int], int, int]:
    name = c.text(f"the name of tensor {i}")
    if len(name.encode()) >= MAX_NAME:
        raise c.fail(f"tensor {i} has a name of {len(name.encode())} bytes ({name[:80]!r}...); GGML takes "
                     f"at most {MAX_NAME - 1}")
    what = f"tensor {name!r}"
    n_dims = c.u32(f"the dimension count of {what}")
    if n_dims > MAX_DIMS:
        raise c.fail(f"{what} has {n_dims} dimensions; GGML tensors have at most {MAX_DIMS}")
    ne = [c.u64(f"dimension {j} of {what}") for j in range(n_dims)]
    gtype = c.u32(f"the type of {what}")
    offset = c.u64(f"the data offset of {what}")
    return name, ne, gtype, offset


def _place(c: _Cursor, raw: list[tuple[str, list[int], int, int]], data_offset: int,
           alignment: int) -> list[TensorInfo]:
    out, expected = [], 0
    for name, ne, gtype, offset in raw:
        what = f"tensor {name!r}"
        if any(n > INT64_MAX for n in ne):
            raise c.fail(f"{what} has dimensions {ne}; each must be below 2^63")
        n_el = 1
        for n in ne:
            n_el *= n
        if n_el > INT64_MAX:
            raise c.fail(f"{what} has dimensions {ne}: {n_el} elements, more than GGML can count (2^63 - 1)")
        try:
            dtype = GGMLType(gtype)
        except ValueError:
            raise c.fail(f"{what} has the unknown GGML type {gtype}") from None
        if dtype.block_size <= 0 or dtype.type_size <= 0:
            raise c.fail(f"{what} has the GGML type {dtype.name}, which this build cannot size")
        ne0 = ne[0] if ne else 1
        if ne0 % dtype.block_size:
            raise c.fail(f"{what} is {dtype.name} with {ne0} elements per row, not a multiple of the block size "
                         f"{dtype.block_size}")
        nbytes = ne0 // dtype.block_size * dtype.type_size * (n_el // ne0 if ne0 else 0)
        if offset % alignment:
            raise c.fail(f"{what} has data offset {offset}, not a multiple of the alignment {alignment}")
        if offset != expected:
            how = "overlaps the tensor before it" if offset < expected else "leaves a gap after the tensor before it"
            raise c.fail(f"{what} has data offset {offset} but the tensors before it end at {expected}: it {how} "
                         "(GGUF tensor data is packed in order)")
        start = data_offset + offset
        if start + nbytes > c.size:
            raise c.fail(f"{what} ({dtype.name}, {ne}) needs {nbytes} bytes from byte {start}, but the "
                         f"{c.size}-byte file holds {max(0, c.size - start)} of them (truncated?)")
        out.append(TensorInfo(name, dtype, tuple(reversed(ne)) if ne else (), start, nbytes))
        expected = offset + -(-nbytes // alignment) * alignment
    return out


__all__ = ["DEFAULT_ALIGNMENT", "Header", "KeyInfo", "TensorInfo", "read_header"]
