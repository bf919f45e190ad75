"""The MTP heads as a drafter: their draft steps, their catching up, their draft vocabulary.

Head k (appended MTP block k) takes the token at position q and a hidden row for q-1,
and predicts the token at q+1. Chained (``mode="chain"``), head i drafts step i from the
output row of head i-1; ``single`` loops head 0. Each head has a draft context of its
own (its KV that block's layer alone), a sequence the same sequence id in every context.

The driver (``mtp.MTPDriver``) owns the round; this class owns what happens inside a
draft step:

* ``draft_fused`` (the default schedule): one decode per head used, each carrying, per
  sequence, the *anchored* rows (token_p, h_tgt(p-1)) the head has not seen yet and then
  the round's chained prefix; only the last row is an output. A head not used in a
  round is not decoded, and catches up on the rows it missed the next time it is
  (``catch_up``; bounded by ``MAX_CATCH_UP``, ``bound_catch_up``).
* ``draft`` and ``process`` (the change's schedule, ``schedule="reference"``): the draft
  steps, then a process decode per head per round re-anchoring every head on the
  target's rows.
* a draft step takes the head's token (``_pick``: its argmax, or a draw from its
  distribution shaped for rejection sampling, with how sure the head was), unless the
  plan gates it out (``SeqPolicy.keep``), a grammar forbids it, or it is a context's
  token the heads extend (``_take_forced``).
* the draft vocabulary: the heads draft among the first ids of their LM head (most of
  what a step reads), widened while the target's tokens fall outside it.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ..llama import Context, KVFullError
from ..sampling import draft_pick
from ..sequence import SeqState, SpecConfig

# (the driver is mtp's, which imports this module: named in annotations, not imported)

__all__ = ["Heads"]

log = logging.getLogger("stepmtp.mtp")

def _masked(s: "SeqState", row: np.ndarray, i: int | None = None) -> np.ndarray:
    """``row`` with what the sequence's constraint forbids next at -inf (a copy: the
    row is a view into llama.cpp's output buffer). ``i``: the row's depth in this
    round's verification, whose mask the drafting step may have computed already."""
    if s.constraint is None:
        return row
    return s.constraint.masked(row, s.draft_bits[i] if i is not None and i < s.n_masked else None)




