"""A GGUF file's metadata and tensor table, read in one pass; tensor bytes mapped.

Tensor bytes are read through a private (copy-on-write) map of the file: a tensor is
a view, nothing is copied until a caller packs or converts it, and ``release`` hands
its pages back (``madvise(MADV_DONTNEED)``) once it has, so a process that reads a
file tensor by tensor never holds more of it than the tensor at hand (the page cache
keeps it for the next load).

The ``gguf`` package's reader (the format's reference) builds a numpy view per array
element: on Gemma 3's 262,144-token vocabulary (three such arrays) that is 8-18 s per
load on a 2-core machine, against about 0.4 s here. This reader parses the same layout
(llama.cpp's gguf.h, versions 2 and 3) in one pass over the mapped header:

    "GGUF", version u32, tensor count u64, key/value count u64
    key/values: key (u64 length + UTF-8), value type u32, value
        (u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64; an array is an
        element type u32, a count u64, then the elements)
    tensor infos: name, dims u32, each dim u64 (innermost first), type u32, offset u64
    data: from the next multiple of general.alignment (32), each tensor at its offset

The ``gguf`` package stays the writer (gguf_export.py) and the tests' reference.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from tandem.quant.blocks import BLOCK, decoded_at_load

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
STRING, ARRAY = 8, 9
# The most a read fault maps around its page: Linux maps the page cache's whole folio
# and its fault-around block (fault_around_bytes, 64 KiB by default), and a file's
# folios are up to 2 MiB on x86-64 (a 6.18 kernel here mapped 512 KiB around a
# one-byte read). The unit ``release`` drops.
FAULT_AROUND = 2 << 20
_FLOAT_BYTES = {0: 4, 1: 2, 30: 2}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (row length) first
    type: int
    offset: int  # from the start of the data section
    part: int = 0  # of a split model (gguf_split.py): the file it is in

    @property
    def nbytes(self) -> int | None:
        """Bytes it takes, None for a type tandem does not know."""
        if self.type in _FLOAT_BYTES:
            return prod(self.shape) * _FLOAT_BYTES[self.type]
        sizes = BLOCK if self.type in BLOCK else decoded_at_load()
        if self.type in sizes:
            weights, size = sizes[self.type]
            return prod(self.shape) // weights * size
        return None


class _Cursor:
    def __init__(self, buffer: bytes) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + size
        return self.buffer[start : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            if element == STRING:
                return [self.string() for _ in range(count)]
            if element == ARRAY:
                return [self.value(ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[element])
            values = np.frombuffer(self.buffer, dtype, count, self.pos)
            self.pos += dtype.itemsize * count
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.unpack(_SCALARS[kind])


class GGUFFile:
    """``fields``: key -> value (Python scalars, strings, lists); ``tensors``: the
    tensor table in file order; ``data(info)``: a tensor's bytes (read-only map)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if len(buffer) < 24 or buffer[:4] != b"GGUF":
                raise ValueError("not a GGUF file")
            version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
            cursor = _Cursor(buffer)
            cursor.pos = 24
            self._parse(cursor, tensor_count, kv_count)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"truncated or corrupt GGUF header: {exc}") from None
        finally:
            buffer.close()
        alignment = int(self.fields.get("general.alignment", 32))
        self.data_start = -(-cursor.pos // alignment) * alignment
        self._mmap: mmap.mmap | None = None
        self._map: np.ndarray | None = None

    def _parse(self, cursor: _Cursor, tensor_count: int, kv_count: int) -> None:
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.unpack("<I"))
        self.tensors: list[TensorInfo] = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = cursor.unpack("<I")
            shape = tuple(cursor.unpack("<Q") for _ in range(dims))
            kind, offset = cursor.unpack("<I"), cursor.unpack("<Q")
            self.tensors.append(TensorInfo(name, shape, kind, offset))

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8: a view of the file's private map (writable, but
        a write would only change this process's copy; nothing here writes)."""
        if info.nbytes is None:
            raise ValueError(f"{info.name}: unknown tensor type {info.type}")
        if self._map is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        start = self.data_start + info.offset
        if start + info.nbytes > len(self._map):
            raise ValueError(f"{info.name}: data past the end of the file (truncated?)")
        return self._map[start : start + info.nbytes]

    def close(self) -> None:
        """Let go of the map (unmapped once no tensor view of it is left)."""
        self._map = self._mmap = None

    def release(self, info: TensorInfo, start: int = 0, end: int | None = None) -> None:
        """Drop the tensor's pages (bytes [start, end) of it; all by default) from this
        process; they stay in the page cache. The range is widened to whole blocks of
        FAULT_AROUND bytes: a read fault maps the pages around it too, so a
        tensor-parallel rank reading its rows of a matrix also had a neighbour's mapped
        (its rows of every expert of a 30B-A3B file peaked 1.0-1.3 GB above what it
        holds, until the load ended). A neighbour's page dropped this way is faulted
        back in from the file if it is read later; views of the tensor stay valid the
        same way."""
        if self._mmap is None or info.nbytes is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = self.data_start + info.offset
        end = info.nbytes if end is None else min(end, info.nbytes)
        start = (base + start) // FAULT_AROUND * FAULT_AROUND
        end = min(-(-(base + end) // FAULT_AROUND) * FAULT_AROUND, len(self._mmap))
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
