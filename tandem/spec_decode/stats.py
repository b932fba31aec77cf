"""SpecDecodeStats: how well the proposer guessed, counted as vLLM counts it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications of one request's draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def minus(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        """What was counted since ``earlier`` (a copy taken before)."""
        before = earlier.accepted_per_position
        return SpecDecodeStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [n - (before[i] if i < len(before) else 0)
             for i, n in enumerate(self.accepted_per_position)],
        )  # fmt: skip

    def copy(self) -> SpecDecodeStats:
        return self.minus(SpecDecodeStats())

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
