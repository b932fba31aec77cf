"""ModelRunner: sequences' token chunks -> tensors -> one forward pass -> logits.

The runner owns the model and the KV cache memory; which blocks a sequence uses is
decided by the caller (the engine's block manager) and arrives as block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.models.loader import LoadedModel
from tandem.runner import cpu_paged_attention
from tandem.runner.attention import CausalAttention, PagedAttention, build_paged_metadata
from tandem.runner.kv_cache import allocate_kv_cache
from tandem.runner.sampler import SampledToken, SamplingRow, sample

if TYPE_CHECKING:  # the runner reads the scheduler's output but never imports the engine
    from tandem.engine.scheduler import SchedulerOutput


@dataclass
class SequenceChunk:
    """One sequence's share of a forward pass."""

    token_ids: Sequence[int]  # tokens to run now
    num_computed_tokens: int  # tokens of this sequence already in the cache before them
    block_table: Sequence[int]  # blocks holding this sequence, covering all its tokens


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.block_size = block_size
        self.kv_cache = allocate_kv_cache(
            loaded.config, num_blocks, block_size, loaded.dtype, loaded.device
        )
        self.decode_kernel = (
            loaded.device.type == "cpu"
            and loaded.dtype in (torch.float32, torch.bfloat16)
            and cpu_paged_attention.load() is not None
        )
        # Requests with a seed sample from their own generator, kept across steps and
        # preemptions; the others share this one.
        self.shared_generator = torch.Generator(device=loaded.device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one scheduled step; the sampled token of each request that samples."""
        for request_id in scheduler_output.finished_ids:
            self.generators.pop(request_id, None)
        scheduled = scheduler_output.scheduled
        if not scheduled:
            return {}
        chunks = [
            SequenceChunk(s.token_ids, s.num_computed_tokens, s.block_table) for s in scheduled
        ]
        last_token_logits = self.forward(chunks)
        sampling = [i for i, s in enumerate(scheduled) if s.samples]
        if not sampling:
            return {}
        requests = [scheduled[i].request for i in sampling]
        rows = [self._sampling_row(r) for r in requests]
        logits = last_token_logits[torch.tensor(sampling, device=self.device)]
        tokens = sample(logits, rows, self.shared_generator)
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}

    def _sampling_row(self, request) -> SamplingRow:
        params = request.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self.generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self.generators[request.request_id] = generator
        banned: tuple[int, ...] = ()
        if request.num_output_tokens < params.min_tokens:
            banned = (*request.eos_token_ids, *request.stop_token_ids)
        return SamplingRow(
            params, request.prompt_token_ids, request.output_token_ids, generator, banned
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
        attn = PagedAttention(metadata, self.kv_cache, self.decode_kernel)
        hidden = self.model(input_ids, positions, attn)
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
