"""The chat APIs of other vendors (Anthropic's Messages, OpenAI's Responses) over chat
completions: their request parsed into the chat request it stands for, run, and
answered whole or as that API's events."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ...engine import Completion
from .. import formats as F
from ..chat import message_json as chat_message
from ..errors import bad_request
from ..schemas import ChatCompletionRequest, format_validation_error
from ..web import SSEResponse, read_json, service
from ..worker import GenRequest


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
    svc = service(request)
    eng = svc.state.need_engine()
    fmt, gens, info = await svc.chat_jobs(eng, req)
    if not req.stream:
        (c,) = await svc.results(gens[:1], request)
        return JSONResponse(whole(c, chat_message(fmt.parser(), c.text), info))
    job, items = await svc.start(gens[0], request)
    parser = fmt.parser()
    events = events_for(info, gens[0])

    def on_chunk(ch: Any) -> list[str]:
        return events.feed(parser.feed(ch.text)) if ch.text else events.start()

    def on_done(c: Completion) -> list[str]:
        return events.feed(parser.finish()) + events.finish(c, parser.message())

    return SSEResponse(svc.stream_events(job, items, on_chunk, on_done, done_marker=False), job.cancel)
