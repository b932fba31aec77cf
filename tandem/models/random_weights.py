"""A model with random weights from a config dict: for benchmarks and training starts.

Initialisation follows the usual recipe (normal(0, 0.02) matrices and embeddings,
unit norms, zero biases) so activations stay in a realistic range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.models.loader import LoadedModel, resolve_device, resolve_dtype
from tandem.models.registry import model_class_for


def random_model(
    raw_config: dict[str, Any],
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    cls = model_class_for(raw_config)
    config = cls.parse_config(raw_config)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model = cls(config)
    initialize(model, torch.Generator().manual_seed(seed))
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
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
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def model_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
