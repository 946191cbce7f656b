"""A GGUF file read through the ``gguf`` package: metadata, and tensors memory-mapped, never read whole.

Tensors can be *placed* on the mapped file (a CPU buffer over the mapping, as
llama.cpp's mmap does: zero copy, pages read from disk on first touch), *loaded*
into a backend buffer, or read one expert at a time for an expert cache.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native import CData, ffi
from ..errors import ModelFileError
from ..files import not_a_file
from ..ggml.backend import Backend, Buffer
from ..ggml.context import Context
from ..ggml.dtypes import GGMLType
from ..ggml.repack import repack_buffer_type
from ..ggml.tensor import Tensor


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: GGMLType
    shape: tuple[int, ...]  # numpy order
    offset: int             # absolute byte offset in the file
    nbytes: int


def _identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@functools.cache
def _reader_class() -> type:
    """``gguf.GGUFReader`` that checks each tensor's bytes lie in the file before it maps them.

    The reader itself would only fail to reshape a short slice ("cannot reshape array of size
    45696 into shape (2000,272)"); this names the tensor and the bytes.
    """
    import gguf

    class _Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                try:
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    continue  # an unknown type: the reader's own error names it
                n_bytes = int(np.prod(dims.astype(object))) * type_size // block
                start = int(start_offs) + int(offset[0])
                if start + n_bytes > size:
                    label = bytes(name).decode("utf-8", "replace")
                    present = max(0, size - start)
                    raise ModelFileError(f"{self.path!r}: tensor {label!r} needs {n_bytes} bytes from byte {start}, "
                                         f"but the {size}-byte file holds {present} of them (truncated?)")
            super()._build_tensors(start_offs, fields)

        def __init__(self, path: str, mode: Any) -> None:
            self.path = path
            super().__init__(path, mode)

    return _Reader


class GGUFStore:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        why = not_a_file(self.path)
        if why is not None:
            raise ModelFileError(f"model file {self.path!r} {why}")
        self._identity = _identity(self.path)
        try:
            self._reader = _reader_class()(self.path, "r")
        except ModelFileError:
            raise
        except Exception as exc:  # the gguf package raises several types for a bad file
            raise ModelFileError(f"{self.path!r} is not a readable GGUF file: {exc}") from exc
        self._info: dict[str, TensorInfo] = {}
        size = len(self._reader.data)
        for t in self._reader.tensors:
            info = TensorInfo(t.name, GGMLType(int(t.tensor_type)), tuple(int(n) for n in reversed(t.shape)),
                              int(t.data_offset), int(t.n_bytes))
            if info.offset + info.nbytes > size:
                raise ModelFileError(f"{self.path!r}: tensor {t.name!r} ends at byte {info.offset + info.nbytes}, "
                                     f"past the end of the {size}-byte file (truncated?)")
            self._info[t.name] = info
        self._data = {t.name: t.data for t in self._reader.tensors}
        self._mapped: Buffer | None = None

    def check_unchanged(self) -> None:
        """Raise :class:`ModelFileError` if the file was truncated, rewritten or replaced since it was opened.

        Tensors are used from a memory mapping: reading a page of a file truncated underneath kills the
        process with SIGBUS. Readers of mapped experts call this before they copy, which makes the common
        case (a model file overwritten while a run streams its experts) a clear error instead.
        """
        try:
            now = _identity(self.path)
        except OSError:
            now = None
        if now != self._identity:
            raise ModelFileError(f"model file {self.path!r} changed on disk while it was in use (size, time or "
                                 "inode differ from when it was opened); reload the model")

    # -- metadata -------------------------------------------------------------

    @property
    def arch(self) -> str:
        return self.meta("general.architecture")

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def meta(self, key: str, default=None):
        """A metadata value (int, float, str or list); ``default`` when given and the key is absent."""
        f = self._reader.fields.get(key)
        if f is None:
            if default is not None:
                return default
            raise ModelFileError(f"{self.path!r} lacks the metadata key {key!r}")
        try:
            return f.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as exc:
            raise ModelFileError(f"{self.path!r}: metadata {key!r} cannot be read ({exc})") from None

    # -- tensors --------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def tensors(self) -> list[TensorInfo]:
        """Every tensor's info, in file order."""
        return list(self._info.values())

    def info(self, name: str) -> TensorInfo:
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
            self._mapped = Buffer.from_host_memory(self._reader.data, "weights")
        return self._mapped

    def place(self, tensor: Tensor) -> None:
        """Point ``tensor`` at its data inside the mapped file: no copy."""
        self.mapped_buffer().place(tensor, self.info(tensor.name).offset)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a read-only view of the mapping), shaped [..., row bytes]."""
        return self._data[name].view(np.uint8).reshape(self._data[name].shape[:-1] + (-1,))

    def load(self, tensor: Tensor, source: str | None = None) -> None:
        """Copy the data of file tensor ``source`` (default: the tensor's name) into its memory, on any backend."""
        name = source or tensor.name
        self.info(name)
        tensor.set(np.ascontiguousarray(self.raw(name)).reshape(-1) if tensor.dtype.is_quantized
                   else np.ascontiguousarray(self._data[name]).reshape(tensor.shape))

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        self._mapped = None


def repack_rule(store: GGUFStore, enabled: bool = True) -> Callable[[str], CData | None]:
    """``rule(name)``: the CPU extra buffer type that tensor ``name`` of ``store`` goes to when it lives on a CPU
    backend (its weights repacked for GGML's faster kernels, as llama.cpp does), or ``None``; always ``None``
    when not ``enabled`` (``repack=false``, llama.cpp's ``--no-repack``)."""
    from ..deploy.layout import weight_op  # the layout imports the options, which import the native module

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

    The tensors go to one buffer of ``backend``, or, with ``backend=None`` (the CPU), are used in place
    from the memory-mapped file (no copy, as llama.cpp's mmap). ``repack(name)`` (see :func:`repack_rule`;
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
    if backend is None:
        for t in rest:
            store.place(t)
    elif rest:
        ctx.allocate(backend, usage, virtual=not load)
    mapped = {id(t) for t in rest} if backend is None else set()
    for n, t in tensors.items():
        if load and id(t) not in mapped:
            store.load(t)
        if on_tensor is not None:
            on_tensor(n)
    return ctx, tensors
