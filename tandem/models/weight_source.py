"""Checkpoint tensors, lazily: a name, a shape and a way to read the data on demand.

Both checkpoint formats come to the loader (weight_loading.py) as a stream of
``CheckpointTensor``: what a tensor is (its Hugging Face name, torch-order shape and
GGUF type) is known without reading it, so the loader decides every parameter's
layout before it reads a byte, then reads, converts or packs, and releases one
tensor at a time. A Hugging Face folder's safetensors files come from here
(``SafetensorsCheckpoint``); a GGUF file's from gguf_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.errors import ModelLoadError
from tandem.quant.blocks import BLOCK, GGMLType


@dataclass
class CheckpointTensor:
    """``read()``: float [shape] (any float dtype), or for a block format (``type`` in
    BLOCK) uint8 [rows, row bytes]; it may be a view of mapped file memory, valid until
    ``release()``'s caller stops using it (a view read after release reads the file
    again). ``release()`` gives the source's pages back once the data is copied;
    ``release(rows)`` those of some rows of a block-format matrix (released as they
    are packed, so not even one whole tensor of the file is held beside the model)."""

    name: str  # the Hugging Face name
    shape: tuple[int, ...]  # torch order: [rows, columns] for a matrix
    file: str
    type: GGMLType | None  # a GGUF tensor's storage type; None for safetensors
    _read: Callable[[], torch.Tensor]
    _release: Callable[[int, int | None], None] | None = None
    # Read rows [start, stop), or a matrix's columns [start, stop), alone (file reads
    # rather than a mapping: safetensors).
    _read_rows: Callable[[int, int], torch.Tensor] | None = None
    _read_columns: Callable[[int, int], torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.type in BLOCK

    def read(self) -> torch.Tensor:
        return self._read()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Part of this tensor, as ``torch.narrow`` (a tensor-parallel rank's shard):
        read as a view of the whole one's data (of a block format, ``start`` and
        ``length`` are whole blocks along the columns); releasing rows of the part
        releases those rows of the whole tensor."""
        shape = list(self.shape)
        shape[dim] = length
        view_start, view_length = start, length
        if self.quantized and dim == len(self.shape) - 1:  # the bytes of whole blocks
            weights, size = BLOCK[self.type]
            view_start, view_length = start // weights * size, length // weights * size
        if dim == 0 and self._read_rows is not None:  # only the part's bytes are read
            read = functools.partial(self._read_rows, start, start + length)
        elif dim == 1 and len(shape) == 2 and self._read_columns is not None:
            read = functools.partial(self._read_columns, start, start + length)
        else:
            read = lambda: self._read().narrow(dim, view_start, view_length)  # noqa: E731
        part = CheckpointTensor(self.name, tuple(shape), self.file, self.type, read)
        if self._release is not None:

            def release(start_byte: int, stop_byte: int | None) -> None:
                if not self._row_bytes():  # pages of a float tensor go all at once
                    self.release()
                    return
                row_bytes = part._row_bytes()
                if stop_byte is None or not row_bytes:  # all of the part's rows
                    rows = range(0, shape[0])
                else:
                    rows = range(start_byte // row_bytes, stop_byte // row_bytes)
                offset = start if dim == 0 else 0
                self.release(slice(offset + rows.start, offset + rows.stop))

            part._release = release
        return part

    def expert(self, index: int, rows: range | None = None) -> CheckpointTensor:
        """Expert ``index``'s matrix [R, C] of a float stack [experts, R, C] (its
        ``rows`` only: a gate/up stack's gate or up), read alone."""
        one = self.narrow(0, index, 1)
        if rows is not None:
            one = one.narrow(1, rows.start, len(rows))
        shape = tuple(one.shape[1:])
        return dataclasses.replace(one, shape=shape, _read=lambda: one.read()[0])

    def take(self, dim: int, spans: list[range]) -> CheckpointTensor:
        """The parts ``spans`` along ``dim``, one after another (a fused tensor's share
        of each of its parts: GPT-2's q, k and v in one c_attn)."""
        if len(spans) == 1:
            return self.narrow(dim, spans[0].start, len(spans[0]))
        parts = [self.narrow(dim, span.start, len(span)) for span in spans]
        shape = list(self.shape)
        shape[dim] = sum(len(span) for span in spans)
        view_dim = dim if not self.quantized or dim == 0 else 1

        def read() -> torch.Tensor:
            return torch.cat([part.read() for part in parts], view_dim)

        def release(start_byte: int, stop_byte: int | None) -> None:
            for part in parts:  # (the rows of a part are not told apart: all of them)
                part.release()

        return CheckpointTensor(self.name, tuple(shape), self.file, self.type, read, release)

    def release(self, rows: slice | None = None) -> None:
        if self._release is None:
            return
        if rows is None:
            self._release(0, None)
            return
        row_bytes = self._row_bytes()
        self._release(rows.start * row_bytes, rows.stop * row_bytes)

    def _row_bytes(self) -> int:
        """Bytes of one row of a block-format matrix (0 otherwise: rows are not
        released one by one)."""
        if not self.quantized:
            return 0
        weights, size = BLOCK[self.type]
        return self.shape[-1] // weights * size


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{folder} has no model.safetensors or model.safetensors.index.json "
        "(only safetensors checkpoints are read)"
    )


