"""``tandem eval``'s work, importable: score a text with a model, and optionally
against a reference (a model run on the same windows, or its saved log-probs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.errors import InvalidParameterError
from tandem.eval.scores import Scores
from tandem.eval.windows import score_windows


def text_tokens(llm, text_path: str | Path) -> list[int]:
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise InvalidParameterError("model", "has no tokenizer to read the text with")
    try:
        text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InvalidParameterError("text", f"cannot read {text_path}: {exc.strerror}") from None
    # As llama-perplexity tokenizes: with the model's BOS first, if it adds one.
    return tokenizer.encode(text, add_special_tokens=True)


def reference_log_probs(
    llm, tokens: list[int], ctx: int, progress: bool, batch: int | None = None
) -> dict[str, Any]:
    """The reference's scored log-probs of every window (what ``--save-reference``
    stores, with the tokens and ctx they belong to). Float32: rounding them to 16 bits
    would flip near-ties of the top token (4 bytes x vocab per scored token: 50 MB per
    512-token window of a 49k vocabulary)."""
    scored = list(tqdm(score_windows(llm, tokens, ctx, batch), desc="reference", unit="window",
                       total=len(tokens) // ctx, disable=not progress))  # fmt: skip
    return {
        "ctx": ctx,
        "tokens": tokens,
        "log_probs": [w.log_probs for w in scored],
    }


def evaluate(
    llm,
    tokens: list[int],
    ctx: int,
    reference: dict[str, Any] | None,
    progress: bool,
    batch: int | None = None,
) -> dict[str, float]:
    if reference is not None and (reference["ctx"] != ctx or reference["tokens"] != tokens):
        raise InvalidParameterError(
            "reference", "was scored on other text or another --ctx (or another tokenizer)"
        )
    scores = Scores()
    scored = tqdm(score_windows(llm, tokens, ctx, batch), desc="scoring", unit="window",
                  total=len(tokens) // ctx, disable=not progress)  # fmt: skip
    for index, window in enumerate(scored):
        ref = None if reference is None else reference["log_probs"][index].float()
        if ref is not None and ref.shape != window.log_probs.shape:
            raise InvalidParameterError("reference", "has another vocabulary than the model")
        scores.add(window.log_probs, window.targets, ref)
    return scores.summary()


def save_reference(reference: dict[str, Any], path: str | Path) -> None:
    torch.save(reference, path)


def load_reference(path: str | Path) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise InvalidParameterError("reference", f"cannot read {path}: {exc}") from None
