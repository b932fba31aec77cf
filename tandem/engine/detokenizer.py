"""Incremental detokenization and stop strings for one request.

Decoding token by token is wrong for byte-level tokenizers: a multi-byte character
can be split over tokens, and some tokenizers change a token's text depending on its
neighbours. So each step decodes a short window twice (the tokens already printed,
and the same plus the new ones) and emits the difference; while the tail decodes to
U+FFFD (an incomplete character) nothing is emitted.

Stop strings end generation and are not part of the output. While streaming, the last
``len(longest stop string) - 1`` characters are held back, since they might be the start
of a stop string; when the request ends without one they are released, not lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer

# Tokens of context decoded before the new ones; enough for any merge-sensitive decoder.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.text = ""  # the output text so far (stop string removed once matched)
        self.matched_stop: str | None = None
        self._hold = max((len(s) for s in stop), default=1) - 1

    def update(self, token_id: int) -> str | None:
        """Add one generated token; returns the stop string if one just matched."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self.tokens[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = decode(self.tokens[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing complete yet
        new_text = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        search_from = max(0, len(self.text) - self._hold)
        self.text += new_text
        return self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> str | None:
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self.include_stop else index
                self.text = self.text[:end]
                self.matched_stop = stop
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished, else minus the held tail."""
        if finished or self.matched_stop is not None or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]
