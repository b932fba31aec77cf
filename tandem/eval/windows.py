"""Log-probabilities of a text's tokens, scored the way llama.cpp's ``llama-perplexity``
scores them, so that the numbers compare with its published tables.

The text's tokens are cut into ``len(tokens) // ctx`` non-overlapping windows of
``ctx`` tokens; the first token of each window is replaced by BOS when the model adds
one; each window runs as one sequence from an empty cache, and only its second half
is scored: the logits at positions ``ctx/2 .. ctx-2`` predict the tokens at
``ctx/2 + 1 .. ctx-1`` (the first half gives every scored token at least ``ctx/2``
tokens of context). A window runs in chunks of ``batch`` tokens (llama.cpp's ``-b``;
by default the whole window at once): a token attends to earlier chunks through the
KV cache, so a cache dtype's effect shows only with chunks smaller than the window
(``batch=1`` scores every token as decode does). Windows run straight through the
model runner, on blocks borrowed from the KV manager (evicting what they cached), and a
hybrid's state slot, while the engine is idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tandem.errors import InvalidParameterError
from tandem.runner.model_runner import SequenceChunk


@dataclass
class ScoredWindow:
    tokens: list[int]  # the window as run (BOS first when the model adds one)
    targets: torch.Tensor  # [n] the scored tokens
    log_probs: torch.Tensor  # [n, vocab] float32: log-softmax at the positions before them


def windows(token_ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    if ctx < 4 or ctx % 2:
        raise InvalidParameterError("ctx", f"must be an even number >= 4, got {ctx}")
    count = len(token_ids) // ctx
    if count == 0:
        raise InvalidParameterError(
            "text", f"has {len(token_ids)} tokens, fewer than one window of {ctx}"
        )
    out = []
    for i in range(count):
        window = token_ids[i * ctx : (i + 1) * ctx]
        if bos is not None:
            window = [bos, *window[1:]]
        out.append(window)
    return out


def score_windows(
    llm, token_ids: list[int], ctx: int, batch: int | None = None
) -> Iterator[ScoredWindow]:
    """Each window's scored half, in order (see the module's docstring)."""
    batch = batch or ctx
    if batch < 1:
        raise InvalidParameterError("batch", f"must be >= 1, got {batch}")
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise InvalidParameterError("model", "the engine is busy; score windows on an idle one")
    if ctx > engine.max_model_len:
        raise InvalidParameterError(
            "ctx", f"{ctx} exceeds the model's context ({engine.max_model_len})"
        )
    runner, kv = engine.executor.runner, engine.kv_manager
    needed = kv.blocks_needed(ctx)
    if needed > kv.num_blocks - kv.num_blocks_in_use:
        raise InvalidParameterError("ctx", "the KV cache cannot hold one window")
    tokenizer = engine.tokenizer
    bos = tokenizer.bos_token_id if tokenizer is not None and tokenizer.add_bos_token else None
    first = ctx // 2
    blocks = kv.borrow(needed)
    slots = engine.state_slots  # (a hybrid's: a window's states in a slot of its own)
    slot = -1 if slots is None else slots.take(WINDOW_ID)
    try:
        for window in windows(token_ids, ctx, bos):
            yield _score(runner, window, blocks, first, batch, slot)
    finally:
        kv.release_detached(blocks)
        if slots is not None:
            slots.give_back(WINDOW_ID)


# Who holds the state slot windows borrow (the engine is idle: no request holds one).
WINDOW_ID = "<perplexity window>"


def _score(
    runner, window: list[int], blocks: list[int], first: int, batch: int, slot: int = -1
) -> ScoredWindow:
    """One window from an empty cache (and empty states: it starts at position 0), in
    chunks of ``batch``: its scored half."""
    ctx, parts = len(window), []
    for start in range(0, ctx, batch):
        end = min(start + batch, ctx)
        wanted = [p - start for p in range(max(start, first), min(end, ctx - 1))]
        chunk = SequenceChunk(window[start:end], start, blocks, state_slot=slot)
        if wanted:
            parts.append(runner.forward([chunk], logit_indices=wanted).float())
        else:  # the first half: its K/V only, no LM head
            runner.hidden_states([chunk])
    log_probs = torch.cat(parts).log_softmax(dim=-1)
    return ScoredWindow(window, torch.tensor(window[first + 1 :]), log_probs)
