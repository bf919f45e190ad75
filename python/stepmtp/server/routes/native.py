"""llama.cpp's native API, as llama-server serves it: ``/completion`` (prompt in, text,
probabilities and timings out, streamed as its SSE), tokens and text both ways, the
chat template applied, and its not-supported error for what this server does not do."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ...api import formats as F
from ...api.errors import APIError
from ...api.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ...api.service import check_tokens, pieces_size, tokenize_pieces
from ...engine import Completion
from ..service import off_loop
from ..web import SSEResponse, body, json_body, service

router = APIRouter()


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
        router.post(path, include_in_schema=False)(not_supported(what))


@router.post("/tokenize", tags=["tokens"], openapi_extra=json_body(TokenizeRequest),
             summary="Text to token ids")
async def tokenize(request: Request) -> dict[str, Any]:
    eng = service(request).state.need_engine()
    req = await body(request, TokenizeRequest)
    tokens = await off_loop(pieces_size(req.content), tokenize_pieces, eng, req.content, req.add_special,
                            req.parse_special)
    if not req.with_pieces:
        return {"tokens": tokens}
    check_tokens(eng, tokens)  # ids given as such have no piece when out of range
    out = []
    for t in tokens:
        piece = eng.model.token_to_piece(t, special=True)
        try:
            p: Any = piece.decode("utf-8")
        except UnicodeDecodeError:
            p = list(piece)
        out.append({"id": t, "piece": p})
    return {"tokens": out}


@router.post("/detokenize", tags=["tokens"], openapi_extra=json_body(DetokenizeRequest),
             summary="Token ids to text")
async def detokenize(request: Request) -> dict[str, str]:
    eng = service(request).state.need_engine()
    req = await body(request, DetokenizeRequest)
    check_tokens(eng, req.tokens)
    text = await off_loop(len(req.tokens), F.pieces_text, eng.model, req.tokens)
    return {"content": text}


@router.post("/apply-template", tags=["tokens"], openapi_extra=json_body(ChatCompletionRequest),
             summary="Chat messages to the prompt text (the GGUF's chat template)")
async def apply_template(request: Request) -> dict[str, str]:
    # llama-server reads the body as a chat request: the prompt its completion would
    # run on, tools, tool_choice and reasoning settings included
    svc = service(request)
    svc.state.need_engine()
    _, prompt = await svc.chat_prompt(await body(request, ChatCompletionRequest))
    return {"prompt": prompt}


# -- POST /completion: llama-server's native API ---------------------------------

@router.post("/completion", tags=["llama.cpp"], openapi_extra=json_body(CompletionRequest),
             summary="llama-server's completion: prompt in, text and timings out (stream: SSE)")
@router.post("/completions", include_in_schema=False, openapi_extra=json_body(CompletionRequest))
async def completion(request: Request) -> Any:
    svc = service(request)
    eng = svc.state.need_engine()
    req = await body(request, CompletionRequest)
    jobs = await svc.completion_jobs(req, req.prompt, stream=req.stream)
    gens, info = jobs.gens, jobs.info
    if not req.stream:
        outs = []
        for i, c in enumerate(await svc.results(gens, request)):
            info.prompt_text = eng.model.detokenize(c.prompt_tokens, unparse_special=True)
            outs.append(_select_fields(F.native_final(c, info, index=i, return_tokens=req.return_tokens),
                                       req.response_fields))
        return JSONResponse(outs[0] if len(outs) == 1 else outs)

    job, items = await svc.start(gens[0], request)
    n_prompt = len(gens[0].prompt_tokens)
    acc: dict[str, Any] = {"n": 0, "tokens": [], "probs": []}

    def on_chunk(ch: Any) -> list[str]:
        acc["n"] += len(ch.tokens)
        acc["tokens"].extend(ch.tokens)
        acc["probs"].extend(ch.probs)
        if not ch.text:
            return []
        toks, acc["tokens"] = acc["tokens"], []
        probs, acc["probs"] = acc["probs"], []
        return [F.sse(F.chunk_timings(F.native_partial(ch.text, toks, acc["n"], n_prompt, probs=probs, info=info),
                                      ch, info))]

    def on_done(c: Completion) -> list[str]:
        info.prompt_text = eng.model.detokenize(c.prompt_tokens, unparse_special=True)
        return [F.sse(_select_fields(F.native_final(c, info, stream=True), req.response_fields))]

    return SSEResponse(svc.stream_events(job, items, on_chunk, on_done, done_marker=False,
                                         progress=lambda p: F.native_partial("", [], 0, n_prompt, info=info)),
                       job.cancel)


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

