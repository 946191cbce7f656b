"""A GGUF file read through the ``gguf`` package: metadata, and tensors memory-mapped, never read whole.

The header is checked first (``gguf_header``: every count, length, type, size and offset against the
file), so everything here works on a file whose structure is sound. Metadata reads state the kind of
value they expect, which is checked on the declared type before the value is decoded.
Tensors can *placed* on the mapped file (a CPU buffer over the mapping, as
llama.cpp's mmap does: zero copy, pages read from disk on first touch), *loaded*
into a backend buffer, or read one expert at a time for an expert cache.
"""

from __future__ import annotations

import os
import weakref
from bisect import bisect_left
from collections.abc import Callable
from typing import Any

import numpy as np

from .._native import CData, ffi, lib
from ..checks import check_choice, check_int, check_type
from ..errors import ModelFileError
from ..files import not_a_file
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.repack import repack_buffer_type
from ..ggml.tensor import Tensor
from .header import ARRAY, STRING, TYPE_NAMES, KeyInfo, TensorInfo, read_header
from .names import weight_op

_INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_NUMBERS = _INTEGERS | {6, 12}
_BOOL = 7
# what a metadata read may expect, checked on the declared types before any value is decoded
KINDS: dict[str, Callable[[KeyInfo], bool]] = {
    "int": lambda k: k.type in _INTEGERS,
    "number": lambda k: k.type in _NUMBERS,
    "bool": lambda k: k.type == _BOOL,
    "str": lambda k: k.type == STRING,
    "ints": lambda k: k.type == ARRAY and k.item_type in _INTEGERS,
    "numbers": lambda k: k.type == ARRAY and k.item_type in _NUMBERS,
    "bools": lambda k: k.type == ARRAY and k.item_type == _BOOL,
    "strs": lambda k: k.type == ARRAY and k.item_type == STRING,
}
Kind = str | tuple[str, ...]


def _declared(k: KeyInfo) -> str:
    if k.type == ARRAY:
        return f"an array of {k.length} {TYPE_NAMES[k.item_type]}"
    return TYPE_NAMES[k.type]


def _identity(fd: int) -> tuple[int, ...] | None:
    """The identity of open descriptor ``fd`` (device, inode, size, modification time in ns), or None when it
    cannot be read: ``_native/src/file_id.h``, the one definition, which the native executor and the host tier
    compare against this before they read the file."""
    out = ffi.new("int64_t[]", lib.HY_FILE_ID_N)
    return tuple(int(v) for v in out) if lib.hy_file_identity(fd, out) == 0 else None


