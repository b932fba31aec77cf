"""What the runner asks of a speculative proposer: the interface it calls each step.
The proposers (tandem/spec_decode/) implement it and the worker builds one; the
runner never imports them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.models.loader import LoadedModel
    from tandem.runner.input_batch import RequestState
    from tandem.runner.model_runner import ModelRunner
    from tandem.runner.sampler import SamplingRow

# How a request samples the token after some draft tokens (penalties, min_tokens and
# seeds see the drafts as output): the proposer draws its guesses the same way.
MakeRow = Callable[["RequestState", Sequence[int]], "SamplingRow"]
# A draft model's own runner, on the target's block ids (draft.py, eagle.py): the
# worker hands a proposer this factory rather than the proposer building a runner.
MakeDraftRunner = Callable[["LoadedModel"], "ModelRunner"]


@dataclass
class SpecItem:
    """What a proposer sees of a speculating request (Proposer.propose)."""

    request: RequestState  # its tokens (all_token_ids, num_tokens) and sampling
    num_spec_tokens: int

    @property
    def block_table(self) -> list[int]:
        """Covers every position a draft writes this step."""
        return self.request.block_ids


class Proposer(Protocol):
    """Guesses draft tokens for speculating requests (spec_decode/: ngram.py,
    suffix.py, draft.py, layer_skip.py, eagle.py). A proposer that reads the target's
    hidden states also has ``observe(chunks, hidden)``: each step's (request id,
    chunk) pairs and the final hidden states of their rows; one made of the target's
    own model has ``attach(runner)``."""

    def propose(
        self, items: list[SpecItem], make_row: MakeRow, shared_generator: torch.Generator
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per item, up to ``item.num_spec_tokens`` draft tokens and the distributions
        they were drawn from ([k, vocab], or None when each guess is certain, as
        n-gram's are)."""
        ...

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        """The target kept K/V for ``num_valid_tokens`` tokens: forget guesses past it."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted."""
        ...
