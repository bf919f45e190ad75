"""llama-server's middleware: the gate before routing (503 while the model loads, the
API key outside the public paths), its response headers (CORS, header case), and its
--timeout, --api-prefix and --path."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import mimetypes
import os
from typing import Any

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api.errors import APIError, error_body
from ..api.service import POOL
from .config import Cors
from .state import ServerState

log = logging.getLogger("stepmtp.server")

#: reachable without an API key: llama-server's public endpoints, no more (the API docs
#: and /slots, which shows other clients' prompts, need the key too)
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/"})
#: the chat page's own files, public like it (llama-server's web UI's paths)
UI_ASSETS = {"/sw.js": "application/javascript", "/manifest.webmanifest": "application/manifest+json",
             "/_app/version.json": "application/json"}
#: reachable while the model loads
LOADING_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
#: GET routes that answer while the server sleeps (--sleep-idle-seconds) without waking
#: it, as llama-server's; the chat page's files and the docs too
ASLEEP_PATHS = frozenset({"/health", "/v1/health", "/props", "/metrics", "/models", "/v1/models", "/"})



class GateMiddleware:
    """llama-server's pre-routing checks: 503 while loading, then the API key
    (``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``) outside the public paths."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if not self.state.ready.is_set() and path not in LOADING_PATHS:
            await JSONResponse(error_body("Loading model", "unavailable_error"), status_code=503)(scope, receive, send)
            return
        keys = self.state.cfg.api_keys
        if keys and path not in PUBLIC_PATHS and path not in UI_ASSETS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            key = headers.get("authorization", "") or headers.get("x-api-key", "")
            if key.startswith("Bearer "):
                key = key[len("Bearer "):]
            if not _key_matches(key, keys):
                log.warning("unauthorized: Invalid API Key")
                await JSONResponse(error_body("Invalid API Key", "authentication_error"),
                                   status_code=401)(scope, receive, send)
                return
            # one context-drafting pool per key (its digest: the key itself is kept nowhere)
            POOL.set(hashlib.sha256(key.encode()).hexdigest()[:16])
        st = self.state
        if st.cfg.sleep_idle_seconds <= 0 or (scope.get("method") == "GET" and (
                path in ASLEEP_PATHS or path in UI_ASSETS or path in LOADING_PATHS)):
            await self.app(scope, receive, send)
            return
        # a request that needs the engine: it wakes the server (the model loads again
        # first) and keeps it awake until its response is sent
        try:
            await run_in_threadpool(st.enter)
        except APIError as e:
            await JSONResponse(e.body(), status_code=e.code)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            st.leave()


class HeadersMiddleware:
    """Response headers as llama-server sends them. CORS, before the API key, by the
    --cors-* flags (``Cors``; by default every response carries the caller's Origin
    back); a preflight (OPTIONS, any path) is answered right here with the allowed
    credentials, methods and headers. And header names in its case
    (``Access-Control-Allow-Origin``): HTTP does not care, some clients' lookups do."""

    def __init__(self, app: ASGIApp, cors: Cors | None = None) -> None:
        self.app = app
        self.cors = cors or Cors()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k == b"origin"), None)
        allow = self.cors.allow_origin(given.decode("latin-1") if given is not None else None)
        if given is None and self.cors.credentials and self.cors.origins == "*":
            allow = None  # as before: no Origin, nothing to echo (a preflight echoes "")
        origin = allow.encode("latin-1") if allow is not None else None
        if scope.get("method") == "OPTIONS":
            c = self.cors
            headers = [(b"access-control-allow-origin", origin or b""),
                       (b"access-control-allow-credentials", b"true" if c.credentials else b"false"),
                       (b"access-control-allow-methods", c.methods.encode("latin-1")),
                       (b"access-control-allow-headers", c.headers.encode("latin-1")),
                       (b"content-type", b"text/html"), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": [(_title(k), v) for k, v in headers]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_llama_server_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if origin is not None:
                    headers.append((b"access-control-allow-origin", origin))
                message = {**message, "headers": [(_title(k), v) for k, v in headers]}
            await send(message)

        await self.app(scope, receive, send_llama_server_headers)


def _title(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))



def _key_matches(key: str, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys``, in time that does not depend on how much
    of it matches (every key is compared)."""
    given = key.encode("utf-8", "surrogateescape")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
    return ok



class TimeoutMiddleware:
    """llama-server's -to/--timeout: a request body that stalls, or a response the
    client stops taking, for this many seconds ends the connection."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = self.timeout
        reading = [True]  # the body: once it is in, receive() only waits for a disconnect

        async def timed_receive() -> Any:
            if not reading[0]:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), t)
            except asyncio.TimeoutError:
                log.warning("read timeout (%ss, -to) on %s", t, scope.get("path"))
                reading[0] = False
                return {"type": "http.disconnect"}
            if msg.get("type") != "http.request" or not msg.get("more_body", False):
                reading[0] = False
            return msg

        async def timed_send(message: Any) -> None:
            await asyncio.wait_for(send(message), t)

        await self.app(scope, timed_receive, timed_send)


class PrefixMiddleware:
    """--api-prefix (every route under the prefix, as llama-server serves them; other
    paths: 404) and --path (static files; a path naming a file under the folder is that
    file, ``/`` its index.html; the API routes otherwise)."""

    def __init__(self, app: ASGIApp, prefix: str = "", static: str | None = None) -> None:
        self.app = app
        self.prefix = prefix
        self.static = os.path.realpath(static) if static else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not (self.prefix or self.static):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.prefix:
            if path != self.prefix and not path.startswith(self.prefix + "/"):
                await JSONResponse(error_body("File Not Found", "not_found_error"), status_code=404)(
                    scope, receive, send)
                return
            path = path[len(self.prefix):] or "/"
            scope = {**scope, "path": path, "root_path": scope.get("root_path", "") + self.prefix}
        if self.static and scope.get("method") in ("GET", "HEAD"):
            f = self._file(path)
            if f is not None:
                from starlette.responses import FileResponse

                await FileResponse(f, media_type=mimetypes.guess_type(f)[0] or "application/octet-stream")(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _file(self, path: str) -> str | None:
        assert self.static is not None
        rel = path.lstrip("/") or "index.html"
        f = os.path.realpath(os.path.join(self.static, rel))
        if f != self.static and not f.startswith(self.static + os.sep):  # no way out of the folder
            return None
        return f if os.path.isfile(f) else None
