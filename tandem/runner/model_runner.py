"""ModelRunner: sequences' token chunks -> tensors -> one forward pass -> logits.

The runner owns the forward and sampling over a loaded model and its KV cache (the
worker loads the model and sizes the cache: tandem/worker/), and reports what the
engine needs as a ``RunnerInfo``. Which blocks a sequence uses is decided by the
engine's block manager and arrives as block tables.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem import host_memory
from tandem.models.linear import set_linear_method
from tandem.models.loader import LoadedModel
from tandem.models.moe import SparseMoE
from tandem.runner.attention import CausalAttention, build_paged_metadata, paged_backend
from tandem.runner.attention.encoder import EncoderAttention
from tandem.runner.attention.triton_paged import TritonPagedAttention
from tandem.runner.cuda_graphs import DecodeGraphs
from tandem.runner.grammar_masks import (
    allow_only,
    apply_masks,
    fill_masks,
    grammar_tokenizer,
    new_masks,
)
from tandem.runner.host_to_device import to_device
from tandem.runner.input_batch import InputBatch, RequestState
from tandem.runner.kv_cache import allocate_kv_cache
from tandem.runner.linear import linear_method_for
from tandem.runner.linear.experts import attach_fused_experts
from tandem.runner.proposing import SpecItem
from tandem.runner.rejection import verify
from tandem.runner.sampler import argmax_rows, sample, scored_tokens, unprocessed
from tandem.runner.state_cache import RecurrentBatch, StateCache
from tandem.runner.tensor_parallel import (
    TensorParallel,
    method_with_collectives,
    parallelize_embedding,
    parallelize_mixtures,
)
from tandem.step import RunnerInfo, RunnerOutput, SpecDecodeStats

logger = logging.getLogger("tandem.runner")

if TYPE_CHECKING:  # the runner reads the scheduler's output but never imports the engine
    from tandem.runner.proposing import Proposer
    from tandem.step import SchedulerOutput


@dataclass
class SequenceChunk:
    """One sequence's share of a forward pass."""

    token_ids: Sequence[int]  # tokens to run now
    num_computed_tokens: int  # tokens of this sequence already in the cache before them
    block_table: Sequence[int]  # blocks holding this sequence, covering all its tokens
    verifies: bool = False  # a decode and its draft tokens (attended as decodes are)
    second_segment: int | None = None  # an encoder's pair: where its second text starts
    state_slot: int = -1  # a hybrid's: its slot of the state cache (state_cache.py)


