"""The MTP3 speculative round: draft, verify, process, accept.

This file is the data flow of ``shared/design/MTP3.md``, in Python. llama.cpp runs
the decodes; everything around them happens here.

Two contexts over the same weights (or a split pair of files):

* the *target* context decodes the trunk and returns, besides logits, ``h_tgt(p)``:
  the trunk's last hidden row at each position, before the output norm;
* the *draft* context (an MTP context) runs one appended MTP block per decode; the
  block is chosen by the context's MTP layer offset, so each head keeps its own KV.

State of a sequence (``SeqState``): ``id_last``, the last sampled token, not yet
decoded by the target, at position ``pos``; and ``pending_h``, the trunk hidden row
of the position before it.

    Invariant: pending_h == h_tgt(pos(id_last) - 1)

A head's KV is *anchored* at position p when it was written from the row
(token_p, h_tgt(p-1)): the true token and the trunk's hidden row before it.

The round of the change (``schedule="reference"``), with r = pos(id_last):

1. draft    head i at step i (``chain``) or head 0 at every step (``single``):
            decode [id_last@r, d1@r+1, .., di@r+i] with hidden rows
            [pending_h, out_0, .., out_{i-1}] (each head's output row feeds the
            next head), sample d(i+1) from the last row;
2. verify   the target decodes [id_last, d1, .., dn] at r..r+n, every row an output:
            logits and verify_h = [h_tgt(r) .. h_tgt(r+n)];
3. process  every head re-decodes the same tokens with the *trunk* rows, right
            shifted, [pending_h, h_tgt(r), .., h_tgt(r+n-1)], no outputs: each head's
            KV is re-anchored on the target's real hidden states;
4. accept   sample the target row by row while the sample equals the draft; the
            first mismatch (or the row after the last draft) gives the new id_last.
            With a accepted drafts: pending_h = verify_h[a], pos = r + a + 1, and
            the target forgets the rejected positions.

The fused round (``schedule="fused"``, the default) drafts the same tokens with
fewer decodes. Processing only matters for the rows that get *accepted* (the
rejected ones are removed by the next draft anyway), so it waits until accept has
decided them, and rides along with the next draft step of the same head: head k's
one decode carries the anchored rows it has not seen yet, then the chained prefix
[d1@r+1, .., dk@r+k]; only the last row is an output. ``kv_valid[k]`` says up to
which position head k is anchored; a head not used in a round is not decoded at
all, and catches up on every row it missed the next time it is used. Per round: one
decode per head used, plus the target's.

At temperature 0 the output is token for token what plain greedy decoding gives.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .adaptive import AdaptiveLength
from .llama import Batch, Context
from .sampling import Sampler, draft_pick, verify_rejection
from .stats import GenStats

__all__ = ["SpecConfig", "SeqState", "RoundTrace", "MTPDriver", "Mode", "Schedule", "Verify"]

Mode = Literal["chain", "single", "none"]
Schedule = Literal["fused", "reference"]
Verify = Literal["auto", "exact", "rejection"]


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings, named as llama-server's ``--spec-draft-*`` flags.

    mode: ``chain`` (head i drafts step i; n_max capped at the number of heads),
        ``single`` (head 0 for every step: the behaviour before chaining), ``none``.
    n_max: most tokens drafted per round. n_min: fewer drafted than this and the
        round drafts none. p_min: drafting stops at a token less likely than this.
    schedule: ``fused`` (process the accepted rows inside the next draft decodes) or
        ``reference`` (the change's schedule: a process decode per head per round).
        Both draft the same tokens.
    verify: ``exact`` (drafts are the heads' argmax; the target's sample must equal
        them), ``rejection`` (drafts drawn from the heads' distributions, accepted
        with probability min(1, p/q), residual resampling), or ``auto``: rejection
        above temperature 0. At temperature 0 both are greedy exact match.
    adaptive: choose the draft length each round (0 .. the draft length above) from
        measured acceptance and decode costs (``adaptive.AdaptiveLength``).
    """

    mode: Mode = "chain"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    schedule: Schedule = "fused"
    verify: Verify = "auto"
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "single", "none"):
            raise ValueError(f"unknown speculation mode {self.mode!r} (chain, single, none)")
        if self.verify not in ("auto", "exact", "rejection"):
            raise ValueError(f"unknown verification {self.verify!r} (auto, exact, rejection)")
        if self.schedule not in ("fused", "reference"):
            raise ValueError(f"unknown schedule {self.schedule!r} (fused, reference)")
        if self.n_max < 0 or self.n_min < 0:
            raise ValueError("n_max and n_min must be >= 0")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError("p_min must be in [0, 1]")

    def draft_length(self, n_heads: int) -> int:
        if self.mode == "none":
            return 0
        if self.mode == "chain":
            return min(self.n_max, n_heads)
        return self.n_max


