"""Static batching: a fixed batch prefilled together, then decoded in lockstep.

Two ways to generate, for the classic comparison:

- ``generate_with_cache``: the prompt's K/V go into the paged cache once; every decode
  step runs one new token per sequence.
- ``generate_recompute``: no cache; every step runs the whole sequence again.

The engine's continuous batching (admit and retire requests every step) is measured
against this baseline.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from tandem.models.loader import LoadedModel
from tandem.runner.model_runner import ModelRunner, SequenceChunk, forward_no_cache


def stream_with_cache(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 16,
    max_prefill_tokens: int = 65536,
) -> Iterator[torch.Tensor]:
    """Yield the batch's next greedy tokens ([B], on the model's device) step by step,
    ``max_new_tokens`` times.

    Each sequence gets its own contiguous run of blocks up front. Prompts are prefilled
    in groups of at most ``max_prefill_tokens`` tokens to bound activation memory. Each
    decode step is one call on arrays (``ModelRunner.decode_logits``): no Python object
    per sequence, and the tokens never leave the device between steps."""
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    blocks_per_seq = math.ceil((max(lengths) + max_new_tokens) / block_size)
    runner = ModelRunner(loaded, batch * blocks_per_seq, block_size, num_state_slots=batch)
    tables = np.arange(batch * blocks_per_seq, dtype=np.int64).reshape(batch, -1)

    last_logits = []
    start = 0
    while start < batch:
        end, tokens = start, 0
        while end < batch and (end == start or tokens + len(prompts[end]) <= max_prefill_tokens):
            tokens += len(prompts[end])
            end += 1
        chunks = [SequenceChunk(prompts[i], 0, tables[i], state_slot=i) for i in range(start, end)]
        last_logits.append(runner.forward(chunks))
        start = end
    tokens = torch.cat(last_logits).argmax(dim=-1)
    yield tokens
    computed = np.array(lengths, np.int64)
    for _ in range(max_new_tokens - 1):  # the tokens stay where the model runs
        tokens = runner.decode_logits(tokens, computed, tables).argmax(dim=-1)
        computed = computed + 1
        yield tokens


def generate_with_cache(
    loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16
) -> torch.Tensor:
    """Greedy tokens [B, max_new_tokens], KV-cached."""
    steps = stream_with_cache(loaded, prompts, max_new_tokens, block_size)
    return torch.stack(list(steps), dim=1)


@torch.inference_mode()
def generate_recompute(
    loaded: LoadedModel, prompt_ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """Greedy tokens [B, max_new_tokens] for equal-length prompts [B, L], recomputing
    the whole sequence at every step (no KV cache): the naive baseline."""
    sequence = prompt_ids
    for _ in range(max_new_tokens):
        logits = forward_no_cache(loaded, sequence)[:, -1]
        sequence = torch.cat([sequence, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return sequence[:, prompt_ids.shape[1] :]
