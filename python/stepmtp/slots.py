"""Slots: several generations decoding together (continuous batching).

Each request gets a slot, i.e. a sequence id in both contexts. ``Slots.step`` is one
scheduling step: requests waiting for a slot take the free ones, then every slot
past its prompt runs one MTP round *together* (``MTPDriver.round`` with all of
them: one target decode and one decode per draft step for all), then one chunk of
one waiting prompt is decoded, so a long prompt never stalls the running streams
for more than a chunk. A new request joins between two steps. A generation a shared
KV cache has no room for gives up its slot while the others go on, and resumes once
one of them ends (``Slots._no_room``).

Nobody owns a scheduling thread: whichever caller needs progress takes the engine's
lock and steps for everyone (``Engine.stream`` does), so several threads calling
the engine at once are batched together, and a single caller is just a loop.
"""
from __future__ import annotations

import codecs
import itertools
import re
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

from .llama import KVFullError, LlamaError
from .mtp import MTPDriver, RoundTrace, SeqState
from .sampling import Sampler, SamplingParams, TokenProbs
from .sequence import common_prefix
from .stats import GenStats

if TYPE_CHECKING:
    from .adapters import Adapters
    from .grammar import ConstraintState
    from .llama import Model

__all__ = ["Chunk", "Completion", "Request", "Slots", "StopType"]

log = logging.getLogger("stepmtp")

StopType = Literal["none", "eos", "word", "limit"]


@dataclass
class Chunk:
    """A piece of streamed output: text now safe to show and the tokens behind it."""

    text: str
    tokens: list[int]
    #: set on the last chunk only
    finish_reason: str | None = None
    #: with n_probs: each token's probabilities
    probs: list[TokenProbs] = field(default_factory=list)
    #: a prompt-progress report instead of text (return_progress): llama-server's
    #: total, cache, processed, time_ms
    progress: dict[str, int] | None = None
    #: for llama-server's timings_per_token: the request's statistics (its own object,
    #: not a copy: the prompt's figures are final by then), and the tokens decoded and
    #: the generation's milliseconds as of this chunk
    stats: GenStats | None = None
    n_decoded: int = 0
    t_gen_ms: float = 0.0


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
    #: with n_probs: each generated token's probabilities (end of generation excluded)
    probs: list[TokenProbs] = field(default_factory=list)
    #: the slot that generated it
    slot: int = 0


class TextAssembler:
    """Turns a token stream into text, holding back what may become a stop string
    and bytes that do not yet form a whole UTF-8 character.

    The cost per token does not grow with the output: text is only searched where a
    stop string can still begin, the text not yet sent (``pending``): everything
    sent was checked not to end with the beginning of any stop string.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._sent: list[str] = []
        self.pending = ""
        self.stopping_word = ""
        # the leftmost match; at one position the first stop string given wins (llama-server)
        alts = list(dict.fromkeys(self.stop))
        self._re = re.compile("|".join(map(re.escape, alts))) if alts else None
        self._prefixes = {s[:k] for s in self.stop for k in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self.stop), default=0)

    @property
    def text(self) -> str:
        return "".join(self._sent) + self.pending

    def push(self, piece: bytes) -> bool:
        """Add a token's bytes; True when a stop string has appeared (text cut before it)."""
        self.pending += self.decoder.decode(piece)
        if self._re is not None:
            m = self._re.search(self.pending)
            if m is not None:
                self.pending = self.pending[: m.start()]
                self.stopping_word = m.group()
                # bytes of a half-decoded character after the stop string are not text
                self.decoder.reset()
                return True
        return False

    def take(self, final: bool = False) -> str:
        """Text that can be sent now (all of it when final)."""
        if final:
            if not self.stopping_word:
                self.pending += self.decoder.decode(b"", final=True)
            out = self.pending
        else:
            out = self.pending[: len(self.pending) - self._held()]
        if out:
            self.pending = self.pending[len(out):]
            self._sent.append(out)
        return out

    def _held(self) -> int:
        # the longest tail of the pending text that is a proper prefix of a stop string
        p = self.pending
        for k in range(min(self._max_prefix, len(p)), 0, -1):
            if p[-k:] in self._prefixes:
                return k
        return 0


