"""What the runner tells the engine once it has loaded the model and sized the cache.
Plain data (no tensors): the engine sizes its block pool and validates requests from
it without ever importing torch or the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunnerInfo:
    num_blocks: int  # KV blocks the runner allocated
    block_size: int
    vocab_size: int
    max_model_len: int  # the engine's context: max_model_len if set, else the model's
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    tokenizer: Any  # tandem.models.tokenizer.Tokenizer, or None for a tokenizer-less model
    generation_config: dict[str, Any] = field(default_factory=dict)  # as the folder has it
