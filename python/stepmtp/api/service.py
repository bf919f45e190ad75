"""One engine's OpenAI and llama-server requests, whoever sends them: a request's
settings and prompts checked and resolved into generations (``GenRequest``), and how
their results are read back (``ChatJobs``, ``CompletionJobs``: the whole response, or a
stream's chunks as dicts).

The server's routes and ``Engine.create_chat_completion`` / ``create_completion`` both
go through ``API``: the same checks, the same prompt, the same parsers and the same
response. What differs is who runs the generations (the server's worker thread, or the
calling thread) and how the dicts leave (SSE, or returned). Nothing here knows HTTP;
everything is synchronous (a chat prompt waits for the template sandbox: the server calls
it off its event loop).
"""
from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from ..chat import user_turn_start
from ..sampling import SamplingParams
from ..slots import Chunk, Completion
from . import formats as F
from .chat import ChatFormat, delta_json, message_json, preserved_tokens
from .defaults import DEFAULT_SEED, RequestDefaults
from .errors import APIError, bad_request
from .prompt import chat_prompt
from .schemas import ChatCompletionRequest, GenerationFields, PromptPieces

if TYPE_CHECKING:
    from ..chat.sandbox import TemplateSandbox

#: the context-drafting pool of the request being handled (the server's middleware sets
#: it to the caller's API key's: a pool shared between keys would tell one key, through
#: timing, what another's requests wrote)
POOL: contextvars.ContextVar[Any] = contextvars.ContextVar("stepmtp_pool", default=None)

__all__ = ["API", "GenRequest", "POOL", "ChatJobs", "CompletionJobs", "SpecReport"]


@dataclass
class GenRequest:
    """One generation, ready to run: tokens in, every setting resolved."""

    prompt_tokens: list[int]
    n_predict: int
    stop: list[str]
    sampling: SamplingParams
    #: post every chunk (streaming) or only the result
    stream: bool
    #: reuse the slot's cached prefix (llama-server's cache_prompt)
    cache_prompt: bool = True
    #: token probabilities to report (n_probs), raw or after the sampling chain
    n_probs: int = 0
    post_probs: bool = False
    #: special tokens kept as text (a chat format's markers)
    preserved: frozenset[int] = frozenset()
    #: stream prompt-progress reports (llama-server's return_progress)
    return_progress: bool = False
    #: constrained decoding (a compiled grammar.Constraint)
    grammar: Any = None
    #: a chat prompt's tokens before its latest user message (0: unknown)
    n_before_user: int = 0
    #: llama-server's reasoning budget (a budget.ReasoningBudget), for a chat that thinks
    reasoning_budget: Any = None
    #: the chat completion's id, for /v1/chat/completions/control ("": not a chat)
    cmpl_id: str = ""
    #: the pool of earlier requests' tokens its context drafting reads (the server's:
    #: one per API key, ``POOL``)
    pool: Any = field(default_factory=lambda: POOL.get())
    #: its own LoRA scales, adapter id -> scale (None: the engine's)
    lora: dict[int, float] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The keywords of ``Engine.submit`` / ``Engine.stream`` that run it (after the prompt)."""
        return dict(n_predict=self.n_predict, stop=self.stop, sampling=self.sampling, cache_prompt=self.cache_prompt,
                    n_probs=self.n_probs, post_sampling_probs=self.post_probs, preserve_tokens=self.preserved,
                    grammar=self.grammar, return_progress=self.return_progress, n_before_user=self.n_before_user,
                    reasoning_budget=self.reasoning_budget, pool=self.pool, lora=self.lora)


@dataclass
class SpecReport:
    """The speculation a response's generation_settings report."""

    spec_type: str = "none"
    mtp_mode: str = "chain"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0


