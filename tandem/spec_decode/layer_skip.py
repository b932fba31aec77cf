"""Self-speculation by layer skipping (method "layer_skip"; Draft & Verify, SWIFT): the
draft is the target itself with some of its layers skipped, so it needs no weights of
its own and no cache of its own.

It runs on the target's runner and paged cache. Before a request's last token every
position already holds the target's exact K/V in every layer, so each proposal runs
the last token and then one token per further guess, through the layers it keeps
(reading the target's K/V there); what it writes at those positions is overwritten by
the verification forward of the same step, which runs the last token and every guess
through all layers. Layers are chosen by ``tandem tune-layer-skip`` (tune_layer_skip.py)
or given as a list: ``"skip_layers": "8-21"``.
"""

from __future__ import annotations

import contextlib

import torch

from tandem.errors import InvalidParameterError
from tandem.spec_decode.draft import DraftProposer


def parse_layers(text: str, num_layers: int) -> frozenset[int]:
    """``"4-11,20"`` -> {4, ..., 11, 20}: the layers to skip (0-based; not all of them)."""
    layers: set[int] = set()
    field = "speculative_config.skip_layers"
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise InvalidParameterError(field, f"{text!r}: give layers as 4-11,20") from None
        if not 0 <= low <= high < num_layers:
            raise InvalidParameterError(field, f"layer {part} is not in 0-{num_layers - 1}")
        layers.update(range(low, high + 1))
    if not layers or len(layers) >= num_layers:
        raise InvalidParameterError(field, "skip at least one layer, and not all of them")
    return frozenset(layers)


def format_layers(layers: frozenset[int] | set[int]) -> str:
    """The inverse of ``parse_layers``: runs as ranges."""
    runs, ordered = [], sorted(layers)
    for layer in ordered:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def default_layers(num_layers: int) -> frozenset[int]:
    """Without tuning: the middle half (the first and last layers matter most), or the
    last layer of a model too shallow to have a middle."""
    first = max(1, num_layers // 4)
    return frozenset(range(first, num_layers - first)) or frozenset({num_layers - 1})


@contextlib.contextmanager
def skipping(model, layers: frozenset[int]):
    """Run ``model`` without ``layers`` inside the block."""
    model.skipped_layers = layers
    try:
        yield
    finally:
        del model.skipped_layers  # back to the class's (none)


class LayerSkipProposer(DraftProposer):
    def __init__(self, target, skip_layers: str | None) -> None:
        if not hasattr(target.model, "skipped_layers"):
            raise InvalidParameterError(
                "speculative_config.method",
                f"layer_skip needs a Llama-family model, not {type(target.model).__name__}",
            )
        num_layers = target.config.num_layers
        if num_layers < 2:
            raise InvalidParameterError(
                "speculative_config.method", "layer_skip needs a model of two layers or more"
            )
        self.layers = (
            parse_layers(skip_layers, num_layers) if skip_layers else default_layers(num_layers)
        )
        self.runner = None  # the target's (attach)
        self.num_valid: dict[str, int] = {}

    def attach(self, runner) -> None:
        """The target's runner: its model and cache are the draft's."""
        self.runner = runner

    def _first_unseen(self, request) -> int:
        return request.num_tokens - 1  # the target has the K/V of everything before

    def _forward(self, chunks) -> torch.Tensor:
        with skipping(self.runner.model, self.layers):
            return self.runner.forward(chunks)
