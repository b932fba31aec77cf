"""No cache: B sequences of L tokens each, flattened to B*L tokens, plain causal
attention. The naive recompute-everything baseline and training use it."""

from __future__ import annotations

import torch

from tandem.runner.attention.torch_sdpa import causal_attention


class CausalAttention:
    def __init__(self, batch_size: int, seq_len: int, sliding_window: int | None = None) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.mask = None
        if sliding_window is not None and seq_len > sliding_window:
            pos = torch.arange(seq_len)
            self.mask = (pos[None, :] <= pos[:, None]) & (
                pos[None, :] > pos[:, None] - sliding_window
            )

    def attend(self, layer_idx, q, k, v, scale: float) -> torch.Tensor:
        mask = None if self.mask is None else self.mask.to(q.device)
        return causal_attention(q, k, v, self.batch_size, self.seq_len, scale, mask)
