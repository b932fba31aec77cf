"""The contract between the engine and whoever runs the model, torch-free.

Both sides import this module and nothing else of each other: the engine (and the
simulator's cost model, and ranks in other processes) speaks only these types, so a
scheduler can drive the real runner, tensor-parallel ranks or a simulated one alike.

    engine  --SchedulerOutput-->  Executor  --RunnerOutput-->  engine
            (which requests, how many tokens each, which blocks: a diff)

``RunnerInfo`` is told once, when the model is loaded and the cache sized;
``SpecDecodeStats`` counts how well speculation guessed (vLLM's definitions).
Plain data throughout: ints, strings, SamplingParams; no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.sampling import SamplingParams


class SampledToken(Protocol):
    token_id: int


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or has forgotten: preempted), sent once when
    it is admitted; afterwards only its ScheduledRequest entries say what changed."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption (recomputed now)
    sampling_params: SamplingParams
    # Banned while the output is shorter than min_tokens: EOS (unless ignored), stop ids.
    stop_token_ids: tuple[int, ...]
    grammar: str | None = None  # structured outputs (tandem/engine/grammar.py)
    cache_salt: str | None = None  # its tenant (suffix decoding keeps tenants apart)
    # A hybrid model's: the state cache slot it holds while it runs (-1: none).
    state_slot: int = -1


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, fixed when the step is scheduled. Plain data:
    the runner keeps each request's tokens and block table itself and applies this."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # tokens to run: the request's tokens [computed, computed + new)
    # Whether this chunk reaches the request's last known token, so that the logits at
    # its end give the next token (false for all but the last chunk of a prompt).
    samples: bool
    # Speculative decoding: slots (budget and KV) reserved for this many draft tokens,
    # which the runner's proposer fills in (it may find fewer).
    num_spec_tokens: int = 0
    # The block table as a diff: keep the runner's copy up to ``block_ids_from`` and
    # append ``new_block_ids`` (a new request: 0 and its whole table).
    block_ids_from: int = 0
    new_block_ids: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_new_tokens + self.num_spec_tokens


@dataclass
class SchedulerOutput:
    """One step, as the runner needs it: serialisable (ints, strings, SamplingParams)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # the runner forgets them
    # Requests that finished since the previous step: the runner drops their state.
    finished_ids: list[str] = field(default_factory=list)
    started_at: float = 0.0
    num_batched_tokens: int = 0  # kept equal to the sum over ``scheduled``

    def add(self, item: ScheduledRequest, new: NewRequestData | None = None) -> None:
        self.scheduled.append(item)
        self.num_batched_tokens += item.num_scheduled_tokens
        if new is not None:
            self.new_requests.append(new)

    def remove(self, request_id: str) -> None:
        """Take back a request's share (it was preempted after being scheduled)."""
        kept = [s for s in self.scheduled if s.request_id != request_id]
        self.num_batched_tokens = sum(s.num_scheduled_tokens for s in kept)
        self.scheduled = kept
        self.new_requests = [n for n in self.new_requests if n.request_id != request_id]


@dataclass(frozen=True)
class RunnerInfo:
    num_blocks: int  # KV blocks the runner allocated
    block_size: int
    vocab_size: int
    max_model_len: int  # the engine's context: max_model_len if set, else the model's
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    tokenizer: Any  # tandem.models.tokenizer.Tokenizer, or None for a tokenizer-less model
    generation_config: dict[str, Any] = field(default_factory=dict)  # as the folder has it
    hidden_size: int = 0  # the width of an embedding (of the final hidden states)
    # How its embeddings are read, as the folder says ({"pooling", "normalize"} or {}).
    pooling_config: dict[str, Any] = field(default_factory=dict)
    # An encoder (BERT): prompts run whole, and it makes vectors, never tokens.
    encoder: bool = False
    # Outputs of its classification head (a cross-encoder's scores); 0: none.
    num_labels: int = 0
    # Whether it writes text (an encoder and a decoder with a score head do not).
    generates: bool = True
    # A hybrid's state cache slots (runner/state_cache.py): how many sequences can run at
    # once; 0: the model has no recurrent layers.
    num_state_slots: int = 0


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
    # Embedding requests whose prompt is done: their pooled vector (PoolingParams).
    pooled: dict[str, list[float]] = field(default_factory=dict)


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


class Executor(Protocol):
    """Runs each step's forward for the engine: a worker in this process, or the
    ranks of a tensor-parallel group (tandem/executor/). The engine is handed one and
    never learns how many processes stand behind it."""

    @property
    def info(self) -> RunnerInfo: ...

    @property
    def spec_stats(self) -> SpecDecodeStats: ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...

    def close(self) -> None: ...
