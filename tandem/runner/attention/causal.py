"""No cache: B sequences of L tokens each, flattened to B*L tokens, plain causal
attention (banded where a layer's sliding window is shorter than L). The naive
recompute-everything baseline and training use it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.runner.attention.metadata import sliding_causal_mask
from tandem.runner.attention.torch_sdpa import causal_attention


class CausalAttention:
    def __init__(
        self, batch_size: int, seq_len: int, layer_windows: Sequence[int | None] = ()
    ) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.layer_windows = tuple(layer_windows)
        self._masks: dict[tuple[int | None, torch.device], torch.Tensor | None] = {}

    def attend(self, layer_idx, q, k, v, scale: float, sinks=None) -> torch.Tensor:
        window = self.layer_windows[layer_idx] if self.layer_windows else None
        key = (window, q.device)
        if key not in self._masks:
            self._masks[key] = sliding_causal_mask(self.seq_len, window, q.device)
        return causal_attention(
            q, k, v, self.batch_size, self.seq_len, scale, self._masks[key], sinks=sinks
        )