# Prompt positions whose logits are made at once when scoring a prompt (memory bound).
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        proposer: Proposer | None = None,
        kv_cache_dtype: str = "auto",
        tp: TensorParallel | None = None,
        cuda_graph_batch: int = 0,
        num_state_slots: int = 0,
    ) -> None:
        """``tp``: this process is one rank of a tensor-parallel group; ``loaded`` holds
        its shard (load_model's ``tensor_parallel``). ``cuda_graph_batch``: on a CUDA
        GPU, decode and verification steps of up to this many sequences replay CUDA
        graphs (cuda_graphs.py; 0: every step runs eagerly). ``num_state_slots``: a
        hybrid model's sequences that can run at once (its state cache's slots)."""
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.block_size = block_size
        self.kv_cache = allocate_kv_cache(
            loaded.config, num_blocks, block_size, loaded.dtype, loaded.device, kv_cache_dtype,
            shared_file=None if tp is None else tp.kv_file,
        )  # fmt: skip
        self.states = self.recurrent = None  # (a hybrid's: state_cache.py)
        if loaded.config.recurrent_layers:
            if num_state_slots < 1:
                raise ValueError("a hybrid model needs state slots (state_cache.py)")
            self.states = StateCache(loaded.config, num_state_slots, loaded.device)
        self.attention = (
            EncoderAttention
            if loaded.config.encoder
            else paged_backend(loaded.device, loaded.dtype, self.kv_cache.dtype)
        )

        def method_for(layer):
            return linear_method_for(layer, loaded.device, loaded.dtype)

        self.tp = tp
        if tp is not None:  # the collectives a shard needs (runner/tensor_parallel.py)
            parallelize_embedding(loaded.model, loaded.shard, tp)
            parallelize_mixtures(loaded.model, tp)
            wrap = method_with_collectives(tp, loaded.config.vocab_size)
            set_linear_method(loaded.model, lambda layer: wrap(layer, method_for(layer)))
        else:
            set_linear_method(loaded.model, method_for)
        if loaded.device.type == "cpu":
            attach_fused_experts(loaded.model)  # a mixture's packed experts, two calls a layer
            host_memory.give_back()  # the loader's freed temporaries: 55 MB on an 8B file
            host_memory.keep_large_temporaries()
        self.moe_layers = [m for m in loaded.model.modules() if isinstance(m, SparseMoE)]
        self.graphs = None
        capturable = (
            self.attention is TritonPagedAttention
            and not self.moe_layers
            and tp is None
            and self.states is None
        )
        if cuda_graph_batch > 0 and capturable and loaded.device.type == "cuda":
            self.graphs = DecodeGraphs(
                loaded.model, self.kv_cache, block_size, loaded.config.layer_windows(),
                cuda_graph_batch,
            )  # fmt: skip
        # Requests with a seed sample from their own generator (input_batch.py); the
        # others share this one.
        self.shared_generator = torch.Generator(device=loaded.device).manual_seed(seed)
        num_labels = getattr(loaded.model, "num_labels", 0)
        self.input_batch = InputBatch(
            loaded.device, loaded.config.vocab_size, self._grammar_tokenizer,
            loaded.model.classify if num_labels else None,
            getattr(loaded.model, "classify_reads", "first" if loaded.config.encoder else "last"),
        )  # fmt: skip
        # Speculative decoding: who guesses (tandem.spec_decode), and how well it guessed.
        self.proposer: Proposer | None = None
        self.use_proposer(proposer)
        self.spec_stats = SpecDecodeStats()
        self.info = RunnerInfo(
            num_blocks=num_blocks,
            block_size=block_size,
            vocab_size=loaded.config.vocab_size,
            max_model_len=loaded.config.max_position_embeddings,
            eos_token_ids=loaded.eos_token_ids,
            tokenizer=loaded.tokenizer,
            generation_config=loaded.generation_config,
            hidden_size=loaded.config.hidden_size,
            pooling_config=loaded.pooling_config,
            encoder=loaded.config.encoder,
            num_labels=num_labels,
            generates=not loaded.config.encoder and getattr(loaded.model, "generates", True),
            num_state_slots=0 if self.states is None else self.states.num_slots,
        )

    def expert_load(self) -> tuple[tuple[int, ...], ...]:
        """Tokens per expert of each mixture-of-experts layer in its last forward;
        empty for a dense model."""
        return tuple(tuple(layer.expert_load) for layer in self.moe_layers)

    def use_proposer(self, proposer: Proposer | None) -> None:
        """Speculate with ``proposer`` (runner/proposing.py's interface; the worker
        builds it: the proposers import the runner, a draft model having one of its
        own, never the reverse)."""
        self.proposer = proposer
        if hasattr(proposer, "attach"):  # a draft made of this runner's model (layer_skip)
            proposer.attach(self)

    def _grammar_tokenizer(self):
        if self.loaded.tokenizer is None:
            raise ValueError("structured outputs need a model with a tokenizer")
        return grammar_tokenizer(
            self.loaded.tokenizer, self.config.vocab_size, self.loaded.eos_token_ids
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step: the new tokens of each request that samples (one, or
        with speculation the accepted draft tokens and the one after them).

        A request whose own state or sampling raises fails alone (RunnerOutput.failed)
        and leaves the batch; only a failure of the shared forward pass (a bug, out of
        memory) propagates, and then the whole step is lost."""
        batch, result = self.input_batch, RunnerOutput()
        for request_id in scheduler_output.finished_ids:
            batch.finished(request_id)
        for request_id in scheduler_output.preempted_ids:
            batch.preempted(request_id)
        if self.proposer is not None:
            for request_id in (*scheduler_output.finished_ids, *scheduler_output.preempted_ids):
                self.proposer.forget(request_id)
        for new in scheduler_output.new_requests:
            with self._failing_alone(new.request_id, result):
                batch.add(new)
        scheduled = [
            (item, batch.update_blocks(item))
            for item in scheduler_output.scheduled
            if item.request_id not in result.failed
        ]
        if not scheduled:
            return result
        drafts = self._drafts(scheduled)
        chunks, logit_rows, position = [], [], 0
        # Prompt tokens to score: (state, flat-batch row, its position + 1, count); the
        # logits of position j score prompt token j + 1.
        prompt_spans: list[tuple[RequestState, int, int, int]] = []
        pooled = []  # (item, state, flat-batch row, count): embedding requests' chunks
        for item, state in scheduled:
            guess = drafts.get(item.request_id, ((), None))[0]
            start = item.num_computed_tokens
            tokens = state.all_token_ids[start : start + item.num_new_tokens]
            pooling = state.sampling_params.pooling
            second = None if pooling is None else pooling.second_segment
            chunks.append(
                SequenceChunk(
                    [*tokens, *guess], start, state.block_ids, bool(guess), second,
                    state.state_slot,
                )
            )  # fmt: skip
            if state.sampling_params.prompt_logprobs is not None:
                count = min(start + len(tokens), len(state.prompt_token_ids) - 1) - start
                if count > 0:
                    prompt_spans.append((state, position, start + 1, count))
            if state.pooler is not None:
                pooled.append((item, state, position, len(tokens)))
            position += len(tokens) + len(guess)
            if item.samples and state.pooler is None:  # the last token's logits, and drafts'
                logit_rows.extend(range(position - 1 - len(guess), position))
        hidden = self.hidden_states(chunks)
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:  # the EAGLE head reads the target's hidden states
            pairs = zip(scheduled, chunks, strict=True)
            observe([(item.request_id, chunk) for (item, _), chunk in pairs], hidden)
        if prompt_spans:
            self._prompt_logprobs(hidden, prompt_spans, result)
        for item, state, row, count in pooled:
            with self._failing_alone(item.request_id, result):
                state.pooler.add(hidden[row : row + count], item.num_computed_tokens)
                if item.samples:  # its prompt is done: the vector, and no token
                    result.pooled[item.request_id] = state.pooler.result()
        if logit_rows:
            logits = self.model.compute_logits(self._rows(hidden, logit_rows))
            self._new_tokens(scheduled, drafts, logits, result)
        for request_id, tokens in list(result.sampled.items()):
            with self._failing_alone(request_id, result):  # (a grammar refusing a token)
                batch.requests[request_id].append([t.token_id for t in tokens])
        return result

    @contextlib.contextmanager
    def _failing_alone(self, request_id: str, result: RunnerOutput) -> Iterator[None]:
        """Whatever raises inside fails ``request_id`` alone: recorded in ``result``, its
        state dropped (the scheduler ends it after this step)."""
        try:
            yield
        except Exception as exc:  # a bug tied to one request's values must not spread
            logger.exception("request %s failed in the runner; the others go on", request_id)
            result.failed[request_id] = f"{type(exc).__name__}: {exc}"
            self.input_batch.finished(request_id)
            if self.proposer is not None:
                self.proposer.forget(request_id)

    def _prompt_logprobs(self, hidden: torch.Tensor, spans, result: RunnerOutput) -> None:
        """Each span's prompt tokens scored by the logits before them (the raw
        distribution, as for generated tokens), with the top ones asked for. Logits are
        made PROMPT_LOGPROB_ROWS rows at a time: a whole chunk's at once would be
        tokens x vocabulary floats (2 GB for 2,048 tokens of a 262k vocabulary)."""
        for state, row, first, count in spans:  # (targets and k validated at the door)
            k = state.sampling_params.prompt_logprobs
            scored = []
            for offset in range(0, count, PROMPT_LOGPROB_ROWS):
                size = min(PROMPT_LOGPROB_ROWS, count - offset)
                logits = self.model.compute_logits(hidden[row + offset : row + offset + size])
                targets = state.prompt_token_ids[first + offset : first + offset + size]
                log_probs = torch.log_softmax(logits, dim=-1)
                scored += scored_tokens(targets, log_probs, [k] * size)
            result.prompt_logprobs[state.request_id] = (first, scored)

    def _drafts(self, scheduled) -> dict[str, tuple]:
        """The proposer's (draft tokens, draft distributions) per speculating request."""
        speculating = [
            SpecItem(state, item.num_spec_tokens)
            for item, state in scheduled
            if item.num_spec_tokens
        ]
        if not speculating:
            return {}
        proposals = self.proposer.propose(
            speculating, RequestState.sampling_row, self.shared_generator
        )
        if self.tp is not None:  # every rank proposed alike; they verify rank 0's drafts
            slots = [item.num_spec_tokens for item in speculating]
            proposals = self.tp.rank0_drafts(proposals, slots)
        drafts = {}
        for item, (guess, guess_probs) in zip(speculating, proposals, strict=True):
            state, valid = item.request, len(guess)
            if not state.speculates():  # its grammar is closing: a token at a time
                valid = 0
            elif state.thinking is not None:  # below the budget, and inside the thinking
                valid = state.thinking.drafts_allowed(guess, state.grammar is not None)
            grammar = state.answer_grammar()
            if grammar is not None and valid:  # cut at the first token the grammar refuses
                valid = grammar.valid_prefix(guess[:valid])
            if valid < len(guess):
                guess = guess[:valid]
                guess_probs = None if guess_probs is None else guess_probs[:valid]
            drafts[state.request_id] = (guess, guess_probs)
        return drafts

    def _new_tokens(self, scheduled, drafts, logits, result: RunnerOutput) -> None:
        """Sample the plain rows in one batch; verify each speculating request's drafts.
        ``logits`` holds, in order, one row per plain request and 1 + k per speculating
        one. Tokens go to ``result.sampled``, requests that raise to ``result.failed``."""
        plain, plain_rows, speculating, row = [], [], [], 0
        for item, state in scheduled:
            if not item.samples or state.pooler is not None:
                continue
            guess, guess_probs = drafts.get(item.request_id, ((), None))
            if not guess:
                plain.append(state)
                plain_rows.append(row)
                row += 1
                continue
            first, row = row, row + len(guess) + 1
            with self._failing_alone(item.request_id, result):
                grammar = state.answer_grammar()
                if grammar is not None:  # each position under the drafts before it
                    masks = new_masks(len(guess) + 1, self.config.vocab_size)
                    grammar.fill_after(list(guess), masks, 0)
                    apply_masks(logits[first:row], masks, list(range(len(guess) + 1)))
                rows = [state.sampling_row(guess[:i]) for i in range(len(guess) + 1)]
                speculating.append((item, guess, guess_probs, first, rows))

        # Greedy rows whose logits nothing changes take their argmax in one batch: one
        # host sync for every speculating request, not one a request.
        def plain_greedy(rows) -> bool:
            return rows[0].params.greedy and all(map(unprocessed, rows))

        targets = None
        if any(plain_greedy(rows) for *_, rows in speculating):
            targets = argmax_rows(logits).tolist()
        for item, guess, guess_probs, first, rows in speculating:
            with self._failing_alone(item.request_id, result):
                own = targets[first : first + len(rows)] if plain_greedy(rows) else None
                tokens = verify(
                    logits[first : first + len(rows)], rows, list(guess), guess_probs,
                    self.shared_generator, own,
                )  # fmt: skip
                result.sampled[item.request_id] = tokens
                if self.states is not None:  # its states after the last accepted token
                    slot = self.input_batch.requests[item.request_id].state_slot
                    self.recurrent.keep(slot, len(tokens))
                result.drafted[item.request_id] = len(guess)
                self.spec_stats.record(len(guess), len(tokens) - 1)
                self.proposer.rollback(item.request_id, item.num_computed_tokens + len(tokens))
        if not plain:
            return
        if len(plain_rows) != len(logits):  # else every row, in order: no copy
            logits = logits[to_device(plain_rows, self.device)]
        # Thinking past its budget, a grammar closing within max_tokens: forced tokens.
        forced = [(i, state.forced_token()) for i, state in enumerate(plain)]
        forced = [(i, token) for i, token in forced if token is not None]
        held = {i for i, _ in forced}
        grammars = [(i, state.answer_grammar()) for i, state in enumerate(plain)]
        constrained = [(i, g) for i, g in grammars if g is not None and i not in held]
        if constrained or forced:
            masks = new_masks(len(constrained) + len(forced), self.config.vocab_size)
            fill_masks([(grammar, j) for j, (_, grammar) in enumerate(constrained)], masks)
            for j, (_, token) in enumerate(forced, start=len(constrained)):
                allow_only(masks, j, token)
            apply_masks(logits, masks, [i for i, _ in constrained + forced])
        try:
            tokens = sample(
                logits, [state.sampling_row() for state in plain], self.shared_generator
            )
        except Exception:  # find the culprit: each row alone (a seeded row may then draw
            tokens = None  # differently than undisturbed; the alternative fails them all)
        for i, state in enumerate(plain):
            with self._failing_alone(state.request_id, result):
                row_logits = logits[i : i + 1]
                if tokens is None:
                    token = sample(row_logits, [state.sampling_row()], self.shared_generator)[0]
                else:
                    token = tokens[i]
                if state.closer is not None and i not in held:
                    token = self._closing_fit(state, token, row_logits)
                result.sampled[state.request_id] = [token]

    def _closing_fit(self, state: RequestState, token, row_logits: torch.Tensor):
        """``token`` sampled freely for a request whose grammar must close within its
        budget, or, when the way to close no longer fits after it, the closing path's
        first token instead (drawn from the row held to it, so its logprobs agree)."""
        remaining = state.remaining()
        if state.answer_grammar() is None or not state.closer.watching(remaining):
            return token
        closing = state.closer.fits(token.token_id, remaining)
        if closing == token.token_id:
            return token
        masks = new_masks(1, self.config.vocab_size)
        allow_only(masks, 0, closing)
        apply_masks(row_logits, masks, [0])
        return sample(row_logits, [state.sampling_row()], self.shared_generator)[0]

    @torch.inference_mode()
    def forward(
        self,
        chunks: Sequence[SequenceChunk],
        all_logits: bool = False,
        logit_indices: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits of each chunk's last token [S, vocab], of every token [T, vocab], or of
        the tokens at ``logit_indices`` in the flat batch."""
        hidden = self.hidden_states(chunks)
        if not all_logits:
            if logit_indices is None:
                ends = itertools.accumulate(len(c.token_ids) for c in chunks)
                logit_indices = [end - 1 for end in ends]
            hidden = self._rows(hidden, logit_indices)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def hidden_states(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """The model over the chunks' tokens as one flat batch -> final hidden states
        [T, hidden] (K/V written to the cache)."""
        graphs = self.graphs
        # (a layer-skipping draft runs the model with layers left out: not the graph's)
        if (
            graphs is not None
            and not getattr(self.model, "skipped_layers", ())
            and graphs.fits([c.token_ids for c in chunks], [c.verifies for c in chunks])
        ):
            return graphs.run(
                [c.token_ids for c in chunks],
                [c.num_computed_tokens for c in chunks],
                [c.block_table for c in chunks],
            )
        input_ids = to_device([t for c in chunks for t in c.token_ids], self.device, torch.long)
        return self._run(
            input_ids,
            [len(c.token_ids) for c in chunks],
            [c.num_computed_tokens for c in chunks],
            [c.block_table for c in chunks],
            [c.verifies for c in chunks],
            max(c.num_computed_tokens + len(c.token_ids) for c in chunks),
            [c.second_segment for c in chunks] if self.config.encoder else None,
            [c.state_slot for c in chunks],
        )

    @torch.inference_mode()
    def decode_logits(
        self, token_ids: torch.Tensor, num_computed: np.ndarray, block_tables: np.ndarray
    ) -> torch.Tensor:
        """One decode token for each of S sequences, from arrays (a static batch of
        thousands, with no Python object per sequence; runner/static_batch.py): token
        ids [S] on the device (the last step's argmax: no trip through the host),
        ``num_computed`` int64 [S], ``block_tables`` int64 [S, >= blocks in use], every
        entry a block of the cache -> logits [S, vocab]. Eager (no graph). A hybrid's
        sequence s holds state slot s."""
        hidden = self._run(
            token_ids,
            np.ones(len(num_computed), np.int64),
            num_computed,
            block_tables,
            None,
            int(num_computed.max()) + 1,
            None,
            range(len(num_computed)) if self.states is not None else (),
        )
        return self.model.compute_logits(hidden)

    def _run(
        self, input_ids, query_lens, num_computed, block_tables, verifies, context,
        second_segments=None, state_slots=(),
    ):  # fmt: skip
        """The model over a flat batch (``hidden_states``' and ``decode_logits``'
        arguments for the attention metadata; ``second_segments``: an encoder's pairs,
        None for any other model; ``state_slots``: a hybrid's sequences' slots) -> final
        hidden states [T, hidden]."""
        build = getattr(self.attention, "build_metadata", build_paged_metadata)
        pairs = {} if second_segments is None else {"second_segments": second_segments}
        metadata = build(
            query_lens,
            num_computed,
            block_tables,
            self.block_size,
            self.config.layer_windows(),
            self.device,
            verifies,
            **pairs,
        )
        if self.device.type == "cpu":
            host_memory.for_forward(len(input_ids), context)
        attn = self.attention(metadata, self.kv_cache)
        if self.states is not None:  # (kept: verification keeps its accepted states)
            attn.recurrent = self.recurrent = RecurrentBatch.build(
                self.states, query_lens, num_computed, state_slots, self.device, verifies
            )
        return self.model(input_ids, metadata.positions, attn)

    def _rows(self, hidden: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
        """hidden[indices]; every row in order needs no gather (the same count in
        another order does)."""
        if len(indices) == len(hidden) and all(i == row for row, i in enumerate(indices)):
            return hidden
        return hidden[to_device(indices, self.device)]


def forward_no_cache(loaded: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Full causal forward over [B, L] token ids, no cache -> logits [B, L, vocab]."""
    batch, length = input_ids.shape
    positions = torch.arange(length, device=input_ids.device).repeat(batch)
    attn = CausalAttention(batch, length, loaded.config.layer_windows())
    if loaded.config.recurrent_layers:
        attn.recurrent = RecurrentBatch.fresh(loaded.config, batch, length, input_ids.device)
    hidden = loaded.model(input_ids.flatten(), positions, attn)
    return loaded.model.compute_logits(hidden).view(batch, length, -1)
