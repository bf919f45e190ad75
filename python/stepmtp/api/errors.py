"""Errors in llama-server's (OpenAI's) shape:
``{"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}``.

The server answers them as JSON; ``Engine.create_chat_completion`` raises them. A
client's mistake (a 4xx) is also a ``ValueError``, as Python code expects of bad input."""
from __future__ import annotations

from typing import Any

#: llama-server's error types and their HTTP status (server-common.cpp, format_error_response)
ERROR_TYPES: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "server_error": 500,
    "permission_error": 403,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
    # ours: past a size limit (the body), and a full queue
    "request_too_large_error": 413,
}


class APIError(Exception):
    """Raised by the API's request handling; the server answers it as llama-server's error JSON."""

    def __init__(self, message: str, type_: str = "invalid_request_error", *, code: int | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.type = type_
        self.code = code or ERROR_TYPES.get(type_, 500)
        self.extra = extra

    def body(self) -> dict[str, Any]:
        b = error_body(self.message, self.type, **self.extra)
        b["error"]["code"] = self.code
        return b


def error_body(message: str, type_: str = "invalid_request_error", **extra: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"code": ERROR_TYPES.get(type_, 500), "message": message, "type": type_}
    err.update(extra)
    return {"error": err}


class InvalidRequest(APIError, ValueError):
    """The request is at fault (a 4xx): a bad field, a prompt longer than the context, ..."""


def bad_request(message: str) -> APIError:
    return InvalidRequest(message, "invalid_request_error")
