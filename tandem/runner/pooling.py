"""An embedding request's vector (SamplingParams.pooling), gathered from the final
hidden states of its prompt as its chunks run: the last token's, the running mean, or
the first token's; cut to its dimensions and normalised when the prompt is done. A
``classify`` request keeps the rows the model's head reads (``classify_reads``: the
first token's, an encoder's CLS; the last one's, a decoder's; or the prompt's mean)
and runs the head over them (``classify``: rows [N, hidden] -> logits [N, labels])."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.sampling import PoolingParams


class PromptPooler:
    def __init__(
        self,
        params: PoolingParams,
        classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
        classify_reads: str = "first",
    ) -> None:
        if params.pooling == "classify" and classify is None:
            raise ValueError("this model has no classification head: it embeds, it does not score")
        self.params = params
        self.classify = classify
        # What is kept, as the pooling kinds keep it: the head's rows are one of them.
        self.kind = params.pooling
        if self.kind == "classify":
            self.kind = {"first": "cls", "last": "last", "mean": "mean"}[classify_reads]
        self._dtype: torch.dtype | None = None  # the rows' (the head reads its dtype)
        self._kept: torch.Tensor | None = None  # last / cls / classify: the row; mean: sum
        self._count = 0

    def add(self, rows: torch.Tensor, first_position: int) -> None:
        """A chunk's final hidden states [tokens, hidden]; its first token is at
        ``first_position`` of the prompt."""
        kind, self._dtype = self.kind, rows.dtype
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
        if self.params.pooling == "classify":
            rows = self._kept / self._count if self.kind == "mean" else self._kept
            logits = self.classify(rows[None].to(self._dtype))[0]
            if not self.params.normalize:
                return logits.tolist()
            if logits.shape[0] == 1:
                return torch.sigmoid(logits).tolist()
            return torch.softmax(logits, dim=0).tolist()
        vector = self._kept / self._count if self.kind == "mean" else self._kept
        if self.params.dimensions is not None:
            if self.params.dimensions > vector.shape[0]:
                raise ValueError(f"dimensions exceeds the model's {vector.shape[0]}")
            vector = vector[: self.params.dimensions]
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()
