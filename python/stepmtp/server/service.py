"""The generation service the routers share: a request becomes the worker's
generations through the shared request handling (``api.service.API``: ``prepare``,
``chat_jobs``, run here off the event loop where it may block), then results
(``results``) or a stream (``start``, then ``stream_events`` with the API's chunks). It
holds what every route needs (the state and the configuration) and knows nothing of
HTTP beyond a client that may leave (``ClientGone``, answered 499).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Protocol

from starlette.concurrency import run_in_threadpool

from ..api import formats as F
from ..api.chat import ChatFormat
from ..api.errors import APIError, bad_request, error_body
from ..api.schemas import ChatCompletionRequest, GenerationFields, PromptPieces
from ..api.service import API, ChatChunks, ChatJobs, CompletionChunks, CompletionJobs, GenRequest, pieces_size
from ..engine import Completion
from .config import ServerConfig
from .state import ServerState
from .worker import Cancelled, Channel, Job

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


class Client(Protocol):
    """Who waits for a job: a request that can tell whether its client left."""

    async def is_disconnected(self) -> bool: ...


class GenerationService:
    """Requests into jobs, jobs into results or streams, over one ``ServerState``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.cfg: ServerConfig = state.cfg

    @property
    def api(self) -> API:
        """The shared request handling of the loaded engine (a 503 while it loads)."""
        return self.state.need_api()

    async def prepare(self, req: GenerationFields, prompts: list[list[int]], *, stream: bool,
                      grammar: tuple[str, Any] | None = None) -> tuple[list[GenRequest], F.Settings]:
        """``API.prepare``: off the event loop when a grammar is to be compiled."""
        return await off_loop(INLINE_LIMIT if grammar or _wants_grammar(req) else 0, self.api.prepare, req, prompts,
                              stream=stream, grammar=grammar)

    async def prompt_tokens(self, prompts: list[PromptPieces]) -> list[list[int]]:
        """A completion request's prompts as token ids, llama-server's way (``API.prompt_tokens``)."""
        return await off_loop(sum(map(pieces_size, prompts)), self.api.prompt_tokens, prompts)

    async def completion_jobs(self, req: GenerationFields, prompts: list[PromptPieces], *,
                              stream: bool) -> CompletionJobs:
        gens, settings = await self.prepare(req, await self.prompt_tokens(prompts), stream=stream)
        return CompletionJobs(gens, self.api.result_info(settings))

    def sse_chunks(self, job: Job, items: list[tuple[str, Any]],
                   chunks: ChatChunks | CompletionChunks) -> AsyncIterator[str]:
        """``stream_events`` for the API's OpenAI chunks: each chunk an event, ``[DONE]`` last."""
        return self.stream_events(job, items, lambda ch: [F.sse(d) for d in chunks.chunk(ch)],
                                  lambda c: [F.sse(d) for d in chunks.done(c)], done_marker=True,
                                  progress=lambda p: chunks.progress())

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[ChatFormat, str]:
        """The prompt for a chat request, and how to read its output back (rendered in
        the template sandbox: never on the event loop)."""
        return await run_in_threadpool(self.api.chat_prompt, req)

    async def chat_tokens(self, req: ChatCompletionRequest) -> tuple[ChatFormat, str, list[int]]:
        """A chat request's prompt (text and tokens), and how to read its output back."""
        return await run_in_threadpool(self.api.chat_tokens, req)

    async def chat_jobs(self, req: ChatCompletionRequest) -> ChatJobs:
        """A chat request's generations, ready to submit, and how to read them back."""
        return await run_in_threadpool(self.api.chat_jobs, req)

    def submit(self, gen: GenRequest) -> Job:
        cfg, st = self.cfg, self.state
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

    async def next_items(self, job: Job, request: Client) -> list[tuple[str, Any]]:
        """The job's next items; raises ClientGone (and cancels the job) if the client left."""
        while True:
            try:
                return await asyncio.wait_for(job.channel.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone() from None

    async def results(self, gens: list[GenRequest], request: Client) -> list[Completion]:
        """Run the generations to the end (``ClientGone`` if the client leaves first)."""
        return await self.run_all([self.submit(g) for g in gens], request)

    async def start(self, gen: GenRequest, request: Client) -> tuple[Job, list[tuple[str, Any]]]:
        """Start a streamed generation: its job and first items (``first_items``)."""
        job = self.submit(gen)
        return job, await self.first_items(job, request)

    async def run_all(self, jobs: list[Job], request: Client) -> list[Completion]:
        out: list[Completion] = []
        try:
            for job in jobs:
                while True:
                    items = await self.next_items(job, request)
                    kind, payload = items[-1]
                    if kind == "done":
                        out.append(payload)
                        break
                    if kind == "error":
                        _raise_job_error(payload)
        finally:
            for job in jobs:
                job.cancel()  # a no-op for the finished ones
        return out

    async def first_items(self, job: Job, request: Client) -> list[tuple[str, Any]]:
        """Wait for the job to start producing: its errors become a plain error response,
        as llama-server answers a stream's first error."""
        try:
            items = await self.next_items(job, request)
        except BaseException:
            job.cancel()
            raise
        for kind, payload in items:
            if kind == "error":
                _raise_job_error(payload)
        return items

    async def stream_events(self, job: Job, items: list[tuple[str, Any]],
                            on_chunk: Callable[[Any], list[str]], on_done: Callable[[Completion], list[str]],
                            done_marker: bool, progress: Callable[[dict[str, int]], dict[str, Any]] | None = None,
                            on_progress: Callable[[dict[str, int]], list[str]] | None = None
                            ) -> AsyncIterator[str]:
        """SSE text for the job's items: one event per token (llama-server's format),
        written in batches at most every STREAM_FLUSH_S. ``progress``: the event a
        prompt-progress report rides on (return_progress), ``prompt_progress`` added;
        ``on_progress``: the SSE text of a report, for an API whose events name their type."""
        last_flush = 0.0
        out: list[str] = []
        while True:
            for kind, payload in items:
                if kind == "chunk" and payload.progress is not None:
                    if on_progress is not None:
                        out.extend(on_progress(payload.progress))
                    elif progress is not None:
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


def _raise_job_error(err: BaseException) -> None:
    if isinstance(err, Cancelled):
        raise APIError(str(err), "unavailable_error")
    if isinstance(err, ValueError):
        raise bad_request(str(err))
    raise APIError(f"generation failed: {type(err).__name__}: {err}", "server_error")


def default_settings(st: ServerState) -> F.Settings:
    cfg = st.cfg
    return F.Settings(sampling=cfg.sampling, seed=cfg.seed_u32, n_predict=cfg.n_predict, stop=[], stream=False,
                      spec_type=cfg.spec_types, n_max=cfg.n_max, n_min=cfg.n_min, p_min=cfg.p_min,
                      mtp_mode=cfg.mtp_mode)


def _wants_grammar(req: GenerationFields) -> bool:
    try:
        return req.requested_grammar() is not None
    except ValueError:  # prepare says so
        return False


async def off_loop(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: in the thread pool when the input is large, else right here."""
    if size >= INLINE_LIMIT:
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)
