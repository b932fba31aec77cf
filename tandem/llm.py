"""LLM: the offline batch API, with vLLM's names.

from tandem import LLM, SamplingParams
llm = LLM(model="path/to/folder", max_num_batched_tokens=512)
outputs = llm.generate(["Hello", "The KV cache"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from tandem.config import EngineConfig
from tandem.engine.engine import Engine, PromptInput
from tandem.errors import InvalidParameterError, TandemError
from tandem.executor import make_executor
from tandem.models.catalog import default_model
from tandem.models.hub import parse_hub_id, resolve
from tandem.outputs import EmbeddingOutput, RequestOutput, relevance, similarity
from tandem.sampling import (
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
    model_pooling_defaults,
    model_sampling_defaults,
)
from tandem.trace.recorder import EngineTracing

Conversation = list[dict[str, Any]]
logger = logging.getLogger("tandem")


class LLM:
    def __init__(
        self,
        model: str | None = None,
        trace: str | None = None,
        revision: str | None = None,
        **engine_options: Any,
    ) -> None:
        """``model``: a local Hugging Face folder or GGUF file, a Hugging Face id
        (``org/repo``, ``org/repo:Q4_K_M``; ``revision``: its branch, tag or commit),
        or a catalog name; the default model when omitted. ``trace``: record every step
        and write a Chrome trace there after each call."""
        model = model if model is not None else default_model()
        if parse_hub_id(model) is not None:
            model = str(resolve(model, revision))
        config = EngineConfig.from_kwargs(model, **engine_options)
        self.engine = Engine(config, make_executor(config))
        self._ids = itertools.count()
        self.tracing = EngineTracing(self.engine)
        self.trace_path = trace
        if trace is not None:
            self.tracing.start()

    def start_trace(self) -> None:
        """Record the steps of the following calls (see tandem.trace)."""
        self.tracing.start()

    def stop_trace(self, path: str) -> None:
        """Stop recording and write the Chrome trace-event file to ``path``."""
        self.tracing.stop(path)
        self.trace_path = None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's recommended sampling (its generation_config.json), with
        ``overrides`` on top; what ``generate`` uses when given no params."""
        defaults = model_sampling_defaults(self.engine.model_info.generation_config)
        return SamplingParams(**{**defaults, **overrides})

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Every prompt is validated before any is
        queued, so one bad prompt fails the call without leaving work behind. A request
        that fails inside the engine fails alone: its output has ``error`` (and the
        finish reason "error"), the others complete."""
        prompts = _prompt_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidParameterError(
                "sampling_params", f"{len(params)} given for {len(prompts)} prompts"
            )
        # Batch generation reads only the end: no per-step outputs, text decoded once.
        final_only = RequestOutputKind.FINAL_ONLY
        params = [dataclasses.replace(p, output_kind=final_only) for p in params]
        return self._run(self._add(prompts, params), use_tqdm)

    def _add(self, prompts: list[PromptInput], params: list[SamplingParams]) -> list[str]:
        """Queue the requests, each validated before any is queued; their ids."""
        request_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        processed = [
            self.engine.input_processor.process(request_id, prompt, p)
            for request_id, prompt, p in zip(request_ids, prompts, params, strict=True)
        ]
        for request in processed:
            self.engine.add(request)
        return request_ids

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingOutput]:
        """Each prompt's vector, in order (``pooling_params``: how it is read; the
        model's own settings when omitted). Prompts run through the same scheduler as
        generation, batched with whatever else runs."""
        prompts = _prompt_list(prompts)
        pooling = pooling_params or model_pooling_defaults(self.engine.model_info.pooling_config)
        params = SamplingParams(
            max_tokens=1, pooling=pooling, output_kind=RequestOutputKind.FINAL_ONLY
        )
        outputs = self._run(self._add(prompts, [params] * len(prompts)), use_tqdm)
        for output in outputs:
            if output.error is not None or output.pooled is None:
                raise TandemError(f"embedding {output.request_id} failed: {output.error}")
        return [EmbeddingOutput(o.request_id, o.prompt_token_ids, o.pooled) for o in outputs]

    def score(
        self, text_1: PromptInput, text_2: Sequence[PromptInput], use_tqdm: bool = True
    ) -> list[float]:
        """How well each of ``text_2`` answers ``text_1``, as vLLM scores: with a
        cross-encoder (a model with a classification head) the head's score of each
        pair read together; with an embedding model the cosine similarity of the two
        texts' normalised embeddings."""
        if self.engine.model_info.num_labels:
            pairs = [{"prompt": text_1, "prompt_pair": other} for other in text_2]
            scored = self.embed(pairs, PoolingParams("classify"), use_tqdm)
            return [relevance(output.embedding) for output in scored]
        pooling = dataclasses.replace(
            model_pooling_defaults(self.engine.model_info.pooling_config), normalize=True
        )
        first, *others = self.embed([text_1, *text_2], pooling, use_tqdm)
        return [similarity(first.embedding, other.embedding) for other in others]

    def stream(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding what is new each step (text, tokens; the
        last output has ``finished``). Stopping the iteration aborts the request."""
        params = sampling_params or self.get_default_sampling_params()
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        request_id = request_id or f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort(request_id)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidParameterError("messages", "this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode_chat(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    **(chat_template_kwargs or {}),
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        start = time.perf_counter()
        output_tokens = 0
        try:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        if output.error is not None:
                            logger.warning("request %s failed: %s", output.request_id, output.error)
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"{output_tokens / elapsed:.1f} out tok/s")
                        bar.update(1)
        except BaseException:
            self.engine.abort(list(pending))
            raise
        finally:
            bar.close()
            if self.trace_path is not None and self.tracing.tracer is not None:
                self.tracing.tracer.write(self.trace_path)
        return [finished[request_id] for request_id in request_ids]


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, token ids, or a dict) or several, as a list."""
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
