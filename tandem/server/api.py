"""The OpenAI-compatible HTTP API: FastAPI routes over an EngineClient (the engine
core in its own process, or on a thread of this one).

    GET  /v1/models            POST /v1/completions     POST /v1/chat/completions
    GET  /v1/models/{id}       POST /tokenize           POST /detokenize
    GET  /health               GET  /metrics            GET  /version
    POST /v1/responses         (OpenAI's Responses API, stateless)
    POST /v1/messages          POST /v1/messages/count_tokens   (Anthropic's API)

    POST /trace/start  POST /trace/stop   (with --api-key or --enable-trace-endpoints)

Responses and stream chunks have OpenAI's shapes (see responses.py); the Responses
and Messages APIs translate to and from the chat path (responses_api.py,
anthropic.py), the latter answering in Anthropic's shapes, errors included. Every
other error, the framework's own included (bad JSON, unknown route, wrong method,
body too large), is ``{"error": {"message", "type", "param", "code"}}`` with its
status, and the OpenAPI document says so (protocol.ErrorResponse; no 422s). A
request's ``X-Request-Id`` comes back on its response (request_id.py). What one
client may ask is bounded (limits.py). A client that disconnects, streaming or not,
aborts its requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tandem.errors import InvalidParameterError, TandemError, require_unicode
from tandem.sampling import model_sampling_defaults
from tandem.server import anthropic, responses_api
from tandem.server.errors import APIError, as_api_error, invalid_body
from tandem.server.handlers import CompletionHandler, engine_prompt
from tandem.server.limits import BodyGuard, ServerLimits
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    render_conversation,
)
from tandem.server.request_id import EchoRequestId
from tandem.server.tool_calls import ToolCalling
from tandem.serving.engine_client import EngineClient

_HTTP_ERROR_TYPES = {
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
}  # fmt: skip
# What each route documents besides its 200 (the framework's 422 is never sent).
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 413, 500, 503)}
STREAMING = {
    200: {
        "description": "A JSON response, or with stream=true server-sent events: "
        "'data: <chunk JSON>' lines, an error chunk on failure, then 'data: [DONE]'.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **ERRORS,
}


def error_body(path: str, error: APIError) -> dict:
    """An error in the shape of the API its route belongs to: Anthropic's on the
    Messages API's routes, OpenAI's on the others."""
    return anthropic.error_body(error) if path.startswith(anthropic.PATH_PREFIX) else error.body()


def package_version() -> str:
    try:
        return distribution_version("tandem")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def build_app(
    engine: EngineClient,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
    limits: ServerLimits | None = None,
    enable_trace_endpoints: bool = False,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """``enable_trace_endpoints``: allow /trace/* without an API key (they are always
    allowed, behind the key, when the server has one); ``tool_call_parser``: how chat
    answers are read for tool calls (tool_calls.py)."""
    limits = limits or ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once
        # the app has shut down, and the process ends without running later code.
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tandem", version=package_version(), lifespan=lifespan)
    app.add_middleware(
        BodyGuard, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout,
        body_of=error_body,
    )  # fmt: skip
    app.add_middleware(EchoRequestId)  # outermost: its errors carry the id too
    handler = CompletionHandler(engine, model_name)
    tokenizer = engine.info.tokenizer
    max_model_len = engine.info.max_model_len
    defaults = model_sampling_defaults(engine.info.generation_config)
    created = int(time.time())

    def error_response(request: Request, error: APIError, headers=None) -> JSONResponse:
        body = error_body(request.url.path, error)
        return JSONResponse(body, status_code=error.status, headers=headers or error.headers())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(TandemError)
    async def tandem_error(request: Request, exc: TandemError):
        return error_response(request, as_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(request, invalid_body(exc.errors()))

    @app.exception_handler(ValidationError)
    async def translated_request_error(request: Request, exc: ValidationError):
        """A translated request (Messages API -> chat) that the chat model refuses."""
        return error_response(request, invalid_body(exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """The framework's own errors (unknown route, wrong method, unreadable or too
        large body) in OpenAI's shape."""
        type_ = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        error = APIError(exc.status_code, str(exc.detail), type_)
        return error_response(request, error, exc.headers)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        # The scheme is case-insensitive (RFC 7235): "bearer", "Bearer", "BEARER".
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")  # Anthropic's header
        valid = secrets.compare_digest(given.strip().encode(), api_key.encode())
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

    async def check_trace_allowed(request: Request) -> None:
        if api_key is None and not enable_trace_endpoints:
            raise APIError(
                403,
                "the trace endpoints are off: start the server with --api-key (they then "
                "require it) or --enable-trace-endpoints",
                "permission_error",
            )

    guarded = [Depends(check_key)]
    trace_guarded = [Depends(check_key), Depends(check_trace_allowed)]

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> dict:
        if not engine.is_alive:
            raise APIError(503, engine.dead_reason, "service_unavailable", code="engine_dead")
        return engine.health()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        """Prometheus exposition text (vLLM's metric names under ``tandem:``), kept
        by the engine core."""
        text = await engine.render_metrics()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "tandem",
        "root": str(engine.config.model),
        "max_model_len": max_model_len,
    }

    @app.get("/v1/models", dependencies=guarded, responses=ERRORS)
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}", dependencies=guarded, responses=ERRORS)
    async def model(model: str):
        """One model's card (the SDK's ``models.retrieve``); 404 for another name."""
        check_model(model)
        return card

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.post("/trace/start", dependencies=trace_guarded, responses=ERRORS)
    async def start_trace():
        """Record every engine step from now on (tandem.trace)."""
        await engine.start_trace()
        return {"tracing": True}

    @app.post("/trace/stop", dependencies=trace_guarded, responses=ERRORS)
    async def stop_trace():
        """Stop recording; the body is the Chrome trace-event JSON (for Perfetto or
        `tandem trace plot`). Nothing is written on the server; the trace is built and
        encoded off the engine loop's and the event loop's way."""
        trace = await engine.stop_trace()
        if trace is None:
            raise APIError(400, "no trace is being recorded", "invalid_request_error")
        text = await asyncio.to_thread(json.dumps, trace)
        return Response(text, media_type="application/json")

    @app.post("/tokenize", dependencies=guarded, responses=ERRORS)
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt, or of a conversation exactly as chat completions
        renders it (content parts joined)."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameterError("prompt", "give exactly one of prompt and messages")
        if body.messages is not None:
            conversation = render_conversation(body.messages)
            encoder = need_tokenizer("messages")
            tokens = await asyncio.to_thread(
                encoder.encode_chat,
                conversation,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        else:
            require_unicode(body.prompt, "prompt")
            encoder = need_tokenizer("prompt")
            tokens = await asyncio.to_thread(encoder.encode, body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=guarded, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = engine.info.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise InvalidParameterError("tokens", f"token ids must be in [0, {vocab})")
        return {"prompt": need_tokenizer("tokens").decode(body.tokens)}

    @app.post("/v1/completions", dependencies=guarded, responses=STREAMING)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = body.prompts()
        limits.check(body, len(prompts))
        params = body.sampling_params(defaults)
        return await handler.serve(
            request,
            "cmpl",
            [engine_prompt(prompt, body.cache_salt) for prompt in prompts],
            params,
            body.stream,
            body.include_usage_in_stream,
            chat=False,
            kv_transfer_params=body.kv_transfer_params,
            continuous_usage=body.continuous_usage_in_stream,
            echo=body.echo,
            drop_generated=body.echo and body.max_tokens == 0,
        )

    async def chat_prompt(body: ChatCompletionRequest, tools: ToolCalling | None) -> list[int]:
        encoder = need_tokenizer("messages")
        template_variables = dict(body.chat_template_kwargs or {})
        if tools is not None:
            template_variables["tools"] = tools.tools
        return await asyncio.to_thread(  # long conversations: off the event loop
            encoder.encode_chat,
            body.conversation(),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **template_variables,
        )

    async def chat(body: ChatCompletionRequest, request: Request, events=None):
        check_model(body.model)
        limits.check(body)
        tools = body.tool_calling(tool_call_parser, limits.max_tool_calls)
        params = body.sampling_params(defaults, tools)
        prompt = engine_prompt(await chat_prompt(body, tools), body.cache_salt)
        return await handler.serve(
            request, "chatcmpl", [prompt], params, body.stream, body.include_usage_in_stream,
            chat=True, kv_transfer_params=body.kv_transfer_params,
            continuous_usage=body.continuous_usage_in_stream, tools=tools, events=events,
        )  # fmt: skip

    @app.post("/v1/chat/completions", dependencies=guarded, responses=STREAMING)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat(body, request)

    @app.post("/v1/messages", dependencies=guarded, responses=anthropic.STREAMING)
    async def messages(body: anthropic.MessagesRequest, request: Request):
        """Anthropic's Messages API, answered by the chat path (server/anthropic.py)."""
        events = functools.partial(anthropic.message_events, model=model_name)
        answer = await chat(anthropic.to_chat(body), request, events)
        return anthropic.to_message(answer) if isinstance(answer, dict) else answer

    @app.post("/v1/responses", dependencies=guarded, responses=STREAMING)
    async def responses(body: responses_api.ResponsesRequest, request: Request):
        """OpenAI's Responses API, stateless, answered by the chat path
        (server/responses_api.py)."""
        shape = responses_api.ResponseShape(body, model_name)
        events = functools.partial(responses_api.response_events, shape=shape)
        answer = await chat(responses_api.to_chat(body), request, events)
        return responses_api.to_response(answer, shape) if isinstance(answer, dict) else answer

    @app.post("/v1/messages/count_tokens", dependencies=guarded, responses=anthropic.ERRORS)
    async def count_message_tokens(body: anthropic.CountTokensRequest):
        translated = anthropic.to_chat(body)
        check_model(translated.model)
        tools = translated.tool_calling(tool_call_parser, limits.max_tool_calls)
        return {"input_tokens": len(await chat_prompt(translated, tools))}

    return app