# safetensors' dtype names -> torch's.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in a safetensors file: a little-endian u64 header
    size, the JSON header (name -> dtype, shape, data_offsets), then the data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return {
        name: (base + entry["data_offsets"][0], base + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


class SafetensorsCheckpoint:
    """A Hugging Face folder's safetensors files (one, or the shards of an index),
    open until ``close()`` (a context manager); ``tensors()`` lists them lazily.

    The safetensors library opens and validates each file and gives names, shapes and
    dtypes; the bytes are then read with ``pread`` into a fresh tensor rather than
    through the library's memory map, whose pages would stay in the process (the
    whole file beside the model) until the file is closed. A tensor-parallel rank's
    rows of a tensor, or its columns of a matrix, are read alone (``narrow``)."""

    def __init__(self, folder: Path) -> None:
        self.files = []
        for path in checkpoint_files(folder):
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
                offsets = _data_offsets(path)
                fd = os.open(path, os.O_RDONLY)
            except Exception as exc:
                self.close()
                raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None
            self.files.append((path, handle, offsets, fd))

    def tensors(self) -> Iterator[CheckpointTensor]:
        for path, handle, offsets, fd in self.files:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                info = handle.get_slice(name)
                shape = tuple(info.get_shape())
                dtype = _SAFETENSORS_DTYPES[info.get_dtype()]
                read = functools.partial(_pread, fd, offsets[name], shape, dtype)
                rows = functools.partial(_pread_rows, fd, offsets[name], shape, dtype)
                columns = functools.partial(_pread_columns, fd, offsets[name], shape, dtype)
                yield CheckpointTensor(
                    name, shape, path.name, None, read, _read_rows=rows, _read_columns=columns
                )

    def close(self) -> None:
        for _, handle, _, fd in self.files:
            handle.__exit__(None, None, None)
            os.close(fd)
        self.files = []

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pread_rows(
    fd: int, span: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype, first: int,
    stop: int,
):  # fmt: skip
    """Rows [first, stop) of a row-major tensor: their bytes alone."""
    row_bytes = (span[1] - span[0]) // max(shape[0], 1)
    start = span[0] + first * row_bytes
    rows = (start, start + (stop - first) * row_bytes)
    return _pread(fd, rows, (stop - first, *shape[1:]), dtype)


def _pread_columns(
    fd: int, span: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype, first: int,
    stop: int,
):  # fmt: skip
    """Columns [first, stop) of a row-major matrix: each row's piece of them alone (a
    read a row)."""
    rows, columns = shape
    width = torch.empty((), dtype=dtype).element_size()
    if span[1] - span[0] != rows * columns * width:
        raise ModelLoadError(
            f"tensor of {span[1] - span[0]} bytes where {rows * columns * width} were expected"
        )
    out = torch.empty((rows, stop - first), dtype=dtype)
    flat = memoryview(out.view(torch.uint8).numpy().reshape(-1))
    piece = (stop - first) * width
    for row in range(rows):
        at = span[0] + (row * columns + first) * width
        _read_fully(fd, flat[row * piece : (row + 1) * piece], at)
    return out


def _pread(fd: int, span: tuple[int, int], shape: tuple[int, ...], dtype: torch.dtype):
    out = torch.empty(shape, dtype=dtype)
    buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    start, end = span
    if len(buffer) != end - start:
        raise ModelLoadError(f"tensor of {end - start} bytes where {len(buffer)} were expected")
    _read_fully(fd, buffer, start)
    return out


def _read_fully(fd: int, buffer: memoryview, start: int) -> None:
    done = 0
    while done < len(buffer):  # a read may return less than asked (over 2 GB at once)
        count = os.preadv(fd, [buffer[done:]], start + done)
        if count == 0:
            raise ModelLoadError("the weights file ends before its tensors (truncated?)")
        done += count
