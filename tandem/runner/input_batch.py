"""The runner's own copy of every running request: tokens, block table, sampling state.

The scheduler sends a request whole once (NewRequestData, when it is admitted or
resumed after a preemption) and afterwards only what changed each step (the tokens to
run, new block ids; see ScheduledRequest). The runner appends the tokens it samples
itself, so nothing is re-sent or re-copied per step. A request leaves when it
finishes or is preempted.

Invariant, after every step, for every running request: ``all_token_ids`` equals the
scheduler's ``all_token_ids``, and ``block_ids`` starts with its block table; blocks
past the table (freed after rejected drafts) are replaced when the request is next
scheduled, before anything reads them. tests/test_spec_decode.py checks this after
every step under preemption, prefix hits and speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.runner.grammar_closing import GrammarCloser, closing_vocabulary
from tandem.runner.grammar_masks import GrammarMatcher
from tandem.runner.pooling import PromptPooler
from tandem.runner.sampler import PenaltyCounts, SamplingRow, needs_penalties
from tandem.runner.thinking import ThinkingGate
from tandem.sampling import SamplingParams
from tandem.step import NewRequestData, ScheduledRequest


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    all_token_ids: list[int]  # prompt + output (kept, so no step concatenates them)
    sampling_params: SamplingParams
    stop_token_ids: tuple[int, ...]  # banned below min_tokens
    block_ids: list[int]
    generator: torch.Generator | None  # its own, when it has a seed and samples
    penalty_counts: PenaltyCounts | None  # when it has penalties: counts kept current
    grammar: GrammarMatcher | None = None  # structured outputs: where it is in its grammar
    closer: GrammarCloser | None = None  # a grammar to finish within max_tokens: its path
    thinking: ThinkingGate | None = None  # a thinking model's: its end, its budget
    pooler: PromptPooler | None = None  # an embedding request's vector, as it gathers
    cache_salt: str | None = None  # its tenant
    state_slot: int = -1  # a hybrid's slot of the state cache (runner/state_cache.py)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.penalty_counts is not None:
            self.penalty_counts.add(token_ids)
        self._advance(token_ids)

    def _advance(self, token_ids: list[int]) -> None:
        """The thinking gate, then the grammar, past accepted tokens (the grammar
        holds the answer only: it sees what follows the thinking)."""
        answer = token_ids if self.thinking is None else self.thinking.advance(token_ids)
        if self.grammar is not None and answer:
            self.grammar.consume(answer)
            if self.closer is not None:
                self.closer.advance(answer)

    def answer_grammar(self) -> GrammarMatcher | None:
        """The grammar that holds the next position: None without one, or while the
        model is still thinking."""
        if self.thinking is not None and not self.thinking.done:
            return None
        return self.grammar

    def remaining(self) -> int | None:
        """The tokens it may still write (None: max_tokens not set)."""
        most = self.sampling_params.max_tokens
        return None if most is None else most - len(self.output_token_ids)

    def forced_token(self) -> int | None:
        """The token the next position must take, or None: the thinking's end once
        its budget is spent, or once the answer's grammar needs all that is left to
        close; then the grammar's closing path (runner/grammar_closing.py)."""
        closer, remaining, thinking = self.closer, self.remaining(), self.thinking
        if thinking is None or thinking.done:
            return None if closer is None else closer.forced(remaining)
        token = thinking.forced()
        if token is None and closer is not None and remaining is not None:
            closing = closer.forced(remaining - thinking.end_left())
            token = None if closing is None else thinking.end_next()
        return token

    def speculates(self) -> bool:
        """Whether drafts may be verified for it (not while its grammar is closing)."""
        return self.closer is None or not self.closer.watching(self.remaining())

    def sampling_row(self, drafts: list[int] | tuple[int, ...] = ()) -> SamplingRow:
        """How this request samples its next token; with ``drafts``, the token after
        them (they count as output for penalties and min_tokens)."""
        params = self.sampling_params
        output = self.output_token_ids if not drafts else [*self.output_token_ids, *drafts]
        # Stops are banned below min_tokens, and while a thinking that a grammar waits
        # for goes on (the constrained answer must follow it: a required tool call).
        waiting = self.grammar is not None and self.answer_grammar() is None
        banned = self.stop_token_ids if len(output) < params.min_tokens or waiting else ()
        return SamplingRow(
            params, self.prompt_token_ids, output, self.generator, banned, self.penalty_counts
        )


