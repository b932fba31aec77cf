"""The error model of tandem's HTTP servers (the OpenAI API and the router): OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, with the status code."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tandem.errors import InvalidParameterError, TandemError


class QueueFullError(TandemError):
    """The waiting queue is at its configured limit; the client should retry later."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def headers(self) -> dict[str, str] | None:
        """A full queue tells the client when to come back."""
        return {"Retry-After": "1"} if self.code == "queue_full" else None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def as_api_error(exc: Exception) -> APIError:
    """Any exception as the error a client sees (a bug is a 500 that says so)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "service_unavailable", code="queue_full")
    if isinstance(exc, TandemError):
        return APIError(500, str(exc), "server_error")
    return APIError(500, f"internal error: {exc}", "server_error")


def error_response(status: int, message: str, type_: str = "server_error", code=None):
    """A JSONResponse carrying an error in OpenAI's shape."""
    error = APIError(status, message, type_, code=code)
    return JSONResponse(error.body(), status_code=status)
