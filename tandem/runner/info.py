"""What the runner tells the engine: once, when it has loaded the model and sized the
cache (RunnerInfo), and after every step (RunnerOutput). Plain data (no tensors): the
engine sizes its block pool, validates requests and advances them without ever
importing torch or the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunnerInfo:
    num_blocks: int  # KV blocks the runner allocated
    block_size: int
    vocab_size: int
    max_model_len: int  # the engine's context: max_model_len if set, else the model's
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    tokenizer: Any  # tandem.models.tokenizer.Tokenizer, or None for a tokenizer-less model
    generation_config: dict[str, Any] = field(default_factory=dict)  # as the folder has it


@dataclass
class RunnerOutput:
    """One step's result. ``sampled``: each sampling request's new tokens (one, or with
    speculation the accepted drafts and the token after them; SampledTokens).
    ``failed``: requests that failed alone this step (request id -> why): their state
    could not be built or their sampling raised. They got no tokens, and the K/V the
    step wrote for them must not be trusted; every other request is unaffected."""

    sampled: dict[str, list[Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # Speculation: the draft tokens each request had verified (its proposer may have
    # found fewer than its slots, or none).
    drafted: dict[str, int] = field(default_factory=dict)
    # Requests that want prompt logprobs: (the prompt position of the first entry, one
    # SampledToken per prompt token from there: the token, its logprob, the top ones).
    prompt_logprobs: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)
