"""Checkpoint tensors, lazily: a name, a shape and a way to read the data on demand.

Both checkpoint formats come to the loader (weight_loading.py) as a stream of
``CheckpointTensor``: what a tensor is (its Hugging Face name, torch-order shape and
GGUF type) is known without reading it, so the loader decides every parameter's
layout before it reads a byte, then reads, converts or packs, and releases one
tensor at a time. A Hugging Face folder's safetensors files come from here
(``SafetensorsCheckpoint``); a GGUF file's from gguf_checkpoint.py.
"""

from __future__ import annotations

import json
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

    @property
    def quantized(self) -> bool:
        return self.type in BLOCK

    def read(self) -> torch.Tensor:
        return self._read()

    def release(self, rows: slice | None = None) -> None:
        if self._release is None:
            return
        if rows is None:
            self._release(0, None)
            return
        row_bytes = 0
        if self.quantized:
            weights, size = BLOCK[self.type]
            row_bytes = self.shape[-1] // weights * size
        self._release(rows.start * row_bytes, rows.stop * row_bytes)


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


class SafetensorsCheckpoint:
    """A Hugging Face folder's safetensors files (one, or the shards of an index),
    open until ``close()`` (a context manager); ``tensors()`` lists them lazily."""

    def __init__(self, folder: Path) -> None:
        self.handles = []
        for path in checkpoint_files(folder):
            try:
                self.handles.append((path, safe_open(str(path), framework="pt", device="cpu")))
            except Exception as exc:
                self.close()
                raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None

    def tensors(self) -> Iterator[CheckpointTensor]:
        for path, handle in self.handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = tuple(handle.get_slice(name).get_shape())
                yield CheckpointTensor(
                    name, shape, path.name, None, lambda h=handle, n=name: h.get_tensor(n)
                )

    def close(self) -> None:
        for _, handle in self.handles:
            handle.__exit__(None, None, None)
        self.handles = []

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