_task_ids = itertools.count()


class Request:
    """One generation: its sequence state, its text so far, and the chunks produced
    and not yet taken by its consumer (appended by whichever thread steps)."""

    def __init__(self, prompt_tokens: list[int], n_predict: int, stop: Sequence[str],
                 params: SamplingParams, rejection: bool, cache_prompt: bool = True,
                 n_probs: int = 0, post_probs: bool = False, preserved: frozenset[int] = frozenset(),
                 constraint: "ConstraintState | None" = None, mask_drafts: bool = True,
                 return_progress: bool = False, pool_key: object = None,
                 lora: "Mapping[int, float] | None" = None) -> None:
        self.id = next(_task_ids)
        #: its own LoRA scales, adapter id -> scale (llama-server's request ``lora``;
        #: None: the engine's at submission)
        self.lora = lora
        #: report prompt processing as it goes (a progress chunk per prompt decode)
        self.return_progress = return_progress
        self._t_prompt = 0.0
        self.prompt_tokens = prompt_tokens
        #: reuse the prefix its slot's KV holds from the slot's last request
        self.cache_prompt = cache_prompt
        #: special tokens whose text the output keeps (a chat format's markers)
        self.preserved = preserved
        self.n_predict = n_predict
        self.params = params
        self.state = SeqState(seq_id=-1, sampler=Sampler(params), rejection=rejection, n_probs=n_probs,
                              post_probs=post_probs, constraint=constraint, mask_drafts=mask_drafts,
                              pool_key=pool_key)
        self.probs: list[TokenProbs] = []
        self._unsent_probs: list[TokenProbs] = []
        self.asm = TextAssembler(stop)
        self.out_tokens: list[int] = []
        self.stop_type: StopType = "none"
        self.finish = "length"
        self.chunks: deque[Chunk] = deque()
        self.completion: Completion | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        #: ended by a full shared cache (run_out): its slot's KV is not kept
        self.kv_lost = False
        #: preempted by a full shared cache: it waits until fewer than this many slots
        #: are busy, then goes on from its prompt and output decoded again (0: never)
        self.resume_below = 0
        #: its prompt's counts, kept across a preemption (n_prompt, n_prompt_cached)
        self._prompt_counts: tuple[int, int] | None = None
        #: its consumer is behind: it sits out the rounds (not the prompt) until it catches up
        self.paused = False
        self._t_gen = 0.0

    @property
    def done(self) -> bool:
        return self.completion is not None or self.error is not None

    @property
    def n_decoded(self) -> int:
        return len(self.out_tokens)

    def report_progress(self) -> None:
        """llama-server's prompt progress: the prompt's tokens, those the cache held,
        and those in the KV now (cached included)."""
        if not self.return_progress:
            return
        if not self._t_prompt:
            self._t_prompt = time.perf_counter()
        st = self.state
        self.chunks.append(Chunk("", [], progress={
            "total": len(self.prompt_tokens), "cache": st.stats.n_prompt_cached, "processed": st.n_prefilled,
            "time_ms": int((time.perf_counter() - self._t_prompt) * 1e3)}))

    def feed(self, tokens: list[int], model: "Model", n_ctx_seq: int) -> None:
        """Take the tokens a round produced: stop at an end-of-generation token, a
        stop string, n_predict or a full context; queue the text that is safe to send."""
        if not self._t_gen:
            self._t_gen = time.perf_counter()
        unsent: list[int] = []
        # the round's tokens' probabilities, in the same order (n_probs)
        probs = self.state.token_probs
        if probs:
            self.state.token_probs = []
        for i, tok in enumerate(tokens):
            if model.is_eog(tok):
                self.stop_type, self.finish = "eos", "stop"
                break
            tp = [probs[i]] if probs else []
            self.probs += tp
            self.out_tokens.append(tok)
            if self.asm.push(model.token_to_piece(tok, special=tok in self.preserved)):
                self.stop_type, self.finish, unsent = "word", "stop", [tok]
                self._unsent_probs = tp
                break
            # llama-server without context shift stops as the next token would fill the
            # context's last cell (prompt + generated + 1 >= n_ctx)
            if 0 < self.n_predict <= len(self.out_tokens) or \
                    len(self.prompt_tokens) + len(self.out_tokens) >= n_ctx_seq:
                self.stop_type, self.finish, unsent = "limit", "length", [tok]
                self._unsent_probs = tp
                break
            # no copy of the statistics per token: two numbers, read only if a client asks
            self.chunks.append(Chunk(self.asm.take(), [tok], probs=tp, stats=self.state.stats,
                                     n_decoded=len(self.out_tokens),
                                     t_gen_ms=(time.perf_counter() - self._t_gen) * 1e3))
        if self.stop_type != "none":
            self._finish(unsent)

    def _finish(self, unsent: list[int]) -> None:
        st = self.state.stats
        if self._t_gen:
            st.t_gen_ms += (time.perf_counter() - self._t_gen) * 1e3
        st.n_predicted = len(self.out_tokens) + (self.stop_type == "eos")
        self.chunks.append(Chunk(self.asm.take(final=True), unsent, finish_reason=self.finish,
                                 probs=self._unsent_probs))
        self.completion = Completion(
            text=self.asm.text,
            tokens=self.out_tokens,
            finish_reason=self.finish,
            stop_type=self.stop_type,
            stopping_word=self.asm.stopping_word,
            prompt_tokens=self.prompt_tokens,
            stats=st,
            trace=self.state.trace,
            probs=self.probs,
            slot=max(0, self.state.seq_id),
        )

    @property
    def resuming(self) -> bool:
        return self._prompt_counts is not None

    def run_out(self) -> None:
        """A shared KV cache has no room left for the next tokens, and no other slot
        will free any: the generation ends as one that reached its context (the text
        so far, "length"), where llama-server fails it, and every running slot with it.
        Its cells are not kept (the driver may have freed them for the others)."""
        if not self.done:
            self.kv_lost = True
            self.stop_type, self.finish = "limit", "length"
            self._finish([])

    def preempted(self) -> None:
        """It gave up its slot to a full shared cache (``Slots._no_room``): its prompt's
        counts are kept for when it goes on, whatever is decoded again then."""
        st = self.state.stats
        if self.out_tokens and self._prompt_counts is None:
            self._prompt_counts = (st.n_prompt, st.n_prompt_cached)
        self.state.seq_id = -1
        self.state.chunk_limit = SeqState.chunk_limit  # its prompt goes back in whole chunks

    def resumed(self) -> None:
        """Its prompt (and output, after a preemption) is decoded: the counts it
        reports are its prompt's, whatever was decoded again."""
        if self._prompt_counts is not None:
            st = self.state.stats
            st.n_prompt, st.n_prompt_cached = self._prompt_counts
            self._prompt_counts = None

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error


