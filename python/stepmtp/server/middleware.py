"""llama-server's middleware: the gate before routing (503 while the model loads, the
API key outside the public paths) and its response headers (CORS, header case)."""
from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..api.errors import error_body
from ..api.service import POOL
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
        await self.app(scope, receive, send)


class HeadersMiddleware:
    """Response headers as llama-server sends them. CORS, before the API key: every
    response carries the caller's Origin back; a preflight (OPTIONS, any path) is
    answered right here, credentials allowed, methods GET and POST, any header. And
    header names in its case (``Access-Control-Allow-Origin``): HTTP does not care,
    some clients' lookups do."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = next((v for k, v in scope.get("headers", []) if k == b"origin"), None)
        if scope.get("method") == "OPTIONS":
            headers = [(b"access-control-allow-origin", origin or b""), (b"access-control-allow-credentials", b"true"),
                       (b"access-control-allow-methods", b"GET, POST"), (b"access-control-allow-headers", b"*"),
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

