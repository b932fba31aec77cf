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
    return int(config.kv_bytes_per_token(element_size)) * block_size


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def num_blocks_for(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    max_tokens_needed: int,
) -> int:
    """Blocks in the pool: ``num_blocks`` if given, else what the memory budget holds:
    ``kv_cache_memory`` bytes; on CUDA the part of ``gpu_memory_utilization`` x total
    memory still free after the weights; on CPU 2 GiB. A budget is never spent on more
    blocks than ``max_tokens_needed`` (max_num_seqs x max_model_len) can use."""
    if num_blocks is not None:
        return num_blocks
    per_block = kv_bytes_per_block(config, block_size, dtype)
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - gpu_memory_utilization) * total
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    useful = -(-max_tokens_needed // block_size)
    return max(1, min(int(budget // per_block), useful))
