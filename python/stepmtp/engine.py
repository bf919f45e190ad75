"""The public API: load a Step3.5 model and its MTP heads, generate text.

>>> from stepmtp import Engine
>>> with Engine("model.gguf", mode="chain", n_max=3) as eng:
...     out = eng.generate("def fib(n):", n_predict=64, temperature=0)
...     print(out.text, out.stats.accept_rate)
"""
from __future__ import annotations

import codecs
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from .llama import Context, Model, default_threads
from .mtp import MTPDriver, Mode, RoundTrace, Schedule, SeqState, SpecConfig, Verify
from .sampling import Sampler, SamplingParams
from .stats import GenStats

__all__ = ["Engine", "Completion", "Chunk", "SpecConfig", "SamplingParams"]

StopType = Literal["none", "eos", "word", "limit"]


@dataclass
class Chunk:
    """A piece of streamed output: text now safe to show and the tokens behind it."""

    text: str
    tokens: list[int]
    #: set on the last chunk only
    finish_reason: str | None = None


@dataclass
class Completion:
    """The result of a generation."""

    text: str
    tokens: list[int]
    #: "stop" (end of generation or a stop string) or "length" (n_predict or context)
    finish_reason: str
    #: llama-server's stop_type: "eos", "word", "limit"
    stop_type: StopType
    stopping_word: str = ""
    prompt_tokens: list[int] = field(default_factory=list)
    stats: GenStats = field(default_factory=GenStats)
    #: debug mode only: what each round drafted and accepted
    trace: list[RoundTrace] | None = None


class _TextAssembler:
    """Turns a token stream into text, holding back what may become a stop string
    and bytes that do not yet form a whole UTF-8 character."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.sent = 0
        self.stopping_word = ""

    def push(self, piece: bytes) -> bool:
        """Add a token's bytes; True when a stop string has appeared (text cut before it)."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += self.decoder.decode(piece)
        for s in self.stop:
            j = self.text.find(s, start)
            if j >= 0:
                self.text = self.text[:j]
                self.stopping_word = s
                return True
        return False

    def take(self, final: bool = False) -> str:
        """Text that can be sent now (all of it when final)."""
        if final:
            self.text += self.decoder.decode(b"", final=True)
            end = len(self.text)
        else:
            end = len(self.text) - self._held()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        # the longest tail of the text that is a proper prefix of a stop string
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


