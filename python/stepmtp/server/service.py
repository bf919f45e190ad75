"""The generation service the routers share: a request's settings and prompts become
the worker's generations (``prepare``, ``chat_jobs``), then results (``results``) or
a stream (``start``, then ``stream_events`` with the API's emitters). It holds what
every route needs (the state and the configuration) and knows nothing of HTTP beyond
a client that may leave (``ClientGone``, answered 499).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Protocol

from starlette.concurrency import run_in_threadpool

from ..chat import user_turn_start
from ..chat.prompt import chat_prompt
from ..engine import Completion, Engine
from ..sampling import SamplingParams
from . import formats as F
from .chat import ChatFormat
from .config import DEFAULT_SEED, ServerConfig
from .errors import APIError, bad_request, error_body
from .schemas import ChatCompletionRequest, GenerationFields, PromptPieces
from .state import ServerState
from .worker import Cancelled, Channel, GenRequest, Job

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

    async def prepare(self, eng: Engine, req: GenerationFields, prompts: list[list[int]], *, stream: bool,
                      grammar: tuple[str, Any] | None = None) -> tuple[list[GenRequest], F.Settings]:
        """Resolve a request's settings and check its prompts; every client error is a 400 here."""
        cfg = self.cfg
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
        sampling, seed_shown = self.resolve_sampling(eng, req)
        for toks in prompts:
            if not toks:
                raise bad_request("the prompt is empty")
            check_tokens(eng, toks)
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

    def resolve_sampling(self, eng: Engine, req: GenerationFields) -> tuple[SamplingParams, int]:
        cfg, st = self.cfg, self.state
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

    async def prompt_tokens(self, eng: Engine, prompts: list[PromptPieces]) -> list[list[int]]:
        """A completion request's prompts as token ids, llama-server's way (``tokenize_pieces``)."""
        return await off_loop(sum(map(pieces_size, prompts)),
                              lambda: [tokenize_pieces(eng, p, True, True) for p in prompts])

    def result_info(self, eng: Engine, settings: F.Settings) -> F.ResultInfo:
        st = self.state
        return F.ResultInfo(model=st.model_name, n_ctx=eng.n_ctx, settings=settings, mtp_mode=st.mtp_mode(),
                            n_heads=eng.n_heads, n_draft=st.n_draft, id=F.completion_id(),
                            created=int(time.time()), piece=eng.model.token_to_piece)

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

    async def chat_prompt(self, eng: Engine, req: ChatCompletionRequest) -> tuple[ChatFormat, str]:
        """The prompt for a chat request, and how to read its output back."""
        return await chat_prompt(eng, req, self.cfg, self.state.templates, self.state.preserved)

    async def chat_tokens(self, eng: Engine, req: ChatCompletionRequest) -> tuple[ChatFormat, str, list[int]]:
        """A chat request's prompt (text and tokens), and how to read its output back."""
        fmt, text = await self.chat_prompt(eng, req)
        return fmt, text, await off_loop(len(text), eng.tokenize, text, add_special=True, parse_special=True)

    async def tokens_before_user(self, eng: Engine, text: str) -> int:
        """llama-server's n_before_user: a chat prompt's tokens before its latest user
        message, where the latest user turn opens (0: none, or a --no-jinja template)."""
        st = self.state
        if not st.cfg.use_jinja:
            return 0
        start = await run_in_threadpool(user_turn_start, eng.model, st.cfg.chat_template_source(),
                                        sandbox=st.templates)  # rendered once per template
        pos = text.rfind(start) if start else -1
        if pos < 0:
            return 0
        return len(await off_loop(pos, eng.tokenize, text[:pos], add_special=True, parse_special=True))

    async def chat_jobs(self, eng: Engine, req: ChatCompletionRequest
                        ) -> tuple[ChatFormat, list[GenRequest], F.ResultInfo]:
        """A chat request's generations, ready to submit, and how to read them back."""
        fmt, text, toks = await self.chat_tokens(eng, req)
        gens, settings = await self.prepare(eng, req, [toks], stream=req.stream,
                                            grammar=("lark", fmt.grammar) if fmt.grammar else None)
        n_before_user = await self.tokens_before_user(eng, text)
        settings.chat_format, settings.reasoning_format = fmt.name, fmt.reasoning_format
        info = self.result_info(eng, settings)
        for g in gens:
            g.preserved = fmt.preserved
            g.n_before_user = n_before_user
            g.reasoning_budget = fmt.reasoning_budget
            g.cmpl_id = info.id
        return fmt, gens, info


def _raise_job_error(err: BaseException) -> None:
    if isinstance(err, Cancelled):
        raise APIError(str(err), "unavailable_error")
    if isinstance(err, ValueError):
        raise bad_request(str(err))
    raise APIError(f"generation failed: {type(err).__name__}: {err}", "server_error")


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


def pieces_size(pieces: PromptPieces) -> int:
    return sum(len(p) if isinstance(p, str) else 1 for p in pieces)


def tokenize_pieces(eng: Engine, pieces: PromptPieces, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed(): strings tokenized (special tokens added only
    when the first piece is a string), token ids kept."""
    out: list[int] = []
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            out.extend(eng.tokenize(p, add_special=add_special and i == 0, parse_special=parse_special))
        else:
            out.append(p)
    return out


def check_tokens(eng: Engine, tokens: list[int]) -> None:
    n = eng.model.n_vocab
    for t in tokens:
        if not 0 <= t < n:
            raise bad_request(f"token id {t} is out of range [0, {n})")

