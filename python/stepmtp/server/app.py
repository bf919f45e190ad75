"""The FastAPI application: llama-server's routes over one ``Engine``.

The model loads in a background thread once the server listens (``/health``
answers 503 until it is ready); generation runs in the worker thread
(``worker.Worker``), one request at a time, the rest queued; the event loop only
parses, tokenizes (large inputs in the thread pool) and writes responses, so ``/health`` and
``/metrics`` stay responsive while a request generates.

``create_app`` only composes: the state (``state``), the generation service the
routes share (``service``), the middleware (``middleware``), llama-server's error
answers, and one router per API family (``routes``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import Engine
from .config import ServerConfig
from ..api.errors import APIError, error_body
from .middleware import GateMiddleware, HeadersMiddleware, PrefixMiddleware, TimeoutMiddleware
from .routes import admin, anthropic, native, openai, responses
from ..api.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OAICompletionRequest,
                      TokenizeRequest, format_validation_error)
from .service import ClientGone, GenerationService
from .state import ServerState

__all__ = ["create_app", "ServerState"]

log = logging.getLogger("stepmtp.server")


def create_app(cfg: ServerConfig, *, engine_factory: Callable[[Path], Engine] | None = None,
               state: ServerState | None = None) -> FastAPI:
    """The ASGI app. ``engine_factory(path)`` replaces ``cfg.load_engine`` (tests)."""
    st = state or ServerState(cfg, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if cfg.threads_http > 0:  # --threads-http: the threads that run the requests' blocking work
            import anyio.to_thread

            anyio.to_thread.current_default_thread_limiter().total_tokens = cfg.threads_http
        threading.Thread(target=st.load, name="stepmtp-load", daemon=True).start()
        sleeper = asyncio.create_task(_sleep_when_idle(st)) if cfg.sleep_idle_seconds > 0 else None
        try:
            yield
        finally:
            if sleeper is not None:
                sleeper.cancel()
            await run_in_threadpool(st.close)

    app = FastAPI(
        title="stepmtp server",
        version=__version__,
        description="llama-server's HTTP API over Step-3.5/3.7-Flash with its MTP heads chained as "
                    "speculative decoding (stepmtp).",
        lifespan=lifespan,
    )
    app.state.stepmtp = st
    app.state.service = GenerationService(st)
    app.add_middleware(GateMiddleware, state=st)
    app.add_middleware(HeadersMiddleware, cors=cfg.cors)
    # added last: the outermost, so the prefix is gone and the timeouts hold before the rest
    app.add_middleware(PrefixMiddleware, prefix=cfg.api_prefix, static=cfg.static_path)
    app.add_middleware(TimeoutMiddleware, timeout=cfg.timeout)
    _error_handlers(app)
    # in this order the API docs list the families (by their tags) as they always did
    for family in (admin, openai, native, anthropic, responses):
        app.include_router(family.router)
    _request_schemas(app)
    return app


async def _sleep_when_idle(st: ServerState) -> None:
    """--sleep-idle-seconds: free the engine once no request has needed it for that long."""
    n = st.cfg.sleep_idle_seconds
    while True:
        await asyncio.sleep(min(1.0, n / 4))
        if st.ready.is_set() and not st.sleeping and st.engine is not None and st.idle_for() >= n:
            try:
                # what GET /props and /v1/models answer while asleep, taken while the engine is here
                st.asleep_bodies = {"/props": await admin.props_body(st), "/v1/models": openai.models_body(st)}
            except Exception:  # noqa: BLE001 - a request took the engine meanwhile: not idle after all
                continue
            await run_in_threadpool(st.sleep, n)


def _error_handlers(app: FastAPI) -> None:
    """Every error as llama-server's JSON error: a 400 for a body the models refuse,
    its "File Not Found" for a 404, a 500 naming the exception for the unexpected;
    499 and no body when the client left before its answer."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(format_validation_error(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            body = error_body("File Not Found", "not_found_error")
        else:
            body = error_body(str(exc.detail), "invalid_request_error")
            body["error"]["code"] = exc.status_code
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)


# the OpenAPI spec: the request models the routes parse themselves
_REQUEST_MODELS = [CompletionRequest, OAICompletionRequest, ChatCompletionRequest, TokenizeRequest,
                   DetokenizeRequest]


def _request_schemas(app: FastAPI) -> None:
    """The spec with the request models' schemas, which the routes' bodies refer to
    (``web.json_body``): the routes read their bodies themselves, so FastAPI does not
    list the models."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _REQUEST_MODELS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps[model.__name__] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
