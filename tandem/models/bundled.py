"""The small models shipped in the repository's models/ folder (trained by
scripts/train_bundled_models.py): the default when no model is given."""

from __future__ import annotations

from pathlib import Path

from tandem.errors import ModelLoadError

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL = MODELS_DIR / "stdlib-lm"
DEFAULT_DRAFT_MODEL = MODELS_DIR / "stdlib-lm-draft"


def _bundled(folder: Path) -> str:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"no model given and the bundled model is not at {folder} "
            "(install from a clone with `pip install -e .`, or pass a model folder)"
        )
    return str(folder)


def default_model() -> str:
    return _bundled(DEFAULT_MODEL)


def default_draft_model() -> str:
    """The draft for speculative decoding when none is given (stdlib-lm's draft)."""
    return _bundled(DEFAULT_DRAFT_MODEL)