class Heads:
    """The MTP heads of a driver (see the module). ``drv`` lends the decodes (its
    ``_decode_evicting``: a full shared cache gives up idle slots' prefixes first), the
    plan, and the batch sizes."""

    #: the fewest token ids an automatic draft vocabulary has
    DRAFT_VOCAB_MIN = 2048
    #: target tokens seen before the draft vocabulary's coverage is judged, and the
    #: share of them it may miss
    DRAFT_VOCAB_WINDOW = 512
    DRAFT_VOCAB_MISS = 0.01
    #: adaptive length: the most rows a head catches up on when drafting resumes
    MAX_CATCH_UP = 256

    def __init__(self, drv: "MTPDriver", debug: bool = False) -> None:
        self.drv = drv
        self.spec: "SpecConfig" = drv.spec
        self.drafts: list[Context | None] = drv.drafts
        self.n_heads, self.n_draft, self.fused = drv.n_heads, drv.n_draft, drv.fused
        self.heads, self.process_heads = drv.heads, drv.process_heads
        self.dbatch = drv.dbatch
        self._need_p = self.spec.p_min > 0 or debug
        want = self.spec.draft_vocab if self.spec.draft_vocab >= 0 else \
            max(self.DRAFT_VOCAB_MIN, drv.target.n_vocab // 4)
        self.set_vocab(want if self._live() else 0)  # (plain decoding: nothing to count)
        self._emitted = self._outside = 0  # the target's tokens, and those not draftable

    def _live(self) -> list[tuple[int, Context]]:
        return [(k, d) for k, d in enumerate(self.drafts) if d is not None]


    @staticmethod
    def plan(spec: SpecConfig, n_heads: int) -> tuple[list[int], list[int]]:
        """(the heads a round drafts with, the heads the reference schedule
        re-anchors): the first n_draft and every head when chaining, head 0 else."""
        if spec.mode != "chain":
            return [0], [0]
        n_draft = spec.draft_length(n_heads) if spec.n_max > 0 else 0
        return list(range(min(n_draft, n_heads))), list(range(n_heads))


    @staticmethod
    def used(spec: SpecConfig, n_heads: int) -> list[int]:
        """The heads a driver with these settings decodes (the draft contexts it
        needs): those it drafts with, and with the reference schedule those it
        re-anchors; none without speculation."""
        if spec.mode == "none" or spec.n_max == 0 or n_heads == 0:
            return []
        heads, process = Heads.plan(spec, n_heads)
        return process if spec.schedule == "reference" else heads


    def set_vocab(self, n: int) -> None:
        n = 0 if n >= self.drv.target.n_vocab else n
        for _, d in self._live():
            n = d.set_draft_vocab(n)
        #: the heads draft among token ids below this (0: all); ``_count_draftable``
        self.draft_vocab = n


    def count_draftable(self, out: list[int]) -> None:
        """Counts the target's tokens the heads could not have drafted; past the window,
        a vocabulary missing more than DRAFT_VOCAB_MISS of them doubles (a text in
        another script than the vocabulary's first ids, say)."""
        self._emitted += len(out)
        if max(out) >= self.draft_vocab:
            self._outside += sum(t >= self.draft_vocab for t in out)
        if self._emitted >= self.DRAFT_VOCAB_WINDOW:
            if self._outside > self.DRAFT_VOCAB_MISS * self._emitted:
                self.set_vocab(2 * self.draft_vocab)
                log.info("drafting among the first %s token ids (%d of %d of the target's were beyond)",
                         self.draft_vocab or "all", self._outside, self._emitted)
            self._emitted = self._outside = 0


    def _drafting(self, seqs: list[SeqState], i: int) -> list[SeqState]:
        """The sequences that draft step i: planned that far, not stopped by p_min."""
        return [s for s in seqs if i < s.n_plan and len(s.drafts) == i]


    def _end_drafts(self, seqs: list[SeqState]) -> None:
        for s in seqs:
            if s.n_plan == 0:
                continue  # (a context draft, made whole before the heads')
            if s.constraint is not None and s.mask_drafts and s.drafts:
                s.constraint.rollback(len(s.drafts))  # verification advances it again
            if len(s.drafts) < self.spec.n_min:
                s.drafts = []


    def draft(self, seqs: list[SeqState]) -> list[float | None]:
        """Up to n_plan draft tokens per sequence from the heads (chained, or head 0
        looped); the seconds each step took."""
        b = self.dbatch
        steps: list[float | None] = []
        for i in range(self.n_draft):
            active = self._drafting(seqs, i)
            if not active:
                break
            t0 = time.perf_counter()
            b.clear()
            # chain: head i has no KV past r, it decodes the whole prefix with the
            # previous heads' output rows as its hidden inputs; single: head 0 starts,
            # then grows its own rows
            k = i if self.spec.mode == "chain" else 0
            d = self.drafts[k]
            if self.spec.mode == "chain" or i == 0:
                for s in active:
                    d.seq_rm(s.seq_id, s.pos)
                    j = b.append([s.id_last, *s.drafts], s.pos, s.seq_id, outputs="last")
                    b.embd[j] = s.pending_h
                    b.embd[j + 1 : j + 1 + i] = s.chain_h[:i]
                    s.row = b.n - 1
            else:
                self._grow_single(active, i)
            if not self._decode_step(d, active, i):
                break
            steps.append(time.perf_counter() - t0)
        for s in seqs:
            for k in self.heads:
                self.drafts[k].seq_rm(s.seq_id, s.pos)
        self._end_drafts(seqs)
        return steps


    def process(self, items: list[tuple[SeqState, list[int], int, np.ndarray]]) -> None:
        """Teacher-force every head on each item's ``tokens`` at p0.. with the trunk
        rows [pending_h, h_tgt[0], .., h_tgt[n-2]] (right-shifted by one), no outputs."""
        b = self.dbatch
        b.clear()
        for s, tokens, p0, h_tgt in items:
            j = b.append(tokens, p0, s.seq_id, outputs="none")
            b.embd[j] = s.pending_h
            b.embd[j + 1 : j + len(tokens)] = h_tgt[: len(tokens) - 1]
        seqs = [it[0] for it in items]
        for k in self.process_heads:
            # the same batch into every head's context
            d = self.drafts[k]
            for s, _, p0, _ in items:
                d.seq_rm(s.seq_id, p0)
            try:
                self.drv._decode_evicting(d, b, seqs)
            except KVFullError:
                # no room: the head starts over on these sequences (a later decode may
                # start anywhere in an empty sequence, not after a gap)
                for s in seqs:
                    d.seq_rm(s.seq_id)


    def draft_fused(self, seqs: list[SeqState]) -> list[float | None]:
        """Draft with one decode per head used, each carrying, per sequence, the
        anchored rows the head has not seen (through id_last@r) and then the chained
        prefix; the seconds each step took (None: a step that first caught a head up
        on the rows of rounds it sat out, not what a step costs)."""
        b = self.dbatch
        steps: list[float | None] = []
        for i in range(self.n_draft):
            active = self._drafting(seqs, i)
            if not active:
                break
            t0 = time.perf_counter()
            k = i if self.spec.mode == "chain" else 0
            d = self.drafts[k]
            head_step = self.spec.mode == "chain" or i == 0
            # a head that drafted last round has the rows it accepted to take in (at most
            # n_draft); one that sat out rounds (a shorter plan) takes theirs in too, and
            # a step timed then costed the deeper plans by what switching to them cost
            # once: steps 2 and 3 were timed at twice step 1 (they cost the same), and
            # the plan drafted 1 where 3 paid (four clients at temperature 0)
            behind = head_step and any(s.pos - s.kv_valid[k] > self.n_draft for s in active)
            if head_step:
                for s in active:
                    # rows [kv_valid[k], r]: anchored; the last one is id_last@r with pending_h
                    self.catch_up(s, keep=self.drv.n_rows_seq - 1 - i, heads=[k])
            b.clear()  # after the catch-ups: their decodes fill the same batch
            # head k's bookkeeping before this step's decode, should it find no room
            before = [(s, s.kv_valid[k], s.kv_end[k]) for s in active]
            if head_step:
                for s in active:
                    A = s.anchors
                    a0 = s.kv_valid[k] - A.start
                    self._trim(s, k)
                    b.append(A.tok[a0 : A.n], s.kv_valid[k], s.seq_id, embd=A.h[a0 : A.n])
                    # then [d1@r+1, .., di@r+i] with the chained rows out_0 .. out_{i-1}
                    if i:
                        b.append(s.drafts, s.pos + 1, s.seq_id, embd=s.chain_h[:i])
                    s.row = b.n - 1
                    b.logits[s.row] = 1
                    s.kv_valid[k] = s.pos + 1
                    s.kv_end[k] = s.pos + 1 + i
            else:
                self._grow_single(active, i)
            if not self._decode_step(d, active, i):
                for s, valid, end in before:  # nothing of the batch was decoded
                    s.kv_valid[k], s.kv_end[k] = valid, end
                break
            steps.append(None if behind else time.perf_counter() - t0)
        for s in seqs:
            s.anchors.drop_before(min(s.kv_valid[k] for k in self.heads))
        self._end_drafts(seqs)
        return steps


    def bound_catch_up(self, s: SeqState, end: int) -> None:
        """Adaptive length: a head that sat out many rounds starts over from the last
        MAX_CATCH_UP rows it missed (of the anchored ones, up to ``end``), its older KV
        dropped (llama.cpp takes a sequence's positions only as a continuation of what
        its KV holds, or from scratch), and so do the rows kept for it. Otherwise the
        round that probes whether drafting pays again would pay for the whole pause
        first (the prompt included), and probing would cost more than it can win.
        Drafts only get worse, never wrong: the target verifies them."""
        floor = end - self.MAX_CATCH_UP
        for k in self.heads:
            if s.kv_valid[k] < floor:
                self.drafts[k].seq_rm(s.seq_id)
                s.kv_valid[k] = s.kv_end[k] = floor
        s.anchors.drop_before(min(s.kv_valid[k] for k in self.heads))


    def catch_up(self, s: SeqState, keep: int, heads: list[int] | None = None) -> None:
        """Decode, without outputs, the anchored rows of each head beyond the last
        ``keep`` (whole chunks), so the next shared decode fits in a batch."""
        b, A = self.dbatch, s.anchors
        for k in self.heads if heads is None else heads:
            d = self.drafts[k]
            while A.end - s.kv_valid[k] > keep:
                a0 = s.kv_valid[k] - A.start
                m = min(self.drv.n_chunk, A.end - s.kv_valid[k] - keep)
                self._trim(s, k)
                b.fill(A.tok[a0 : a0 + m], s.kv_valid[k], s.seq_id, outputs="none", embd=A.h[a0 : a0 + m])
                t0 = time.perf_counter()
                try:
                    self.drv._decode_evicting(d, b, [s])
                except KVFullError:
                    return  # the rows wait in the anchors for a decode with room
                if self.drv.planner is not None:
                    self.drv.planner.observe_catch_up(m, time.perf_counter() - t0)
                s.kv_valid[k] += m
                s.kv_end[k] = s.kv_valid[k]
        A.drop_before(min(s.kv_valid[k] for k in self.heads))


    def _trim(self, s: SeqState, k: int) -> None:
        """Drop head k's cells past its anchored prefix (the chained rows of its last
        draft), if it has any: llama.cpp's seq_rm scans every cell of the stream."""
        if s.kv_end[k] > s.kv_valid[k]:
            self.drafts[k].seq_rm(s.seq_id, s.kv_valid[k])
            s.kv_end[k] = s.kv_valid[k]


    def _take_forced(self, d: Context, s: SeqState, i: int) -> None:
        """Draft step i takes the context's token at depth i (``extend``): the head's
        output row chains the next step, the grammar masks it as a head's draft."""
        tok = s.proposal.tokens[i]
        h = d.nextn_ith(s.row)
        c = s.constraint
        if c is not None and s.mask_drafts:
            c.fill_bitmask(out=s.draft_bits[i])
            s.n_masked = i + 1
            if not c.allowed(tok):
                s.n_point = i
                return
            c.advance(tok)
        s.probs[i] = 1.0
        s.drafts.append(tok)
        s.chain_h[i] = h


    def _grow_single(self, active: list[SeqState], i: int) -> None:
        """Single mode after step 0: head 0's own KV holds the round's earlier rows,
        so each sequence adds just its last draft with the last output row."""
        for s in active:
            s.row = self.dbatch.append([s.drafts[-1]], s.pos + i, s.seq_id, outputs="last",
                                       embd=s.chain_h[i - 1 : i])
            if self.fused:
                s.kv_end[0] = s.pos + i + 1


    def _decode_step(self, d: Context, active: list[SeqState], i: int) -> bool:
        """Run draft step i's decode (on head context ``d``) and take each sequence's
        draft token; False when the heads' cache has no room (drafting stops there)."""
        try:
            self.drv._decode_evicting(d, self.dbatch, active)
        except KVFullError:
            return False
        for s in active:
            self._take_draft(d, s, i)
        return True


    def _take_draft(self, d: Context, s: SeqState, i: int) -> None:
        """Take draft token i from the sequence's output row of the last draft
        decode, unless it is below p_min (which ends the sequence's drafting)."""
        if i < s.n_point:  # the context's token, the head's row to chain the next step from
            self._take_forced(d, s, i)
            return
        tok, p, h, conf = self._pick(d, s, i)
        if p < self.spec.p_min:
            return
        if s.policy is not None and not s.policy.keep(i, conf, s.n_plan):
            return  # too unsure a draft to pay for its row: drafting stops here
        c = s.constraint
        if c is not None and s.mask_drafts:
            if not c.allowed(tok):  # nothing allowed (the grammar is over): stop drafting
                return
            c.advance(tok)
        s.probs[i] = p
        s.drafts.append(tok)
        s.chain_h[i] = h


    def _pick(self, d: Context, s: SeqState, i: int) -> tuple[int, float, np.ndarray, float]:
        """Draft token i from the last decode (on head context ``d``), its
        probability, its hidden row, and how sure the head was (the largest
        probability of what it drafted from; 1.0 when no plan gates on it)."""
        t0 = time.perf_counter()
        logits = d.logits(s.row)
        if self.draft_vocab:
            logits[self.draft_vocab :] = -np.inf  # the ids the head's logits leave out
        h = d.nextn_ith(s.row)
        dt = (time.perf_counter() - t0) * 1e3
        s.stats.t_llama_ms += dt
        s.stats.t_draft_ms += dt
        c = s.constraint
        if c is not None and s.mask_drafts:
            # grammar-aware drafting: the head only proposes what the grammar allows
            # after the drafts before it (forced tokens get drafted, and accepted);
            # the mask is kept for the verifier's row i
            c.fill_bitmask(out=s.draft_bits[i])
            s.n_masked = i + 1
            logits = _masked(s, logits, i)
            if s.rejection and not np.isfinite(logits.max()):
                return 0, 0.0, h, 0.0  # nothing the grammar allows among the draft vocabulary
        if s.rejection:
            # drawn from the head's distribution under the request's settings, shaped
            # to be accepted more (DraftShaper); q kept for verification
            q = s.q[i]
            if s.shaper is None:
                q[:] = s.sampler.dense(logits, s.tokens, s.drafts)
            else:
                s.q0[i] = s.sampler.dense(logits, s.tokens, s.drafts)
                s.shaper.shape(s.q0[i], i, q)
            tok = s.sampler.draw(q)
            # of the head's own distribution, not of the draw: the gate keeps the output
            # exact only if the drawn token has no say in whether it is verified
            conf = float((s.q[i] if s.shaper is None else s.q0[i]).max()) if s.policy is not None else 1.0
            return tok, float(q[tok]), h, conf
        if self._need_p:
            tok, p = draft_pick(logits)
        else:  # p_min 0 and no trace: the probability is never looked at
            tok, p = int(np.argmax(logits)), 1.0
        conf = 1.0
        if s.policy is not None:
            # the softmax's largest entry, the argmax's (8k entries: ~20 us), over the ids
            # the head drafts among (the others are -inf)
            top = logits[tok]
            conf = float(1.0 / np.exp(logits[: self.draft_vocab or None] - top).sum()) if np.isfinite(top) else 0.0
        return tok, p, h, conf