class _Anchors:
    """The anchored rows (token_p, h_tgt(p-1)) for positions [start, end) that some
    head still has to see (fused schedule). A preallocated buffer, compacted as
    the slowest head catches up."""

    def __init__(self, n_embd: int, capacity: int) -> None:
        self.tok = np.zeros(capacity, dtype=np.int32)
        self.h = np.zeros((capacity, n_embd), dtype=np.float32)
        self.start = 0  # position of row 0
        self.n = 0

    @property
    def end(self) -> int:
        return self.start + self.n

    def reset(self, start: int = 0) -> None:
        self.start, self.n = start, 0

    def append(self, tokens: list[int] | np.ndarray, h_rows: np.ndarray) -> None:
        k = len(tokens)
        if self.n + k > len(self.tok):
            cap = max(2 * len(self.tok), self.n + k)
            tok, h = np.zeros(cap, dtype=np.int32), np.zeros((cap, self.h.shape[1]), dtype=np.float32)
            tok[: self.n], h[: self.n] = self.tok[: self.n], self.h[: self.n]
            self.tok, self.h = tok, h
        self.tok[self.n : self.n + k] = tokens
        self.h[self.n : self.n + k] = h_rows
        self.n += k

    def drop_before(self, pos: int) -> None:
        k = min(max(0, pos - self.start), self.n)
        if k:
            self.tok[: self.n - k] = self.tok[k : self.n]
            self.h[: self.n - k] = self.h[k : self.n]
            self.n -= k
            self.start += k


@dataclass
class SeqState:
    """One sequence being generated (one per slot)."""

    seq_id: int
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)  # prompt + generated, id_last included
    pos: int = 0  # position of id_last
    id_last: int = -1
    pending_h: np.ndarray | None = None  # h_tgt(pos - 1)
    stats: GenStats = field(default_factory=GenStats)
    #: verify by rejection sampling (drafts drawn from the heads' distributions)
    rejection: bool = False
    #: adaptive draft length (SpecConfig.adaptive): chooses n for each round
    policy: AdaptiveLength | None = None
    #: fused schedule: head k is anchored on positions [0, kv_valid[k])
    kv_valid: list[int] = field(default_factory=list)
    anchors: _Anchors | None = None
    #: debug mode: every trunk hidden row the target produced, by position
    h_log: dict[int, np.ndarray] | None = None
    #: debug mode: one RoundTrace per round
    trace: list["RoundTrace"] | None = None


@dataclass
class RoundTrace:
    """What one round did (debug mode): for comparing schedules round by round."""

    pos: int  # position of id_last at the round's start
    drafts: list[int]
    probs: list[float]
    n_accepted: int
    out: list[int]
    #: the draft context's cells of this sequence after the round (seq_pos_min, seq_pos_max)
    draft_cells: tuple[int, int]
    #: fused schedule: each head's anchored prefix after the round
    kv_valid: list[int]


