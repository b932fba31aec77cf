"""An embedding request's vector (SamplingParams.pooling), gathered from the final
hidden states of its prompt as its chunks run: the last token's, the running mean, or
the first token's; cut to its dimensions and normalised when the prompt is done."""

from __future__ import annotations

import torch

from tandem.sampling import PoolingParams


class PromptPooler:
    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self._kept: torch.Tensor | None = None  # last / cls: the row; mean: the sum
        self._count = 0

    def add(self, rows: torch.Tensor, first_position: int) -> None:
        """A chunk's final hidden states [tokens, hidden]; its first token is at
        ``first_position`` of the prompt."""
        kind = self.params.pooling
        if kind == "last":
            self._kept = rows[-1].float()
        elif kind == "cls":
            if first_position == 0:
                self._kept = rows[0].float()
        else:
            total = rows.sum(dim=0, dtype=torch.float32)  # (no float copy of the chunk)
            self._kept = total if self._kept is None else self._kept + total
            self._count += rows.shape[0]

    def result(self) -> list[float]:
        """The vector, once every prompt token was added."""
        if self._kept is None:
            raise ValueError("no prompt token was pooled")
        vector = self._kept / self._count if self.params.pooling == "mean" else self._kept
        if self.params.dimensions is not None:
            if self.params.dimensions > vector.shape[0]:
                raise ValueError(f"dimensions exceeds the model's {vector.shape[0]}")
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()
