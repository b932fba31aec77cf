"""The proposer interface the runner calls, and the factory that picks one."""

from __future__ import annotations

from typing import Any, Protocol

from tandem.config import SpeculativeConfig
from tandem.models.bundled import default_draft_model


class Proposer(Protocol):
    """Guesses draft tokens for speculating requests (ngram.py, draft.py)."""

    def propose(self, items, make_row, shared_generator) -> list[tuple[list[int], Any]]:
        """Per item (a ScheduledRequest with ``num_spec_tokens``), up to that many draft
        tokens and the distributions they were drawn from ([k, vocab], or None when
        each guess is certain, as n-gram's are)."""
        ...

    def rollback(self, request_id: str, num_valid_tokens: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


def make_proposer(
    spec: SpeculativeConfig | None, target, num_blocks: int, block_size: int
) -> Proposer | None:
    if spec is None:
        return None
    if spec.method == "ngram":
        from tandem.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
    from tandem.spec_decode.draft import DraftProposer  # it builds a ModelRunner of its own

    return DraftProposer(spec.model or default_draft_model(), target, num_blocks, block_size)