class MTPDriver:
    """Runs MTP rounds for sequences on a target and a draft context.

    ``draft`` may be None for ``mode="none"``. ``debug`` checks the invariant
    ``pending_h == h_tgt(pos(id_last) - 1)`` every round (it keeps every trunk row).
    """

    def __init__(self, target: Context, draft: Context | None, spec: SpecConfig, *, debug: bool = False) -> None:
        self.target = target
        self.draft = draft
        self.spec = spec
        self.debug = debug
        self.speculate = spec.mode != "none" and spec.n_max > 0
        if self.speculate and draft is None:
            raise ValueError("speculation needs a draft (MTP) context")
        self.n_heads = draft.model.n_mtp_blocks if draft is not None else 0
        self.n_draft = spec.draft_length(self.n_heads) if self.speculate else 0
        self.fused = spec.schedule == "fused"
        # the heads a round can use: the first n_draft when chaining, head 0 alone when
        # it is the only one; the others are never decoded (nor anchored)
        self.heads = list(range(min(self.n_draft, self.n_heads))) if spec.mode == "chain" else [0]
        # the change's schedule re-anchors every head, used or not, each round
        self.process_heads = list(range(self.n_heads)) if spec.mode == "chain" else [0]
        self.n_embd = target.n_embd
        self.n_chunk = target.n_batch if draft is None else min(target.n_batch, draft.n_batch)
        if self.speculate and self.n_chunk <= self.n_draft:
            raise ValueError(f"n_batch ({self.n_chunk}) must exceed the draft length ({self.n_draft})")
        self.tbatch = Batch(self.n_chunk)
        self.dbatch = Batch(self.n_chunk, n_embd=self.n_embd) if draft is not None else None
        # unmasked: a hidden row for every batch row (the prompt's rows are not outputs)
        target.set_nextn(self.speculate, masked=False)
        if draft is not None:
            draft.set_nextn(True, masked=True)
        self._zero_h = np.zeros((1, self.n_embd), dtype=np.float32)
        # fused schedule: the heads' output rows out_0 .. out_{n-1} of the current round
        self._chain_h = np.zeros((max(1, self.n_draft), self.n_embd), dtype=np.float32)
        self._probs = [0.0] * max(1, self.n_draft)
        self._t_steps: list[float] = []  # seconds per draft step of the current round
        self._need_p = spec.p_min > 0 or debug
        # rejection sampling: the distributions the round's drafts were drawn from
        self._q = np.zeros((max(1, self.n_draft), target.n_vocab), dtype=np.float64)

    # -- timing: what runs inside llama.cpp, so the rest is Python's share ------

    def _decode(self, ctx: Context, batch: Batch, s: SeqState) -> None:
        t0 = time.perf_counter()
        ctx.decode(batch)
        s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3
        if ctx is self.target:
            s.stats.n_target_decodes += 1
            s.stats.n_target_rows += batch.n
        else:
            s.stats.n_draft_decodes += 1
            s.stats.n_draft_rows += batch.n

    # -- bootstrap --------------------------------------------------------------

    def begin(self, s: SeqState, prompt: list[int]) -> int:
        """Decode the prompt, anchor the heads on it, and sample the first token."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context ({self.target.n_ctx})")
        t0 = time.perf_counter()
        self.target.seq_rm(s.seq_id)
        if self.draft is not None:
            self.draft.seq_rm(s.seq_id)
        s.tokens = list(prompt)
        s.pending_h = self._zero_h[0]
        s.policy = AdaptiveLength(self.n_draft) if self.spec.adaptive and self.speculate else None
        s.h_log = {} if self.debug else None
        s.trace = [] if self.debug else None
        if self.fused and self.speculate:
            s.kv_valid = [0] * self.n_heads
            s.anchors = s.anchors or _Anchors(self.n_embd, 2 * self.n_chunk)
            s.anchors.reset()
        n = len(prompt)
        logits = None
        for a in range(0, n, self.n_chunk):
            chunk = prompt[a : a + self.n_chunk]
            last = a + len(chunk) == n
            self.tbatch.fill(chunk, a, s.seq_id, outputs="last" if last else "none")
            self._decode(self.target, self.tbatch, s)
            if self.speculate:
                h = self.target.nextn(len(chunk))
                self._log_h(s, a, h)
                if self.fused:
                    # the heads see these rows in their next decodes; whole chunks go
                    # now, so the buffer stays under n_batch rows
                    s.anchors.append(chunk[:1], s.pending_h[None, :])
                    s.anchors.append(chunk[1:], h[:-1])
                    self._catch_up(s, keep=self.n_chunk - 1 - self.n_draft)
                else:
                    self._process(s, chunk, a, h, n_rows=len(chunk))
                s.pending_h = h[-1].copy()
            if last:
                logits = self.target.logits(-1)
        s.id_last = s.sampler.sample(logits, s.tokens)
        s.tokens.append(s.id_last)
        s.pos = n
        if self.fused and self.speculate:
            s.anchors.append([s.id_last], s.pending_h[None, :])
        s.stats.n_prompt = n
        s.stats.t_prompt_ms += (time.perf_counter() - t0) * 1e3
        return s.id_last

    # -- one round ----------------------------------------------------------------

    def round(self, s: SeqState) -> list[int]:
        """One draft / verify / (process) / accept round; returns the tokens it emits
        (the accepted drafts and the target's own next token)."""
        r = s.pos
        if self.debug and self.speculate:
            self._check_invariant(s)
        room = self.target.n_ctx - 1 - r  # positions left after id_last
        n_max = min(self.n_draft, room)
        if s.policy is not None:
            n_max = min(n_max, s.policy.choose())
        self._t_steps.clear()
        if not self.speculate:
            drafts = []
        elif self.fused:
            drafts = self._draft_fused(s, n_max)
        else:
            drafts = self._draft(s, n_max)
        n = len(drafts)

        # verify: the target decodes id_last and the drafts, every row an output
        t_verify = time.perf_counter()
        self.tbatch.fill([s.id_last, *drafts], r, s.seq_id, outputs="all")
        self._decode(self.target, self.tbatch, s)
        t0 = time.perf_counter()
        logits = self.target.logits_rows(n + 1)
        verify_h = self.target.nextn(n + 1) if self.speculate else None
        s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3
        if self.speculate:
            self._log_h(s, r, verify_h)
            if not self.fused:
                # process: re-anchor every head on the trunk rows, right-shifted by one
                self._process(s, [s.id_last, *drafts], r, verify_h, n_rows=n + 1)

        # accept: the target's samples while they equal the drafts, or rejection sampling
        if s.rejection:
            hist = s.tokens
            out = verify_rejection(
                s.sampler, lambda i: s.sampler.dense(logits[i], hist + drafts[:i]), drafts, self._q[:n]
            )
            s.tokens.extend(out)
        else:
            out = []
            for i in range(n + 1):
                tok = s.sampler.sample(logits[i], s.tokens)
                out.append(tok)
                s.tokens.append(tok)
                if i == n or tok != drafts[i]:
                    break
        a = len(out) - 1
        if self.speculate:
            s.pending_h = verify_h[a].copy()
            if self.fused:
                # positions r+1 .. r+a+1 (accepted drafts, new id_last) wait for the heads
                s.anchors.append(out, verify_h[: a + 1])
        s.id_last = out[-1]
        s.pos = r + a + 1
        if a < n:
            self.target.seq_rm(s.seq_id, s.pos)  # the rejected drafts' KV
        s.stats.count_round(n, a)
        if s.policy is not None:
            s.policy.observe(n, a, self._t_steps, time.perf_counter() - t_verify)
        if s.trace is not None:
            cells = (self.draft.seq_pos_min(s.seq_id), self.draft.seq_pos_max(s.seq_id)) if self.draft else (-1, -1)
            s.trace.append(RoundTrace(r, drafts, self._probs[:n], a, out, cells, list(s.kv_valid)))
        return out

    # -- the change's schedule ---------------------------------------------------

    def _draft(self, s: SeqState, n_max: int) -> list[int]:
        """Up to n_max draft tokens from the heads (chained, or head 0 looped)."""
        d, b, r = self.draft, self.dbatch, s.pos
        drafts: list[int] = []
        h_prev = s.pending_h
        for i in range(n_max):
            t_step = time.perf_counter()
            if self.spec.mode == "chain":
                # head i has no KV past r: it decodes the whole prefix, with the
                # previous heads' output rows as its hidden inputs
                d.seq_rm(s.seq_id, r)
                d.mtp_offset = i
                if i == 0:
                    b.fill([s.id_last], r, s.seq_id, outputs="last", embd=s.pending_h[None, :])
                else:
                    self._grow(b, drafts[-1], r + i, s.seq_id, h_prev)
            else:
                # one head, its own KV: one new row per step
                if i == 0:
                    d.seq_rm(s.seq_id, r)
                    d.mtp_offset = 0
                    b.fill([s.id_last], r, s.seq_id, outputs="last", embd=s.pending_h[None, :])
                else:
                    b.fill([drafts[-1]], r + i, s.seq_id, outputs="last", embd=h_prev[None, :])
            h_prev = self._take_draft(s, i, drafts, t_step)
            if h_prev is None:
                break
        d.seq_rm(s.seq_id, r)
        return drafts if len(drafts) >= self.spec.n_min else []

    def _process(self, s: SeqState, tokens: list[int], p0: int, h_tgt: np.ndarray, n_rows: int) -> None:
        """Teacher-force every head on ``tokens`` at p0.. with the trunk rows
        [pending_h, h_tgt[0], .., h_tgt[n-2]] (right-shifted by one), no outputs."""
        d, b = self.draft, self.dbatch
        b.fill(tokens, p0, s.seq_id, outputs="none")
        b.embd[0] = s.pending_h
        b.embd[1:n_rows] = h_tgt[: n_rows - 1]
        for k in self.process_heads:
            d.seq_rm(s.seq_id, p0)
            d.mtp_offset = k
            self._decode(d, b, s)

    # -- the fused schedule --------------------------------------------------------

    def _draft_fused(self, s: SeqState, n_max: int) -> list[int]:
        """Draft with one decode per head used, each carrying the anchored rows the
        head has not seen (through id_last@r) and then the chained prefix."""
        d, b, r = self.draft, self.dbatch, s.pos
        drafts: list[int] = []
        h_prev = s.pending_h
        for i in range(n_max):
            t_step = time.perf_counter()
            k = i if self.spec.mode == "chain" else 0
            if self.spec.mode == "chain" or i == 0:
                d.mtp_offset = k
                # rows [kv_valid[k], r]: anchored; the last one is id_last@r with pending_h
                self._catch_up(s, keep=self.n_chunk - 1 - i, heads=[k])
                a0 = s.kv_valid[k] - s.anchors.start
                m = s.anchors.n - a0
                d.seq_rm(s.seq_id, s.kv_valid[k])
                b.fill(s.anchors.tok[a0 : a0 + m], s.kv_valid[k], s.seq_id, outputs="none",
                       embd=s.anchors.h[a0 : a0 + m])
                # then [d1@r+1, .., di@r+i] with the chained rows out_0 .. out_{i-1}
                for j in range(i):
                    b.add(drafts[j], r + 1 + j, s.seq_id)
                    b.embd[b.n - 1] = self._chain_h[j]
                b.logits[b.n - 1] = 1
                s.kv_valid[k] = r + 1
            else:
                # single: head 0's own KV holds the round's earlier rows
                b.fill([drafts[-1]], r + i, s.seq_id, outputs="last", embd=h_prev[None, :])
            h_prev = self._take_draft(s, i, drafts, t_step)
            if h_prev is None:
                break
            self._chain_h[i] = h_prev
        s.anchors.drop_before(min(s.kv_valid[k] for k in self.heads))
        return drafts if len(drafts) >= self.spec.n_min else []

    def _catch_up(self, s: SeqState, keep: int, heads: list[int] | None = None) -> None:
        """Decode, without outputs, the anchored rows of each head beyond the last
        ``keep`` (whole n_batch chunks), so the next decode fits in a batch."""
        d, b, A = self.draft, self.dbatch, s.anchors
        for k in self.heads if heads is None else heads:
            while A.end - s.kv_valid[k] > keep:
                a0 = s.kv_valid[k] - A.start
                m = min(self.n_chunk, A.end - s.kv_valid[k] - keep)
                d.mtp_offset = k
                d.seq_rm(s.seq_id, s.kv_valid[k])
                b.fill(A.tok[a0 : a0 + m], s.kv_valid[k], s.seq_id, outputs="none", embd=A.h[a0 : a0 + m])
                self._decode(d, b, s)
                s.kv_valid[k] += m
        A.drop_before(min(s.kv_valid[k] for k in self.heads))

    # -- shared pieces -------------------------------------------------------------

    @staticmethod
    def _grow(b: Batch, token: int, pos: int, seq: int, h: np.ndarray) -> None:
        """Extend the previous draft step's batch by one row, now the only output."""
        i = b.n
        b.n = i + 1
        b.token[i], b.pos[i], b.seq[i] = token, pos, seq
        b.logits[i - 1], b.logits[i] = 0, 1
        b.embd[i] = h

    def _take_draft(self, s: SeqState, i: int, drafts: list[int], t_step: float) -> np.ndarray | None:
        """Decode draft step i's batch and append its token to ``drafts``; returns the
        step's output hidden row, or None when the token is below p_min."""
        self._decode(self.draft, self.dbatch, s)
        tok, p, h = self._pick(s, i, drafts)
        self._t_steps.append(time.perf_counter() - t_step)
        if p < self.spec.p_min:
            return None
        self._probs[i] = p
        drafts.append(tok)
        return h

    def _pick(self, s: SeqState, i: int, drafts: list[int]) -> tuple[int, float, np.ndarray]:
        """Draft token i from the last decode, its probability, and its hidden row."""
        t0 = time.perf_counter()
        logits = self.draft.logits(-1)
        h = self.draft.nextn(1)[0].copy()
        s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3
        if s.rejection:
            # drawn from the head's distribution under the request's settings; q kept
            # for verification
            q = self._q[i]
            q[:] = s.sampler.dense(logits, s.tokens + drafts if s.sampler.penalizes else s.tokens)
            tok = s.sampler.draw(q)
            return tok, float(q[tok]), h
        if self._need_p:
            tok, p = draft_pick(logits)
        else:  # p_min 0 and no trace: the probability is never looked at
            tok, p = int(np.argmax(logits)), 1.0
        return tok, p, h

    def _log_h(self, s: SeqState, p0: int, h: np.ndarray) -> None:
        if s.h_log is not None:
            for j in range(len(h)):
                s.h_log[p0 + j] = h[j].copy()

    def _check_invariant(self, s: SeqState) -> None:
        want = s.h_log.get(s.pos - 1)
        if want is None or not np.array_equal(s.pending_h, want):
            raise AssertionError(f"invariant broken: pending_h != h_tgt({s.pos - 1}) at pos {s.pos}")
        if self.fused:
            A = s.anchors
            if A.end != s.pos + 1 or A.tok[A.n - 1] != s.id_last or not np.array_equal(A.h[A.n - 1], s.pending_h):
                raise AssertionError(f"the anchored rows do not end with (id_last, pending_h) at {s.pos}")
