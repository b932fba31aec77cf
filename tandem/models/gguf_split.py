"""A GGUF model written in several files, as llama.cpp's gguf-split and gguf-py's
writer split large models (``NAME-00001-of-00003.gguf`` ...): the first part holds
the metadata, every part a share of the tensors, each part's data section its own.

``open_gguf(path)`` reads a single file (gguf_file.GGUFFile) or, given any part of a
split model, all of its parts, as one object with GGUFFile's interface (``fields``,
``tensors``, ``data``, ``release``, ``close``): each tensor knows its part
(``TensorInfo.part``), so its bytes are read from its own file's map.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.errors import ModelLoadError

if TYPE_CHECKING:  # (the file reader imports torch: the names below must not, the Hub
    # client reads them in torch-free commands such as `tandem router`)
    import numpy as np

    from tandem.models.gguf_file import GGUFFile, TensorInfo

PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str | Path) -> list[Path] | None:
    """The paths of every part of the split model ``path`` is a part of, in order
    (None when the name is not a part's)."""
    path = Path(path)
    match = PART.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return [path.with_name(f"{match['stem']}-{n:05d}-of-{count:05d}.gguf")
            for n in range(1, count + 1)]  # fmt: skip


class SplitGGUF:
    def __init__(self, parts: list[Path]) -> None:
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise ModelLoadError(
                f"{parts[0].name} is split into {len(parts)} parts; missing beside it: "
                f"{', '.join(missing)}"
            )
        from tandem.models.gguf_file import GGUFFile

        self.path = parts[0]
        self.parts = [GGUFFile(p) for p in parts]
        self.fields = self.parts[0].fields
        self.tensors: list[TensorInfo] = []
        for number, part in enumerate(self.parts):
            stated = part.fields.get("split.no")
            if stated is not None and stated != number:
                says = f"says it is part {stated + 1}, not {number + 1}"
                raise ModelLoadError(f"{part.path.name} {says}")
            self.tensors += [dataclasses.replace(t, part=number) for t in part.tensors]
        expected = self.fields.get("split.tensors.count")
        if expected is not None and expected != len(self.tensors):
            raise ModelLoadError(
                f"{self.path.name}: its parts hold {len(self.tensors)} tensors, "
                f"its metadata says {expected}"
            )

    def data(self, info: TensorInfo) -> np.ndarray:
        return self.parts[info.part].data(info)

    def release(self, info: TensorInfo, start: int = 0, end: int | None = None) -> None:
        self.parts[info.part].release(info, start, end)

    def close(self) -> None:
        for part in self.parts:
            part.close()


def open_gguf(path: str | Path) -> GGUFFile | SplitGGUF:
    """A GGUF model: one file, or every part of a split one (any part may be named)."""
    from tandem.models.gguf_file import GGUFFile

    parts = split_parts(path)
    if parts is None or len(parts) == 1:
        return GGUFFile(path)
    return SplitGGUF(parts)