class InputBatch:
    def __init__(
        self,
        device: torch.device,
        vocab_size: int,
        grammar_tokenizer: Callable[[], Any] | None = None,
        classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
        classify_reads: str = "first",
    ) -> None:
        """``grammar_tokenizer``: the vocabulary for structured outputs (built on first
        use; grammar.py). ``classify``: the model's classification head, for requests
        that score (PoolingParams' classify); None when it has none. It reads
        ``classify_reads``: the first token's row (BERT's CLS), the last one's (a
        decoder's) or the prompt's mean (runner/pooling.py)."""
        self.device = device
        self.classify = classify
        self.classify_reads = classify_reads
        self.vocab_size = vocab_size
        self.grammar_tokenizer = grammar_tokenizer
        self.requests: dict[str, RequestState] = {}
        # Seeded requests' generators live until the request finishes, across
        # preemptions, so a preempted request draws exactly what it would have drawn.
        self.generators: dict[str, torch.Generator] = {}

    def add(self, new: NewRequestData) -> None:
        """Raises for a request whose values cannot run (the runner then fails it
        alone); the input processor refuses these at the door, this guards the
        engine's own API (Engine.add takes an EngineRequest as given)."""
        params = new.sampling_params
        for name, ids in (("prompt", new.prompt_token_ids), ("stop_token_ids", new.stop_token_ids)):
            if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
                # An embedding or logit index out of range would fail the whole batch.
                raise ValueError(f"{name} holds token ids outside [0, {self.vocab_size})")
        generator = self.generators.get(new.request_id)
        if generator is None and params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.generators[new.request_id] = generator
        self.requests[new.request_id] = RequestState(
            new.request_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            [*new.prompt_token_ids, *new.output_token_ids],
            params,
            new.stop_token_ids,
            [],
            generator,
            None,
            cache_salt=new.cache_salt,
            state_slot=new.state_slot,
        )
        state = self.requests[new.request_id]
        if needs_penalties(params):
            state.penalty_counts = PenaltyCounts.of(
                new.prompt_token_ids, new.output_token_ids, self.vocab_size, self.device
            )
        if new.grammar is not None:
            if self.grammar_tokenizer is None:
                raise ValueError("structured outputs need a model with a tokenizer")
            vocabulary = self.grammar_tokenizer()
            state.grammar = GrammarMatcher(new.grammar, vocabulary)
            constraint = params.structured_outputs
            if constraint is not None and constraint.close_in_budget:
                state.closer = GrammarCloser(state.grammar.raw, closing_vocabulary(vocabulary))
        if params.pooling is not None:
            state.pooler = PromptPooler(params.pooling, self.classify, self.classify_reads)
        if params.thinking is not None:
            if max(params.thinking.end_token_ids) >= self.vocab_size:
                raise ValueError(f"thinking's end holds token ids outside [0, {self.vocab_size})")
            state.thinking = ThinkingGate(params.thinking)
        if new.output_token_ids:  # resumed after a preemption: where it was
            state._advance(list(new.output_token_ids))

    def update_blocks(self, item: ScheduledRequest) -> RequestState:
        state = self.requests[item.request_id]
        if item.new_block_ids or item.block_ids_from != len(state.block_ids):
            del state.block_ids[item.block_ids_from :]
            state.block_ids.extend(item.new_block_ids)
        return state

    def preempted(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.generators.pop(request_id, None)
