"""``X-Request-Id``: a client's id for a request, echoed on the response (as vLLM and
most API gateways do), so logs on both sides can be joined. An id over 256 bytes or
with characters outside printable ASCII is not echoed (headers are client-controlled
input); h11 has already refused control characters."""

from __future__ import annotations

HEADER = b"x-request-id"
MAX_BYTES = 256


class EchoRequestId:
    """ASGI middleware: the request's X-Request-Id header on its response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = dict(scope["headers"]).get(HEADER)
        if value is None or len(value) > MAX_BYTES or not all(32 < b < 127 for b in value):
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, value)]}
            await send(message)

        return await self.app(scope, receive, send_with_id)
