"""Encoder attention (BERT-family models, ModelConfig.encoder): every token attends to
every token of its own prompt, both ways, over this forward's K/V; nothing is written
to or read from the cache.

A prompt must run whole (the scheduler never cuts an encoder's prompt: a chunk could
not see the tokens after it). Sequences of one length attend as one batch, without
padding or a mask; when the whole forward is one length its tokens are used in place.

The metadata also says which segment each token is in (``token_types``: a pair's
second text is 1, as BERT's token type embeddings read it), which only encoders use.
A layer with a window (ModelConfig.layer_windows(); ModernBERT's local layers) lets a
token see only the tokens within that distance on either side (a band mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.runner.attention.metadata import (
    FreshPromptGroup,
    StepMetadata,
    groups_by_length,
    host_layout,
)
from tandem.runner.attention.torch_sdpa import causal_attention
from tandem.runner.host_to_device import to_device


@dataclass(kw_only=True)
class EncoderMetadata(StepMetadata):
    groups: list[FreshPromptGroup]  # the prompts by length (metadata.groups_by_length)
    token_types: torch.Tensor | None = None  # [T]; None: every token is of segment 0
    windows: tuple[int | None, ...] = ()  # per layer: how far a token sees either side


def build_encoder_metadata(
    query_lens: Sequence[int] | np.ndarray,
    num_computed: Sequence[int] | np.ndarray,
    block_tables,
    block_size: int,
    layer_windows: Sequence[int | None] = (),
    device: torch.device | str = "cpu",
    verifying: Sequence[bool] | None = None,
    second_segments: Sequence[int | None] = (),
) -> EncoderMetadata:
    """Whole prompts of ``query_lens[s]`` tokens; ``second_segments[s]``: where prompt
    s's second text starts (None: it has one)."""
    device = torch.device(device)
    host = host_layout(query_lens, num_computed, block_tables, block_size)
    if host.num_computed.any():
        raise ValueError("an encoder's prompt runs whole: none of it may be cached")
    types = None
    if any(second is not None for second in second_segments):
        lens = host.query_lens
        seconds = np.array([lens[s] if x is None else x for s, x in enumerate(second_segments)])
        types = to_device(torch.from_numpy(host.positions >= seconds[host.owner]).long(), device)
    return EncoderMetadata(
        positions=to_device(torch.from_numpy(host.positions), device),
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        groups=groups_by_length(np.arange(len(host.query_lens)), host, device),
        token_types=types,
        windows=tuple(layer_windows),
        num_tokens=len(host.positions),
    )


class EncoderAttention:
    build_metadata = staticmethod(build_encoder_metadata)

    def __init__(self, metadata: EncoderMetadata, kv_cache: torch.Tensor) -> None:
        self.metadata = metadata
        self.token_types = metadata.token_types

    def attend(self, layer_idx, q, k, v, scale: float) -> torch.Tensor:
        groups, windows = self.metadata.groups, self.metadata.windows
        window = windows[layer_idx] if windows else None
        if len(groups) == 1:  # every prompt of one length: the batch in order, in place
            num_seqs, length = groups[0].token_index.shape
            mask = _band(length, window, q.device)
            return causal_attention(q, k, v, num_seqs, length, scale, mask, causal=False)
        out = q.new_empty(q.shape)
        for group in groups:
            num_seqs, length = group.token_index.shape
            tokens = group.token_index.flatten()
            picked = (t.index_select(0, tokens) for t in (q, k, v))
            mask = _band(length, window, q.device)
            out.index_copy_(0, tokens, causal_attention(*picked, num_seqs, length, scale, mask,
                                                        causal=False))  # fmt: skip
        return out


def _band(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[length, length] True where two positions are at most ``window`` apart; None
    when every pair is (no window, or a prompt no longer than it)."""
    if window is None or length <= window + 1:
        return None
    index = torch.arange(length, device=device)
    return (index[:, None] - index[None, :]).abs() <= window
