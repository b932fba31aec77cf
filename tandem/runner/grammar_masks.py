"""Structured outputs on the runner's side: each request's GrammarMatcher and the
token masks built from it (the grammar itself is compiled at the door:
engine/grammar.py, whose docstring follows a constraint from end to end)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.runner.host_to_device import to_device

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer


def _llguidance():
    """The grammar library, imported on first use: a runner that never sees a
    constraint never loads it."""
    import llguidance

    return llguidance


@functools.lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    return _llguidance().LLTokenizer(
        tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The vocabulary as llguidance sees it (built once per process: ~0.2 s for a 49k
    vocabulary). ``vocab_size`` is the logits' width (may exceed the tokenizer's);
    the grammar allows ``eos_token_ids`` where it may end."""
    return _grammar_tokenizer(tokenizer.backend_json(), vocab_size, tuple(eos_token_ids))


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, grammar: str, llg_tokenizer: Any) -> None:
        self._matcher = _llguidance().LLMatcher(llg_tokenizer, grammar)
        if self._matcher.is_error():  # validated at the door; guards the engine's own API
            raise ValueError(f"the grammar does not compile: {self._matcher.get_error()}")

    @property
    def raw(self) -> Any:
        return self._matcher

    def consume(self, token_ids: list[int]) -> None:
        """Advance past tokens sampled under this grammar's masks. Once the grammar is
        complete only an end-of-sequence token was allowed, and nothing moves."""
        matcher = self._matcher
        for token in token_ids:
            if matcher.is_stopped():
                return
            if not matcher.consume_token(token):
                raise ValueError(f"the grammar refused a sampled token: {matcher.get_error()}")

    def valid_prefix(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """How many of these (draft) tokens the grammar accepts in a row from here."""
        return self._matcher.validate_tokens(list(token_ids))

    def fill_after(self, drafts: list[int], masks: torch.Tensor, first_row: int) -> None:
        """Rows first_row .. first_row + len(drafts): the allowed tokens here and after
        each draft in turn (the drafts must be a ``valid_prefix``); state unchanged."""
        matcher = self._matcher
        for i in range(len(drafts) + 1):
            row = masks[first_row + i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if i < len(drafts) and not matcher.consume_token(drafts[i]):
                raise ValueError(f"a draft token was not valid: {matcher.get_error()}")
        if drafts:
            matcher.rollback(len(drafts))


def new_masks(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32 bitmasks, every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_only(masks: torch.Tensor, row: int, token_id: int) -> None:
    """Row ``row`` of ``masks``: ``token_id`` alone allowed (a forced token)."""
    masks[row] = 0
    bit = token_id % 32
    masks[row, token_id // 32] = -(1 << 31) if bit == 31 else 1 << bit


def fill_masks(matchers: list[tuple[GrammarMatcher, int]], masks: torch.Tensor) -> None:
    """Each matcher's allowed next tokens into its row of ``masks`` (in parallel, on
    llguidance's threads)."""
    if matchers:
        width = masks.shape[1] * 4
        pairs = [(m.raw, row) for m, row in matchers]
        _executor().unsafe_compute_mask_ptr(pairs, masks.data_ptr(), width, masks.shape[0])


@functools.cache
def _executor():
    return _llguidance().LLExecutor()


_BIT = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, rows: list[int]) -> None:
    """In place: in each of ``rows`` of ``logits`` [S, vocab], the tokens the matching
    row of ``masks`` leaves out become -inf (the compiled kernel on CPU: a bit test per
    token; docs/lab-notes/serving.md has its cost beside torch's unpack and masked_fill)."""
    if not rows:
        return
    fits = logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype == torch.float32
    if fits and cpu_kernels.usable(logits):
        cpu_kernels.load().mask_rows(logits, masks, torch.tensor(rows, dtype=torch.long))
        return
    vocab = logits.shape[1]
    index = to_device(rows, logits.device)
    packed = to_device(masks[: len(rows)], logits.device)
    allowed = (packed[:, :, None] & to_device(_BIT, logits.device)) != 0
    allowed = allowed.reshape(len(rows), -1)[:, :vocab]
    selected = logits.index_select(0, index)
    logits.index_copy_(0, index, selected.masked_fill_(~allowed, float("-inf")))
