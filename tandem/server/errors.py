"""The error model of tandem's HTTP servers (the OpenAI API and the router): OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, with the status code.
``code`` is always a string: a specific one where there is one (``invalid_api_key``,
``model_not_found``, ``queue_full``...), else the status's name (``bad_request``)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from tandem.errors import EngineDeadError, InvalidParameterError, QueueFullError, TandemError


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
                "code": self.code if self.code is not None else status_code_name(self.status),
            }
        }


def status_code_name(status: int) -> str:
    """404 -> "not_found": the error code when no more specific one applies."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return f"http_{status}"
    return phrase.lower().replace(" ", "_").replace("-", "_")


def as_api_error(exc: Exception) -> APIError:
    """Any exception as the error a client sees (a bug is a 500 that says so)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "service_unavailable", code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", code="engine_dead")
    if isinstance(exc, TandemError):
        return APIError(500, str(exc), "server_error")
    return APIError(500, f"internal error: {exc}", "server_error")


def error_response(status: int, message: str, type_: str = "server_error", code=None):
    """A JSONResponse carrying an error in OpenAI's shape."""
    error = APIError(status, message, type_, code=code)
    return JSONResponse(error.body(), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(location) -> str | None:
    """pydantic's error location as the field it names: ("body", "messages", 0,
    "content", "str") -> "messages[0].content" (the union member tried is dropped)."""
    path = ""
    for part in location[1:] if location[:1] == ("body",) else location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def invalid_body(errors: list[dict[str, Any]]) -> APIError:
    """A 400 for pydantic's errors about a request body (its first error, by field)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the body is not valid JSON ({detail})", "invalid_request_error")
    param = field_path(first.get("loc", ()))
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, "invalid_request_error", param)
