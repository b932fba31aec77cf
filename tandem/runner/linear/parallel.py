"""Tensor-parallel linear methods: a rank's matmul, then the collective its split needs.

A column-parallel layer (q/k/v, gate/up: the rank's output rows) needs nothing: its
output is the rank's heads or MLP columns, which the next layer consumes as they are.
A row-parallel layer (o, down: the rank's input columns) yields a partial sum that an
all-reduce completes; a vocabulary-parallel LM head yields the rank's logits, which an
all-gather puts side by side. Which layer is which the loader recorded as
``layer.tp_style`` (models/sharding.py); the collectives are the group's (gloo, or
shared memory between ranks on one host).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.models.linear import Linear, LinearMethod
from tandem.models.sharding import PARTIAL, ROW, VOCAB


class Collectives(Protocol):
    """What the split layers need of a group (runner/tensor_parallel.py: gloo;
    runner/shm_group.py: shared memory on one host)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """``tensor`` <- the sum over the ranks, in place."""
        ...

    def all_gather(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[rows, sizes[rank]] -> [rows, sum(sizes)], rank order."""
        ...


class RowParallelLinearMethod:
    """The rank's partial product, summed over the ranks; the bias is added once
    (rank 0 keeps it, the others zero theirs). ``reduce`` False: a partial sum that a
    later collective completes (a mixture's split experts' down projections: the
    mixture all-reduces once, models/moe.py), so none here."""

    def __init__(
        self, inner: LinearMethod, comm: Collectives, rank: int, reduce: bool = True
    ) -> None:
        self.inner, self.comm, self.rank, self.reduce = inner, comm, rank, reduce

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)
        if self.rank != 0 and layer.bias is not None:
            layer.bias.data.zero_()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.apply(layer, x)
        if self.reduce:
            self.comm.all_reduce(out)
        return out


class GatheredLinearMethod:
    """The rank's rows of the vocabulary, gathered from every rank into whole rows."""

    def __init__(self, inner: LinearMethod, comm: Collectives, sizes: list[int]) -> None:
        self.inner, self.comm, self.sizes = inner, comm, sizes

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.inner.process_weights_after_loading(layer)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        local = self.inner.apply(layer, x)
        return self.comm.all_gather(local.reshape(-1, local.shape[-1]), self.sizes).view(
            *local.shape[:-1], sum(self.sizes)
        )


def parallel_linear_method(
    layer: Linear, inner: LinearMethod, comm: Collectives, rank: int, sizes: list[int]
) -> LinearMethod:
    """``inner`` with the collective ``layer``'s split needs (``sizes``: each rank's
    vocabulary rows, for the LM head)."""
    style = getattr(layer, "tp_style", None)
    if style == ROW:
        return RowParallelLinearMethod(inner, comm, rank)
    if style == PARTIAL and layer.bias is not None:  # (the bias added by rank 0 alone)
        return RowParallelLinearMethod(inner, comm, rank, reduce=False)
    if style == VOCAB:
        return GatheredLinearMethod(inner, comm, sizes)
    return inner