def same_shape(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """llama.cpp's shape rule: a tensor matches when both shapes, padded with 1s to GGML's four dimensions, are
    equal (``llama_model_loader::check_tensor_dims``). Shapes here are numpy-order (``ne`` reversed), so the 1s go
    in front: the converter's ``(1, n_embd)`` shared-expert gate matches ``(n_embd,)``, and GGML sees the same
    ``ne = (n_embd, 1, 1, 1)`` either way."""
    def padded(s: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * (4 - len(s)) + tuple(s) if len(s) <= 4 else tuple(s)

    return padded(have) == padded(want)


class GGUFStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        import gguf

        self.path = os.fspath(check_type(path, "GGUFStore: path", str, os.PathLike))
        if not isinstance(self.path, str):  # a PathLike may give bytes
            raise ModelFileError(f"GGUFStore: path {path!r} must name a file as text, not bytes")
        why = not_a_file(self.path)
        if why is not None:
            raise ModelFileError(f"model file {self.path!r} {why}")
        # the file as opened: a file renamed over this path later is another file, and this one (which the
        # mapping keeps) is unchanged; a truncation or a rewrite in place changes it
        self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._close_fd_once = weakref.finalize(self, os.close, self._fd)  # at close(), or when dropped
        identity = _identity(self._fd)
        if identity is None:
            raise ModelFileError(f"model file {self.path!r}: its identity cannot be read (fstat failed)")
        self._identity: tuple[int, ...] = identity
        # the header is walked and every tensor checked against the file before the gguf package reads it
        self.header = header = read_header(self.path)
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as exc:  # the checked header leaves nothing it should refuse; kept as a backstop
            raise ModelFileError(f"{self.path!r} is not a readable GGUF file: {exc}") from exc
        self._map: np.ndarray = self._reader.data
        self._info: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        self._mapped: Buffer | None = None
        n_split = self.meta("split.count", 0, kind="int") if self.has("split.count") else 0
        if n_split > 1:
            raise ModelFileError(f"{self.path!r} is part {self.meta('split.no', 0, kind='int') + 1} of a GGUF split "
                                 f"in {n_split} parts (split.count); ggml-hybrid loads single-file GGUFs only: merge "
                                 "the parts with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`")
        # a read past the end of the file, truncated under us, reads zeros and counts a fault instead of
        # killing the process with SIGBUS (src/map_guard.h); check_reads() and check_unchanged() report it
        self._guard = -1
        if self._map.nbytes:
            at = ffi.cast("void *", self._map.ctypes.data)
            self._guard = int(lib.hy_map_guard_add(at, self._map.nbytes))
        self._unguard = weakref.finalize(self, lib.hy_map_guard_remove, self._guard)

    @property
    def fd(self) -> int | None:
        """The file as opened (None once closed, or its experts unmapped: :meth:`unmap`)."""
        return self._fd

    @property
    def identity(self) -> tuple[int, ...]:
        """The file's identity when it was opened (``_native/src/file_id.h``)."""
        return self._identity

    @property
    def map_guard(self) -> int:
        """The mapping's guard id (``_native/src/map_guard.h``), -1 for none."""
        return self._guard

    def check_reads(self) -> None:
        """Raise :class:`ModelFileError` if a read of the mapping since the file was opened went past the end of
        the file (it was truncated under us): that read gave zeros, and what was computed from it is wrong.

        Cheap (one counter): callers check it after the reads whose results they are about to use."""
        if self._guard >= 0 and lib.hy_map_guard_faults(self._guard):
            raise ModelFileError(f"model file {self.path!r} was truncated while it was in use (a read went past "
                                 "its end); reload the model")

    def check_unchanged(self) -> None:
        """Raise :class:`ModelFileError` if the file as opened was truncated or rewritten in place since (a file
        renamed over its path is another file: the one opened, and mapped, is unchanged and the run goes on).

        Tensors are used from a memory mapping: reading a page of a file truncated underneath kills the
        process with SIGBUS. Readers of mapped experts call this before they copy, which makes the common
        case (a model file overwritten while a run streams its experts) a clear error instead; a read that
        races a truncation past this check is caught by the mapping's guard (:meth:`check_reads`).
        """
        self.check_reads()
        if self._fd is None or _identity(self._fd) != self._identity:
            raise ModelFileError(f"model file {self.path!r} changed on disk while it was in use (truncated or "
                                 "rewritten in place: its size or time differ from when it was opened); reload "
                                 "the model")

    # -- metadata -------------------------------------------------------------

    @property
    def arch(self) -> str:
        return str(self.meta("general.architecture", kind="str"))

    def has(self, key: str) -> bool:
        return key in self.header.keys

    def meta(self, key: str, default: Any = None, kind: Kind | None = None) -> Any:
        """A metadata value (int, float, bool, str or a list of them); ``default`` when given and the key is absent.

        ``kind`` (one of :data:`KINDS`, or a tuple of them) is checked on the type the header declares, before
        the value is decoded.
        """
        check_type(key, "GGUFStore.meta: key", str)
        kinds: tuple[str, ...] = ()
        if kind is not None:
            kinds = (kind,) if isinstance(kind, str) else tuple(check_type(kind, "GGUFStore.meta: kind", tuple))
            for k in kinds:
                check_choice(check_type(k, "GGUFStore.meta: kind", str), "GGUFStore.meta: kind", KINDS)
        declared = self.header.keys.get(key)
        if declared is None:
            if default is not None:
                return default
            raise ModelFileError(f"{self.path!r} lacks the metadata key {key!r}")
        if kinds and not any(KINDS[k](declared) for k in kinds):
            raise ModelFileError(f"{self.path!r}: metadata {key} is {_declared(declared)}, expected "
                                 f"{' or '.join(kinds)}")
        try:
            return self._reader.fields[key].contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise ModelFileError(f"{self.path!r}: metadata {key!r} cannot be read ({exc})") from None

    # -- tensors --------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def tensors(self) -> list[TensorInfo]:
        """Every tensor's info, in file order."""
        return list(self._info.values())

    def info(self, name: str) -> TensorInfo:
        check_type(name, "GGUFStore: tensor name", str)
        try:
            return self._info[name]
        except KeyError:
            raise ModelFileError(f"{self.path!r} has no tensor {name!r}") from None

    def new_tensor(self, ctx: Context, name: str) -> Tensor:
        info = self.info(name)
        return ctx.new_tensor(info.dtype, info.shape, name)

    def mapped_buffer(self) -> Buffer:
        """One CPU buffer over the whole mapped file (weights usage)."""
        if self._mapped is None or self._mapped.closed:
            self._mapped = Buffer.from_host_memory(self._map, "weights")
        return self._mapped

    def place(self, tensor: Tensor) -> None:
        """Point ``tensor`` at its data inside the mapped file: no copy."""
        self.mapped_buffer().place(tensor, self.info(tensor.name).offset)

    def populate(self, name: str) -> None:
        """Read tensor ``name``'s pages of the mapping now (``map_guard.h: hy_map_populate``), as a copy would: a
        tensor used in place then takes no page fault when it is first computed with (a fault's readahead would
        bring neighbouring pages of the file into the page cache: experts the host tier reads itself)."""
        info = self.info(name)
        if info.nbytes and lib.hy_map_populate(ffi.cast("const void *", self._map.ctypes.data + info.offset),
                                               info.nbytes) != 0:
            raise ModelFileError(f"{self.path!r}: cannot read tensor {name!r} from the mapping: "
                                 f"{os.strerror(ffi.errno)}")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a read-only view of the mapping), shaped [..., row bytes]."""
        info = self.info(name)
        row = info.dtype.row_size(info.shape[-1]) if info.shape else info.nbytes
        return self._map[info.offset:info.offset + info.nbytes].reshape(info.shape[:-1] + (row,))

    def load(self, tensor: Tensor, source: str | None = None) -> None:
        """Copy the data of file tensor ``source`` (default: the tensor's name) into its memory, on any backend."""
        raw = np.ascontiguousarray(self.raw(source or tensor.name))
        tensor.set(raw.reshape(-1) if tensor.dtype.is_quantized
                   else raw.view(tensor.dtype.numpy_dtype).reshape(tensor.shape))

    def validate_data(self, names: list[str] | None = None, n_threads: int = 1) -> None:
        """Check the tensors' values as llama.cpp's ``--check-tensors`` does (``ggml_validate_row_data``: no NaN
        or infinity in a float, no NaN or infinite scale in a quantized block); reads every byte of them."""
        from concurrent.futures import ThreadPoolExecutor

        if names is not None:
            check_type(names, "GGUFStore.validate_data: names", list, tuple)
        infos = [self.info(n) for n in names] if names is not None else self.tensors()
        n_threads = check_int(n_threads, "GGUFStore.validate_data: n_threads", 1, 512)

        def valid(info: TensorInfo) -> bool:
            if not info.nbytes:
                return True
            ptr = ffi.cast("void *", self._map[info.offset:info.offset + info.nbytes].ctypes.data)
            return bool(lib.ggml_validate_row_data(info.dtype, ptr, info.nbytes))  # the GIL is released

        # GGML prints the block it refused (on stderr, as in llama.cpp); the first bad tensor in file order is named
        with ThreadPoolExecutor(max_workers=n_threads) as pool:
            for info, ok in zip(infos, pool.map(valid, infos)):
                if not ok:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise ModelFileError(f"{self.path!r}: tensor {info.name!r} ({info.dtype.name}) holds NaN or "
                                         "infinite values (check_tensors)")

    def unmap(self, names: list[str]) -> int:
        """Stop mapping the named tensors' bytes (``host_tier_bytes``: the host tier reads them with ``pread``, and
        nothing may read them through the mapping): zero pages of no file replace the whole pages inside them, so
        they cost no page cache and a stray read gives zeros. The bytes released. Only for a store no one else
        reads these tensors from: :meth:`raw` of them gives zeros after."""
        spans = sorted((self.info(n).offset, self.info(n).offset + self.info(n).nbytes) for n in names)
        released = set(names)
        others = sorted(t.offset for t in self.header.tensors if t.name not in released)

        def other_in(lo: int, hi: int) -> bool:  # a tensor still read through the mapping starts in [lo, hi)
            i = bisect_left(others, lo)
            return i < len(others) and others[i] < hi

        merged: list[list[int]] = []
        for start, end in spans:  # neighbours in one range when only alignment padding lies between them (a small
            if merged and not other_in(merged[-1][1], start):  # tensor between two experts stays mapped)
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        base, total = int(self._map.ctypes.data), 0
        for start, end in merged:
            got = int(lib.hy_map_release(ffi.cast("const void *", base + start), end - start))
            if got < 0:
                raise ModelFileError(f"{self.path!r}: cannot unmap bytes {start}..{end} of the file: "
                                     f"{os.strerror(ffi.errno)}")
            total += got
        return total

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        self._mapped = None
        self._unguard()
        self._guard = -1
        self._fd = None
        self._close_fd_once()


def repack_rule(store: GGUFStore, enabled: bool = True) -> Callable[[str], CData | None]:
    """``rule(name)``: the CPU extra buffer type that tensor ``name`` of ``store`` goes to when it lives on a CPU
    backend (its weights repacked for GGML's faster kernels, as llama.cpp does), or ``None``; always ``None``
    when not ``enabled`` (``repack=false``, llama.cpp's ``--no-repack``)."""
    def rule(name: str) -> CData | None:
        if not enabled:
            return None
        info = store.info(name)
        return repack_buffer_type(info.dtype, info.shape, weight_op(name, len(info.shape)))

    return rule


def load_into(store: GGUFStore, names, backend: Backend | None, usage: str = "weights", n_extra: int = 0,
              on_tensor=None, load: bool = True, repack: Callable[[str], CData | None] | None = None,
              ctx: Context | None = None):
    """A context with the named tensors, filled from the file.

    The tensors go to one buffer of ``backend``, or, with ``backend=None`` (the CPU) or a CPU backend (a CPU
    instance playing a device), are used in place from the memory-mapped file (no copy, as llama.cpp's mmap
    does for every CPU buffer: the page cache maps a large file's pages as huge pages where it can, which a
    copy in this process's memory would not get; decode, which reads every weight once a token, was 10-20%
    slower on copies of Q8_0 weights, docs/benchmarks.md section 23). ``repack(name)`` (see :func:`repack_rule`;
    only for CPU backends) may name a CPU extra buffer type for a tensor instead: it is loaded there,
    repacked. ``on_tensor(name)`` is called after each tensor is placed (progress reporting). With
    ``load=False`` (planning) memory is only reserved (``virtual``) and no tensor data is read. ``ctx``:
    create the tensors in this context (unallocated ones of it are allocated too) instead of a new one.
    """
    if ctx is None:
        ctx = Context(n_tensors=len(names) + n_extra)
    tensors = {n: store.new_tensor(ctx, n) for n in names}
    groups: dict[int, tuple[CData, list[Tensor]]] = {}
    rest = []
    for n, t in tensors.items():
        buft = repack(n) if repack is not None else None
        if buft is None:
            rest.append(t)
        else:
            groups.setdefault(int(ffi.cast("uintptr_t", buft)), (buft, []))[1].append(t)
    for buft, group in groups.values():
        ctx.allocate_group(group, buft, usage, virtual=not load)
    in_place = backend is None or backend.is_cpu
    if in_place:
        for t in rest:
            store.place(t)
    elif rest and backend is not None:
        ctx.allocate(backend, usage, virtual=not load)
    mapped = {id(t) for t in rest} if in_place else set()
    for n, t in tensors.items():
        if load and id(t) not in mapped:
            store.load(t)
        elif load and backend is not None:  # a CPU backend's tensor used in place: read now, as a copy would be
            store.populate(n)
        if on_tensor is not None:
            on_tensor(n)
    return ctx, tensors


__all__ = ["KINDS", "GGUFStore", "TensorInfo", "load_into", "same_shape"]
