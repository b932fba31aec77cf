"""The OpenAI-compatible HTTP API: FastAPI routes over an AsyncEngine.

    GET  /v1/models            POST /v1/completions     POST /v1/chat/completions
    POST /tokenize             POST /detokenize         GET  /health   GET /metrics

Responses and stream chunks have OpenAI's shapes (see responses.py); errors are
``{"error": {"message", "type", "param", "code"}}`` with 400 / 401 / 404 / 503. A
client that disconnects, streaming or not, aborts its requests at once.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from tandem.errors import InvalidParameterError, TandemError, require_unicode
from tandem.sampling import model_sampling_defaults
from tandem.server.async_engine import AsyncEngine
from tandem.server.errors import APIError, as_api_error
from tandem.server.handlers import CompletionHandler, engine_prompt
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


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
    handler = CompletionHandler(engine, model_name)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    defaults = model_sampling_defaults(engine.engine.model_info.generation_config)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(TandemError)
    async def tandem_error(_: Request, exc: TandemError):
        error = as_api_error(exc)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

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
        # The scheme is case-insensitive (RFC 7235): "bearer", "Bearer", "BEARER".
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        valid = scheme.lower() == "bearer" and secrets.compare_digest(
            given.strip().encode(), api_key.encode()
        )
        if not valid:
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
        for index, message in enumerate(body.messages or ()):
            if isinstance(message.get("content"), str):
                require_unicode(message["content"], f"messages[{index}].content")
        if body.prompt is not None:
            require_unicode(body.prompt, "prompt")
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
        return await handler.serve(
            request,
            "cmpl",
            [engine_prompt(prompt, body.cache_salt) for prompt in body.prompts()],
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
        prompt = engine_prompt(prompt_ids, body.cache_salt)
        return await handler.serve(
            request, "chatcmpl", [prompt], params, body.stream, body.include_usage_in_stream,
            chat=True, kv_transfer_params=body.kv_transfer_params,
        )  # fmt: skip

    return app
