"""The HTTP side the routers share: the generation service a request's app holds,
request bodies read under the size limit and validated, a body's schema in the
OpenAPI spec, and the response that streams a job's events."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from ..api.errors import APIError, bad_request
from ..api.schemas import format_validation_error
from .service import GenerationService

M = TypeVar("M", bound=BaseModel)


def service(request: Request) -> GenerationService:
    """The generation service of the request's app (``create_app`` keeps it in ``app.state``)."""
    return request.app.state.service


# -- request bodies: parsed here whatever the Content-Type (curl -d sends a form
# type), validated by the pydantic models, errors as llama-server's 400 ---------

async def body(request: Request, model: type[M]) -> M:
    raw = await read_body(request)
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        raise bad_request(format_validation_error(e)) from None


async def read_json(request: Request) -> Any:
    """The request's body as JSON, whatever its shape (null when empty)."""
    raw = await read_body(request)
    try:
        return json.loads(raw or b"null")
    except ValueError as e:
        raise bad_request(f"invalid JSON: {e}") from None


async def read_body(request: Request) -> bytes:
    limit = service(request).cfg.max_body_bytes
    too_large = APIError(f"the request body exceeds {limit} bytes (--max-body-size)", "request_too_large_error")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class SSEResponse(StreamingResponse):
    """A stream that, however it ends (done, client gone, error), runs ``on_close``
    (cancels the job) and closes its iterator at once."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001
                    pass
