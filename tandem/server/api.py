"""The OpenAI-compatible HTTP API: FastAPI routes over an AsyncEngine.

    GET  /v1/models            POST /v1/completions     POST /v1/chat/completions
    POST /tokenize             POST /detokenize         GET  /health   GET /metrics

Responses and stream chunks have OpenAI's shapes (see responses.py); errors are
``{"error": {"message", "type", "param", "code"}}`` with 400 / 401 / 404 / 503. A
client that disconnects, streaming or not, aborts its requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.errors import InvalidParameterError, TandemError
from tandem.outputs import RequestOutput
from tandem.sampling import RequestOutputKind, SamplingParams, model_sampling_defaults
from tandem.server.async_engine import AsyncEngine
from tandem.server.errors import APIError, as_api_error
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.server.responses import ChoiceStream


def build_app(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once
        # the app has shut down, and the process ends without running later code.
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tandem", version="0.1.0", lifespan=lifespan)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    defaults = model_sampling_defaults(engine.engine.model_info.generation_config)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(TandemError)
    async def tandem_error(_: Request, exc: TandemError):
        error = as_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            message, param = f"the body is not valid JSON ({detail})", None
        else:
            # loc is ("body", field, ...): the field, then union members / indexes.
            location = [str(part) for part in first.get("loc", ()) if part != "body"]
            param = location[0] if location else None
            message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(
            APIError(400, message, "invalid_request_error", param).body(), status_code=400
        )

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key"
            )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def need_tokenizer(param: str):
        if tokenizer is None:
            raise InvalidParameterError(param, "this model has no tokenizer; send token ids")
        return tokenizer

    guarded = [Depends(check_key)]

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise APIError(503, "the engine thread has stopped", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": str(engine.engine.config.model),
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/trace/start", dependencies=guarded)
    async def start_trace():
        """Record every engine step from now on (tandem.trace)."""
        await engine.call(lambda e: e.start_trace())
        return {"tracing": True}

    @app.post("/trace/stop", dependencies=guarded)
    async def stop_trace():
        """Stop recording; the body is the Chrome trace-event JSON (for Perfetto or
        `tandem trace plot`). Nothing is written on the server."""
        tracer = await engine.call(lambda e: e.stop_trace())
        if tracer is None:
            raise APIError(400, "no trace is being recorded", "invalid_request_error")
        return tracer.chrome_trace()

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameterError("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            tokens = need_tokenizer("messages").encode_chat(
                body.messages, add_generation_prompt=body.add_generation_prompt
            )
        else:
            tokens = need_tokenizer("prompt").encode(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.engine.model_info.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise InvalidParameterError("tokens", f"token ids must be in [0, {vocab})")
        return {"prompt": need_tokenizer("tokens").decode(body.tokens)}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = body.sampling_params(defaults)
        return await _serve(
            request,
            "cmpl",
            [_engine_prompt(prompt, body.cache_salt) for prompt in body.prompts()],
            params,
            body.stream,
            body.include_usage_in_stream,
            chat=False,
            kv_transfer_params=body.kv_transfer_params,
        )

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = body.sampling_params(defaults)
        prompt_ids = need_tokenizer("messages").encode_chat(
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
        prompt = _engine_prompt(prompt_ids, body.cache_salt)
        return await _serve(
            request, "chatcmpl", [prompt], params, body.stream, body.include_usage_in_stream,
            chat=True, kv_transfer_params=body.kv_transfer_params,
        )  # fmt: skip

    async def _serve(
        request: Request,
        id_prefix: str,
        prompts: list[dict[str, Any]],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        chat: bool,
        kv_transfer_params: dict[str, Any] | None = None,
    ):
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        # A stream sends what is new each step; a response needs only the end.
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        params = dataclasses.replace(params, output_kind=kind)
        if kv_transfer_params is not None and len(prompts) != 1:
            raise InvalidParameterError("kv_transfer_params", "takes a single prompt")
        outputs: asyncio.Queue = asyncio.Queue()
        engine_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        added: list[str] = []
        try:
            for engine_id, prompt in zip(engine_ids, prompts, strict=True):
                await engine.add_request(engine_id, prompt, params, outputs, kv_transfer_params)
                added.append(engine_id)
        except BaseException:
            for engine_id in added:
                engine.abort(engine_id)
            raise
        state = ChoiceStream(
            response_id,
            model_name,
            int(time.time()),
            engine_ids,
            params.n,
            chat,
            want_logprobs=params.logprobs is not None,
        )
        if stream:
            return StreamingResponse(
                _sse(state, outputs, engine_ids, include_usage), media_type="text/event-stream"
            )
        return await _until_disconnect(request, _collect(state, outputs, engine_ids))

    async def _next_outputs(
        outputs: asyncio.Queue, engine_ids: list[str]
    ) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of this HTTP request's engine requests until all finish; aborts
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

    async def _collect(state: ChoiceStream, outputs: asyncio.Queue, engine_ids: list[str]):
        transfer = None
        async for output in _next_outputs(outputs, engine_ids):
            state.update(output)
            transfer = output.kv_transfer_params or transfer
        response = state.final_response()
        if transfer is not None:
            # A prefill instance's answer: where the decode side reads the prompt's K/V.
            response["kv_transfer_params"] = transfer
        return response

    async def _sse(
        state: ChoiceStream, outputs: asyncio.Queue, engine_ids: list[str], include_usage: bool
    ) -> AsyncIterator[str]:
        try:
            if state.chat:
                for index in range(state.num_choices):
                    yield _event(state.role_chunk(index))
            async for output in _next_outputs(outputs, engine_ids):
                for index, delta in state.update(output):
                    yield _event(state.chunk(index, delta))
            if include_usage:
                yield _event(state.usage_chunk())
        except Exception as exc:  # an error mid-stream: an error frame, then [DONE]
            yield _event(as_api_error(exc).body())
        yield "data: [DONE]\n\n"

    return app


def _engine_prompt(prompt: str | list[int], cache_salt: str | None) -> dict[str, Any]:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt} if cache_salt is None else {key: prompt, "cache_salt": cache_salt}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _until_disconnect(request: Request, work: Awaitable[dict[str, Any]]):
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
