"""What one client may ask of the server: bounds on everything a request controls, so
that no single client can stall or exhaust the server for the others.

    body size          413 when Content-Length says so, or as the body arrives
    slow clients       request headers must arrive within ``header_timeout`` of the
                       connection (or of the previous response), a body within
                       ``body_timeout`` (408); half-open connections are closed
    fan-out            n, the prompts of one completions request, stop strings and
                       stop token ids (400 naming the field; logprobs are bounded by
                       SamplingParams); the calls of a required tool answer

Each has a flag on ``tandem serve``; the defaults suit a server shared by many
clients. The waiting queue's bound (503 with Retry-After) is ``max_waiting_requests``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem import host_memory
from tandem.errors import InvalidParameterError
from tandem.server.errors import APIError

logger = logging.getLogger("tandem.server")
# After a request body this large, free heap memory goes back to the system.
GIVE_BACK_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    max_prompts: int = 64  # prompts in one completions request (each also takes n)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # entries of logit_bias
    max_tool_calls: int = 8  # calls in one answer held to tool_choice required
    max_inputs: int = 2048  # texts in one embeddings, score or rerank request (OpenAI's)
    header_timeout: float = 15.0  # seconds
    body_timeout: float = 60.0

    def check(self, body: Any, num_prompts: int = 1) -> None:
        """Raise InvalidParameterError for a request over a limit."""
        if isinstance(body.n, int) and body.n > self.max_n:
            raise InvalidParameterError("n", f"must be at most {self.max_n}, got {body.n}")
        if num_prompts > self.max_prompts:
            raise InvalidParameterError(
                "prompt", f"holds {num_prompts} prompts; at most {self.max_prompts} per request"
            )
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > self.max_stop_strings:
            raise InvalidParameterError(
                "stop", f"holds {len(stop)} strings; at most {self.max_stop_strings}"
            )
        if any(len(s) > self.max_stop_string_chars for s in stop):
            raise InvalidParameterError(
                "stop", f"strings may be at most {self.max_stop_string_chars} characters"
            )
        if len(body.stop_token_ids or ()) > self.max_stop_token_ids:
            raise InvalidParameterError(
                "stop_token_ids", f"may hold at most {self.max_stop_token_ids} ids"
            )
        if len(body.logit_bias or ()) > self.max_logit_bias:
            raise InvalidParameterError(
                "logit_bias", f"may hold at most {self.max_logit_bias} entries"
            )


class BodyGuard:
    """ASGI middleware: a request body may hold at most ``max_bytes`` (413) and must
    arrive whole within ``timeout`` seconds (408: a client sending a byte every few
    seconds would otherwise hold its connection and its task forever). Either answer
    is an error body in the shape of the route's API (``body_of(path, error)``;
    OpenAI's by default) with ``Connection: close``; the app then sees the client
    gone. (Starlette's own limit answers in plain text, hence this.)"""

    def __init__(self, app, max_bytes: int, timeout: float, body_of=None) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout
        self.body_of = body_of or (lambda path, error: error.body())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")

        async def send_error(status: int, message: str) -> None:
            error = APIError(status, message, "invalid_request_error")
            body = json.dumps(self.body_of(scope["path"], error)).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        if declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(413, self._too_large())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received, body_done, responded = 0, False, False

        async def guarded_receive():
            nonlocal received, body_done, responded
            if body_done:  # afterwards, receive only waits for a disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                logger.info("closing a connection whose body took over %.0f s", self.timeout)
                message = f"the request body did not arrive within {self.timeout:g} s"
                status = 408
            else:
                if message["type"] != "http.request":
                    body_done = True
                    return message
                received += len(message.get("body", b""))
                if received <= self.max_bytes:
                    body_done = not message.get("more_body")
                    return message
                message, status = self._too_large(), 413
            body_done = responded = True
            await send_error(status, message)
            return {"type": "http.disconnect"}

        async def guarded_send(message) -> None:
            if not responded:  # (the app's answer to a request already answered)
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        finally:
            if received >= GIVE_BACK_BYTES:  # what handling it allocated, to the system
                await asyncio.to_thread(host_memory.give_back)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"


def h11_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request headers do not arrive
    within ``header_timeout`` seconds (of the connection, or of the previous response
    on a kept-alive one). uvicorn only times out idle kept-alive connections."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        @property
        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if not self._awaiting_headers:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (may start a pipelined request)
            if self._awaiting_headers and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if self._awaiting_headers and not self.transport.is_closing():
                logger.info("closing a connection whose headers took over %.0f s", header_timeout)
                self.transport.close()

    return HeaderTimeoutH11Protocol