class Slots:
    """``n`` slots over one driver; see the module's docstring. ``step`` and ``drop``
    must be called with the engine's lock held; ``submit`` from any thread."""

    def __init__(self, driver: MTPDriver, model: "Model", n: int, *, similarity: float = 0.1,
                 adapters: "Adapters | None" = None) -> None:
        self.driver = driver
        #: LoRA adapters: slots with other scales decode in separate rounds (a decode
        #: computes every row with the context's one set)
        self.adapters = adapters if adapters else None
        self.model = model
        self.n = n
        self.slots: list[Request | None] = [None] * n
        self.waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._next_prefill = 0
        #: what each slot served last (for /slots after a request ends)
        self.last: list[Request | None] = [None] * n
        #: a request goes to the free slot whose cache shares the most with its prompt
        #: when that is more than this fraction of the prompt (llama-server's
        #: --slot-prompt-similarity), else to the least recently used free slot
        self.similarity = similarity
        self._used = [0] * n
        self._clock = itertools.count(1)

    # -- from any thread ------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if req.n_predict == 0:
            req.state.stats.n_prompt = len(req.prompt_tokens)
            req.stop_type = "limit"
            req._finish([])
            return
        if self.adapters is not None:
            req.state.adapter = self.adapters.key(req.lora)
        with self._lock:
            self.waiting.append(req)

    @property
    def stalled(self) -> bool:
        """Nothing to do but wait: every slot's request is paused, and none waits for
        one (or the first that waits, waits for one of them to end: ``_no_room``)."""
        head = self.waiting[0] if self.waiting else None
        return ((head is None or 0 < head.resume_below <= self.n_busy) and any(r is not None for r in self.slots)
                and all(r is None or (r.paused and not r.state.prefilling) for r in self.slots))

    @property
    def n_busy(self) -> int:
        return sum(r is not None for r in self.slots)

    # -- stepping (engine lock held) ------------------------------------------------

    def step(self) -> None:
        """One scheduling step: admit, one round for every generating slot, one
        prompt chunk."""
        self._release_finished()
        self._admit()
        drv = self.driver
        running = [r for r in self.slots if r is not None and not r.state.prefilling and not r.paused]
        by_adapter: dict[tuple[float, ...], list[Request]] = {}
        for r in running:
            by_adapter.setdefault(r.state.adapter, []).append(r)
        for key, group in by_adapter.items():
            self._use(key)
            self._round(group)
        prefilling = [r for r in self.slots if r is not None and r.state.prefilling]
        if prefilling:
            k = self._next_prefill % len(prefilling)
            self._next_prefill += 1
            # every prompt's next chunk while they fit one batch, as llama-server fills
            # its batch: requests that arrive together start generating together (one
            # by one, each started a step later and the slots drafted and ended out of
            # step, rounds of fewer rows than plain decoding's). Chunks share a decode
            # where each row keeps the bits it has decoded alone (``shared_prefills``):
            # a prompt's must be its own; and with the first's LoRA scales
            order = prefilling[k:] + prefilling[:k]
            order = [r for r in order if r.state.adapter == order[0].state.adapter]
            self._use(order[0].state.adapter)
            budget, chosen = drv.target.n_batch, []
            for i, r in enumerate(order):
                size = drv.chunk_size(r.state)
                if i and size > budget:
                    break
                budget -= size
                chosen.append(r)
            by_state = {id(r.state): r for r in chosen}
            for group in drv.shared_prefills([r.state for r in chosen]):
                reqs = [by_state[id(st)] for st in group]
                if len(reqs) == 1 or not self._prefill_together(reqs):
                    for r in reqs:
                        self._prefill_one(r)
        self._release_finished()

    def _use(self, adapter: tuple[float, ...]) -> None:
        """The target decodes with these LoRA scales from now on."""
        if self.adapters is not None:
            self.adapters.apply(self.driver.target, adapter)

    def _round(self, running: list[Request]) -> None:
        """One MTP round for these generating slots (at least one), together."""
        drv = self.driver
        for r in running:
            # tokens still wanted: drafts past them are rows verified for nothing
            r.state.budget = r.n_predict - len(r.out_tokens) if r.n_predict > 0 else -1
        try:
            outs = drv.round([r.state for r in running])
        except KVFullError as e:
            outs = [e]  # one sequence alone, and no room for its next token
        except LlamaError as e:
            # a round is shared: what failed it (a backend error) fails its members;
            # the slots are freed and the engine stays usable
            outs = []
            for r in running:
                r.fail(e)
        stuck = [r for r, out in zip(running, outs) if isinstance(out, LlamaError)]
        for r, out in zip(running, outs):
            if isinstance(out, LlamaError):
                self._no_room(r, len(stuck))
            else:
                r.feed(out, self.model, drv.n_ctx_seq)

    def _prefill_together(self, reqs: list[Request]) -> bool:
        """The next chunks of ``reqs``' prompts in one decode; False when the cache had no
        room for them all (nothing decoded: each goes on alone, as ``_prefill_one``)."""
        try:
            done = self.driver.prefill_together([r.state for r in reqs])
        except KVFullError:
            return False
        except LlamaError as e:
            for r in reqs:
                r.fail(e)
            return True
        for r, d in zip(reqs, done):
            self._prefilled(r, d)
        return True

    def _prefilled(self, r: Request, done: bool) -> None:
        """After a chunk of ``r``'s prompt: its progress, and once ``done`` its first token."""
        if not r.resuming:
            r.report_progress()
        if done:
            r.resumed()
            r.feed([r.state.id_last], self.model, self.driver.n_ctx_seq)

    def _prefill_one(self, r: Request) -> None:
        drv = self.driver
        try:
            self._prefilled(r, drv.prefill(r.state))
        except KVFullError as e:
            # as llama-server: idle slots' cached prefixes went first (the driver),
            # then smaller chunks; then it waits for a busy slot to end, and one that
            # finds no room with none busy fails alone
            if not drv.shrink_chunk(r.state):
                if self.n_busy > 1 or r.out_tokens:
                    self._no_room(r, 1)
                else:
                    r.fail(_context_exceeded(e))
        except LlamaError as e:
            r.fail(e)

    def _no_room(self, r: Request, n_stuck: int) -> None:
        """A shared cache has no room for ``r``'s next tokens or its prompt (``n_stuck``
        of the busy slots found none this step). While another slot goes on (it frees
        cells when it ends), ``r`` is preempted: its slot and cells are given up, and it
        waits to go on from its prompt and output decoded again, its text so far kept,
        as vLLM recomputes a preempted sequence. Else it ends as one that reached its
        context."""
        slot = r.state.seq_id
        if self.n_busy <= n_stuck or r.cancelled:
            r.run_out()
            return
        self.driver.release(slot)
        self.slots[slot] = None
        r.resume_below = self.n_busy
        r.preempted()
        with self._lock:
            self.waiting.appendleft(r)

    def _admit(self) -> None:
        with self._lock:
            while self.waiting:
                if self.waiting[0].cancelled:
                    self.waiting.popleft().fail(_cancelled())
                    continue
                if self.waiting[0].resume_below and self.n_busy >= self.waiting[0].resume_below:
                    return  # a preempted request waits for a slot to end and free cells
                slot = self._pick_slot(self.waiting[0])
                if slot < 0:
                    return
                req = self.waiting.popleft()
                req.state.seq_id = slot
                req.resume_below = 0
                self._used[slot] = next(self._clock)
                try:
                    self.driver.start(req.state, req.prompt_tokens + req.out_tokens, reuse=req.cache_prompt)
                except (ValueError, LlamaError) as e:
                    self.driver.release(slot)
                    req.fail(e)
                    continue
                self.slots[slot] = req
                self.last[slot] = req
                if not req.resuming:
                    req.report_progress()  # the first: what the cache held

    def _pick_slot(self, req: Request) -> int:
        """The free slot for ``req`` (-1: none free)."""
        free = [i for i, r in enumerate(self.slots) if r is None]
        if not free:
            return -1
        if req.cache_prompt:
            best, n_best = -1, 0
            for i in free:
                n = common_prefix(self.driver.cached_tokens(i, req.state.adapter), req.prompt_tokens)
                if n > n_best:
                    best, n_best = i, n
            if best >= 0 and n_best > self.similarity * len(req.prompt_tokens):
                return best
        return min(free, key=lambda i: self._used[i])

    def _release_finished(self) -> None:
        for i, r in enumerate(self.slots):
            if r is None:
                continue
            if r.cancelled and not r.done:
                r.fail(_cancelled())
            if r.done:
                self.slots[i] = None
                # its KV stays for the next request that shares a prefix with it, unless
                # a decode failed in its middle or the cache ran out of room for it
                self.driver.finish(r.state, keep=(r.error is None or isinstance(r.error, Cancelled))
                                   and not r.kv_lost)

    def drop(self, req: Request) -> None:
        """Cancel ``req`` and free what it holds now (its consumer went away)."""
        req.cancelled = True
        with self._lock:
            if req in self.waiting:
                self.waiting.remove(req)
                req.fail(_cancelled())
        self._release_finished()


def _context_exceeded(e: LlamaError) -> LlamaError:
    """llama-server's error for a request the KV cache has no room left for."""
    return LlamaError(f"Context size has been exceeded. ({e})")


class Cancelled(Exception):
    """The request was cancelled before it finished."""


def _cancelled() -> Cancelled:
    return Cancelled("cancelled")
