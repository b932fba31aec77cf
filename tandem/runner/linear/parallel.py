"""Tensor-parallel linear methods: a rank's matmul, then the collective its split needs.

A column-parallel layer (q/k/v, gate/up: the rank's output rows) needs nothing: its
output is the rank's heads or MLP columns, which the next layer consumes as they are.
A row-parallel layer (o, down: the rank's input columns) yields a partial sum that an
all-reduce completes; a vocabulary-parallel LM head yields the rank's logits, which an
all-gather puts side by side. Which layer is which the loader recorded as
``layer.tp_style`` (models/sharding.py); the collectives are torch.distributed's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tandem.models.linear import Linear, LinearMethod
from tandem.models.sharding import ROW, VOCAB


class RowParallelLinearMethod:
    """The rank's partial product, summed over the ranks; the bias is added once
    (rank 0 keeps it, the others zero theirs)."""

    def __init__(self, inner: LinearMethod, group: dist.ProcessGroup, rank: int) -> None:
        self.inner, self.group, self.rank = inner, group, rank

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)
        if self.rank != 0 and layer.bias is not None:
            layer.bias.data.zero_()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.apply(layer, x)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredLinearMethod:
    """The rank's rows of the vocabulary, gathered from every rank into whole rows
    (ranks whose share is a tile shorter pad it for the collective)."""

    def __init__(self, inner: LinearMethod, group: dist.ProcessGroup, sizes: list[int]) -> None:
        self.inner, self.group, self.sizes = inner, group, sizes

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        local = self.inner.apply(layer, x)
        width = max(self.sizes)
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        pieces = [torch.empty_like(local) for _ in self.sizes]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, self.sizes, strict=True)], dim=-1)


def parallel_linear_method(
    layer: Linear, inner: LinearMethod, group: dist.ProcessGroup, rank: int, sizes: list[int]
) -> LinearMethod:
    """``inner`` with the collective ``layer``'s split needs (``sizes``: each rank's
    vocabulary rows, for the LM head)."""
    style = getattr(layer, "tp_style", None)
    if style == ROW:
        return RowParallelLinearMethod(inner, group, rank)
    if style == VOCAB:
        return GatheredLinearMethod(inner, group, sizes)
    return inner
