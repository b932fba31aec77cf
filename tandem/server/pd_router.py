"""``tandem router``: an OpenAI-compatible front for prefill and decode instances.

    client -> router -> prefill instance   the request with max_tokens 1, not streamed,
                                            kv_transfer_params {"do_remote_decode": true}
                     -> decode instance    the original request plus the transfer
                                            parameters the prefill answered with; its
                                            answer (streamed or not) goes back as is

Instances are picked by fewest requests in flight. An instance that cannot be reached
is skipped for the next one of its role; every call has a timeout, reported as 504. A
client that hangs up closes the decode stream, which aborts the request there (the
prefill side's lease expires on its own); a decode instance that dies mid-stream ends
the client's stream with an error chunk and ``[DONE]``. Prompts shorter than
``--local-prefill-threshold`` tokens skip the prefill instance: moving their K/V would
cost more than computing it.

Trust (docs/SECURITY.md): a request is validated with the server's own models before
anything is prefilled (a request a decode instance would refuse never pins a lease),
a client's ``kv_transfer_params`` are dropped (only a prefill instance's signed answer
is forwarded), ``--api-key`` guards the router and the client's Authorization header
goes on to the instances. Errors have OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

import httpx
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException

from tandem.errors import InvalidParameterError
from tandem.server.errors import APIError, as_api_error, error_response, invalid_body
from tandem.server.limits import BodyGuard, ServerLimits
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.serving.metrics import LATENCY_BUCKETS
from tandem.serving.placement import Instance, least_busy

logger = logging.getLogger("tandem.router")


class PDRouter:
    """The router's state (its instances, HTTP client, metrics) and what it does with a
    request; ``build_router_app`` puts its routes on a FastAPI app."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        local_prefill_threshold: int = 0,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.prefills = [Instance(u.rstrip("/")) for u in prefill_urls]
        self.decodes = [Instance(u.rstrip("/")) for u in decode_urls]
        self.local_prefill_threshold = local_prefill_threshold
        self.api_key = api_key
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.registry = registry = CollectorRegistry()
        self.requests_total = Counter(
            "tandem:router_requests", "Requests by path taken.", ["path"], registry=registry
        )
        self.failures = Counter(
            "tandem:router_failures", "Failed requests.", ["reason"], registry=registry
        )
        self.ttft = Histogram(
            "tandem:router_time_to_first_token_seconds",
            "Arrival at the router to the first token, transfer included.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_time = Histogram(
            "tandem:router_prefill_seconds", "The prefill call.", buckets=LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (
            scheme.lower() == "bearer"
            and secrets.compare_digest(given.strip().encode(), self.api_key.encode())
        ):
            raise APIError(
                401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key"
            )

    def forwarded(self, request: Request) -> dict[str, str]:
        """The client's credentials, for instances that have an --api-key too."""
        key = request.headers.get("authorization")
        return {"authorization": key} if key else {}

    async def healthy(self, instance: Instance) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await self.http.get(f"{instance.url}/health", timeout=2.0)).status_code == 200
        return False

    async def health(self):
        """200 while at least one instance of each role answers; 503 otherwise. The
        body says which instances are down."""
        checks = await asyncio.gather(*(self.healthy(i) for i in (*self.prefills, *self.decodes)))
        up = dict(zip([i.url for i in (*self.prefills, *self.decodes)], checks, strict=True))
        ok = any(up[i.url] for i in self.prefills) and any(up[i.url] for i in self.decodes)
        body = {"prefill": {i.url: up[i.url] for i in self.prefills},
                "decode": {i.url: up[i.url] for i in self.decodes}}  # fmt: skip
        return JSONResponse(body, status_code=200 if ok else 503)

    async def models(self, request: Request):
        self.check_key(request)
        for instance in self.decodes:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await self.http.get(
                    f"{instance.url}/v1/models", headers=self.forwarded(request), timeout=10.0
                )
                if response.status_code < 500:
                    return JSONResponse(response.json(), status_code=response.status_code)
        raise APIError(503, "no decode instance answered", "service_unavailable")

    async def post(self, instance: Instance, role: str, path: str, body: dict, headers: dict):
        """The instance's response, or the error to give the client: 504 on a timeout,
        502 when it cannot be reached."""
        instance.in_flight += 1
        try:
            return await self.http.post(f"{instance.url}{path}", json=body, headers=headers)
        except httpx.TimeoutException:
            self.failures.labels(f"{role} timeout").inc()
            return error_response(504, f"{role} instance {instance.url} timed out", code="timeout")
        except httpx.TransportError as exc:
            self.failures.labels(f"{role} unreachable").inc()
            return error_response(
                502, f"{role} instance {instance.url} unreachable: {exc}", code="bad_gateway"
            )
        finally:
            instance.in_flight -= 1

    async def prompt_tokens(self, path: str, body: dict, headers: dict) -> int:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)
        query = {"messages": body.get("messages")} if path.endswith("chat/completions") else {
            "prompt": prompt if isinstance(prompt, str) else ""}  # fmt: skip
        for instance in self.decodes:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await self.http.post(
                    f"{instance.url}/tokenize", json=query, headers=headers, timeout=30.0
                )
                return response.json().get("count", 0) if response.status_code == 200 else 0
        return 0

    async def prefill(self, path: str, body: dict, headers: dict) -> dict | JSONResponse | None:
        """The prefill call: the transfer parameters, None when the prefill instance
        did not keep the blocks (the decode instance computes the prompt), or an error
        response."""
        request = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        request.pop("stream_options", None)
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        tried: set[str] = set()
        while (instance := least_busy(self.prefills, tried)) is not None:
            tried.add(instance.url)
            started = time.perf_counter()
            response = await self.post(instance, "prefill", path, request, headers)
            if isinstance(response, JSONResponse):
                if response.status_code == 502:  # unreachable: the next one may answer
                    logger.warning("prefill instance %s unreachable; trying another",
                                   instance.url)  # fmt: skip
                    continue
                return response
            self.prefill_time.observe(time.perf_counter() - started)
            if response.status_code != 200:
                return JSONResponse(response.json(), status_code=response.status_code)
            # None: its lease cap was reached (the decode instance computes the prompt).
            return response.json().get("kv_transfer_params")
        self.failures.labels("no prefill instance").inc()
        return error_response(502, "no prefill instance could be reached", code="bad_gateway")

    async def read_body(self, path: str, request: Request) -> dict:
        """The client's JSON body, checked as the instances will check it (a 400 here
        costs nothing; after a prefill it would pin a lease for nothing)."""
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            message = f"the body is not valid JSON ({exc})"
            raise APIError(400, message, "invalid_request_error") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", "invalid_request_error")
        body.pop("kv_transfer_params", None)  # only a prefill instance's answer is trusted
        model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
        try:
            parsed = model.model_validate(body)
            parsed.sampling_params({})
            if isinstance(parsed, CompletionRequest):
                parsed.prompts()
            else:
                parsed.conversation()
        except pydantic.ValidationError as exc:
            raise invalid_body(exc.errors(include_url=False)) from None
        except InvalidParameterError as exc:
            raise as_api_error(exc) from None
        return body

    async def route(self, path: str, request: Request):
        started = time.perf_counter()
        self.check_key(request)
        body = await self.read_body(path, request)
        headers = self.forwarded(request)
        # n > 1 samples need blocks each: the decode instance computes those prompts.
        remote = body.get("n", 1) == 1 and (
            not self.local_prefill_threshold
            or await self.prompt_tokens(path, body, headers) >= self.local_prefill_threshold
        )
        if remote:
            params = await self.prefill(path, body, headers)
            if isinstance(params, JSONResponse):
                return params
            if params is not None:
                body = {**body, "kv_transfer_params": params}
        self.requests_total.labels("disaggregated" if remote else "decode only").inc()
        tried: set[str] = set()
        while (instance := least_busy(self.decodes, tried)) is not None:
            tried.add(instance.url)
            if body.get("stream"):
                response = await self.stream(instance, path, body, headers, started)
            else:
                response = await self.post(instance, "decode", path, body, headers)
            if isinstance(response, JSONResponse) and response.status_code == 502:
                logger.warning("decode instance %s unreachable; trying another", instance.url)
                continue
            if isinstance(response, Response):
                return response
            logger.info(
                "%s via %s: %.1f ms", path, instance.url, (time.perf_counter() - started) * 1e3
            )
            return JSONResponse(response.json(), status_code=response.status_code)
        self.failures.labels("no decode instance").inc()
        return error_response(502, "no decode instance could be reached", code="bad_gateway")

    async def stream(
        self, instance: Instance, path: str, body: dict, headers: dict, started: float
    ):
        instance.in_flight += 1
        upstream = self.http.stream("POST", f"{instance.url}{path}", json=body, headers=headers)
        try:
            response = await upstream.__aenter__()
        except httpx.TransportError as exc:
            instance.in_flight -= 1
            self.failures.labels("decode unreachable").inc()
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
                        self.ttft.observe(time.perf_counter() - started)
                        logger.info("%s via %s: TTFT %.1f ms", path, instance.url,
                                    (time.perf_counter() - started) * 1e3)  # fmt: skip
                        first = False
                    yield chunk
            except httpx.HTTPError as exc:  # the decode instance died mid-stream
                self.failures.labels("decode lost mid-stream").inc()
                error = APIError(
                    502, f"decode instance {instance.url} failed mid-stream: {exc}",
                    "server_error", code="bad_gateway",
                )  # fmt: skip
                yield f"\n\ndata: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
            finally:  # done, or the client hung up: closing aborts the decode request
                with contextlib.suppress(httpx.HTTPError):
                    await upstream.__aexit__(None, None, None)
                instance.in_flight -= 1

        return StreamingResponse(relay(), media_type="text/event-stream")


def build_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    local_prefill_threshold: int = 0,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """``limits``: body size and timeouts for clients (limits.py; the instances check
    the rest)."""
    limits = limits or ServerLimits()
    router = PDRouter(prefill_urls, decode_urls, local_prefill_threshold, timeout_s, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await router.http.aclose()

    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.add_middleware(BodyGuard, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        return await router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.models(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.route("/v1/chat/completions", request)

    return app


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    local_prefill_threshold: int = 0,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    limits: ServerLimits | None = None,
) -> None:
    from tandem.server.serve import claim_port, run_app

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    limits = limits or ServerLimits()
    listener = claim_port(host, port)  # a busy port fails at once, in one line
    app = build_router_app(
        prefill_urls, decode_urls, local_prefill_threshold, timeout_s, api_key, limits
    )
    logger.info("router on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls,
                decode_urls)  # fmt: skip
    run_app(app, listener, "warning", limits.header_timeout)
