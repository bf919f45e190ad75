"""The HTTP side the routers share: the generation service a request's app holds,
request bodies read under the size limit and validated, a body's schema in the
OpenAPI spec, and the response that streams a job's events."""
from __future__ import annotations

import asyncio
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
        inner = self.body_iterator
        app = scope.get("app")
        ping = getattr(getattr(getattr(app, "state", None), "service", None), "cfg", None)
        interval = getattr(ping, "sse_ping_interval", 0) or 0
        if interval > 0:
            self.body_iterator = _pinged(inner, interval)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            for it in {id(x): x for x in (self.body_iterator, inner)}.values():
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # noqa: BLE001
                        pass


async def _pinged(items: Any, interval: float) -> AsyncIterator[Any]:
    """``items``, with llama-server's SSE ping (a comment line) whenever none came for
    ``interval`` seconds: some clients (undici) drop a silent stream, e.g. a long prompt's."""
    it = items.__aiter__()
    nxt: asyncio.Future[Any] | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=interval)
            if not done:
                yield ":\n\n"
                continue
            fut, nxt = nxt, None
            try:
                item = fut.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if nxt is not None:
            nxt.cancel()
