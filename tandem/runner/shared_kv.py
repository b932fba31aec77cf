"""Every tensor-parallel rank's KV cache seen as one, from rank 0: what a
disaggregated role moves between instances.

Each rank of a host holds the K/V of its own KV heads (models/sharding.py), in a file
in shared memory (kv_cache.py ``shared_file``) that rank 0 maps beside its own. A
block read here has every KV head of the model, in order, as one process's cache
would (a head copied to several ranks is read from the first); a block written here
goes to each rank's heads (to every copy). So the blocks that cross between a
prefill and a decode instance are the same whatever either side's tensor-parallel
size: a 2-rank prefill instance can feed a 1-rank decode instance.
"""

from __future__ import annotations

import contextlib
import os

import torch

from tandem.models.config import ModelConfig
from tandem.models.sharding import head_ranges
from tandem.runner.kv_cache import map_shared


def kv_file(prefix: str, rank: int) -> str:
    return f"{prefix}-rank{rank}"


class RankedKVCache:
    """[layers, 2, blocks, block_size, all KV heads, head_dim] through ``read`` and
    ``write``; ``caches[r]`` is rank r's own (its heads only)."""

    def __init__(self, caches: list[torch.Tensor], config: ModelConfig) -> None:
        size = len(caches)
        self.caches = caches
        self.heads = [head_ranges(config.num_heads, config.num_kv_heads, size, r)[1]
                      for r in range(size)]  # fmt: skip
        first = caches[0]
        self.shape = (*first.shape[:4], config.num_kv_heads, first.shape[5])
        self.dtype, self.device = first.dtype, first.device
        # Each head read from the first rank that holds it: (rank, its local index).
        self.sources = [next((r, h - k.start) for r, k in enumerate(self.heads) if h in k)
                        for h in range(config.num_kv_heads)]  # fmt: skip

    @classmethod
    def open(cls, prefix: str, own: torch.Tensor, config: ModelConfig, size: int) -> RankedKVCache:
        """Rank 0's view: its own cache and the other ``size - 1`` ranks' files of
        ``prefix`` (then unlinked: the mappings keep them while the processes live).
        ``config``: the whole model's."""
        caches = [own]
        for rank in range(1, size):
            heads = head_ranges(config.num_heads, config.num_kv_heads, size, rank)[1]
            shape = (*own.shape[:4], len(heads), own.shape[5])
            caches.append(map_shared(kv_file(prefix, rank), shape, own.dtype))
        remove_files(prefix)
        return cls(caches, config)

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` with every KV head [layers, 2, n, block_size, heads, d]."""
        parts = [self.caches[r][:, :, block_ids, :, h : h + 1] for r, h in self.sources]
        return torch.cat(parts, dim=4)

    def write(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        for cache, heads in zip(self.caches, self.heads, strict=True):
            cache[:, :, block_ids] = blocks[:, :, :, :, heads.start : heads.stop]


def remove_files(prefix: str) -> None:
    folder, _, stem = prefix.rpartition("/")
    for name in os.listdir(folder):
        if name.startswith(stem + "-rank"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
