"""ModelRunner: sequences' token chunks -> tensors -> one forward pass -> logits.

The runner owns the model and the KV cache memory; which blocks a sequence uses is
decided by the caller (the engine's block manager) and arrives as block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.models.loader import LoadedModel
from tandem.runner.attention import CausalAttention, PagedAttention, build_paged_metadata
from tandem.runner.kv_cache import allocate_kv_cache


@dataclass
class SequenceChunk:
    """One sequence's share of a forward pass."""

    token_ids: Sequence[int]  # tokens to run now
    num_computed_tokens: int  # tokens of this sequence already in the cache before them
    block_table: Sequence[int]  # blocks holding this sequence, covering all its tokens


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(
            loaded.config, num_blocks, block_size, loaded.dtype, loaded.device
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SequenceChunk], all_logits: bool = False) -> torch.Tensor:
        """Logits of each chunk's last token [S, vocab], or of every token [T, vocab]."""
        to_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        width = max(len(c.block_table) for c in chunks)
        tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
        input_ids = to_tensor([t for c in chunks for t in c.token_ids])
        return self.forward_tensors(
            input_ids,
            to_tensor([len(c.token_ids) for c in chunks]),
            to_tensor([c.num_computed_tokens for c in chunks]),
            to_tensor(tables),
            all_logits,
        )

    @torch.inference_mode()
    def forward_tensors(
        self,
        input_ids: torch.Tensor,
        query_lens: torch.Tensor,
        num_computed: torch.Tensor,
        block_tables: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """The same as ``forward`` for callers that keep their batch as tensors."""
        metadata, positions = build_paged_metadata(
            query_lens, num_computed, block_tables, self.block_size, self.config.sliding_window
        )
        hidden = self.model(input_ids, positions, PagedAttention(metadata, self.kv_cache))
        if not all_logits:
            hidden = hidden[torch.cumsum(query_lens, 0) - 1]
        return self.model.compute_logits(hidden)


def forward_no_cache(loaded: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full causal forward over [B, L] token ids, no cache -> logits [B, L, vocab]."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    attn = CausalAttention(batch, length, loaded.config.sliding_window)
    hidden = loaded.model(input_ids.flatten(), positions, attn)
    return loaded.model.compute_logits(hidden).view(batch, length, -1)
