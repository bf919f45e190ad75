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

A round, with r = pos(id_last):

1. draft    head i at step i (``chain``) or head 0 at every step (``single``):
            decode [id_last@r, d1@r+1, .., di@r+i] with hidden rows
            [pending_h, out_0, .., out_{i-1}] (each head's own output row feeds the
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

At temperature 0 the output is token for token what plain greedy decoding gives.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .llama import Batch, Context
from .sampling import Sampler, draft_pick
from .stats import GenStats

__all__ = ["SpecConfig", "SeqState", "MTPDriver", "Mode"]

Mode = Literal["chain", "single", "none"]


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings, named as llama-server's ``--spec-draft-*`` flags.

    mode: ``chain`` (head i drafts step i; n_max capped at the number of heads),
        ``single`` (head 0 for every step: the behaviour before chaining), ``none``.
    n_max: most tokens drafted per round. n_min: fewer drafted than this and the
        round drafts none. p_min: drafting stops at a token less likely than this.
    """

    mode: Mode = "chain"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "single", "none"):
            raise ValueError(f"unknown speculation mode {self.mode!r} (chain, single, none)")
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


class MTPDriver:
    """Runs MTP rounds for sequences on a target and a draft context.

    ``draft`` may be None for ``mode="none"``.
    """

    def __init__(self, target: Context, draft: Context | None, spec: SpecConfig) -> None:
        self.target = target
        self.draft = draft
        self.spec = spec
        self.speculate = spec.mode != "none" and spec.n_max > 0
        if self.speculate and draft is None:
            raise ValueError("speculation needs a draft (MTP) context")
        self.n_heads = draft.model.n_mtp_blocks if draft is not None else 0
        self.n_draft = spec.draft_length(self.n_heads) if self.speculate else 0
        # heads re-anchored by the process step: all of them when chaining, head 0 alone
        # when it is the only one ever used
        self.process_heads = list(range(self.n_heads)) if spec.mode == "chain" else [0]
        self.n_embd = target.n_embd
        self.n_chunk = target.n_batch if draft is None else min(target.n_batch, draft.n_batch)
        self.tbatch = Batch(self.n_chunk)
        self.dbatch = Batch(self.n_chunk, n_embd=self.n_embd) if draft is not None else None
        # unmasked: a hidden row for every batch row (the prompt's rows are not outputs)
        target.set_nextn(self.speculate, masked=False)
        if draft is not None:
            draft.set_nextn(True, masked=True)
        self._zero_h = np.zeros(self.n_embd, dtype=np.float32)

    # -- timing: what runs inside llama.cpp, so the rest is Python's share ------

    def _decode(self, ctx: Context, batch: Batch, s: SeqState) -> None:
        t0 = time.perf_counter()
        ctx.decode(batch)
        s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3
        if ctx is self.target:
            s.stats.n_target_decodes += 1
        else:
            s.stats.n_draft_decodes += 1

    # -- bootstrap --------------------------------------------------------------

    def begin(self, s: SeqState, prompt: list[int]) -> int:
        """Decode the prompt, anchor every head on it, and sample the first token."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.target.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context ({self.target.n_ctx})")
        t0 = time.perf_counter()
        self.target.seq_rm(s.seq_id)
        if self.draft is not None:
            self.draft.seq_rm(s.seq_id)
        s.tokens = list(prompt)
        s.pending_h = self._zero_h
        n = len(prompt)
        logits = None
        for a in range(0, n, self.n_chunk):
            chunk = prompt[a : a + self.n_chunk]
            last = a + len(chunk) == n
            self.tbatch.fill(chunk, a, s.seq_id, outputs="last" if last else "none")
            self._decode(self.target, self.tbatch, s)
            if self.speculate:
                h = self.target.nextn(len(chunk))
                self._process(s, chunk, a, h, n_rows=len(chunk))
                s.pending_h = h[-1].copy()
            if last:
                logits = self.target.logits(-1)
        s.id_last = s.sampler.sample(logits, s.tokens)
        s.tokens.append(s.id_last)
        s.pos = n
        s.stats.n_prompt = n
        s.stats.t_prompt_ms += (time.perf_counter() - t0) * 1e3
        return s.id_last

    # -- one round ----------------------------------------------------------------

    def round(self, s: SeqState) -> list[int]:
        """One draft / verify / process / accept round; returns the tokens it emits
        (the accepted drafts and the target's own next token)."""
        r = s.pos
        room = self.target.n_ctx - 1 - r  # positions left after id_last
        drafts = self._draft(s, min(self.n_draft, room)) if self.speculate else []
        n = len(drafts)

        # verify: the target decodes id_last and the drafts, every row an output
        self.tbatch.fill([s.id_last, *drafts], r, s.seq_id, outputs="all")
        self._decode(self.target, self.tbatch, s)
        t0 = time.perf_counter()
        logits = self.target.logits_rows(n + 1)
        verify_h = self.target.nextn(n + 1) if self.speculate else None
        s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3

        if self.speculate:
            # process: re-anchor every head on the trunk rows, right-shifted by one
            self._process(s, [s.id_last, *drafts], r, verify_h, n_rows=n + 1)

        # accept: the target's samples, while they equal the drafts
        out: list[int] = []
        for i in range(n + 1):
            tok = s.sampler.sample(logits[i], s.tokens)
            out.append(tok)
            s.tokens.append(tok)
            if i == n or tok != drafts[i]:
                break
        a = len(out) - 1
        if self.speculate:
            s.pending_h = verify_h[a].copy()
        s.id_last = out[-1]
        s.pos = r + a + 1
        if a < n:
            self.target.seq_rm(s.seq_id, s.pos)  # the rejected drafts' KV
        s.stats.count_round(n, a)
        return out

    def _draft(self, s: SeqState, n_max: int) -> list[int]:
        """Up to n_max draft tokens from the heads (chained, or head 0 looped)."""
        d, b, r = self.draft, self.dbatch, s.pos
        drafts: list[int] = []
        h_prev = s.pending_h
        for i in range(n_max):
            if self.spec.mode == "chain":
                # head i has no KV past r: it decodes the whole prefix, with the
                # previous heads' output rows as its hidden inputs
                d.seq_rm(s.seq_id, r)
                d.mtp_offset = i
                if i == 0:
                    b.fill([s.id_last], r, s.seq_id, outputs="last", embd=s.pending_h[None, :])
                else:
                    b.n = i + 1  # rows 0..i-1 hold the previous step's batch
                    b.token[i] = drafts[-1]
                    b.pos[i] = r + i
                    b.seq[i] = s.seq_id
                    b.logits[i - 1] = 0
                    b.logits[i] = 1
                    b.embd[i] = h_prev
            else:
                # one head, its own KV: one new row per step
                if i == 0:
                    d.seq_rm(s.seq_id, r)
                    d.mtp_offset = 0
                    b.fill([s.id_last], r, s.seq_id, outputs="last", embd=s.pending_h[None, :])
                else:
                    b.fill([drafts[-1]], r + i, s.seq_id, outputs="last", embd=h_prev[None, :])
            self._decode(d, b, s)
            t0 = time.perf_counter()
            tok, p = draft_pick(d.logits(-1))
            h_prev = d.nextn(1)[0].copy()
            s.stats.t_llama_ms += (time.perf_counter() - t0) * 1e3
            if p < self.spec.p_min:
                break
            drafts.append(tok)
        d.seq_rm(s.seq_id, r)
        if len(drafts) < self.spec.n_min:
            drafts = []
        return drafts

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
