"""One tensor-parallel rank's view: its place in the group, and the model's collectives.

The executor (tandem/executor/) starts the ranks and their torch.distributed group;
the loader gives each rank its shard of the weights (models/sharding.py); this module
adds what a shard needs to compute the whole model's numbers:

    row-parallel layers (o, down)   all-reduce of the partial sums (runner/linear/parallel.py)
    the LM head                     all-gather of the ranks' logits
    the token embedding             each rank looks up the ids in its rows, zeros for the
                                    others; an all-reduce assembles the rows
    a mixture of experts            each rank runs the picked experts it holds (and its
                                    part of a shared expert); an all-reduce of the
                                    layer's output adds the ranks' (models/moe.py)
    the KV cache                    the rank's KV heads only; every rank holds the same
                                    number of blocks (the smallest any rank can afford),
                                    since one scheduler counts them for all

Every rank ends a step with the same logits (all-gathered), samples them with the
same generator state and so draws the same tokens: the ranks' request states stay
equal without sending tokens back; rank 0's are the ones returned.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from tandem.errors import ModelLoadError
from tandem.models.linear import Linear, LinearMethod
from tandem.models.moe import SparseMoE
from tandem.models.quantized import replace_module
from tandem.models.sharding import VOCAB, ShardPlan, parallel_style, vocab_rows
from tandem.runner.host_to_device import to_device
from tandem.runner.linear.parallel import Collectives, parallel_linear_method


class DistCollectives:
    """torch.distributed's collectives on a group: gloo on CPUs, NCCL on GPUs (a group
    of its own beside the world's gloo: executor/ranks.py)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """A collective that waits longer fails (the hang timeout, step_channel.py)."""
        if self.group is not None:
            _set_pg_timeout(timeout, self.group)

    def abort(self) -> None:
        """End every collective in flight on this group, here, with an error (a rank
        died: its peers' NCCL kernels would otherwise wait on the GPU for ever)."""
        if self.group is not None:
            self.group.abort()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)

    def all_gather(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        width = max(sizes)  # gloo gathers equal sizes: the shorter shares padded
        padded = torch.nn.functional.pad(local, (0, width - local.shape[-1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes, strict=True)], dim=-1)


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank in a tensor-parallel group of ``size``; ``comm`` runs the
    model's collectives (setup's rare ones go through torch.distributed's group)."""

    rank: int
    size: int
    comm: Collectives = field(default_factory=DistCollectives)
    group: dist.ProcessGroup | None = None  # None: the default (world) group
    device: str | torch.device = "cpu"  # where ``comm``'s tensors live
    # Where this rank's KV cache lives in shared memory, for rank 0 to map it (a
    # disaggregated role moves every rank's blocks from there: shared_kv.py); None:
    # private memory.
    kv_file: str | None = None

    def vocab_sizes(self, vocab_size: int) -> list[int]:
        """Each rank's vocabulary rows (models/sharding.py splits them so)."""
        return [len(vocab_rows(vocab_size, self.size, r)) for r in range(self.size)]

    def raise_any(self, failure: Exception | None) -> None:
        """Raise, on every rank, the first rank's failure (None: this rank's went
        well); each rank calls it."""
        failures: list[str | None] = [None] * self.size
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(failures, mine, group=self.group)
        for rank, text in enumerate(failures):
            if text is not None:
                if rank == self.rank and failure is not None:
                    raise failure
                raise ModelLoadError(f"tensor-parallel rank {rank} failed to load: {text}")

    def rank0_drafts(
        self, proposals: list[tuple[list[int], torch.Tensor | None]], slots: list[int]
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Every rank ran the proposer (a draft model or head on each, layer skipping
        through the shards together); rank 0's drafts, tokens and distributions, replace
        each rank's own, so that all verify the same ones even where a rank's float sums
        came out a bit apart. (Rank 0's values plus the others' zeros, all-reduced: its
        values exactly.) ``slots``: each request's draft slots, the most it proposes."""
        width = sum(slots)
        tokens = [-1] * max(width, 1)
        offset = 0
        for (guess, _), slot in zip(proposals, slots, strict=True):
            tokens[offset : offset + len(guess)] = guess
            offset += slot
        sampled = [probs for _, probs in proposals if probs is not None]
        shared = to_device(tokens, self.device, torch.long)
        if self.rank != 0:
            shared.zero_()
        self.comm.all_reduce(shared)
        tokens = shared.tolist()
        probs = None
        if sampled:  # (every rank samples its drafts, or none does)
            shape, dtype = (width, sampled[0].shape[-1]), sampled[0].dtype
            probs = torch.zeros(shape, dtype=dtype, device=self.device)
            if self.rank == 0:
                offset = 0
                for (guess, guess_probs), slot in zip(proposals, slots, strict=True):
                    probs[offset : offset + len(guess)] = guess_probs[: len(guess)]
                    offset += slot
            self.comm.all_reduce(probs)
            probs = probs.to(sampled[0].device)
        aligned, offset = [], 0
        for slot in slots:
            guess = [t for t in tokens[offset : offset + slot] if t >= 0]
            aligned.append((guess, None if probs is None else probs[offset : offset + len(guess)]))
            offset += slot
        return aligned

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank calls it)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


class VocabParallelEmbedding(nn.Module):
    """The rank's rows of the embedding; a lookup is whole after the all-reduce."""

    def __init__(self, local: nn.Module, rows: range, comm: Collectives) -> None:
        super().__init__()
        self.local, self.rows, self.comm = local, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.rows.start
        outside = (local_ids < 0) | (local_ids >= len(self.rows))
        out = self.local(local_ids.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        self.comm.all_reduce(out)
        return out


def parallelize_embedding(model: nn.Module, shard: ShardPlan, tp: TensorParallel) -> None:
    """Wrap the vocabulary-split embedding (float or quantized) so that its lookups
    are whole rows."""
    for name, module in list(model.named_modules()):
        if parallel_style(name) == VOCAB and not isinstance(module, Linear):
            replace_module(model, name, VocabParallelEmbedding(module, shard.vocab, tp.comm))


def parallelize_mixtures(model: nn.Module, tp: TensorParallel) -> None:
    """Each mixture-of-experts layer of a rank's shard sums its partial output over
    the ranks (each holds some of the experts: models/sharding.py)."""
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.all_reduce = tp.comm.all_reduce


def method_with_collectives(tp: TensorParallel, vocab_size: int):
    """``linear_method_for``'s choice for a layer, with its split's collective."""
    sizes = tp.vocab_sizes(vocab_size)

    def wrap(layer: Linear, inner: LinearMethod) -> LinearMethod:
        return parallel_linear_method(layer, inner, tp.comm, tp.rank, sizes)

    return wrap
