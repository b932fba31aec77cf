"""Encoder attention (BERT-family models, ModelConfig.encoder): every token attends to
every token of its own prompt, both ways, over this forward's K/V; nothing is written
to or read from the cache.

A prompt must run whole (the scheduler never cuts an encoder's prompt: a chunk could
not see the tokens after it). Sequences of one length attend as one batch, without
padding or a mask; when the whole forward is one length its tokens are used in place.

The metadata also says which segment each token is in (``token_types``: a pair's
second text is 1, as BERT's token type embeddings read it), which only encoders use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.runner.attention.metadata import StepMetadata
from tandem.runner.host_to_device import to_device


@dataclass(kw_only=True)
class EncoderMetadata(StepMetadata):
    # Per prompt length: [S, L] flat-batch token indices; None for a forward of one
    # length (its tokens are the batch as it is).
    groups: list[torch.Tensor | None]
    lengths: list[int]
    token_types: torch.Tensor | None = None  # [T]; None: every token is of segment 0


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
    lens = np.asarray(query_lens, np.int64)
    if np.any(np.asarray(num_computed, np.int64) != 0):
        raise ValueError("an encoder's prompt runs whole: none of it may be cached")
    starts = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    owner = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(int(starts[-1])) - starts[owner]
    by_length: dict[int, list[int]] = {}
    for s, length in enumerate(lens.tolist()):
        by_length.setdefault(length, []).append(s)
    groups: list[torch.Tensor | None] = [None]
    if len(by_length) > 1:
        groups = [
            to_device(torch.from_numpy(starts[members][:, None] + np.arange(length)), device)
            for length, members in by_length.items()
        ]
    types = None
    if any(second is not None for second in second_segments):
        seconds = np.array([lens[s] if x is None else x for s, x in enumerate(second_segments)])
        types = to_device(torch.from_numpy((positions >= seconds[owner]).astype(np.int64)), device)
    return EncoderMetadata(
        positions=to_device(torch.from_numpy(positions), device),
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        groups=groups,
        lengths=list(by_length),
        token_types=types,
        num_tokens=len(positions),
    )


class EncoderAttention:
    build_metadata = staticmethod(build_encoder_metadata)

    def __init__(self, metadata: EncoderMetadata, kv_cache: torch.Tensor) -> None:
        self.metadata = metadata
        self.token_types = metadata.token_types

    def attend(self, layer_idx, q, k, v, scale: float) -> torch.Tensor:
        groups = self.metadata.groups
        if groups == [None]:
            return _bidirectional(q, k, v, self.metadata.lengths[0], scale)
        out = q.new_empty(q.shape)
        for tokens, length in zip(groups, self.metadata.lengths, strict=True):
            flat = tokens.flatten()
            pick = [t.index_select(0, flat) for t in (q, k, v)]
            out.index_copy_(0, flat, _bidirectional(*pick, length, scale))
        return out


def _bidirectional(q, k, v, length: int, scale: float) -> torch.Tensor:
    """Sequences of ``length`` tokens, flattened: q [n*L, H, D], k/v [n*L, Hkv, D] ->
    [n*L, H, D], every token attending to all of its sequence."""
    h, hkv = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        *(t.reshape(-1, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)),
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.transpose(1, 2).reshape(q.shape[0], h, -1)