class Engine:
    """A Step3.5 model with its MTP heads, ready to generate.

    Args:
        model: the target GGUF (trunk, with the MTP blocks embedded or not).
        mtp_model: a separate MTP-only GGUF with the heads (llama-server's
            ``--spec-draft-model``); by default the heads come from ``model``.
        mode, n_max, n_min, p_min, schedule, verify, adaptive: speculation (see
            ``SpecConfig``); or pass ``spec``.
        n_ctx: context size (0: the model's). n_batch, n_ubatch: as ``-b``/``-ub``.
        n_threads, n_threads_batch: CPU threads (default: all this process may use).
        n_gpu_layers, n_gpu_layers_draft: layers offloaded, ``"all"`` for all.
        rpc: RPC servers for the target and the draft (MTP) model, ``"host:port,..."``
            (llama-server's ``--rpc``); they count as GPUs for ``n_gpu_layers``.
        seed: default seed of the samplers (a request's own seed wins).
        progress: show loading progress on stderr.
        debug: check the driver's invariant (pending_h == h_tgt(pos(id_last) - 1))
            every round; slow. Also on with the environment variable STEPMTP_DEBUG=1.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        mtp_model: str | os.PathLike[str] | None = None,
        mode: Mode = "chain",
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        schedule: Schedule = "fused",
        verify: Verify = "auto",
        adaptive: bool = False,
        spec: SpecConfig | None = None,
        n_ctx: int = 4096,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int | str = 0,
        n_gpu_layers_draft: int | str | None = None,
        rpc: str | Sequence[str] | None = None,
        seed: int = -1,
        flash_attn: bool | None = None,
        progress: bool = False,
        debug: bool = False,
    ) -> None:
        self.spec = spec or SpecConfig(mode=mode, n_max=n_max, n_min=n_min, p_min=p_min, schedule=schedule,
                                       verify=verify, adaptive=adaptive)
        self.seed = seed
        self._lock = threading.Lock()
        self.model = Model(model, n_gpu_layers=n_gpu_layers, progress=progress, rpc=rpc)
        self.draft_model: Model | None = None
        self.target: Context | None = None
        self.draft: Context | None = None
        try:
            threads = n_threads or default_threads()
            ctx_kw: dict[str, Any] = dict(
                n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                n_threads_batch=n_threads_batch or threads, flash_attn=flash_attn,
            )
            self.target = Context(self.model, **ctx_kw)
            if self.spec.mode != "none":
                if mtp_model is not None:
                    ngl = n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft
                    self.draft_model = Model(mtp_model, n_gpu_layers=ngl, progress=progress, rpc=rpc)
                    if self.draft_model.n_vocab != self.model.n_vocab:
                        raise ValueError(
                            f"{mtp_model}: vocabulary of {self.draft_model.n_vocab} tokens, "
                            f"the target has {self.model.n_vocab}"
                        )
                    if self.draft_model.n_embd != self.model.n_embd:
                        raise ValueError(
                            f"{mtp_model}: hidden rows of width {self.draft_model.n_embd}, "
                            f"the target's are {self.model.n_embd}"
                        )
                else:
                    self.draft_model = self.model
                ctx_kw["n_ctx"] = self.target.n_ctx
                self.draft = Context(self.draft_model, mtp=True, **ctx_kw)
            debug = debug or os.environ.get("STEPMTP_DEBUG", "") not in ("", "0")
            self.driver = MTPDriver(self.target, self.draft, self.spec, debug=debug)
        except BaseException:
            self.close()
            raise

    # -- lifetime ---------------------------------------------------------------

    def close(self) -> None:
        for ctx in (self.draft, self.target):
            if ctx is not None:
                ctx.close()
        if self.draft_model is not None and self.draft_model is not self.model:
            self.draft_model.close()
        self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- text -------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    @property
    def n_heads(self) -> int:
        return self.driver.n_heads

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.model.detokenize(tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs: Any) -> str:
        """Render chat messages with the GGUF's jinja chat template."""
        from .chat import render_chat

        return render_chat(self.model, messages, add_generation_prompt=add_generation_prompt,
                           template=template, **kwargs)

    # -- generation ---------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, n_predict: int = -1, stop: Sequence[str] = (),
                 sampling: SamplingParams | None = None, verify: Verify | None = None,
                 **sampling_kw: Any) -> Completion:
        """Generate a completion. ``sampling_kw`` are SamplingParams fields
        (temperature, top_k, top_p, min_p, seed, repeat_penalty, ...); ``verify``
        overrides the engine's verification (exact, rejection, auto) for this request."""
        gen = self._run(prompt, n_predict, stop, sampling, sampling_kw, verify)
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | Sequence[int], *, n_predict: int = -1, stop: Sequence[str] = (),
               sampling: SamplingParams | None = None, verify: Verify | None = None,
               **sampling_kw: Any) -> Iterator[Chunk]:
        """Generate, yielding pieces of text as tokens are accepted. The generator's
        return value (``StopIteration.value``) is the Completion."""
        return self._run(prompt, n_predict, stop, sampling, sampling_kw, verify)

    def _run(self, prompt: str | Sequence[int], n_predict: int, stop: Sequence[str],
             sampling: SamplingParams | None, sampling_kw: dict[str, Any],
             verify: Verify | None = None) -> Iterator[Chunk]:
        verify = verify or self.spec.verify
        if verify not in ("auto", "exact", "rejection"):
            raise ValueError(f"unknown verification {verify!r} (auto, exact, rejection)")
        if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < -1:
            raise ValueError(f"n_predict must be -1 (no limit), 0 (prompt only) or positive, not {n_predict!r}")
        params = sampling or SamplingParams()
        if sampling_kw:
            params = params.with_(**sampling_kw)
        if params.seed is None or params.seed < 0:
            params = params.with_(seed=None if self.seed < 0 else self.seed)
        if isinstance(prompt, str):
            prompt_tokens = self.tokenize(prompt)
        else:
            prompt_tokens = [int(t) for t in prompt]
            for t in prompt_tokens:
                self.model._check_token(t)
        if not prompt_tokens:
            raise ValueError("the prompt is empty")
        if isinstance(stop, str):
            stop = [stop]
        rejection = verify != "exact" and not params.greedy and self.driver.speculate
        return self._generate(prompt_tokens, n_predict, list(stop), params, rejection)

    def _generate(self, prompt_tokens: list[int], n_predict: int, stop: list[str],
                  params: SamplingParams, rejection: bool) -> Iterator[Chunk]:
        with self._lock:
            s = SeqState(seq_id=0, sampler=Sampler(params), rejection=rejection)
            asm = _TextAssembler(stop)
            out_tokens: list[int] = []
            stop_type: StopType = "none"
            finish = "length"
            if n_predict == 0:
                return Completion("", [], "length", "limit", prompt_tokens=prompt_tokens, stats=s.stats)
            pending = [self.driver.begin(s, prompt_tokens)]
            t_gen = time.perf_counter()
            unsent: list[int] = []  # tokens whose text goes out with the last chunk
            try:
                while stop_type == "none":
                    for tok in pending:
                        if self.model.is_eog(tok):
                            stop_type, finish = "eos", "stop"
                            break
                        out_tokens.append(tok)
                        if asm.push(self.model.token_to_piece(tok)):
                            stop_type, finish, unsent = "word", "stop", [tok]
                            break
                        if 0 < n_predict <= len(out_tokens):
                            stop_type, finish, unsent = "limit", "length", [tok]
                            break
                        yield Chunk(asm.take(), [tok])
                    else:
                        if s.pos >= self.n_ctx:  # no room to decode id_last: the context is full
                            stop_type, finish = "limit", "length"
                            break
                        pending = self.driver.round(s)
            finally:
                s.stats.t_gen_ms += (time.perf_counter() - t_gen) * 1e3
                s.stats.n_predicted = len(out_tokens) + (stop_type == "eos")
            yield Chunk(asm.take(final=True), unsent, finish_reason=finish)
            return Completion(
                text=asm.text,
                tokens=out_tokens,
                finish_reason=finish,
                stop_type=stop_type,
                stopping_word=asm.stopping_word,
                prompt_tokens=prompt_tokens,
                stats=s.stats,
                trace=s.trace,
            )
