"""Engine: add_request / step / abort. It owns the scheduler, the block manager, the
runner and the per-request detokenizers; ``step`` is schedule, execute, update.

A request with ``n > 1`` becomes n child requests (``<id>-0`` ...) that are scheduled
independently and reported together in one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.config import EngineConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.errors import InvalidParameterError
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling import SamplingParams
from tandem.trace.recorder import StepTracer

if TYPE_CHECKING:  # the engine drives a runner; it never imports torch or model code
    from tandem.runner.model_runner import ModelRunner
    from tandem.runner.sampler import SampledToken
    from tandem.spec.stats import SpecDecodeStats

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class _Sample:
    """Engine-side state of one child request: text, logprobs."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """``runner``: anything with ``info`` (a RunnerInfo) and ``execute``; by default
        a ModelRunner that loads ``config.model`` (the one place torch enters)."""
        self.config = config
        if runner is None:
            from tandem.runner.model_runner import ModelRunner

            runner = ModelRunner.from_config(config)
        self.runner = runner
        self.model_info = info = runner.info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        cache = config.cache
        self.kv_manager = KVCacheManager(
            info.num_blocks, info.block_size, cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, self.max_model_len, config.speculative
        )
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, tuple[_Parent, _Sample]] = {}
        self.tracer: StepTracer | None = None
        # Disaggregated serving: requests waiting for their prompt's K/V from a prefill
        # instance (id -> request, (remote, local) block pairs, tokens), and how long a
        # finished prefill-only request keeps its blocks for the decode side.
        self.pending_kv: dict[str, tuple[Request, list[tuple[int, int]], int]] = {}
        self.kv_lease_seconds = 30.0

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.runner.spec_stats

    # -- tracing -----------------------------------------------------------------------

    def start_trace(self) -> None:
        """Record every step from now on (requests already queued are not drawn)."""
        self.tracer = StepTracer()

    def stop_trace(self, path: str | Path | None = None) -> StepTracer | None:
        """Stop recording; write the Chrome trace to ``path`` if given."""
        tracer, self.tracer = self.tracer, None
        if tracer is not None and path is not None:
            tracer.write(path)
        return tracer

    # -- requests --------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "this model has no tokenizer; pass prompt_token_ids"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidParameterError(
            "prompt", "must be a string, a list of token ids or {'prompt_token_ids': [...]}"
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[int]:
        """Validate and queue; on a bad request raise before anything is queued.
        Returns the prompt's token ids.

        ``kv_transfer_params`` (disaggregated serving, tandem.disagg): ``{"do_remote_decode":
        true}`` keeps the blocks under a lease when the request finishes, for a decode
        instance; ``{"remote_block_ids": [...], "remote_num_tokens": R, ...}`` parks the
        request with blocks for R prompt tokens until ``finish_remote_kv``."""
        if request_id in self._parents:
            raise InvalidParameterError("request_id", f"{request_id!r} is already in use")
        text, prompt_ids = self.tokenize_prompt(prompt)
        max_tokens = self._validate(prompt_ids, params)
        transfer = kv_transfer_params or {}
        if transfer.get("do_remote_decode") and params.n != 1:
            raise InvalidParameterError("n", "a request decoded remotely takes n = 1")
        remote_tokens = _remote_tokens(transfer, len(prompt_ids), self.kv_manager)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "must be a non-empty string")
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        parent = _Parent(request_id, text, prompt_ids)
        arrival = arrival_time or time.perf_counter()
        for index in range(params.n):
            child_params = params.for_child(index) if params.n > 1 else params
            child_id = request_id if params.n == 1 else f"{request_id}-{index}"
            request = Request(
                child_id,
                prompt_ids,
                child_params,
                self.model_info.eos_token_ids,
                arrival,
                cache_salt,
            )
            sample = _Sample(
                request, index, self._detokenizer(prompt_ids, child_params), None, None
            )
            if child_params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            parent.samples.append(sample)
        self._parents[request_id] = parent
        for sample in parent.samples:
            request = sample.request
            self._samples[request.request_id] = (parent, sample)
            if transfer.get("do_remote_decode"):
                request.lease_seconds = self.kv_lease_seconds
            if self.tracer is not None:
                self.tracer.request_arrived(request)
            if (
                remote_tokens
                and params.n == 1
                and self.kv_manager.allocate_slots(request, remote_tokens)
            ):
                table = self.kv_manager.block_table(request.request_id)
                pairs = list(zip(transfer["remote_block_ids"], table, strict=False))
                self.pending_kv[request.request_id] = (request, pairs, remote_tokens)
                continue
            self.scheduler.add_request(request)
        return prompt_ids

    def finish_remote_kv(self, request_id: str, ok: bool, recompute: bool = True) -> bool:
        """The pull for a parked request ended. On success it runs from the pulled
        tokens; on failure it recomputes its prompt here (``recompute``) or is dropped.
        Returns False when the request was dropped (failed, or aborted meanwhile)."""
        request, _, remote_tokens = self.pending_kv.pop(request_id)
        if request.status.finished:  # aborted while its blocks were being written
            self.kv_manager.free(request)
            return False
        if ok:
            request.num_computed_tokens = remote_tokens
        else:
            self.kv_manager.free(request)
            if not recompute:
                request.status = RequestStatus.FINISHED_ABORTED
                self._forget(self._samples[request_id][0])
                return False
        self.scheduler.add_request(request)
        return True

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise InvalidParameterError("prompt", "is empty")
        vocab = self.model_info.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidParameterError("prompt", f"token ids must be in [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidParameterError(
                "prompt",
                f"is {len(prompt_ids)} tokens; the context (max_model_len) is "
                f"{self.max_model_len}, leaving no room to generate",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidParameterError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
            )
        needed = self.kv_manager.blocks_needed(len(prompt_ids) + max_tokens)
        if needed > self.kv_manager.num_blocks:
            raise InvalidParameterError(
                "max_tokens",
                f"the request needs {needed} KV blocks but the cache has only "
                f"{self.kv_manager.num_blocks}; raise num_blocks or kv_cache_memory",
            )
        return max_tokens

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            params.stop_strings,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for request_id in ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            children = [s.request.request_id for s in parent.samples]
            for child in children:
                if child in self.pending_kv:  # freed when its transfer ends
                    self.pending_kv[child][0].status = RequestStatus.FINISHED_ABORTED
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            if self.tracer is not None:
                for sample in parent.samples:
                    self.tracer.request_aborted(sample.request)
            self._forget(parent)

    def _forget(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for sample in parent.samples:
            self._samples.pop(sample.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        sampled = self.runner.execute(scheduler_output)
        outputs = self._outputs(self.scheduler.update(scheduler_output, sampled))
        if self.tracer is not None:
            self.tracer.step_done(scheduler_output, self.kv_manager.num_blocks_in_use)
        return outputs

    def _outputs(self, updated: list[tuple[Request, list[SampledToken]]]) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {}
        for request, tokens in updated:
            parent, sample = self._samples[request.request_id]
            for index, token in enumerate(tokens):
                if sample.logprobs is not None:
                    self._record_logprobs(sample, token)
                stop = sample.detokenizer.update(token.token_id) if sample.detokenizer else None
                if stop is not None:
                    self._stop_at_string(request, stop, len(tokens) - index - 1)
                    break
            touched[parent.request_id] = parent
        outputs = [self._request_output(parent) for parent in touched.values()]
        for parent in touched.values():
            if parent.finished:
                self._forget(parent)
        return outputs

    def _stop_at_string(self, request: Request, stop: str, num_after: int) -> None:
        """A stop string ended in a token; tokens accepted after it in the same step
        (speculation) are dropped, as if the request had stopped there."""
        request.stop_reason = stop
        if num_after:
            request.drop_last_output_tokens(num_after)
        if request.status.finished:  # a later token also hit max_tokens or EOS
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    def _record_logprobs(self, sample: _Sample, token: SampledToken) -> None:
        decode = (lambda t: self.tokenizer.decode([t], False)) if self.tokenizer else lambda t: None
        entry = {
            t: Logprob(value, rank, decode(t))
            for rank, (t, value) in enumerate(token.top_logprobs or [], start=1)
        }
        if token.token_id not in entry:
            entry[token.token_id] = Logprob(token.logprob, None, decode(token.token_id))
        sample.logprobs.append(entry)
        sample.cumulative_logprob += token.logprob

    def _request_output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for sample in parent.samples:
            request = sample.request
            finished = request.status.finished
            detok = sample.detokenizer
            completions.append(
                CompletionOutput(
                    index=sample.index,
                    text=detok.visible_text(finished) if detok else "",
                    token_ids=list(request.output_token_ids),
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=sample.logprobs,
                    cumulative_logprob=sample.cumulative_logprob,
                    metrics=RequestMetrics.from_timeline(request.timeline),
                )
            )
        first = parent.samples[0].request
        transfer = None
        lease = self.kv_manager.leases.get(first.request_id)
        if lease is not None and first.status.finished:
            # The decode side recomputes the last prompt token (to get logits), so it
            # reads the blocks holding all tokens before it.
            num_tokens = len(parent.prompt_token_ids) - 1
            blocks = lease[0][: self.kv_manager.blocks_needed(num_tokens)]
            transfer = {
                "lease_id": first.request_id,
                "remote_block_ids": blocks,
                "remote_num_tokens": num_tokens,
            }
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=completions[0].metrics,
            kv_transfer_params=transfer,
        )


def _remote_tokens(transfer: dict[str, Any], num_prompt_tokens: int, kv) -> int:
    """How many prompt tokens' K/V a request should pull (0: none), validated."""
    if "remote_block_ids" not in transfer:
        return 0
    tokens, blocks = transfer.get("remote_num_tokens"), transfer["remote_block_ids"]
    if not isinstance(tokens, int) or not 0 <= tokens < num_prompt_tokens:
        raise InvalidParameterError(
            "kv_transfer_params.remote_num_tokens", f"must be in [0, {num_prompt_tokens})"
        )
    if not isinstance(blocks, list) or len(blocks) < kv.blocks_needed(tokens):
        raise InvalidParameterError(
            "kv_transfer_params.remote_block_ids", f"must list the blocks of {tokens} tokens"
        )
    return tokens
