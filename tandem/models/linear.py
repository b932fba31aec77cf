"""Linear layers with a swappable method: how the weight is stored and multiplied.

Model files build ``Linear`` / ``MergedLinear`` and never say how they compute. Each
layer holds a ``LinearMethod`` (by default ``F.linear`` on the stored weight); the
runner picks one per device, dtype and quantization after loading (runner/linear/),
so a quantized format or a faster kernel plugs in without touching model code::

    loader: build on meta -> load checkpoint tensors -> runner: set_linear_method(model,
            method_for) (m = method_for(layer); m.process_weights_after_loading(layer))
    forward: layer(x) -> layer.method.apply(layer, x)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the loaded checkpoint weight into this method's layout (once)."""
        ...

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        ...


class TorchLinearMethod:
    """The weight as loaded, multiplied by torch (BLAS / oneDNN / cuBLAS)."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


TORCH_LINEAR = TorchLinearMethod()


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose product is delegated
    to ``self.method``."""

    method: LinearMethod = TORCH_LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class MergedLinear(Linear):
    """One matmul for several projections that read the same input (q/k/v, gate/up).

    Checkpoints store the parts separately; ``shard_rows`` says which rows part
    ``index`` loads into. Fewer, larger matmuls matter most for decode, where every
    kernel launch and every pass over the activations is overhead.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def shard_rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])


def set_linear_method(model: nn.Module, method_for: Callable[[Linear], LinearMethod]) -> int:
    """Give every Linear of ``model`` the method ``method_for(layer)`` chooses (after its
    weights are loaded); returns how many layers took one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            method = method_for(module)
            method.process_weights_after_loading(module)
            module.method = method
            count += 1
    return count
