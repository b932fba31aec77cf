"""One request's thinking, as the runner holds it (SamplingParams.thinking): where the
thinking ends, the budget that ends it, and the hand-over to the answer's grammar.

    output  [thinking tokens ...] [end token ids] [answer tokens ...]
                                  ^ forced, a token at a time, once ``budget``
                                    thinking tokens are written
            the grammar (structured outputs) sees the answer tokens only

The gate keeps no history but a count and the tail it needs: ``advance`` takes each
accepted token in order (a resumed request's output replays through it), so its state
is a function of the output alone.
"""

from __future__ import annotations

from tandem.sampling import ThinkingParams


class ThinkingGate:
    def __init__(self, params: ThinkingParams) -> None:
        self.end = params.end_token_ids
        self.budget = params.budget
        self.count = 0  # output tokens written inside the thinking (the end's included)
        self.done = False  # the end was written: what follows is the answer
        self._tail: list[int] = []  # the last len(end) - 1 tokens, to find the end

    def advance(self, token_ids: list[int]) -> list[int]:
        """Take accepted tokens; returns those that belong to the answer."""
        for i, token in enumerate(token_ids):
            if self.done:
                return token_ids[i:]
            self.count += 1
            self._tail.append(token)
            if token == self.end[-1] and tuple(self._tail[-len(self.end) :]) == self.end:
                self.done = True
            del self._tail[: -(len(self.end) - 1) or None]
        return []

    def forced(self) -> int | None:
        """The token the next position must take (the budget is spent: the next token
        of the end, after what of it is already written), or None."""
        if self.done or self.budget is None or self.count < self.budget:
            return None
        return self.end_next()

    def end_next(self) -> int:
        """The end's next token (after what of it the output already ends with)."""
        return self.end[self._end_written()]

    def end_left(self) -> int:
        """How many of the end's tokens are still to write."""
        return len(self.end) - self._end_written()

    def _end_written(self) -> int:
        """How many of the end's first tokens the output ends with."""
        for size in range(min(len(self.end) - 1, len(self._tail)), 0, -1):
            if tuple(self._tail[-size:]) == self.end[:size]:
                return size
        return 0

    def drafts_allowed(self, drafts: list[int] | tuple[int, ...], constrained: bool) -> int:
        """How many of these draft tokens can be verified as free thinking: every
        position up to the one after them samples below the budget, and, when a
        grammar waits for the answer (``constrained``), none of them ends the
        thinking (the positions after the end would need the grammar's masks)."""
        if self.done:
            return len(drafts)
        allowed = len(drafts)
        if self.budget is not None:
            allowed = min(allowed, max(self.budget - self.count - 1, 0))
        if constrained:
            for i, token in enumerate(drafts[:allowed]):
                if token == self.end[-1]:
                    return i
        return allowed
