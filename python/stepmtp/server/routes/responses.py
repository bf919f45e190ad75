"""OpenAI's Responses API, what its coding agents speak: a request becomes the chat
request it stands for (``responses.to_openai``), the answer comes back as reasoning,
message and function-call items, streamed as the Responses events."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ...api import formats as F
from .. import responses as R
from ..web import service
from .converted import answer_converted, converted_request

router = APIRouter()


@router.post("/v1/responses", tags=["openai"], summary="OpenAI's Responses API (stream: the Responses events)")
@router.post("/responses", include_in_schema=False)
async def responses(request: Request) -> Any:
    service(request).state.need_engine()
    req = await converted_request(request, R.to_openai)
    resp_id = F.random_id("resp_")
    return await answer_converted(request, req, lambda c, m, info: R.response_json(c, m, info.model, resp_id),
                                  lambda info, gen: R.Events(info.model, resp_id))


@router.post("/v1/responses/input_tokens", tags=["openai"], summary="Tokens a Responses request's prompt takes")
@router.post("/responses/input_tokens", include_in_schema=False)
async def responses_input_tokens(request: Request) -> dict[str, Any]:
    svc = service(request)
    svc.state.need_engine()
    _, _, toks = await svc.chat_tokens(await converted_request(request, R.to_openai))
    return {"input_tokens": len(toks), "object": "response.input_tokens"}
