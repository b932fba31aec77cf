"""The training corpus: the Python standard library of the running interpreter.

Found through ``sysconfig`` (no hard-coded path, no download), deduplicated by content,
and split into train and held-out files by a hash of each file's relative path, so
the split is the same on every machine and does not move when files are added.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[SourceFile]:
    """Every readable ``.py`` file under the stdlib (site-packages excluded), sorted
    by path, each distinct text once."""
    root = root or stdlib_root()
    seen: set[str] = set()
    sources = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "dist-packages" in relative:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        sources.append(SourceFile(relative, text))
    return sources


def is_heldout(relative_path: str, heldout_percent: int = 5) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 100 < heldout_percent


def split(
    sources: list[SourceFile], heldout_percent: int = 5
) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [s for s in sources if not is_heldout(s.path, heldout_percent)]
    heldout = [s for s in sources if is_heldout(s.path, heldout_percent)]
    return train, heldout
