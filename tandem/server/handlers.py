"""The completion handlers behind the routes: queue an HTTP request's prompts on the
engine, then stream its outputs as OpenAI chunks or gather them into one response;
a client that goes away aborts its engine requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.errors import InvalidParameterError
from tandem.outputs import RequestOutput
from tandem.sampling import RequestOutputKind, SamplingParams
from tandem.server.errors import APIError, as_api_error
from tandem.server.reasoning import ThinkParser
from tandem.server.responses import ChoiceStream, Echo
from tandem.server.tool_calls import ToolCalling
from tandem.serving.engine_client import EngineClient


class CompletionHandler:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def serve(
        self,
        request: Request,
        id_prefix: str,
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        chat: bool,
        kv_transfer_params: dict[str, Any] | None = None,
        continuous_usage: bool = False,
        echo: bool = False,
        drop_generated: bool = False,
        tools: ToolCalling | None = None,
        reasoning: ThinkParser | None = None,
        events: Callable[[AsyncIterator[dict[str, Any] | APIError]], AsyncIterator[str]]
        | None = None,
    ):
        """``include_usage``: a last stream chunk with the usage; ``continuous_usage``:
        also the usage so far in every chunk (vLLM's continuous_usage_stats);
        ``events``: how a stream's chunks go out (default: OpenAI's server-sent
        events; the Responses and Messages APIs pass their own)."""
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # A stream sends what is new each step; a response needs only the end.
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(params, output_kind=kind)
        if kv_transfer_params is not None and len(prompts) != 1:
            raise InvalidParameterError("kv_transfer_params", "takes a single prompt")
        outputs: asyncio.Queue = asyncio.Queue()
        engine_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        await add_requests(self.engine, engine_ids, prompts, params, outputs, kv_transfer_params)
        state = ChoiceStream(
            response_id,
            self.model_name,
            int(time.time()),
            engine_ids,
            params.n,
            chat,
            want_logprobs=params.logprobs is not None,
            echo=Echo(self._decode, drop_generated) if echo else None,
            tools=tools,
            reasoning=reasoning,
        )
        if stream:
            chunks = self._chunks(state, outputs, engine_ids, include_usage, continuous_usage)
            return StreamingResponse((events or _sse)(chunks), media_type="text/event-stream")
        return await until_disconnect(request, self._collect(state, outputs, engine_ids))

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.info.tokenizer
        return tokenizer.decode(token_ids, False) if tokenizer is not None else ""

    async def _collect(self, state: ChoiceStream, outputs: asyncio.Queue, engine_ids: list[str]):
        transfer = None
        async for output in next_outputs(self.engine, outputs, engine_ids):
            state.update(output)
            transfer = output.kv_transfer_params or transfer
        response = state.final_response()
        if transfer is not None:
            # A prefill instance's answer: where the decode side reads the prompt's K/V.
            response["kv_transfer_params"] = transfer
        return response

    async def _chunks(
        self,
        state: ChoiceStream,
        outputs: asyncio.Queue,
        engine_ids: list[str],
        include_usage: bool,
        continuous_usage: bool,
    ) -> AsyncIterator[dict[str, Any] | APIError]:
        """A stream's chunks; if the request fails midway, its error last."""

        def with_usage(chunk: dict[str, Any]) -> dict[str, Any]:
            return {**chunk, "usage": state.usage()} if continuous_usage else chunk

        try:
            roles_sent = not state.chat
            async for output in next_outputs(self.engine, outputs, engine_ids):
                if not roles_sent:  # with the first output, as vLLM: the prompt is counted
                    state.note_prompt(output)
                    for index in range(state.num_choices):
                        yield with_usage(state.role_chunk(index))
                    roles_sent = True
                for index, delta in state.update(output):
                    chunk = state.chunk(index, delta)
                    if chunk is not None:
                        yield with_usage(chunk)
            if include_usage:
                yield state.usage_chunk()
        except Exception as exc:
            yield as_api_error(exc)


async def add_requests(
    engine: EngineClient,
    engine_ids: list[str],
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    outputs: asyncio.Queue,
    kv_transfer_params: dict[str, Any] | None = None,
) -> None:
    """Queue one engine request a prompt, their outputs to ``outputs``; if one is
    refused, those already queued are aborted and the refusal raised."""
    added: list[str] = []
    try:
        for engine_id, prompt in zip(engine_ids, prompts, strict=True):
            await engine.add_request(engine_id, prompt, params, outputs, kv_transfer_params)
            added.append(engine_id)
    except BaseException:
        for engine_id in added:
            engine.abort(engine_id)
        raise


async def next_outputs(
    engine: EngineClient, outputs: asyncio.Queue, engine_ids: list[str]
) -> AsyncIterator[RequestOutput]:
    """RequestOutputs of one HTTP request's engine requests until all finish; aborts
    the unfinished ones if the consumer goes away (disconnect, error)."""
    pending = set(engine_ids)
    try:
        while pending:
            item = await outputs.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                pending.discard(item.request_id)
            yield item
    finally:
        for engine_id in pending:
            engine.abort(engine_id)


async def _sse(chunks: AsyncIterator[dict[str, Any] | APIError]) -> AsyncIterator[str]:
    """OpenAI's server-sent events: each chunk, an error frame if one comes, [DONE]."""
    async for chunk in chunks:
        yield _event(chunk.body() if isinstance(chunk, APIError) else chunk)
    yield "data: [DONE]\n\n"


def engine_prompt(prompt: str | list[int], cache_salt: str | None) -> dict[str, Any]:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt} if cache_salt is None else {key: prompt, "cache_salt": cache_salt}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def until_disconnect(request: Request, work: Awaitable[dict[str, Any]]):
    """Await ``work``; if the client disconnects first, cancel it (which aborts its
    engine requests) instead of finishing a response nobody will read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(request.receive))
    done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    if work_task in done:
        watch_task.cancel()
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    return Response(status_code=499)


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
