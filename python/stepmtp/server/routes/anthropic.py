"""Anthropic's Messages API, as llama-server serves it: a request becomes the chat
request it stands for (``anthropic.to_openai``), the answer comes back as content
blocks, streamed as Anthropic's events."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from .. import anthropic as A
from ...api import formats as F
from ..anthropic import to_openai as to_anthropic_openai
from ..web import service
from .converted import answer_converted, converted_request

router = APIRouter()


@router.post("/v1/messages", tags=["anthropic"], summary="Anthropic's Messages API (stream: Anthropic's events)")
async def anthropic_messages(request: Request) -> Any:
    service(request).state.need_engine()
    req = await converted_request(request, to_anthropic_openai)
    msg_id = F.random_id("msg_")
    return await answer_converted(
        request, req, lambda c, m, info: A.message_json(c, m, info.model, msg_id),
        lambda info, gen: A.Events(info.model, msg_id, len(gen.prompt_tokens)))


@router.post("/v1/messages/count_tokens", tags=["anthropic"], summary="Tokens the messages' prompt takes")
async def anthropic_count_tokens(request: Request) -> dict[str, int]:
    svc = service(request)
    svc.state.need_engine()
    _, _, toks = await svc.chat_tokens(await converted_request(request, to_anthropic_openai))
    return {"input_tokens": len(toks)}
