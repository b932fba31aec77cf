"""Closing a grammar before max_tokens runs out (StructuredOutputsParams.close_in_budget:
required and named tool calls). A call cut inside its arguments is no call at all, so
near the budget the runner finds a short way to finish and holds the request to it:

    R     the tokens the request may still write (max_tokens - its output)
    P     the closing path from the grammar's state: the tokens of a short way to
          finish it, then the end of sequence (``closing_path``)
    len(P) >= R    the next token is P[0], forced (P[1:] is then the path after it)
    len(P) <  R    the model samples under the grammar as usual; a sampled token t
                   after which the path no longer fits (len(P after t) > R - 1)
                   is replaced by P[0] (``fits``)

so, once the path fits when the window opens, the answer always closes within the
budget (for as long as the search below finds a path). Paths are looked for only in
the window, one per step at most (the path after the accepted token is the next
step's): the last MARGIN tokens beyond the length of the shortest whole answer (the
path from the grammar's start), ~0.5 ms a step for a JSON call on a 49k vocabulary.

The search is greedy over the grammar (llguidance): the forced tokens, then the
first closing token (quote, brace, bracket, parenthesis, newline: the ends of JSON,
Python and XML-tag formats) that the grammar accepts and that does not leave the
text free, where any text would go on (a JSON string, a parameter's free text); when
none does, the lowest-id token the grammar allows. "Free" is probed with a few
ordinary characters: a state that takes them all is inside free text.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

MARGIN = 32  # the window: the shortest whole answer's length + MARGIN tokens
MAX_PATH = 256  # give up beyond this (the request is then cut as before)
_CLOSING = "\"'}])"  # characters that end a string, an object, a list, a call
_VALUES = ("0",)  # the shortest number, tried after the closing tokens
_PROBES = ("a", "Q", "7", "#")  # ordinary characters: free text takes every one


@dataclass(frozen=True)
class ClosingVocabulary:
    closers: tuple[int, ...]  # single tokens of closing characters (longest first), "0"
    probes: tuple[int, ...]  # single-character tokens that free text accepts
    eos: int
    # A closer -> the token of its text without its first character ('" -> "): when
    # that one closes as well, the first character would be written into the text.
    tails: dict[int, int]


@functools.cache
def closing_vocabulary(llg_tokenizer: Any) -> ClosingVocabulary:
    """The tokens the search tries, for this vocabulary (built once: ~1 ms)."""

    def single(text: str) -> int | None:
        ids = llg_tokenizer.tokenize_str(text)
        return ids[0] if len(ids) == 1 else None

    texts = ["".join(p) for n in (3, 2, 1) for p in itertools.product(_CLOSING, repeat=n)]
    closers = {t: single(t) for t in [*texts, "\n", *_VALUES]}
    tails = {closers[t]: closers[t[1:]] for t in texts[: -len(_CLOSING)]}
    probes = [single(t) for t in _PROBES]
    return ClosingVocabulary(
        tuple(dict.fromkeys(t for t in closers.values() if t is not None)),
        tuple(t for t in probes if t is not None),
        llg_tokenizer.eos_token,
        {t: tail for t, tail in tails.items() if t is not None and tail is not None},
    )


def closing_path(matcher: Any, vocabulary: ClosingVocabulary, limit: int = MAX_PATH):
    """The tokens of a short way from ``matcher``'s state (llguidance's LLMatcher, left
    as it was) to the grammar's end, the end of sequence last; None when the search
    finds none within ``limit`` tokens."""
    probe = matcher.deep_copy()
    path: list[int] = []
    while len(path) < limit:
        if probe.is_accepting():
            return [*path, vocabulary.eos]
        step = probe.compute_ff_tokens() or [_next(probe, vocabulary)]
        if step[0] is None or not probe.consume_tokens(step):
            return None
        path += step
    return None


def _next(probe: Any, vocabulary: ClosingVocabulary) -> int | None:
    """The closing token to write here (see the module's docstring)."""
    fallback = None
    for token in vocabulary.closers:
        closes = _closes(probe, token, vocabulary)
        if closes is None:
            continue
        tail = vocabulary.tails.get(token)
        if closes and (tail is None or not _closes(probe, tail, vocabulary)):
            return token
        if not closes:
            fallback = fallback if fallback is not None else token
    if fallback is not None and not _inside_free_text(probe, vocabulary):
        return fallback  # opens a string the path then closes (a key, a value)
    return _lowest_allowed(probe)


def _closes(probe: Any, token: int, vocabulary: ClosingVocabulary) -> bool | None:
    """None when the grammar refuses ``token`` here; else whether the text after it
    is not free."""
    if probe.validate_tokens([token]) != 1:
        return None
    probe.consume_token(token)
    free = _inside_free_text(probe, vocabulary)
    probe.rollback(1)
    return not free


def _inside_free_text(probe: Any, vocabulary: ClosingVocabulary) -> bool:
    probes = vocabulary.probes
    return bool(probes) and all(probe.validate_tokens([t]) == 1 for t in probes)


def _lowest_allowed(probe: Any) -> int | None:
    mask = torch.frombuffer(bytearray(probe.compute_bitmask()), dtype=torch.int32)
    words = torch.nonzero(mask).flatten()
    if not len(words):
        return None
    word = int(words[0])
    bits = int(mask[word]) & 0xFFFFFFFF
    return word * 32 + (bits & -bits).bit_length() - 1


class GrammarCloser:
    """One request's way to its grammar's end within its budget (the module's
    docstring). ``advance`` takes the tokens the grammar consumes, in order."""

    def __init__(self, matcher: Any, vocabulary: ClosingVocabulary) -> None:
        self._matcher = matcher  # the request's LLMatcher (read, never moved here)
        self._vocabulary = vocabulary
        self._path = closing_path(matcher, vocabulary)  # from the current state, if known
        self._window = (len(self._path) if self._path else MAX_PATH) + MARGIN

    def advance(self, token_ids: list[int]) -> None:
        path = self._path
        if path is not None and path[: len(token_ids)] == token_ids:
            self._path = path[len(token_ids) :]
        else:
            self._path = None

    def path(self) -> list[int] | None:
        if self._path is None:
            self._path = closing_path(self._matcher, self._vocabulary)
        return self._path

    def watching(self, remaining: int | None) -> bool:
        """Whether a request with ``remaining`` tokens left is in the closing window."""
        return remaining is not None and remaining <= self._window

    def forced(self, remaining: int | None) -> int | None:
        """The next token when the path takes all that is left (or more), else None."""
        if not self.watching(remaining) or self._matcher.is_stopped():
            return None
        path = self.path()
        return path[0] if path and len(path) >= remaining else None

    def fits(self, token: int, remaining: int) -> int:
        """``token``, sampled with ``remaining`` tokens left (this one included), or the
        path's first token when the path after ``token`` would not fit in what is then
        left. Keeps the path after the token it returns."""
        path = self.path()
        if not path or token == path[0] or self._matcher.is_stopped():
            return token
        matcher = self._matcher
        if matcher.validate_tokens([token]) != 1:
            return token  # (the grammar refuses it: the request fails as before)
        matcher.consume_token(token)
        after = closing_path(matcher, self._vocabulary)
        matcher.rollback(1)
        if after is not None and len(after) <= remaining - 1:
            self._path = [token, *after]  # so that advance(token) leaves ``after``
            return token
        return path[0]
