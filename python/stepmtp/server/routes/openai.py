"""OpenAI's API, as llama-server serves it: the models list, completions, chat
completions (the chat template, reasoning and tool calls; streamed as chunks ending in
``[DONE]``), the count of a chat prompt's tokens, and the control route that ends a
running chat's thinking."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...api import formats as F
from ...api.errors import bad_request
from ...api.schemas import ChatCompletionRequest, OAICompletionRequest
from ..web import SSEResponse, body, json_body, read_json, service

router = APIRouter()

#: tokenizer.ggml.model -> llama_vocab_type
_VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


@router.get("/models", tags=["openai"], summary="The model served (llama-server's and OpenAI's list)")
@router.get("/v1/models", tags=["openai"], summary="The model served (OpenAI's list)")
async def models(request: Request) -> dict[str, Any]:
    st = service(request).state
    asleep = st.asleep_bodies.get("/v1/models") if st.sleeping else None
    return asleep if asleep is not None else models_body(st)


def models_body(st: Any) -> dict[str, Any]:
    """GET /v1/models' answer (the engine loaded)."""
    cfg = st.cfg
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


# -- POST /v1/completions: OpenAI's completions ---------------------------------

@router.post("/v1/completions", tags=["openai"], openapi_extra=json_body(OAICompletionRequest),
             summary="OpenAI completions (stream: SSE ending in [DONE])")
async def oai_completions(request: Request) -> Any:
    svc = service(request)
    svc.state.need_engine()
    req = await body(request, OAICompletionRequest)
    jobs = await svc.completion_jobs(req, req.prompt, stream=req.stream)
    if not req.stream:
        return JSONResponse(jobs.response(await svc.results(jobs.gens, request)))
    job, items = await svc.start(jobs.gens[0], request)
    return SSEResponse(svc.sse_chunks(job, items, jobs.chunks()), job.cancel)


# -- POST /v1/chat/completions: OpenAI's chat -------------------------------------

@router.post("/v1/chat/completions", tags=["openai"], openapi_extra=json_body(ChatCompletionRequest),
             summary="OpenAI chat completions with the GGUF's chat template (stream: SSE ending in [DONE])")
@router.post("/chat/completions", include_in_schema=False, openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Any:
    svc = service(request)
    eng = svc.state.need_engine()
    req = await body(request, ChatCompletionRequest)
    if req.unsupported():
        raise bad_request(f"not supported by this server: {', '.join(req.unsupported())}")
    jobs = await svc.chat_jobs(req)
    if not req.stream:
        results = await svc.results(jobs.gens, request)
        res = jobs.response(results)
        if svc.cfg.verbose:  # llama-server's debug object: the native result, the prompt included
            jobs.info.prompt_text = eng.model.detokenize(results[0].prompt_tokens, unparse_special=True)
            res["__verbose"] = F.native_final(results[0], jobs.info)
        return JSONResponse(res)
    job, items = await svc.start(jobs.gens[0], request)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return SSEResponse(svc.sse_chunks(job, items, jobs.chunks(include_usage)), job.cancel)


@router.post("/v1/chat/completions/control", tags=["openai"],
             summary="Act on a running chat completion: {\"id\": ..., \"action\": \"reasoning_end\"}")
async def chat_control(request: Request) -> dict[str, Any]:
    st = service(request).state
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


# llama-server names the count as the Responses API does, on chat's route too
@router.post("/chat/completions/input_tokens", tags=["openai"], openapi_extra=json_body(ChatCompletionRequest),
             summary="Tokens a chat request's prompt takes")
@router.post("/v1/chat/completions/input_tokens", include_in_schema=False,
             openapi_extra=json_body(ChatCompletionRequest))
async def chat_input_tokens(request: Request) -> dict[str, Any]:
    svc = service(request)
    svc.state.need_engine()
    _, _, toks = await svc.chat_tokens(await body(request, ChatCompletionRequest))
    return {"input_tokens": len(toks), "object": "response.input_tokens"}
