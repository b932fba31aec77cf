"""Routes for operators: /health, /metrics (Prometheus), /version, and the step traces
(/trace/start, /trace/stop: with --api-key, or --enable-trace-endpoints)."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse, Response

from tandem.server.errors import APIError
from tandem.server.protocol import ErrorResponse
from tandem.server.state import ERRORS, check_key, package_version, served

router = APIRouter()


async def check_trace_allowed(request: Request) -> None:
    model = served(request)
    if model.api_key is None and not model.enable_trace_endpoints:
        raise APIError(
            403,
            "the trace endpoints are off: start the server with --api-key (they then "
            "require it) or --enable-trace-endpoints",
            "permission_error",
        )


TRACE_GUARDED = [Depends(check_key), Depends(check_trace_allowed)]


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> dict:
    engine = served(request).engine
    if not engine.is_alive:
        raise APIError(503, engine.dead_reason, "service_unavailable", code="engine_dead")
    return engine.health()


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(request: Request):
    """Prometheus exposition text (vLLM's metric names under ``tandem:``), kept
    by the engine core."""
    text = await served(request).engine.render_metrics()
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": package_version()}


@router.post("/trace/start", dependencies=TRACE_GUARDED, responses=ERRORS)
async def start_trace(request: Request):
    """Record every engine step from now on (tandem.trace)."""
    await served(request).engine.start_trace()
    return {"tracing": True}


@router.post("/trace/stop", dependencies=TRACE_GUARDED, responses=ERRORS)
async def stop_trace(request: Request):
    """Stop recording; the body is the Chrome trace-event JSON (for Perfetto or
    `tandem trace plot`). Nothing is written on the server; the trace is built and
    encoded off the engine loop's and the event loop's way."""
    trace = await served(request).engine.stop_trace()
    if trace is None:
        raise APIError(400, "no trace is being recorded", "invalid_request_error")
    text = await asyncio.to_thread(json.dumps, trace)
    return Response(text, media_type="application/json")
