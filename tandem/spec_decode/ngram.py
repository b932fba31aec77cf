"""The n-gram proposer (prompt lookup): find the sequence's last n tokens earlier in
its own prompt and output, and propose what followed them there. No model, no state;
on code (repeated identifiers, boilerplate) it often guesses right."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_proposal(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` (between ``n_max`` and ``n_min`` tokens long)."""
    tokens = list(tokens)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer:
    def __init__(self, n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, items, make_row, shared_generator):
        """Drafts for each item; no draft distribution (a point mass on each guess)."""
        return [
            (ngram_proposal(item.request.all_token_ids, item.num_spec_tokens, self.n_max,
                            self.n_min), None)
            for item in items
        ]  # fmt: skip

    def rollback(self, request_id: str, num_valid_tokens: int) -> None:
        """Nothing to roll back: the proposer keeps no state."""

    def forget(self, request_id: str) -> None:
        """Nothing to forget."""
