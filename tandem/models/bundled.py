"""The small models shipped in the repository's models/ folder (trained by
scripts/train_bundled_models.py): the default when no model is given."""

from __future__ import annotations

from pathlib import Path

from tandem.errors import ModelLoadError

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL = MODELS_DIR / "stdlib-lm"
DEFAULT_DRAFT_MODEL = MODELS_DIR / "stdlib-lm-draft"


def default_model() -> str:
    if not (DEFAULT_MODEL / "config.json").is_file():
        raise ModelLoadError(
            f"no model given and the bundled model is not at {DEFAULT_MODEL} "
            "(install from a clone with `pip install -e .`, or pass a model folder)"
        )
    return str(DEFAULT_MODEL)
