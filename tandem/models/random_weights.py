"""A model with random weights from a config dict: for benchmarks and training starts.

Initialisation follows the usual recipe (normal(0, 0.02) matrices and embeddings,
unit norms, zero biases) so activations stay in a realistic range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.models.loader import LoadedModel, initializers_skipped, resolve_device, resolve_dtype
from tandem.models.registry import model_class_for
from tandem.models.weight_loading import materialize


def random_model(
    raw_config: dict[str, Any],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """On a GPU the weights are drawn there, in ``dtype`` (an 8B model's float32
    weights would not fit in many hosts' memory); on the CPU in float32, then cast."""
    cls = model_class_for(raw_config)
    config = cls.parse_config(raw_config)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if device.type == "cuda":
        with torch.device("meta"), initializers_skipped():
            model = cls(config).to(dtype)
        materialize(model, device)
        initialize(model, torch.Generator(device).manual_seed(seed))
    else:
        model = cls(config)
        initialize(model, torch.Generator().manual_seed(seed))
        model = model.to(device=device, dtype=dtype)
    model = model.eval().requires_grad_(False)
    model.tie_weights()
    return LoadedModel(Path("<random>"), config, model, None, dtype, device)


@torch.no_grad()
def initialize(model: nn.Module, generator: torch.Generator) -> None:
    """The usual recipe on every trainable parameter (frozen ones are left alone)."""
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            drawn = torch.randn(param.shape, generator=generator, device=generator.device)
            param.copy_(drawn * 0.02)


def model_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
