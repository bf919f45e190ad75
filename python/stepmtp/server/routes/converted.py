"""The chat APIs of other vendors (Anthropic's Messages, OpenAI's Responses) over chat
completions: their request parsed into the chat request it stands for, run, and
answered whole or as that API's events."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ...api import formats as F
from ...api.errors import bad_request
from ...api.schemas import ChatCompletionRequest, format_validation_error
from ...api.service import GenRequest
from ...engine import Completion
from ..web import SSEResponse, read_json, service


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
    svc.state.need_engine()
    jobs = await svc.chat_jobs(req)
    if not req.stream:
        (c,) = await svc.results(jobs.gens[:1], request)
        return JSONResponse(whole(c, jobs.messages([c])[0], jobs.info))
    job, items = await svc.start(jobs.gens[0], request)
    parser = jobs.fmt.parser()
    events = events_for(jobs.info, jobs.gens[0])
    per_token = jobs.info.settings.timings_per_token and hasattr(events, "timings")

    def on_chunk(ch: Any) -> list[str]:
        if per_token and ch.stats is not None:  # llama-server's timings_per_token, on the text's events
            events.timings = F.chunk_stats_timings(ch)
        return events.feed(parser.feed(ch.text)) if ch.text else events.start()

    def on_done(c: Completion) -> list[str]:
        return events.feed(parser.finish()) + events.finish(c, parser.message())

    on_progress = getattr(events, "progress", None) if jobs.gens[0].return_progress else None
    return SSEResponse(svc.stream_events(job, items, on_chunk, on_done, done_marker=False, on_progress=on_progress),
                       job.cancel)
