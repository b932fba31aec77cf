"""OutputProcessor: sampled tokens -> RequestOutputs, with text, logprobs and stop strings.

It owns the user-facing side of every request the engine runs: the ``n > 1`` fan-out
(one parent, n child requests ``<id>-0`` ...; reported together), incremental
detokenization, logprobs with decoded tokens, and stop strings (a match finishes the
child through ``finish_child``, dropping tokens accepted after it in the same step).

What each output carries follows the request's ``output_kind``:

    CUMULATIVE   everything so far, each step the request advances
    DELTA        only the text, tokens and logprobs new since its previous output
                 (the server streams these as they are; nothing is diffed again)
    FINAL_ONLY   one output when the request finishes; without stop strings the text
                 is not even decoded before then (batch generation pays nothing per step)

A request fails alone: when one child fails (in the runner, or here while decoding
its text) every child of its parent ends with FINISHED_ERROR (``fail_child``) and the
parent's last output carries ``error``; other parents are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.input_processor import EngineRequest
from tandem.engine.request import Request
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling import RequestOutputKind

if TYPE_CHECKING:
    from tandem.models.tokenizer import Tokenizer

logger = logging.getLogger("tandem.engine")


class SampledToken(Protocol):
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class _Sample:
    """One child request's user-facing state, and how much of it was reported."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # Detokenize as tokens arrive (stop strings, streaming) or once at the end.
    eager_text: bool = True
    num_detokenized: int = 0
    sent_text: int = 0  # characters, tokens and logprobs already reported (DELTA)
    sent_tokens: int = 0
    reported_finish: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: list[_Sample] = field(default_factory=list)
    # With prompt_logprobs: None for the first prompt token, then one entry per token
    # as the prompt's chunks are computed; reported once it is whole.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False

    @property
    def prompt_logprobs_ready(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(
            self.prompt_token_ids
        )

    @property
    def finished(self) -> bool:
        return all(s.request.status.finished for s in self.samples)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        finish_child: Callable[[Request, str, int], None],
        fail_child: Callable[[Request, str], None],
    ) -> None:
        """``finish_child(request, stop_string, num_tokens_after)`` ends a child whose
        text hit a stop string; ``fail_child(request, why)`` ends one as FINISHED_ERROR."""
        self.tokenizer = tokenizer
        self.finish_child = finish_child
        self.fail_child = fail_child
        self.parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Sample]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add_request(self, request: EngineRequest, children: list[Request]) -> None:
        params = request.params
        parent = _Parent(
            request.request_id, request.prompt, request.prompt_token_ids, params.output_kind
        )
        eager = bool(params.stop_strings) or params.output_kind != RequestOutputKind.FINAL_ONLY
        for index, child in enumerate(children):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    params.stop_strings,
                    params.skip_special_tokens,
                    params.include_stop_str_in_output,
                )
            if params.prompt_logprobs is not None:
                parent.prompt_logprobs = [None]
            sample = _Sample(child, index, detokenizer, None, None, eager)
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            parent.samples.append(sample)
            self._children[child.request_id] = (parent, sample)
        self.parents[request.request_id] = parent

    def add_prompt_logprobs(self, request_id: str, first: int, scored: list) -> None:
        """Scores of prompt tokens ``first``.. from one child's computed chunk. Kept
        once per parent: another child's, or a recompute after preemption, repeats
        positions already held."""
        parent, _ = self._children.get(request_id, (None, None))
        if parent is None or parent.prompt_logprobs is None:
            return
        held = parent.prompt_logprobs
        for position, token in enumerate(scored, start=first):
            if position == len(held):
                held.append(self._logprob_entry(token))

    def children(self, request_id: str) -> list[Request]:
        parent = self.parents.get(request_id)
        return [] if parent is None else [s.request for s in parent.samples]

    def forget(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for sample in parent.samples if parent else ():
            self._children.pop(sample.request.request_id, None)

    def process(self, updated: list[tuple[Request, list[SampledToken]]]) -> list[RequestOutput]:
        """Take each child's new tokens from a step; return the outputs due now."""
        touched: dict[str, _Parent] = {}
        errors: dict[str, str] = {}  # parent id -> why it failed here
        for request, tokens in updated:
            parent, sample = self._children[request.request_id]
            touched[parent.request_id] = parent
            try:
                self._take_tokens(sample, tokens)
            except Exception as exc:  # e.g. a token the tokenizer cannot decode
                errors[parent.request_id] = _failure(parent, exc)
        outputs = []
        for parent in touched.values():
            # Failed here, or in the runner (the scheduler set the child's error).
            error = errors.get(parent.request_id) or next(
                (s.request.error for s in parent.samples if s.request.error), None
            )
            if error is None:
                try:
                    output = self._request_output(parent, parent.finished)
                except Exception as exc:
                    error = _failure(parent, exc)
            if error is not None:
                output = self._error_output(parent, error)
            if output is not None:
                outputs.append(output)
            if output is not None and output.finished:
                self.forget(parent.request_id)
        return outputs

    def _take_tokens(self, sample: _Sample, tokens: list[SampledToken]) -> None:
        request = sample.request
        for index, token in enumerate(tokens):
            if sample.logprobs is not None:
                self._record_logprobs(sample, token)
            if sample.eager_text and self._detokenize(sample, token.token_id):
                self.finish_child(request, sample.detokenizer.matched_stop, len(tokens) - index - 1)
                break

    def _error_output(self, parent: _Parent, error: str) -> RequestOutput:
        """The failed parent's last output: every sample ends with "error" (siblings of
        the one that failed are ended too: the request is one answer)."""
        for sample in parent.samples:
            if sample.request.error is None:
                self.fail_child(sample.request, error)
        first = parent.samples[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[
                CompletionOutput(index=s.index, text="", token_ids=[], finish_reason="error")
                for s in parent.samples
            ],
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics.from_timeline(first.timeline),
            error=error,
        )

    def _detokenize(self, sample: _Sample, token_id: int) -> bool:
        """Feed one token to the detokenizer; True when a stop string just matched."""
        sample.num_detokenized += 1
        detokenizer = sample.detokenizer
        return detokenizer is not None and detokenizer.update(token_id) is not None

    def _record_logprobs(self, sample: _Sample, token: SampledToken) -> None:
        sample.logprobs.append(self._logprob_entry(token))
        sample.cumulative_logprob += token.logprob

    def _logprob_entry(self, token: SampledToken) -> dict[int, Logprob]:
        """token id -> Logprob: the top ones with their ranks, and the token itself."""
        decode = (lambda t: self.tokenizer.decode([t], False)) if self.tokenizer else lambda t: None
        entry = {
            t: Logprob(value, rank, decode(t))
            for rank, (t, value) in enumerate(token.top_logprobs or [], start=1)
        }
        if token.token_id not in entry:
            entry[token.token_id] = Logprob(token.logprob, None, decode(token.token_id))
        return entry

    def _request_output(self, parent: _Parent, finished: bool) -> RequestOutput | None:
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = [self._completion(sample, kind) for sample in parent.samples]
        if kind == RequestOutputKind.DELTA:
            completions = [c for c in completions if c is not None]
            if not completions:
                return None
        first = parent.samples[0].request
        # The first sample's metrics (all samples share one arrival); DELTA: in the
        # last output only.
        metrics = None
        if finished or kind != RequestOutputKind.DELTA:
            metrics = next(
                (c.metrics for c in completions if c.index == 0 and c.metrics is not None),
                None,
            ) or RequestMetrics.from_timeline(first.timeline)
        # What the KV connector says of a finished request (where its K/V wait).
        transfer = first.kv_transfer_output if first.status.finished else None
        prompt_logprobs = None
        if parent.prompt_logprobs_ready and not (
            kind == RequestOutputKind.DELTA and parent.sent_prompt_logprobs
        ):  # DELTA: in the first output only
            prompt_logprobs = parent.prompt_logprobs
            parent.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=metrics,
            kv_transfer_params=transfer,
            prompt_logprobs=prompt_logprobs,
            pooled=first.pooled,
        )

    def _completion(self, sample: _Sample, kind: RequestOutputKind) -> CompletionOutput | None:
        """The sample's output so far (DELTA: only what is new; None if nothing is)."""
        request = sample.request
        finished = request.status.finished
        if finished and not sample.eager_text:
            for token_id in request.output_token_ids[sample.num_detokenized :]:
                self._detokenize(sample, token_id)
        detok = sample.detokenizer
        text = detok.visible_text(finished) if detok else ""
        token_ids = request.output_token_ids
        logprobs = sample.logprobs
        if kind == RequestOutputKind.DELTA:
            finishing = finished and not sample.reported_finish
            unchanged = len(text) == sample.sent_text and len(token_ids) == sample.sent_tokens
            if unchanged and not finishing:
                return None
            start = sample.sent_tokens
            text, token_ids = text[sample.sent_text :], token_ids[start:]
            logprobs = None if logprobs is None else logprobs[start:]
            sample.sent_text += len(text)
            sample.sent_tokens += len(token_ids)
        else:
            token_ids = list(token_ids)
        sample.reported_finish = finished
        unfinished_delta = kind == RequestOutputKind.DELTA and not finished
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sample.cumulative_logprob,
            # DELTA: in the last output only (the token times grow with every step).
            metrics=None if unfinished_delta else RequestMetrics.from_timeline(request.timeline),
        )


def _failure(parent: _Parent, exc: Exception) -> str:
    """Log a parent's failure (with its traceback); returns what its output says."""
    logger.exception("request %s failed; the others go on", parent.request_id)
    return f"{type(exc).__name__}: {exc}"
