"""Server administration, as llama-server's: the chat page and its files, health,
properties, slots (their state, and their caches to files and back) and the
Prometheus metrics."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...chat import template_caps
from ...engine import SlotBusy
from ...api import formats as F
from ...api.errors import APIError, bad_request, error_body
from ..middleware import UI_ASSETS
from ..service import default_settings
from ..web import read_body, service

router = APIRouter()

#: the chat page and its files
STATIC = Path(__file__).parent.parent / "static"


@router.get("/", include_in_schema=False)
async def ui(request: Request) -> Response:
    cfg = service(request).cfg
    # a small chat page over /v1/chat/completions (reasoning, streaming, MTP counts)
    if not cfg.ui:
        raise StarletteHTTPException(404)
    return Response((STATIC / "index.html").read_bytes(),
                    media_type="text/html; charset=utf-8")


async def ui_asset(request: Request) -> Response:
    cfg = service(request).cfg
    if not cfg.ui:
        raise StarletteHTTPException(404)
    path = request.url.path
    if path == "/_app/version.json":
        return JSONResponse({"version": __version__})
    return Response((STATIC / path.lstrip("/")).read_bytes(), media_type=UI_ASSETS[path])


for _path in UI_ASSETS:
    router.add_api_route(_path, ui_asset, methods=["GET"], include_in_schema=False)


@router.get("/health", tags=["server"], summary="200 when ready, 503 while the model loads")
@router.get("/v1/health", include_in_schema=False)
async def health(request: Request) -> Any:
    st = service(request).state
    # an engine that lost what it runs on (an RPC server) is not healthy: load
    # balancers drain it rather than send requests that fail
    why = st.engine.unusable() if st.engine is not None else None
    if why:
        return JSONResponse(error_body(why, "unavailable_error"), status_code=503)
    return {"status": "ok"}


@router.get("/props", tags=["server"], summary="Server properties, as llama-server's")
async def props(request: Request) -> dict[str, Any]:
    st = service(request).state
    asleep = st.asleep_bodies.get("/props") if st.sleeping else None
    if asleep is not None:  # llama-server's cached properties, without waking the server
        return {**asleep, "is_sleeping": True}
    return await props_body(st)


async def props_body(st: Any) -> dict[str, Any]:
    """GET /props' answer (the engine loaded)."""
    cfg = st.cfg
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
        "endpoint_props": cfg.endpoint_props,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": cfg.ui_config,
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


@router.post("/props", tags=["server"], summary="Change global properties (with --props), as llama-server's")
async def post_props(request: Request) -> Any:
    await read_body(request)
    if not service(request).state.cfg.endpoint_props:
        raise APIError("This server does not support changing global properties. Start it with `--props`",
                       "not_supported_error")
    # llama-server has no property to change yet either: it answers success
    return {"success": True}


@router.get("/slots", tags=["server"], summary="Each slot's state, as llama-server's")
async def slots(request: Request, fail_on_no_slot: int = 0) -> Any:
    st = service(request).state
    cfg = st.cfg
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


@router.post("/slots/{id_slot}", tags=["server"],
             summary="A slot's cache to a file and back: ?action=save|restore|erase, body {\"filename\": ...}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> dict[str, Any]:
    st = service(request).state
    cfg = st.cfg
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


@router.get("/lora-adapters", tags=["server"], summary="The LoRA adapters and their scales, as llama-server's")
async def lora_adapters(request: Request) -> Any:
    return service(request).state.need_engine().adapters.describe()


@router.post("/lora-adapters", tags=["server"],
             summary="Set the LoRA scales of requests that give none: [{\"id\": N, \"scale\": S}, ...]")
async def set_lora_adapters(request: Request) -> Any:
    from ...adapters import parse_lora

    raw = await read_body(request)
    eng = service(request).state.need_engine()
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise bad_request("Request body must be valid JSON") from None
    if not isinstance(body, list):
        raise bad_request("Request body must be an array")
    try:
        lora = parse_lora(body)
    except ValueError as e:
        raise bad_request(str(e)) from None
    await run_in_threadpool(eng.set_lora, lora)  # waits for the round in progress
    return {"success": True}


@router.get("/metrics", tags=["server"], response_class=PlainTextResponse,
            summary="Prometheus metrics (llama-server's, plus the MTP heads' per depth)")
async def metrics(request: Request) -> Response:
    st = service(request).state
    w = st.worker
    text = st.metrics.render(processing=w.n_running if w else 0, deferred=w.n_waiting if w else 0)
    return Response(text, media_type="text/plain; version=0.0.4",
                    headers={"Process-Start-Time-Unix": str(st.metrics.t_start)})


def _valid_filename(name: Any) -> bool:
    """A plain file name inside --slot-save-path: no directories, nothing hidden."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\0" not in name and not name.startswith(".") and name.strip() == name)


def _special_text(m: Any, tok: int) -> str:
    if tok < 0:
        return ""
    return m.token_to_piece(tok, special=True).decode("utf-8", "replace")

