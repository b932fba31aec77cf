"""``tandem router``: an OpenAI-compatible front for prefill and decode instances.

    client -> router -> prefill instance   the request with max_tokens 1, not streamed,
                                            kv_transfer_params {"do_remote_decode": true}
                     -> decode instance    the original request plus the transfer
                                            parameters the prefill answered with; its
                                            answer (streamed or not) goes back as is

Instances are picked by fewest requests in flight. A prefill instance that cannot be
reached is skipped for the next one; every call has a timeout, reported as 504. A
client that hangs up closes the decode stream, which aborts the request there (the
prefill side's lease expires on its own). Prompts shorter than
``--local-prefill-threshold`` tokens skip the prefill instance: moving their K/V would
cost more than computing it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tandem.server.errors import error_response
from tandem.server.metrics import LATENCY_BUCKETS

logger = logging.getLogger("tandem.router")


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    picked: int = 0


def _least_busy(instances: list[Instance], skip: set[str] = frozenset()) -> Instance | None:
    """Fewest requests in flight; among equals, the one picked least (round robin)."""
    candidates = [i for i in instances if i.url not in skip]
    if not candidates:
        return None
    choice = min(candidates, key=lambda i: (i.in_flight, i.picked))
    choice.picked += 1
    return choice


def build_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    local_prefill_threshold: int = 0,
    timeout_s: float = 600.0,
) -> FastAPI:
    prefills = [Instance(u.rstrip("/")) for u in prefill_urls]
    decodes = [Instance(u.rstrip("/")) for u in decode_urls]
    http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), limits=httpx.Limits(
        max_connections=None, max_keepalive_connections=64))  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await http.aclose()

    app = FastAPI(title="tandem router", lifespan=lifespan)
    registry = CollectorRegistry()
    requests_total = Counter(
        "tandem:router_requests", "Requests by path taken.", ["path"], registry=registry
    )
    failures = Counter("tandem:router_failures", "Failed requests.", ["reason"], registry=registry)
    ttft = Histogram(
        "tandem:router_time_to_first_token_seconds",
        "Arrival at the router to the first token, transfer included.",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    prefill_time = Histogram(
        "tandem:router_prefill_seconds", "The prefill call.", buckets=LATENCY_BUCKETS,
        registry=registry,
    )  # fmt: skip

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        response = await http.get(f"{decodes[0].url}/v1/models")
        return JSONResponse(response.json(), status_code=response.status_code)

    async def post(instance: Instance, role: str, path: str, body: dict):
        """The instance's response, or the error to give the client: 504 on a timeout,
        502 when it cannot be reached."""
        instance.in_flight += 1
        try:
            return await http.post(f"{instance.url}{path}", json=body)
        except httpx.TimeoutException:
            failures.labels(f"{role} timeout").inc()
            return error_response(504, f"{role} instance {instance.url} timed out", code="timeout")
        except httpx.TransportError as exc:
            failures.labels(f"{role} unreachable").inc()
            return error_response(
                502, f"{role} instance {instance.url} unreachable: {exc}", code="bad_gateway"
            )
        finally:
            instance.in_flight -= 1

    async def prompt_tokens(path: str, body: dict) -> int:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        query = {"messages": body.get("messages")} if path.endswith("chat/completions") else {
            "prompt": prompt if isinstance(prompt, str) else ""}  # fmt: skip
        response = await http.post(f"{decodes[0].url}/tokenize", json=query)
        return response.json().get("count", 0) if response.status_code == 200 else 0

    async def prefill(path: str, body: dict) -> dict | JSONResponse:
        """The prefill call; the transfer parameters, or an error response."""
        request = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        request.pop("stream_options", None)
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        tried: set[str] = set()
        while (instance := _least_busy(prefills, tried)) is not None:
            tried.add(instance.url)
            started = time.perf_counter()
            response = await post(instance, "prefill", path, request)
            if isinstance(response, JSONResponse):
                if response.status_code == 502:  # unreachable: the next one may answer
                    logger.warning("prefill instance %s unreachable; trying another",
                                   instance.url)  # fmt: skip
                    continue
                return response
            prefill_time.observe(time.perf_counter() - started)
            if response.status_code != 200:
                return JSONResponse(response.json(), status_code=response.status_code)
            params = response.json().get("kv_transfer_params")
            if params is None:
                return error_response(
                    502, f"{instance.url} is not a prefill instance", code="bad_gateway"
                )
            return params
        failures.labels("no prefill instance").inc()
        return error_response(502, "no prefill instance could be reached", code="bad_gateway")

    async def route(path: str, request: Request):
        started = time.perf_counter()
        body = await request.json()
        # n > 1 samples need blocks each: the decode instance computes those prompts.
        remote = body.get("n", 1) == 1 and (
            not local_prefill_threshold
            or await prompt_tokens(path, body) >= local_prefill_threshold
        )
        if remote:
            params = await prefill(path, body)
            if isinstance(params, JSONResponse):
                return params
            body = {**body, "kv_transfer_params": params}
        requests_total.labels("disaggregated" if remote else "decode only").inc()
        instance = _least_busy(decodes)
        if body.get("stream"):
            return await stream(instance, path, body, started)
        response = await post(instance, "decode", path, body)
        if isinstance(response, JSONResponse):
            return response
        logger.info("%s via %s: %.1f ms", path, instance.url, (time.perf_counter() - started) * 1e3)
        return JSONResponse(response.json(), status_code=response.status_code)

    async def stream(instance: Instance, path: str, body: dict, started: float):
        instance.in_flight += 1
        upstream = http.stream("POST", f"{instance.url}{path}", json=body)
        try:
            response = await upstream.__aenter__()
        except httpx.TransportError as exc:
            instance.in_flight -= 1
            failures.labels("decode unreachable").inc()
            return error_response(
                502, f"decode instance {instance.url} unreachable: {exc}", code="bad_gateway"
            )
        if response.status_code != 200:
            content = await response.aread()
            await upstream.__aexit__(None, None, None)
            instance.in_flight -= 1
            return Response(content, status_code=response.status_code,
                            media_type="application/json")  # fmt: skip

        async def relay() -> AsyncIterator[bytes]:
            first = True
            try:
                async for chunk in response.aiter_raw():
                    # The first chunk with generated text (a chat stream opens with
                    # a role-only chunk, which is not a token yet).
                    if first and (b'"text": ' in chunk or b'"delta": {"content"' in chunk):
                        ttft.observe(time.perf_counter() - started)
                        logger.info("%s via %s: TTFT %.1f ms", path, instance.url,
                                    (time.perf_counter() - started) * 1e3)  # fmt: skip
                        first = False
                    yield chunk
            finally:  # done, or the client hung up: closing aborts the decode request
                await upstream.__aexit__(None, None, None)
                instance.in_flight -= 1

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route("/v1/chat/completions", request)

    return app


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    local_prefill_threshold: int = 0,
    timeout_s: float = 600.0,
) -> None:
    import uvicorn

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_router_app(prefill_urls, decode_urls, local_prefill_threshold, timeout_s)
    logger.info("router on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls,
                decode_urls)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="warning")
