"""The HTTP app: FastAPI over an EngineClient (the engine core in its own process, or
on a thread of this one), its routes one router module per API (server/routes/).

    GET  /v1/models            POST /v1/completions     POST /v1/chat/completions
    GET  /v1/models/{id}       POST /tokenize           POST /detokenize
    GET  /health               GET  /metrics            GET  /version
    POST /v1/responses         (OpenAI's Responses API, stateless)
    POST /v1/messages          POST /v1/messages/count_tokens   (Anthropic's API)

    POST /trace/start  POST /trace/stop   (with --api-key or --enable-trace-endpoints)

Responses and stream chunks have OpenAI's shapes (see responses.py); the Responses
and Messages APIs translate to and from the chat path (responses_api.py,
anthropic.py; their routes in routes/), the latter answering in Anthropic's shapes,
errors included. This module holds what is the app's rather than a route's: the
middleware, the error handlers, the OpenAPI document. Every
other error, the framework's own included (bad JSON, unknown route, wrong method,
body too large), is ``{"error": {"message", "type", "param", "code"}}`` with its
status, and the OpenAPI document says so (protocol.ErrorResponse; no 422s). A
request's ``X-Request-Id`` comes back on its response (request_id.py). What one
client may ask is bounded (limits.py). A client that disconnects, streaming or not,
aborts its requests at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tandem.errors import TandemError
from tandem.server import anthropic
from tandem.server.errors import APIError, as_api_error, invalid_body
from tandem.server.limits import BodyGuard, ServerLimits
from tandem.server.request_id import EchoRequestId
from tandem.server.routes import admin
from tandem.server.routes import anthropic as anthropic_routes
from tandem.server.routes import openai as openai_routes
from tandem.server.routes import pooling as pooling_routes
from tandem.server.routes import responses as responses_routes
from tandem.server.state import ServedModel, package_version
from tandem.serving.engine_client import EngineClient

_HTTP_ERROR_TYPES = {
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
}  # fmt: skip


def error_body(path: str, error: APIError) -> dict:
    """An error in the shape of the API its route belongs to: Anthropic's on the
    Messages API's routes, OpenAI's on the others."""
    return anthropic.error_body(error) if path.startswith(anthropic.PATH_PREFIX) else error.body()


def build_app(
    engine: EngineClient,
    model_name: str,
    api_key: str | None = None,
    on_shutdown: Callable[[], None] | None = None,
    limits: ServerLimits | None = None,
    enable_trace_endpoints: bool = False,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> FastAPI:
    """``enable_trace_endpoints``: allow /trace/* without an API key (they are always
    allowed, behind the key, when the server has one); ``tool_call_parser``: how chat
    answers are read for tool calls (tool_calls.py); ``reasoning_parser``: how a
    thinking model's answers are split (reasoning.py; auto: from the chat template)."""
    limits = limits or ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once
        # the app has shut down, and the process ends without running later code.
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tandem", version=package_version(), lifespan=lifespan)
    app.state.served = ServedModel(
        engine, model_name, api_key, limits, enable_trace_endpoints, tool_call_parser,
        reasoning_parser,
    )  # fmt: skip
    app.add_middleware(
        BodyGuard, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout,
        body_of=error_body,
    )  # fmt: skip
    app.add_middleware(EchoRequestId)  # outermost: its errors carry the id too
    _handle_errors(app)
    for routes in (admin, openai_routes, anthropic_routes, responses_routes, pooling_routes):
        app.include_router(routes.router)
    app.openapi = lambda: _openapi(app)
    return app


def _handle_errors(app: FastAPI) -> None:
    """Every error, the framework's own included, in its API's shape with its status."""

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


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI document without the framework's 422s (never sent)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema
