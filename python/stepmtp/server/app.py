"""The FastAPI application: llama-server's routes over one ``Engine``.

The model loads in a background thread once the server listens (``/health``
answers 503 until it is ready); generation runs in the worker thread
(``worker.Worker``), one request at a time, the rest queued; the event loop only
parses, tokenizes (large inputs in the thread pool) and writes responses, so ``/health`` and
``/metrics`` stay responsive while a request generates.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..budget import ReasoningBudget
from ..chat import (render_builtin, render_chat as render_chat_text, template_caps, template_source,
                    user_turn_start)
from ..chat.sandbox import TemplateSandbox
from ..engine import Completion, Engine, SlotBusy
from ..sampling import SamplingParams
from . import anthropic as A
from . import formats as F
from . import responses as R
from .anthropic import to_openai as to_anthropic_openai
from .config import DEFAULT_SEED, ServerConfig
from .errors import APIError, bad_request, error_body
from .chat import (REASONING_FORMATS, ChatFormat, delta_json, is_step_template, message_json as chat_message,
                   normalize_messages, preserved_tokens, tool_call_grammar)
from .metrics import Metrics
from .schemas import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                      DetokenizeRequest, GenerationFields, OAICompletionRequest, PromptPieces,
                      TokenizeRequest, format_validation_error)
from .worker import Cancelled, Channel, GenRequest, Job, Worker

log = logging.getLogger("stepmtp.server")

M = TypeVar("M", bound=BaseModel)

#: reachable without an API key: llama-server's public endpoints, no more (the API docs
#: and /slots, which shows other clients' prompts, need the key too)
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/"})
#: the chat page's own files, public like it (llama-server's web UI's paths)
UI_ASSETS = {"/sw.js": "application/javascript", "/manifest.webmanifest": "application/manifest+json",
             "/_app/version.json": "application/json"}
#: reachable while the model loads
LOADING_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

#: tokenizer.ggml.model -> llama_vocab_type
_VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}

#: how often a waiting non-streamed request checks that its client is still there
DISCONNECT_POLL_S = 0.25
#: a stream writes at most one batch of events per this many seconds: tokens that come
#: faster (the tokens of one speculative round come at once) share a socket write, so
#: the event loop does not take the GIL from the generating thread for every token.
#: Tokens slower than this go out one by one, as they come.
STREAM_FLUSH_S = 0.01
#: inputs smaller than this (characters or tokens) are processed on the event loop:
#: a thread-pool hop costs more than the work
INLINE_LIMIT = 4096


class ClientGone(Exception):
    """The client closed the connection; nobody is left to answer."""


# -- state ------------------------------------------------------------------------


class ServerState:
    """The engine and everything around it, shared by the routes."""

    def __init__(self, cfg: ServerConfig, engine_factory: Callable[[Path], Engine] | None = None) -> None:
        self.cfg = cfg
        self.engine_factory = engine_factory or cfg.load_engine
        self.ready = threading.Event()
        self.failed: str | None = None
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.metrics = Metrics()
        self.model_path: Path | None = None
        self.model_name = cfg.model_name() if cfg.model or cfg.aliases else "stepmtp-default"
        self.eog_tokens: list[int] = []
        #: the chat format's marker tokens, kept as text in chat output
        self.preserved: frozenset[int] = frozenset()
        self.n_draft = 0
        self.memory: dict[str, dict[str, int]] = {}
        #: called (from the loading thread) when the model cannot be loaded: stops the server
        self.on_fatal: Callable[[], None] | None = None
        self.exit_code = 0
        self._closed = False
        #: chat templates render here: bounded in time, output and memory, off the event loop
        self.templates = TemplateSandbox(timeout=cfg.template_timeout, max_chars=cfg.template_max_chars)

    # -- loading ----------------------------------------------------------------

    def load(self) -> None:
        cfg = self.cfg
        try:
            path = cfg.model_path()
            self.model_path = path
            self.model_name = cfg.model_name(path)
            log.info("loading model %s%s", path, f" (draft/MTP model {cfg.mtp_model})" if cfg.speculative
                     and cfg.mtp_model else "")
            t0 = time.perf_counter()
            engine = self.engine_factory(path)
            self.engine = engine
            m = engine.model
            self.eog_tokens = [t for t in range(m.n_vocab) if m.is_eog(t)]
            self.preserved = preserved_tokens(m)
            from ..grammar import vocabulary

            vocabulary(m)  # the grammar backend's view of the vocabulary: built once, at load
            self.templates.render("", {})  # a template worker started now, not on the first chat
            self.n_draft = engine.driver.n_draft
            log.info("model: %s (%s, %s parameters, %.1f MiB), n_ctx_train %d, loaded in %.2f s",
                     self.model_name, m.description, _si(m.n_params), m.size / 2**20, m.n_ctx_train,
                     time.perf_counter() - t0)
            src = f"from {cfg.mtp_model}" if cfg.speculative and cfg.mtp_model else "in the target file"
            if engine.draft_model is not None:
                log.info("MTP heads: %d found (%s)", engine.n_heads, src)
            else:
                log.info("MTP heads: %d/%d in the file, not used", m.n_mtp_blocks_loaded, m.n_mtp_blocks)
            if cfg.speculative:
                log.info("speculation: draft-mtp, mode %s, n_max %d (%d drafted per round), n_min %d, p_min %.2f",
                         cfg.mtp_mode, cfg.n_max, self.n_draft, cfg.n_min, cfg.p_min)
            else:
                log.info("speculation: none (--spec-type draft-mtp to draft with the MTP heads)")
            if engine.target.batch_invariant:
                log.info("batch-invariant target: decodes of up to %d rows computed a row at a time, attention "
                         "over the whole KV cache", engine.target.batch_invariant)
            log.info("context: n_ctx %d, n_batch %d, n_ubatch %d", engine.n_ctx, engine.target.n_batch,
                     engine.target.n_ubatch)
            log.info("slots: %d, decoded together; n_ctx per slot %d (%s KV cache)", engine.n_parallel,
                     engine.n_ctx, "unified" if engine.target.kv_unified else "split")
            # llama.cpp's buffers: fixed once the contexts exist (the output buffer may grow)
            self.memory = engine.memory()
            mib = {k: {kk: v / 2**20 for kk, v in d.items()} for k, d in self.memory.items()}
            log.info("memory (MiB): target KV %.2f, compute %.2f; draft KV %.2f (%d heads, one layer each), "
                     "compute %.2f; sliding-window cache %s, %d context checkpoints per slot",
                     mib["target"]["kv"], mib["target"]["compute"], mib["draft"]["kv"],
                     sum(d is not None for d in engine.drafts), mib["draft"]["compute"],
                     "full" if engine.target.swa_full else "window + ubatch",
                     engine.driver.n_checkpoints)
            self.worker = Worker(engine, on_done=self._on_done)
            self.ready.set()
            log.info("server is listening on http://%s:%d - ready", _host_for_url(cfg.host), cfg.port)
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            self.failed = f"{type(e).__name__}: {e}"
            self.exit_code = 1
            log.error("failed to load the model: %s", e)
            if self.on_fatal is not None:
                self.on_fatal()

    def _on_done(self, job: Job, result: Completion | None, error: BaseException | None, n_seen: int) -> None:
        self.metrics.record(result, cancelled=isinstance(error, Cancelled), failed=error is not None
                            and not isinstance(error, Cancelled))

    def begin_shutdown(self) -> None:
        """The server stops: end the running and waiting generations now, so that their
        streams finish (with an error event) instead of being cut after the grace period."""
        if self.worker is not None:
            self.worker.cancel_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.templates.close()
        stopped = True
        if self.worker is not None:
            stopped = self.worker.stop()
        if self.engine is not None and stopped:
            self.engine.close()

    # -- helpers for the routes ---------------------------------------------------

    def need_engine(self) -> Engine:
        if not self.ready.is_set() or self.engine is None:
            raise APIError("Loading model", "unavailable_error")
        return self.engine

    def mtp_mode(self) -> str:
        return self.cfg.mtp_mode if self.cfg.speculative else "none"


# -- middleware -----------------------------------------------------------------


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


# -- the app --------------------------------------------------------------------


def create_app(cfg: ServerConfig, *, engine_factory: Callable[[Path], Engine] | None = None,
               state: ServerState | None = None) -> FastAPI:
    """The ASGI app. ``engine_factory(path)`` replaces ``cfg.load_engine`` (tests)."""
    st = state or ServerState(cfg, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=st.load, name="stepmtp-load", daemon=True).start()
        try:
            yield
        finally:
            await run_in_threadpool(st.close)

    app = FastAPI(
        title="stepmtp server",
        version=__version__,
        description="llama-server's HTTP API over Step-3.5/3.7-Flash with its MTP heads chained as "
                    "speculative decoding (stepmtp).",
        lifespan=lifespan,
    )
    app.state.stepmtp = st
    app.add_middleware(GateMiddleware, state=st)
    app.add_middleware(HeadersMiddleware)

    # -- errors -----------------------------------------------------------------

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

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)

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
        limit = cfg.max_body_bytes
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

    # -- simple routes ------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    async def ui() -> Response:
        # a small chat page over /v1/chat/completions (reasoning, streaming, MTP counts)
        if not cfg.ui:
            raise StarletteHTTPException(404)
        return Response((Path(__file__).parent / "static" / "index.html").read_bytes(),
                        media_type="text/html; charset=utf-8")

    async def ui_asset(request: Request) -> Response:
        if not cfg.ui:
            raise StarletteHTTPException(404)
        path = request.url.path
        if path == "/_app/version.json":
            return JSONResponse({"version": __version__})
        return Response((Path(__file__).parent / "static" / path.lstrip("/")).read_bytes(), media_type=UI_ASSETS[path])

    for _path in UI_ASSETS:
        app.add_api_route(_path, ui_asset, methods=["GET"], include_in_schema=False)

    @app.get("/health", tags=["server"], summary="200 when ready, 503 while the model loads")
    @app.get("/v1/health", include_in_schema=False)
    async def health() -> Any:
        # an engine that lost what it runs on (an RPC server) is not healthy: load
        # balancers drain it rather than send requests that fail
        why = st.engine.unusable() if st.engine is not None else None
        if why:
            return JSONResponse(error_body(why, "unavailable_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/props", tags=["server"], summary="Server properties, as llama-server's")
    async def props() -> dict[str, Any]:
        eng = st.need_engine()
        m = eng.model
        caps = await run_in_threadpool(template_caps, m, cfg.chat_template_source(),
                                       sandbox=st.templates)  # probed once per template
        return {
            "default_generation_settings": {
                "params": F.generation_settings(default_settings(st)),
                "n_ctx": eng.n_ctx,
            },
            "total_slots": cfg.total_slots,
            "model_alias": st.model_name,
            "model_path": str(st.model_path),
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": "<__media__>",
            "endpoint_slots": cfg.endpoint_slots,
            "endpoint_props": False,
            "endpoint_metrics": True,
            "ui": False,
            "ui_settings": {},
            "chat_template": m.chat_template or "",
            "chat_template_caps": caps,
            "bos_token": _special_text(m, m.bos),
            "eos_token": _special_text(m, m.eos),
            "build_info": f"stepmtp-{__version__}",
            "is_sleeping": False,
            "cors_proxy_enabled": False,
            "stepmtp": {
                "version": __version__,
                "spec_type": cfg.spec_type,
                "mtp_mode": st.mtp_mode(),
                "mtp_model": cfg.mtp_model,
                "n_heads": eng.n_heads,
                "n_max": cfg.n_max,
                "n_draft": st.n_draft,
                "n_min": cfg.n_min,
                "p_min": cfg.p_min,
                "batch_invariant": eng.target.batch_invariant,
                "n_parallel": cfg.n_parallel,
                "concurrent_sequences": eng.n_parallel,
                # bytes of llama.cpp's buffers (KV cache, compute, output) per context
                "memory": st.memory,
                "swa_full": eng.target.swa_full,
                "ctx_checkpoints": eng.driver.n_checkpoints,
            },
        }

    @app.get("/slots", tags=["server"], summary="Each slot's state, as llama-server's")
    async def slots(fail_on_no_slot: int = 0) -> Any:
        if not cfg.endpoint_slots:
            raise APIError("This server does not support slots endpoint. Start it with `--slots`",
                           "not_supported_error")
        eng = st.need_engine()
        out = []
        sl = eng.slots
        for i in range(sl.n):
            req = sl.slots[i] or sl.last[i]
            item: dict[str, Any] = {"id": i, "n_ctx": eng.n_ctx, "speculative": st.n_draft > 0,
                                    "is_processing": sl.slots[i] is not None}
            if req is not None:
                settings = F.Settings(sampling=req.params, seed=cfg.seed_u32 if req.params.seed is None
                                      else req.params.seed, n_predict=req.n_predict, stop=list(req.asm.stop),
                                      stream=False)
                n_remain = -1 if req.n_predict < 0 else max(0, req.n_predict - req.n_decoded)
                item.update({
                    "id_task": req.id,
                    "n_prompt_tokens": len(req.prompt_tokens),
                    "n_prompt_tokens_processed": req.state.n_prefilled,
                    "n_prompt_tokens_cache": req.state.stats.n_prompt_cached,
                    "params": F.generation_settings(settings),
                    "next_token": [{"has_next_token": not req.done, "has_new_line": "\n" in req.asm.text,
                                    "n_remain": n_remain, "n_decoded": req.n_decoded}],
                    "prompt": eng.detokenize(req.prompt_tokens),
                    "generated": req.asm.text,
                    "stepmtp": {"drafted": req.state.stats.n_drafted, "accepted": req.state.stats.n_accepted,
                                "rounds": req.state.stats.n_rounds,
                                "ctx_checkpoints": len(req.state.checkpoints)},
                })
            out.append(item)
        if fail_on_no_slot and all(x["is_processing"] for x in out):
            raise APIError("no slot available", "unavailable_error")
        return out

    @app.get("/models", tags=["openai"], summary="The model served (llama-server's and OpenAI's list)")
    @app.get("/v1/models", tags=["openai"], summary="The model served (OpenAI's list)")
    async def models() -> dict[str, Any]:
        eng = st.need_engine()
        m = eng.model
        info = {
            "id": st.model_name,
            "aliases": sorted(cfg.aliases),
            "tags": list(cfg.tags),
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {
                "vocab_type": _VOCAB_TYPES.get(m.meta("tokenizer.ggml.model") or "", 0),
                "n_vocab": m.n_vocab,
                "n_ctx": eng.n_ctx,
                "n_ctx_train": m.n_ctx_train,
                "n_embd": m.n_embd,
                "n_params": m.n_params,
                "size": m.size,
            },
        }
        return {
            "models": [{
                "name": st.model_name, "model": st.model_name, "modified_at": "", "size": "", "digest": "",
                "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                              "families": [""], "parameter_size": "", "quantization_level": ""},
            }],
            "object": "list",
            "data": [info],
        }

    # llama-server's routes for what this server does not do: its not-supported error
    # (501, naming what), not a 404 a client would take for a wrong address
    not_served = {"embeddings": ("/embedding", "/embeddings", "/v1/embeddings"),
                  "reranking": ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"),
                  "infill": ("/infill",),
                  "audio transcription": ("/audio/transcriptions", "/v1/audio/transcriptions")}

    def not_supported(what: str) -> Callable[[], Any]:
        async def route() -> Any:
            raise APIError(f"This server does not support {what}: it serves text generation only",
                           "not_supported_error")
        return route

    for what, paths in not_served.items():
        for path in paths:
            app.post(path, include_in_schema=False)(not_supported(what))

    @app.post("/slots/{id_slot}", tags=["server"],
              summary="A slot's cache to a file and back: ?action=save|restore|erase, body {\"filename\": ...}")
    async def slot_action(id_slot: str, request: Request, action: str = "") -> dict[str, Any]:
        eng = st.need_engine()
        if not cfg.slot_save_path:
            raise APIError("This server does not support slots action. Start it with `--slot-save-path`",
                           "not_supported_error")
        try:
            slot = int(id_slot)
        except ValueError:
            raise bad_request("Invalid slot ID") from None
        if action not in ("save", "restore", "erase"):
            raise bad_request("Invalid action")
        path = None
        if action != "erase":
            raw = await read_body(request)
            try:
                filename = json.loads(raw or b"{}").get("filename")
            except (ValueError, AttributeError):
                filename = None
            if not _valid_filename(filename):
                raise bad_request("Invalid filename")
            path = Path(cfg.slot_save_path) / filename
        t0 = time.perf_counter()
        try:
            if action == "save":
                n, size = await run_in_threadpool(eng.save_slot, slot, path)
                return {"id_slot": slot, "filename": path.name, "n_saved": n, "n_written": size,
                        "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
            if action == "restore":
                if not path.is_file():
                    raise bad_request(f"slot file {path.name} not found")
                n, size = await run_in_threadpool(eng.restore_slot, slot, path)
                return {"id_slot": slot, "filename": path.name, "n_restored": n, "n_read": size,
                        "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}
            return {"id_slot": slot, "n_erased": await run_in_threadpool(eng.erase_slot, slot)}
        except SlotBusy as e:
            raise APIError(str(e), "unavailable_error") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    @app.get("/metrics", tags=["server"], response_class=PlainTextResponse,
             summary="Prometheus metrics (llama-server's, plus the MTP heads' per depth)")
    async def metrics() -> Response:
        w = st.worker
        text = st.metrics.render(processing=w.n_running if w else 0, deferred=w.n_waiting if w else 0)
        return Response(text, media_type="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(st.metrics.t_start)})

    @app.post("/tokenize", tags=["tokens"], openapi_extra=json_body(TokenizeRequest),
              summary="Text to token ids")
    async def tokenize(request: Request) -> dict[str, Any]:
        eng = st.need_engine()
        req = await body(request, TokenizeRequest)
        tokens = await off_loop(_size(req.content), _tokenize_pieces, eng, req.content, req.add_special,
                                req.parse_special)
        if not req.with_pieces:
            return {"tokens": tokens}
        _check_tokens(eng, tokens)  # ids given as such have no piece when out of range
        out = []
        for t in tokens:
            piece = eng.model.token_to_piece(t, special=True)
            try:
                p: Any = piece.decode("utf-8")
            except UnicodeDecodeError:
                p = list(piece)
            out.append({"id": t, "piece": p})
        return {"tokens": out}

    @app.post("/detokenize", tags=["tokens"], openapi_extra=json_body(DetokenizeRequest),
              summary="Token ids to text")
    async def detokenize(request: Request) -> dict[str, str]:
        eng = st.need_engine()
        req = await body(request, DetokenizeRequest)
        _check_tokens(eng, req.tokens)
        text = await off_loop(len(req.tokens), eng.model.detokenize, req.tokens, unparse_special=True)
        return {"content": text}

    @app.post("/apply-template", tags=["tokens"], openapi_extra=json_body(ChatCompletionRequest),
              summary="Chat messages to the prompt text (the GGUF's chat template)")
    async def apply_template(request: Request) -> dict[str, str]:
        # llama-server reads the body as a chat request: the prompt its completion would
        # run on, tools, tool_choice and reasoning settings included
        eng = st.need_engine()
        _, prompt = await chat_prompt(eng, await body(request, ChatCompletionRequest))
        return {"prompt": prompt}

    # -- generation -------------------------------------------------------------------

    async def prepare(eng: Engine, req: GenerationFields, prompts: list[list[int]], *, stream: bool,
                      grammar: tuple[str, Any] | None = None) -> tuple[list[GenRequest], F.Settings]:
        """Resolve a request's settings and check its prompts; every client error is a 400 here."""
        bad = req.unsupported()
        if bad:
            raise bad_request(f"not supported by this server: {', '.join(bad)}")
        if len(prompts) > cfg.max_prompts:
            raise bad_request(f"{len(prompts)} prompts in one request; at most {cfg.max_prompts} (--max-prompts)")
        if len(req.stop) > cfg.max_stop:
            raise bad_request(f"{len(req.stop)} stop strings; at most {cfg.max_stop} (--max-stop)")
        if any(len(x) > cfg.max_stop_len for x in req.stop):
            raise bad_request(f"a stop string is longer than {cfg.max_stop_len} characters (--max-stop-length)")
        if len(req.logit_bias) > cfg.max_logit_bias:
            raise bad_request(f"{len(req.logit_bias)} logit_bias entries; at most {cfg.max_logit_bias} "
                              "(--max-logit-bias)")
        n_cmpl = req.n_cmpl if req.n_cmpl is not None else (req.n if req.n is not None else 1)
        if n_cmpl > cfg.total_slots:
            raise bad_request(f"n_cmpl (n) must be between 1 and {cfg.total_slots} (the server's -np)")
        if stream and len(prompts) * n_cmpl > 1:
            raise bad_request("streaming supports one prompt and n = 1")
        try:
            n_probs = req.requested_n_probs()
        except ValueError as e:
            raise bad_request(str(e)) from None
        if n_probs > cfg.max_n_probs:
            raise bad_request(f"n_probs (top_logprobs) must be at most {cfg.max_n_probs}")
        try:
            spec = grammar or req.requested_grammar()
        except ValueError as e:
            raise bad_request(str(e)) from None
        grammar = None
        if spec is not None:
            from ..grammar import Constraint

            try:
                grammar = await run_in_threadpool(Constraint.compile, eng.model, *spec)
            except ValueError as e:
                raise bad_request(f"invalid grammar: {e}") from None
        # llama-server: -n is the default for a request that gives no limit of its own
        n_predict = req.requested_n_predict()
        n_predict = cfg.n_predict if n_predict is None else n_predict
        sampling, seed_shown = resolve_sampling(eng, req)
        for toks in prompts:
            if not toks:
                raise bad_request("the prompt is empty")
            _check_tokens(eng, toks)
            if len(toks) >= eng.n_ctx:
                raise APIError(f"request ({len(toks)} tokens) exceeds the available context size "
                               f"({eng.n_ctx} tokens), try increasing it", "exceed_context_size_error",
                               n_prompt_tokens=len(toks), n_ctx=eng.n_ctx)
        gens = [GenRequest(list(toks), n_predict, list(req.stop), sampling, stream, req.cache_prompt,
                           n_probs, req.post_sampling_probs, grammar=grammar,
                           return_progress=stream and req.return_progress)
                for toks in prompts for _ in range(n_cmpl)]
        settings = F.Settings(
            sampling=sampling, seed=seed_shown, n_predict=n_predict, stop=list(req.stop), stream=stream,
            ignore_eos=req.ignore_eos, logit_bias=[(t, None if b == float("-inf") else b)
                                                   for t, b in sampling.logit_bias.items()],
            spec_type=cfg.spec_type, n_max=cfg.n_max, n_min=cfg.n_min, p_min=cfg.p_min, mtp_mode=cfg.mtp_mode,
            n_probs=n_probs, post_sampling_probs=req.post_sampling_probs,
        )
        return gens, settings

    def resolve_sampling(eng: Engine, req: GenerationFields) -> tuple[SamplingParams, int]:
        base = cfg.sampling
        kw: dict[str, Any] = {}
        if req.temperature is not None:
            kw["temperature"] = max(0.0, req.temperature)
        if req.top_k is not None:
            kw["top_k"] = max(0, req.top_k)
        if req.top_p is not None:
            kw["top_p"] = min(1.0, max(0.0, req.top_p))
        if req.min_p is not None:
            kw["min_p"] = min(1.0, max(0.0, req.min_p))
        for name in ("repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "typical_p",
                     "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
                     "min_keep"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        order = req.requested_samplers()
        if order is not None:
            kw["samplers"] = order
        seed_shown = cfg.seed_u32
        if req.seed is not None and req.seed != -1 and (req.seed & 0xFFFFFFFF) != DEFAULT_SEED:
            kw["seed"] = req.seed & 0xFFFFFFFF
            seed_shown = kw["seed"]
        bias: dict[int, float] = {}
        for key, b in req.logit_bias:
            value = float("-inf") if b is None else b
            ids = [key] if isinstance(key, int) else eng.tokenize(key, add_special=False, parse_special=False)
            for t in ids:
                if 0 <= t < eng.model.n_vocab:  # llama-server ignores the others
                    bias[t] = value
        if req.ignore_eos:
            for t in st.eog_tokens:
                bias[t] = float("-inf")
        if bias:
            kw["logit_bias"] = bias
        try:
            return base.with_(**kw), seed_shown
        except ValueError as e:
            raise bad_request(str(e)) from None

    def result_info(eng: Engine, settings: F.Settings) -> F.ResultInfo:
        return F.ResultInfo(model=st.model_name, n_ctx=eng.n_ctx, settings=settings, mtp_mode=st.mtp_mode(),
                            n_heads=eng.n_heads, n_draft=st.n_draft, id=F.completion_id(),
                            created=int(time.time()), piece=eng.model.token_to_piece)

    def submit(gen: GenRequest) -> Job:
        w = st.worker
        if w is None:
            raise APIError("Loading model", "unavailable_error")
        if 0 <= cfg.max_queue <= w.n_waiting:
            raise APIError(f"the server is busy: {w.n_waiting} requests are waiting (--max-queue), retry later",
                           "unavailable_error")
        job = Job(gen, Channel(asyncio.get_running_loop()))
        try:
            w.submit(job)
        except RuntimeError as e:
            raise APIError(str(e), "unavailable_error") from None
        return job

    async def next_items(job: Job, request: Request) -> list[tuple[str, Any]]:
        """The job's next items; raises ClientGone (and cancels the job) if the client left."""
        while True:
            try:
                return await asyncio.wait_for(job.channel.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone() from None

    def raise_job_error(err: BaseException) -> None:
        if isinstance(err, Cancelled):
            raise APIError(str(err), "unavailable_error")
        if isinstance(err, ValueError):
            raise bad_request(str(err))
        raise APIError(f"generation failed: {type(err).__name__}: {err}", "server_error")

    async def run_all(jobs: list[Job], request: Request) -> list[Completion]:
        out: list[Completion] = []
        try:
            for job in jobs:
                while True:
                    items = await next_items(job, request)
                    kind, payload = items[-1]
                    if kind == "done":
                        out.append(payload)
                        break
                    if kind == "error":
                        raise_job_error(payload)
        finally:
            for job in jobs:
                job.cancel()  # a no-op for the finished ones
        return out

    async def first_items(job: Job, request: Request) -> list[tuple[str, Any]]:
        """Wait for the job to start producing: its errors become a plain error response,
        as llama-server answers a stream's first error."""
        try:
            items = await next_items(job, request)
        except BaseException:
            job.cancel()
            raise
        for kind, payload in items:
            if kind == "error":
                raise_job_error(payload)
        return items

    def gone() -> Response:
        return Response(status_code=499)

    async def stream_events(job: Job, items: list[tuple[str, Any]],
                            on_chunk: Callable[[Any], list[str]], on_done: Callable[[Completion], list[str]],
                            done_marker: bool, progress: Callable[[dict[str, int]], dict[str, Any]] | None = None
                            ) -> AsyncIterator[str]:
        """SSE text for the job's items: one event per token (llama-server's format),
        written in batches at most every STREAM_FLUSH_S. ``progress``: the event a
        prompt-progress report rides on (return_progress), ``prompt_progress`` added."""
        last_flush = 0.0
        out: list[str] = []
        while True:
            for kind, payload in items:
                if kind == "chunk" and payload.progress is not None:
                    if progress is not None:
                        out.append(F.sse({**progress(payload.progress), "prompt_progress": payload.progress}))
                elif kind == "chunk":
                    out.extend(on_chunk(payload))
                elif kind == "done":
                    out.extend(on_done(payload))
                    if done_marker:
                        out.append(F.SSE_DONE)
                    yield "".join(out)
                    return
                elif kind == "error":
                    code = "unavailable_error" if isinstance(payload, Cancelled) else "server_error"
                    out.append(F.sse(error_body(str(payload), code)))
                    yield "".join(out)
                    return
            if out:
                wait = last_flush + STREAM_FLUSH_S - time.perf_counter()
                if wait > 0:  # the last write was just now: gather what comes meanwhile
                    await asyncio.sleep(wait)
                    items = job.channel.get_nowait()
                    if items:
                        continue
                yield "".join(out)
                out = []
                last_flush = time.perf_counter()
            items = await job.channel.get()

    # -- POST /completion: llama-server's native API ---------------------------------

    @app.post("/completion", tags=["llama.cpp"], openapi_extra=json_body(CompletionRequest),
              summary="llama-server's completion: prompt in, text and timings out (stream: SSE)")
    @app.post("/completions", include_in_schema=False, openapi_extra=json_body(CompletionRequest))
    async def completion(request: Request) -> Any:
        eng = st.need_engine()
        req = await body(request, CompletionRequest)
        prompts = await off_loop(sum(map(_size, req.prompt)),
                                 lambda: [_tokenize_pieces(eng, p, True, True) for p in req.prompt])
        gens, settings = await prepare(eng, req, prompts, stream=req.stream)
        info = result_info(eng, settings)
        if not req.stream:
            jobs = [submit(g) for g in gens]
            try:
                results = await run_all(jobs, request)
            except ClientGone:
                return gone()
            outs = []
            for i, c in enumerate(results):
                info.prompt_text = eng.model.detokenize(c.prompt_tokens, unparse_special=True)
                outs.append(_select_fields(F.native_final(c, info, index=i, return_tokens=req.return_tokens),
                                           req.response_fields))
            return JSONResponse(outs[0] if len(outs) == 1 else outs)

        job = submit(gens[0])
        n_prompt = len(gens[0].prompt_tokens)
        try:
            items = await first_items(job, request)
        except ClientGone:
            return gone()
        acc: dict[str, Any] = {"n": 0, "tokens": [], "probs": []}

        def on_chunk(ch: Any) -> list[str]:
            acc["n"] += len(ch.tokens)
            acc["tokens"].extend(ch.tokens)
            acc["probs"].extend(ch.probs)
            if not ch.text:
                return []
            toks, acc["tokens"] = acc["tokens"], []
            probs, acc["probs"] = acc["probs"], []
            return [F.sse(F.native_partial(ch.text, toks, acc["n"], n_prompt, probs=probs, info=info))]

        def on_done(c: Completion) -> list[str]:
            info.prompt_text = eng.model.detokenize(c.prompt_tokens, unparse_special=True)
            return [F.sse(_select_fields(F.native_final(c, info, stream=True), req.response_fields))]

        return SSEResponse(stream_events(job, items, on_chunk, on_done, done_marker=False,
                                         progress=lambda p: F.native_partial("", [], 0, n_prompt, info=info)),
                           job.cancel)

    # -- POST /v1/completions: OpenAI's completions ---------------------------------

    @app.post("/v1/completions", tags=["openai"], openapi_extra=json_body(OAICompletionRequest),
              summary="OpenAI completions (stream: SSE ending in [DONE])")
    async def oai_completions(request: Request) -> Any:
        eng = st.need_engine()
        req = await body(request, OAICompletionRequest)
        prompts = await off_loop(sum(map(_size, req.prompt)),
                                 lambda: [_tokenize_pieces(eng, p, True, True) for p in req.prompt])
        gens, settings = await prepare(eng, req, prompts, stream=req.stream)
        info = result_info(eng, settings)
        if not req.stream:
            jobs = [submit(g) for g in gens]
            try:
                results = await run_all(jobs, request)
            except ClientGone:
                return gone()
            return JSONResponse(F.oai_completion(results, info))

        job = submit(gens[0])
        try:
            items = await first_items(job, request)
        except ClientGone:
            return gone()

        held: list[Any] = []

        def on_chunk(ch: Any) -> list[str]:
            held.extend(ch.probs)
            if not ch.text:
                return []
            probs = held[:]
            held.clear()
            return [F.sse(F.oai_completion_chunk(ch.text, info, probs=probs))]

        def on_done(c: Completion) -> list[str]:
            return [F.sse(F.oai_completion_final_chunk(c, info))]

        return SSEResponse(stream_events(job, items, on_chunk, on_done, done_marker=True,
                                         progress=lambda p: F.oai_completion_chunk("", info)), job.cancel)

    # -- POST /v1/chat/completions: OpenAI's chat -------------------------------------

    @app.post("/v1/chat/completions", tags=["openai"], openapi_extra=json_body(ChatCompletionRequest),
              summary="OpenAI chat completions with the GGUF's chat template (stream: SSE ending in [DONE])")
    @app.post("/chat/completions", include_in_schema=False, openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        eng = st.need_engine()
        req = await body(request, ChatCompletionRequest)
        if req.unsupported():
            raise bad_request(f"not supported by this server: {', '.join(req.unsupported())}")
        fmt, gens, info = await chat_jobs(eng, req)
        if not req.stream:
            jobs = [submit(g) for g in gens]
            try:
                results = await run_all(jobs, request)
            except ClientGone:
                return gone()
            res = F.oai_chat(results, info, [chat_message(fmt.parser(), c.text) for c in results])
            if cfg.verbose:  # llama-server's debug object: the native result, the prompt included
                info.prompt_text = eng.model.detokenize(results[0].prompt_tokens, unparse_special=True)
                res["__verbose"] = F.native_final(results[0], info)
            return JSONResponse(res)

        job = submit(gens[0])
        try:
            items = await first_items(job, request)
        except ClientGone:
            return gone()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        started = {"role": False}
        held: list[Any] = []
        parser = fmt.parser()

        def deltas(text: str, final: bool = False) -> list[dict[str, Any]]:
            out = delta_json(parser.feed(text)) if text else []
            return out + (delta_json(parser.finish()) if final else [])

        def role() -> list[str]:
            if started["role"]:
                return []
            started["role"] = True
            return [F.sse(F.oai_chat_chunk({"role": "assistant", "content": None}, info))]

        def on_chunk(ch: Any) -> list[str]:
            out = role()
            held.extend(ch.probs)
            for i, d in enumerate(deltas(ch.text)):
                probs = held[:] if i == 0 else []
                held.clear()
                out.append(F.sse(F.oai_chat_chunk(d, info, probs=probs)))
            return out

        def on_done(c: Completion) -> list[str]:
            out = role()
            out.extend(F.sse(F.oai_chat_chunk(d, info)) for d in deltas("", final=True))
            reason = F.chat_finish_reason(c, parser.message())
            out.extend(F.sse(x) for x in F.oai_chat_final_chunks(c, info, include_usage, reason))
            return out

        # llama-server sends the role delta with every progress report
        return SSEResponse(stream_events(job, items, on_chunk, on_done, done_marker=True,
                                         progress=lambda p: F.oai_chat_chunk({"role": "assistant", "content": None},
                                                                             info)), job.cancel)

    @app.post("/v1/chat/completions/control", tags=["openai"],
              summary="Act on a running chat completion: {\"id\": ..., \"action\": \"reasoning_end\"}")
    async def chat_control(request: Request) -> dict[str, Any]:
        payload = await read_json(request)
        payload = payload if isinstance(payload, dict) else {}
        cmpl_id, action = payload.get("id"), payload.get("action")
        if not isinstance(cmpl_id, str) or not cmpl_id:
            raise bad_request("missing completion id")
        if action != "reasoning_end":
            raise bad_request("unknown control action")
        # the worker's jobs in a slot, as llama-server looks among its slots
        gens = [job.request for job in (st.worker.running() if st.worker else []) if job.request.cmpl_id == cmpl_id]
        if not gens:
            return {"success": False, "message": "no active completion for this id"}
        budget = gens[0].reasoning_budget
        if budget is None or budget.control is None:
            return {"success": False, "message": "reasoning control not enabled for this completion"}
        budget.control.set()
        return {"success": True}

    async def chat_tokens(eng: Engine, req: ChatCompletionRequest) -> tuple[ChatFormat, str, list[int]]:
        """A chat request's prompt (text and tokens), and how to read its output back."""
        fmt, text = await chat_prompt(eng, req)
        return fmt, text, await off_loop(len(text), eng.tokenize, text, add_special=True, parse_special=True)

    async def tokens_before_user(eng: Engine, text: str) -> int:
        """llama-server's n_before_user: a chat prompt's tokens before its latest user
        message, where the latest user turn opens (0: none, or a --no-jinja template)."""
        if not st.cfg.use_jinja:
            return 0
        start = await run_in_threadpool(user_turn_start, eng.model, st.cfg.chat_template_source(),
                                        sandbox=st.templates)  # rendered once per template
        pos = text.rfind(start) if start else -1
        if pos < 0:
            return 0
        return len(await off_loop(pos, eng.tokenize, text[:pos], add_special=True, parse_special=True))

    async def chat_jobs(eng: Engine, req: ChatCompletionRequest) -> tuple[ChatFormat, list[GenRequest], F.ResultInfo]:
        """A chat request's generations, ready to submit, and how to read them back."""
        fmt, text, toks = await chat_tokens(eng, req)
        gens, settings = await prepare(eng, req, [toks], stream=req.stream,
                                       grammar=("lark", fmt.grammar) if fmt.grammar else None)
        n_before_user = await tokens_before_user(eng, text)
        settings.chat_format, settings.reasoning_format = fmt.name, fmt.reasoning_format
        info = result_info(eng, settings)
        for g in gens:
            g.preserved = fmt.preserved
            g.n_before_user = n_before_user
            g.reasoning_budget = fmt.reasoning_budget
            g.cmpl_id = info.id
        return fmt, gens, info

    # -- the chat APIs of other vendors: Anthropic's Messages, OpenAI's Responses ----------

    async def converted_request(request: Request, to_chat: Callable[[Any], dict[str, Any]]) -> ChatCompletionRequest:
        """Another API's request as the chat request it stands for (``to_chat``)."""
        payload = await read_json(request)
        try:
            return ChatCompletionRequest.model_validate(to_chat(payload), strict=False)
        except ValidationError as e:
            raise bad_request(format_validation_error(e)) from None

    async def answer_converted(request: Request, req: ChatCompletionRequest,
                               whole: Callable[[Completion, dict[str, Any], F.ResultInfo], dict[str, Any]],
                               events_for: Callable[[F.ResultInfo, GenRequest], Any]) -> Any:
        """Run a converted chat request; the answer in that API's shape: ``whole`` (the
        completion and its parsed message) or, streamed, its events object (``start()``,
        ``feed(delta)``, ``finish(completion, message)``: lists of SSE text)."""
        eng = st.need_engine()
        fmt, gens, info = await chat_jobs(eng, req)
        if not req.stream:
            try:
                (c,) = await run_all([submit(gens[0])], request)
            except ClientGone:
                return gone()
            return JSONResponse(whole(c, chat_message(fmt.parser(), c.text), info))
        job = submit(gens[0])
        try:
            items = await first_items(job, request)
        except ClientGone:
            return gone()
        parser = fmt.parser()
        events = events_for(info, gens[0])

        def on_chunk(ch: Any) -> list[str]:
            return events.feed(parser.feed(ch.text)) if ch.text else events.start()

        def on_done(c: Completion) -> list[str]:
            return events.feed(parser.finish()) + events.finish(c, parser.message())

        return SSEResponse(stream_events(job, items, on_chunk, on_done, done_marker=False), job.cancel)

    @app.post("/v1/messages", tags=["anthropic"], summary="Anthropic's Messages API (stream: Anthropic's events)")
    async def anthropic_messages(request: Request) -> Any:
        st.need_engine()
        req = await converted_request(request, to_anthropic_openai)
        msg_id = F.random_id("msg_")
        return await answer_converted(
            request, req, lambda c, m, info: A.message_json(c, m, info.model, msg_id),
            lambda info, gen: A.Events(info.model, msg_id, len(gen.prompt_tokens)))

    @app.post("/v1/responses", tags=["openai"], summary="OpenAI's Responses API (stream: the Responses events)")
    @app.post("/responses", include_in_schema=False)
    async def responses(request: Request) -> Any:
        st.need_engine()
        req = await converted_request(request, R.to_openai)
        resp_id = F.random_id("resp_")
        return await answer_converted(request, req, lambda c, m, info: R.response_json(c, m, info.model, resp_id),
                                      lambda info, gen: R.Events(info.model, resp_id))

    # llama-server names the count as the Responses API does, on chat's route too
    @app.post("/chat/completions/input_tokens", tags=["openai"], openapi_extra=json_body(ChatCompletionRequest),
              summary="Tokens a chat request's prompt takes")
    @app.post("/v1/chat/completions/input_tokens", include_in_schema=False,
              openapi_extra=json_body(ChatCompletionRequest))
    async def chat_input_tokens(request: Request) -> dict[str, Any]:
        eng = st.need_engine()
        _, _, toks = await chat_tokens(eng, await body(request, ChatCompletionRequest))
        return {"input_tokens": len(toks), "object": "response.input_tokens"}

    @app.post("/v1/responses/input_tokens", tags=["openai"], summary="Tokens a Responses request's prompt takes")
    @app.post("/responses/input_tokens", include_in_schema=False)
    async def responses_input_tokens(request: Request) -> dict[str, Any]:
        eng = st.need_engine()
        _, _, toks = await chat_tokens(eng, await converted_request(request, R.to_openai))
        return {"input_tokens": len(toks), "object": "response.input_tokens"}

    @app.post("/v1/messages/count_tokens", tags=["anthropic"], summary="Tokens the messages' prompt takes")
    async def anthropic_count_tokens(request: Request) -> dict[str, int]:
        eng = st.need_engine()
        _, _, toks = await chat_tokens(eng, await converted_request(request, to_anthropic_openai))
        return {"input_tokens": len(toks)}

    async def chat_prompt(eng: Engine, req: ChatCompletionRequest) -> tuple[ChatFormat, str]:
        """The prompt for a chat request, and how to read its output back."""
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(choice, str) and choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function, not {choice!r}")
        if req.tools is not None and not isinstance(req.tools, list):
            raise bad_request("'tools' must be a list")
        for i, t in enumerate(req.tools or []):
            if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")):
                raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        # the template sees each tool as llama-server passes it: name, description and
        # parameters alone, in that order (a client's "strict" or key order would
        # otherwise change the prompt)
        tools = [{"type": "function", "function": {"name": t["function"]["name"],
                                                   "description": t["function"].get("description", ""),
                                                   "parameters": t["function"].get("parameters", {})}}
                 for t in req.tools] if req.tools and choice != "none" else None
        forced: str | None = None  # the grammar of the call(s) tool_choice demands
        if choice not in ("auto", "none"):
            if not tools:
                raise bad_request("tool_choice 'required' or a function needs 'tools'")
            if isinstance(choice, dict):
                fn = choice.get("function") if isinstance(choice.get("function"), dict) else {}
                if not fn.get("name"):
                    raise bad_request("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
                forced = tool_call_grammar(tools, fn["name"], parallel=False)
            else:
                # llama-server: parallel_tool_calls is off unless asked for
                forced = tool_call_grammar(tools, parallel=req.parallel_tool_calls is True)
        variables: dict[str, Any] = {}
        if tools:
            variables["tools"] = tools
        if req.reasoning_effort is not None:
            variables["reasoning_effort"] = req.reasoning_effort
        variables.update(req.chat_template_kwargs or {})
        msgs = req.messages
        if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise bad_request("Cannot set both add_generation_prompt and continue_final_message")
        if len(msgs) >= 2 and msgs[-1].role == "assistant" and msgs[-2].role == "assistant":
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
        # a last assistant message is a prefill (llama-server): the answer continues it
        try:
            prefill = msgs[-1].text("\n\n") if msgs and msgs[-1].role == "assistant" and not (
                msgs[-1].model_extra or {}).get("tool_calls") else None
        except ValueError as e:
            raise bad_request(str(e)) from None
        text = await render_chat(eng, msgs, req.add_generation_prompt and prefill is None, variables,
                                 last_content=prefill)
        if prefill:
            cut = text.rfind(prefill)
            if cut >= 0:
                text = text[: cut + len(prefill)]
        rf = req.reasoning_format or cfg.reasoning_format
        if rf not in REASONING_FORMATS:
            raise bad_request(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {rf!r}")
        thinking = req.add_generation_prompt and prefill is None and text.rstrip().endswith("<think>")
        try:
            constrained = forced is not None or req.requested_grammar() is not None
        except ValueError as e:
            raise bad_request(str(e)) from None
        # llama-server: a request's thinking_budget_tokens, else --reasoning-budget
        budget = req.thinking_budget_tokens
        if budget is None or budget == -1:
            budget = cfg.reasoning_budget
        # no thinking when asked, and none under a grammar: the format is the answer, in content
        if thinking and (budget == 0 or constrained):
            # no thinking: the think block the template opened is closed right away
            text += "\n</think>\n" if not text.endswith("\n") else "</think>\n"
            thinking = False
        source = template_source(eng.model, cfg.chat_template_source())
        step = is_step_template(source)
        # llama-server's reasoning_control: a budget (none, -1, unless one is set) whose
        # think block a /v1/chat/completions/control request can end
        control = threading.Event() if req.reasoning_control else None
        thinks = (budget > 0 or control is not None) and (thinking or step) and not constrained
        fmt = ChatFormat(step=step, thinking=thinking, reasoning_format=rf, tools=tools,
                         parse_tools=bool(tools), preserved=st.preserved, grammar=forced,
                         reasoning_budget=ReasoningBudget(budget, cfg.reasoning_budget_message, control=control)
                         if thinks else None)
        return fmt, text

    # -- chat template ----------------------------------------------------------------

    async def render_chat(eng: Engine, messages: list[ChatMessage], add_generation_prompt: bool,
                          kwargs: dict[str, Any] | None, last_content: str | None = None) -> str:
        _check_messages(messages)
        source = st.cfg.chat_template_source()
        # llama.cpp's workarounds, by what the template reads (probed once per template);
        # its built-in templates (--no-jinja) take the messages as they are
        caps = await run_in_threadpool(template_caps, eng.model, source, sandbox=st.templates) \
            if st.cfg.use_jinja else None
        try:
            msgs = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
            if last_content is not None:  # a prefill, its parts joined as llama.cpp does
                msgs[-1]["content"] = last_content
            msgs = normalize_messages(msgs, caps, template_source(eng.model, source) if caps is not None else "")
        except ValueError as e:
            raise bad_request(str(e)) from None
        variables = {**st.cfg.chat_template_kwargs, **(kwargs or {})}
        # never on the event loop: the sandbox's worker process renders, this thread waits
        try:
            if not st.cfg.use_jinja:
                return await run_in_threadpool(render_builtin, eng.model, msgs, add_generation_prompt,
                                               st.cfg.chat_template)
            return await run_in_threadpool(render_chat_text, eng.model, msgs, add_generation_prompt=add_generation_prompt,
                                           template=source, variables=variables,
                                           sandbox=st.templates)
        except (ValueError, TypeError) as e:  # ChatTemplateError is a ValueError
            raise bad_request(f"chat template: {e}") from None

    # -- the OpenAPI spec: the request models the routes parse themselves -------------

    request_models = [CompletionRequest, OAICompletionRequest, ChatCompletionRequest, TokenizeRequest,
                      DetokenizeRequest]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in request_models:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                comps.setdefault(name, sub)
            comps[model.__name__] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


# -- helpers ------------------------------------------------------------------------


def default_settings(st: ServerState) -> F.Settings:
    cfg = st.cfg
    return F.Settings(sampling=cfg.sampling, seed=cfg.seed_u32, n_predict=cfg.n_predict, stop=[], stream=False,
                      spec_type=cfg.spec_type, n_max=cfg.n_max, n_min=cfg.n_min, p_min=cfg.p_min,
                      mtp_mode=cfg.mtp_mode)


async def off_loop(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: in the thread pool when the input is large, else right here."""
    if size >= INLINE_LIMIT:
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _size(pieces: PromptPieces) -> int:
    return sum(len(p) if isinstance(p, str) else 1 for p in pieces)


def _tokenize_pieces(eng: Engine, pieces: PromptPieces, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed(): strings tokenized (special tokens added only
    when the first piece is a string), token ids kept."""
    out: list[int] = []
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            out.extend(eng.tokenize(p, add_special=add_special and i == 0, parse_special=parse_special))
        else:
            out.append(p)
    return out


def _valid_filename(name: Any) -> bool:
    """A plain file name inside --slot-save-path: no directories, nothing hidden."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\0" not in name and not name.startswith(".") and name.strip() == name)


def _key_matches(key: str, keys: list[str]) -> bool:
    """Whether ``key`` is one of ``keys``, in time that does not depend on how much
    of it matches (every key is compared)."""
    given = key.encode("utf-8", "surrogateescape")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
    return ok


def _check_tokens(eng: Engine, tokens: list[int]) -> None:
    n = eng.model.n_vocab
    for t in tokens:
        if not 0 <= t < n:
            raise bad_request(f"token id {t} is out of range [0, {n})")


def _check_messages(messages: list[ChatMessage]) -> None:
    """llama-server's checks on ``messages``."""
    for i, m in enumerate(messages):
        fields = m.model_fields_set | set(m.model_extra or {})
        if m.role != "assistant" and "content" not in fields:
            raise bad_request(f"messages[{i}]: all non-assistant messages must contain 'content'")
        if m.role == "assistant" and "content" not in fields and "tool_calls" not in fields:
            raise bad_request(f"messages[{i}]: assistant message must contain either 'content' or 'tool_calls'")


def _select_fields(res: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's response_fields: keep the fields named; "a/b" moves a.b to the top as "a/b"."""
    if not fields:
        return res
    out: dict[str, Any] = {}
    for f in fields:
        cur: Any = res
        ok = True
        for part in f.split("/"):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                ok = False
                break
        if ok:
            out[f] = cur
    return out


def _special_text(m: Any, tok: int) -> str:
    if tok < 0:
        return ""
    return m.token_to_piece(tok, special=True).decode("utf-8", "replace")


def _si(n: int) -> str:
    for unit, k in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.2f}{unit}"
    return str(n)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
