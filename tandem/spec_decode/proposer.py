"""The proposer interface the runner calls, and the factory that picks one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from tandem.config import SpeculativeConfig
from tandem.models.catalog import default_draft_model

if TYPE_CHECKING:
    import torch

    from tandem.runner.input_batch import RequestState
    from tandem.runner.model_runner import SpecItem
    from tandem.runner.sampler import SamplingRow

# How a request samples the token after some draft tokens (penalties, min_tokens and
# seeds see the drafts as output): the proposer draws its guesses the same way.
MakeRow = Callable[["RequestState", Sequence[int]], "SamplingRow"]


class Proposer(Protocol):
    """Guesses draft tokens for speculating requests (ngram.py, suffix.py, draft.py,
    layer_skip.py, eagle.py). A proposer that reads the target's hidden states also
    has ``observe(chunks, hidden)``: each step's (request id, chunk) pairs and the
    final hidden states of their rows."""

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


def make_proposer(
    spec: SpeculativeConfig | None, target, num_blocks: int, block_size: int, tp=None
) -> Proposer | None:
    """``tp``: the target is a tensor-parallel rank's shard (an EAGLE head borrows
    rows of its vocabulary from every rank)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        from tandem.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    if spec.method == "suffix":
        from tandem.spec_decode.suffix import SuffixProposer

        return SuffixProposer()
    if spec.method == "layer_skip":  # the target minus some layers, on its own runner
        from tandem.spec_decode.layer_skip import LayerSkipProposer

        return LayerSkipProposer(target, spec.skip_layers)
    if spec.method == "eagle":  # a trained head over the target's hidden states
        from tandem.spec_decode.eagle import EagleProposer

        return EagleProposer(spec.model, target, num_blocks, block_size, tp)
    from tandem.spec_decode.draft import DraftProposer  # it builds a ModelRunner of its own

    return DraftProposer(spec.model or default_draft_model(), target, num_blocks, block_size)