class API:
    """Requests into generations and results into responses, over one engine.

    ``defaults``: what a request leaves out (the server's flags); ``templates``: the
    sandbox chat templates render in (None: rendered in this thread); ``model_name``:
    what responses call the model; ``spec``: what generation_settings report of the
    speculation; ``mtp_mode``: the ``mtp`` field's mode ("none" when nothing drafts).
    """

    def __init__(self, engine: Any, defaults: RequestDefaults, *, model_name: str, spec: SpecReport,
                 mtp_mode: str, templates: TemplateSandbox | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        self.model_name = model_name
        self.spec = spec
        self.mtp_mode = mtp_mode
        self.templates = templates
        m = engine.model
        self.eog_tokens = [t for t in range(m.n_vocab) if m.is_eog(t)]
        #: the chat format's marker tokens, kept as text in chat output
        self.preserved = preserved_tokens(m)
        #: -sp: every special token's text kept (a token that is not special renders the same
        #: either way, so "every token" is the set); else none outside a chat format's markers
        self.special: frozenset[int] = frozenset(range(m.n_vocab)) if defaults.special else frozenset()

    # -- requests into generations -----------------------------------------------------

    def prepare(self, req: GenerationFields, prompts: list[list[int]], *, stream: bool,
                grammar: tuple[str, Any] | None = None) -> tuple[list[GenRequest], F.Settings]:
        """Resolve a request's settings and check its prompts; every client error is a 400 here."""
        cfg, eng = self.defaults, self.engine
        bad = req.unsupported()
        if bad:
            raise bad_request(f"not supported by this server: {', '.join(bad)}")
        if len(prompts) > cfg.max_prompts:
            raise bad_request(f"{len(prompts)} prompts in one request; at most {cfg.max_prompts} (--max-prompts)")
        # llama-server: -r's strings for a request with none; --ignore-eos, --no-cache-prompt,
        # -l, --grammar / -j for a request that does not say
        stop = list(req.stop) or list(cfg.stop)
        given = req.model_fields_set
        ignore_eos = req.ignore_eos if "ignore_eos" in given else cfg.ignore_eos
        cache_prompt = req.cache_prompt if "cache_prompt" in given else cfg.cache_prompt
        if len(req.stop) > cfg.max_stop:
            raise bad_request(f"{len(req.stop)} stop strings; at most {cfg.max_stop} (--max-stop)")
        if any(len(x) > cfg.max_stop_len for x in req.stop):
            raise bad_request(f"a stop string is longer than {cfg.max_stop_len} characters (--max-stop-length)")
        if len(req.logit_bias) > cfg.max_logit_bias:
            raise bad_request(f"{len(req.logit_bias)} logit_bias entries; at most {cfg.max_logit_bias} "
                              "(--max-logit-bias)")
        n_cmpl = req.n_cmpl if req.n_cmpl is not None else (req.n if req.n is not None else 1)
        if n_cmpl > eng.n_parallel:
            raise bad_request(f"n_cmpl (n) must be between 1 and {eng.n_parallel} (the server's -np)")
        if stream and len(prompts) * n_cmpl > 1:
            raise bad_request("streaming supports one prompt and n = 1")
        try:
            n_probs = req.requested_n_probs()
        except ValueError as e:
            raise bad_request(str(e)) from None
        if n_probs > cfg.max_n_probs:
            raise bad_request(f"n_probs (top_logprobs) must be at most {cfg.max_n_probs}")
        try:
            spec = grammar or req.requested_grammar() or cfg.grammar
        except ValueError as e:
            raise bad_request(str(e)) from None
        constraint = None
        if spec is not None:
            from ..grammar import Constraint

            try:
                constraint = Constraint.compile(eng.model, *spec)
            except ValueError as e:
                raise bad_request(f"invalid grammar: {e}") from None
        # llama-server: -n is the default for a request that gives no limit of its own
        n_predict = req.requested_n_predict()
        n_predict = cfg.n_predict if n_predict is None else n_predict
        sampling, seed_shown = self.resolve_sampling(req, ignore_eos)
        lora = None
        if req.lora is not None:
            from ..adapters import parse_lora

            try:
                lora = parse_lora(req.lora) or None  # llama-server: an empty list is the server's scales
            except ValueError as e:
                raise bad_request(str(e)) from None
        for toks in prompts:
            if not toks:
                raise bad_request("the prompt is empty")
            check_tokens(eng, toks)
            if len(toks) >= eng.n_ctx:
                raise APIError(f"request ({len(toks)} tokens) exceeds the available context size "
                               f"({eng.n_ctx} tokens), try increasing it", "exceed_context_size_error",
                               n_prompt_tokens=len(toks), n_ctx=eng.n_ctx)
        gens = [GenRequest(list(toks), n_predict, stop, sampling, stream, cache_prompt,
                           n_probs, req.post_sampling_probs, grammar=constraint,
                           return_progress=stream and req.return_progress, preserved=self.special,
                           lora=lora)
                for toks in prompts for _ in range(n_cmpl)]
        sp = self.spec
        settings = F.Settings(
            sampling=sampling, seed=seed_shown, n_predict=n_predict, stop=stop, stream=stream,
            ignore_eos=ignore_eos, logit_bias=[(t, None if b == float("-inf") else b)
                                                   for t, b in sampling.logit_bias.items()],
            spec_type=sp.spec_type, n_max=sp.n_max, n_min=sp.n_min, p_min=sp.p_min, mtp_mode=sp.mtp_mode,
            n_probs=n_probs, post_sampling_probs=req.post_sampling_probs, lora=lora or {},
            timings_per_token=stream and req.timings_per_token,
        )
        return gens, settings

    def resolve_sampling(self, req: GenerationFields, ignore_eos: bool | None = None) -> tuple[SamplingParams, int]:
        cfg, eng = self.defaults, self.engine
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
        for key, b in (req.logit_bias if "logit_bias" in req.model_fields_set else cfg.logit_bias):
            value = float("-inf") if b is None else b
            ids = [key] if isinstance(key, int) else eng.tokenize(key, add_special=False, parse_special=False)
            for t in ids:
                if 0 <= t < eng.model.n_vocab:  # llama-server ignores the others
                    bias[t] = value
        if req.ignore_eos if ignore_eos is None else ignore_eos:
            for t in self.eog_tokens:
                bias[t] = float("-inf")
        if bias:
            kw["logit_bias"] = bias
        try:
            return cfg.sampling.with_(**kw), seed_shown
        except ValueError as e:
            raise bad_request(str(e)) from None

    def prompt_tokens(self, prompts: list[PromptPieces]) -> list[list[int]]:
        """A completion request's prompts as token ids, llama-server's way (``tokenize_pieces``)."""
        return [tokenize_pieces(self.engine, p, True, True) for p in prompts]

    def result_info(self, settings: F.Settings) -> F.ResultInfo:
        eng = self.engine
        return F.ResultInfo(model=self.model_name, n_ctx=eng.n_ctx, settings=settings, mtp_mode=self.mtp_mode,
                            n_heads=eng.n_heads, n_draft=eng.driver.n_draft, id=F.completion_id(),
                            created=int(time.time()), piece=eng.model.token_to_piece)

    def completion_jobs(self, req: GenerationFields, prompts: list[PromptPieces], *,
                        stream: bool) -> CompletionJobs:
        """A completion request's generations, ready to run, and how to read them back."""
        gens, settings = self.prepare(req, self.prompt_tokens(prompts), stream=stream)
        return CompletionJobs(gens, self.result_info(settings))

    # -- chat ----------------------------------------------------------------------------

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[ChatFormat, str]:
        """The prompt for a chat request, and how to read its output back."""
        return chat_prompt(self.engine.model, req, self.defaults, self.templates, self.preserved)

    def chat_tokens(self, req: ChatCompletionRequest) -> tuple[ChatFormat, str, list[int]]:
        """A chat request's prompt (text and tokens), and how to read its output back."""
        fmt, text = self.chat_prompt(req)
        return fmt, text, self.engine.tokenize(text, add_special=True, parse_special=True)

    def tokens_before_user(self, text: str) -> int:
        """llama-server's n_before_user: a chat prompt's tokens before its latest user
        message, where the latest user turn opens (0: none, or a --no-jinja template)."""
        if not self.defaults.use_jinja:
            return 0
        model = self.engine.model
        start = user_turn_start(model, self.defaults.chat_template_source(),
                                sandbox=self.templates)  # rendered once per template
        pos = text.rfind(start) if start else -1
        if pos < 0:
            return 0
        return len(self.engine.tokenize(text[:pos], add_special=True, parse_special=True))

    def chat_jobs(self, req: ChatCompletionRequest) -> ChatJobs:
        """A chat request's generations, ready to run, and how to read them back."""
        fmt, text, toks = self.chat_tokens(req)
        gens, settings = self.prepare(req, [toks], stream=req.stream,
                                      grammar=("lark", fmt.grammar) if fmt.grammar else None)
        n_before_user = self.tokens_before_user(text)
        settings.chat_format, settings.reasoning_format = fmt.name, fmt.reasoning_format
        info = self.result_info(settings)
        for g in gens:
            g.preserved = fmt.preserved | self.special
            g.n_before_user = n_before_user
            g.reasoning_budget = fmt.reasoning_budget
            g.cmpl_id = info.id
        return ChatJobs(fmt, gens, info)


@dataclass
class CompletionJobs:
    """A completion request's generations and how their results read back (OpenAI's shapes)."""

    gens: list[GenRequest]
    info: F.ResultInfo

    def response(self, results: list[Completion]) -> dict[str, Any]:
        return F.oai_completion(results, self.info)

    def chunks(self) -> CompletionChunks:
        return CompletionChunks(self.info)


@dataclass
class ChatJobs:
    """A chat request's generations, how their text is parsed (``fmt``) and how the
    results read back: the whole response, or a stream's chunks."""

    fmt: ChatFormat
    gens: list[GenRequest]
    info: F.ResultInfo

    def messages(self, results: list[Completion]) -> list[dict[str, Any]]:
        """Each result's assistant message: reasoning, content and tool calls parsed."""
        return [message_json(self.fmt.parser(), c.text) for c in results]

    def response(self, results: list[Completion]) -> dict[str, Any]:
        return F.oai_chat(results, self.info, self.messages(results))

    def chunks(self, include_usage: bool, usage_on_finish: bool = False) -> ChatChunks:
        return ChatChunks(self, include_usage, usage_on_finish)


class ChatChunks:
    """A streamed chat completion's chunks, as llama-server writes them: the role delta
    first (and with every prompt-progress report), each piece of text parsed into
    reasoning, content and tool-call deltas (the token probabilities on the first delta
    after them), then the finish chunk, the usage chunk when asked for, ``timings`` and
    ``mtp`` on the last. ``usage_on_finish``: the finish chunk carries ``usage`` when no
    usage chunk follows (in the process, where a caller cannot ask the response later)."""

    def __init__(self, jobs: ChatJobs, include_usage: bool, usage_on_finish: bool = False) -> None:
        self.info = jobs.info
        self.parser = jobs.fmt.parser()
        self.include_usage = include_usage
        self.usage_on_finish = usage_on_finish
        self.started = False
        self.held: list[Any] = []

    def progress(self) -> dict[str, Any]:
        """The chunk a prompt-progress report rides on (llama-server sends the role delta)."""
        return F.oai_chat_chunk({"role": "assistant", "content": None}, self.info)

    def _role(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return [self.progress()]

    def _deltas(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        out = delta_json(self.parser.feed(text)) if text else []
        return out + (delta_json(self.parser.finish()) if final else [])

    def chunk(self, ch: Chunk) -> list[dict[str, Any]]:
        out = self._role()
        self.held.extend(ch.probs)
        for i, d in enumerate(self._deltas(ch.text)):
            probs = self.held[:] if i == 0 else []
            self.held.clear()
            out.append(F.chunk_timings(F.oai_chat_chunk(d, self.info, probs=probs), ch, self.info))
        return out

    def done(self, c: Completion) -> list[dict[str, Any]]:
        out = self._role()
        out.extend(F.oai_chat_chunk(d, self.info) for d in self._deltas("", final=True))
        reason = F.chat_finish_reason(c, self.parser.message())
        final = F.oai_chat_final_chunks(c, self.info, self.include_usage, reason)
        if self.usage_on_finish and not self.include_usage:
            final[-1]["usage"] = F.usage([c])
        return out + final


class CompletionChunks:
    """A streamed completion's chunks: each piece of text with the probabilities of its
    tokens, then the final chunk (``usage``, ``timings``, ``mtp``)."""

    def __init__(self, info: F.ResultInfo) -> None:
        self.info = info
        self.held: list[Any] = []

    def progress(self) -> dict[str, Any]:
        return F.oai_completion_chunk("", self.info)

    def chunk(self, ch: Chunk) -> list[dict[str, Any]]:
        self.held.extend(ch.probs)
        if not ch.text:
            return []
        probs = self.held[:]
        self.held.clear()
        return [F.chunk_timings(F.oai_completion_chunk(ch.text, self.info, probs=probs), ch, self.info)]

    def done(self, c: Completion) -> list[dict[str, Any]]:
        return [F.oai_completion_final_chunk(c, self.info)]


def run_stream(eng: Any, gen: GenRequest, chunks: ChatChunks | CompletionChunks) -> Iterator[dict[str, Any]]:
    """Run one generation in this thread (``Engine.stream``), its chunks as they come."""
    it = eng.stream(gen.prompt_tokens, **gen.engine_kwargs())
    while True:
        try:
            ch = next(it)
        except StopIteration as done:
            yield from chunks.done(done.value)
            return
        if ch.progress is None:
            yield from chunks.chunk(ch)


def run_whole(eng: Any, gens: list[GenRequest]) -> list[Completion]:
    """Run generations to the end in this thread, together (``n`` > 1 shares the decodes)."""
    reqs = [eng.submit(g.prompt_tokens, **g.engine_kwargs()) for g in gens]
    try:
        while not all(r.done for r in reqs):
            eng.step()
            for r in reqs:
                r.chunks.clear()  # the whole results are all that is wanted
    finally:
        for r in reqs:
            if not r.done:
                eng.cancel(r)
    for r in reqs:
        if r.error is not None:
            raise r.error
    return [r.completion for r in reqs]


def pieces_size(pieces: PromptPieces) -> int:
    return sum(len(p) if isinstance(p, str) else 1 for p in pieces)


def tokenize_pieces(eng: Any, pieces: PromptPieces, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed(): strings tokenized (special tokens added only
    when the first piece is a string), token ids kept."""
    out: list[int] = []
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            out.extend(eng.tokenize(p, add_special=add_special and i == 0, parse_special=parse_special))
        else:
            out.append(p)
    return out


def check_tokens(eng: Any, tokens: list[int]) -> None:
    n = eng.model.n_vocab
    for t in tokens:
        if not 0 <= t < n:
            raise bad_request(f"token id {t} is out of range [0, {n})")
