"""The paged KV cache memory: one tensor for all layers.

Layout ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``: a
block is ``block_size`` consecutive token slots, and slot ``b * block_size + i`` is
token ``i`` of block ``b`` in every layer. One allocation keeps the cache easy to size
from a memory budget and to hand to a transfer engine as a single region.
"""

from __future__ import annotations

import torch

from tandem.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * block_size * element_size


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)

