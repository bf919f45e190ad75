"""The MTP3 speculative round: draft, verify, process, accept.

This file is the data flow of ``shared/design/MTP3.md``, in Python. llama.cpp runs
the decodes; everything around them happens here.

Two contexts over the same weights (or a split pair of files):

* the *target* context decodes the trunk and returns, besides logits, ``h_tgt(p)``:
  the trunk's last hidden row at each position, before the output norm;
* the *draft* contexts (MTP contexts), one per head: head k's runs appended MTP
  block k and its KV holds that block's layer alone.

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

Who drafts (``drafters``): the heads (``drafters.heads.Heads``: the draft steps above,
their catching up, their draft vocabulary) and the context's proposers
(``drafters.drafting.ContextDrafting``: continuations of text the sequence or an
earlier one already holds, no decode needed). Each round the plan
(``adaptive.DraftPlanner``) chooses per sequence the heads' drafts, a context draft,
a context draft the heads extend, or nothing, by expected tokens per second; the verify
and accept steps are the same for every kind (a context draft is a point proposal:
rejection sampling accepts it with the target's probability of it). A verify carries
at most ``max_verify_rows`` rows (63 on the CPU), where every row keeps a one-row
decode's bits.

At temperature 0 the output is token for token what plain greedy decoding gives.

Sliding-window layers keep a trimmed cache (a window and a ubatch of cells a sequence,
patch 0024, unless ``swa_full``), which our patch 0008 fills by position: position p of a
sequence goes to cell p mod R of the sequence's region of R cells. Rows written, taken
back and written again land where one-row-at-a-time decoding puts them (attention
sums in cell order: the same logits), and p overwrites only p - R, outside every
window still needed, as long as a decode carries at most R - n_swa rows of a sequence
(``Context.swa_rows``; the chunks here stay within it). A sequence's cells then
always hold every position from the oldest one kept (``seq_pos_min``) on, so a cached
prompt (prompt caching) can go on from P exactly when P's window starts there or later:
P - n_swa + 1 >= seq_pos_min; from further back, from a *context checkpoint*: the
sliding-window cells saved near a prompt's end.

llama.cpp rounds a row by the size of the ubatch it is in (the CPU's attention works
in tiles from 64 rows on), so a prompt is decoded in llama-server's pieces: its last
4 + n_ubatch and last 4 tokens apart, each piece split into ubatches from its start;
and a cached prefix's last token is decoded again in every mode. The same pieces give
the same bits: plain decoding, speculative decoding and llama-server write the same
text at temperature 0.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .adaptive import DraftPlanner, regime
from .drafters import PointMass
from .drafters.context import ContextPool
from .drafters.drafting import ContextDrafting
from .drafters.heads import Heads, _masked
from .llama import Batch, Context, KVFullError, LlamaError, cpu_only
from .prompt_cache import Checkpoint, HostPromptCache, SlotState, heads_path, read_heads, write_heads
from .sampling import DraftShaper, TokenProbs, chain_probs, raw_probs, verify_rejection
from .sequence import Anchors, Mode, RoundTrace, Schedule, SeqState, SpecConfig, Verify, common_prefix

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass

__all__ = ["SpecConfig", "SeqState", "RoundTrace", "MTPDriver", "Mode", "Schedule", "Verify"]









@dataclass
class _Cache:
    """What a slot's KV still holds after its sequence ended, for the next one to
    reuse (prompt caching): the target's KV at positions [0, len(tokens)); head k
    anchored on [0, kv_valid[k]) (fused; the rows it has not seen are in ``anchors``),
    or every head on all of them (reference)."""

    tokens: list[int]
    kv_valid: list[int]
    anchors: Anchors | None
    h_log: dict[int, np.ndarray] | None
    #: when it was last used (the driver's clock): the least recently used goes first
    used: int = 0
    #: SeqState.checkpoints, of the sequence that left this cache
    checkpoints: list["Checkpoint"] = field(default_factory=list)
    #: the LoRA scales its KV was computed with (SeqState.adapter): only a sequence
    #: with the same ones reuses it
    adapter: tuple[float, ...] = ()







class MTPDriver:
    """Runs MTP rounds for sequences on a target and a draft context.

    A round serves every sequence passed to it at once: one target decode carries
    each sequence's ``[id_last, drafts..]``, one draft decode per step carries each
    still-drafting sequence's rows. ``n_seq`` sequences may be in flight.

    Each head has a draft context of its own (``drafts[k]``, bound to block k, its
    KV that block's layer alone); a sequence is the same sequence id in every
    context. With its own cells one head can be rewound and caught up without
    touching another's. Only the heads the settings decode need a context
    (``heads_used``); the others may be None.

    ``drafts`` may be None for ``mode="none"``. ``debug`` checks the invariant
    ``pending_h == h_tgt(pos(id_last) - 1)`` every round (it keeps every trunk row).
    ``checkpoints``: context checkpoints kept per slot (llama-server's
    ``--ctx-checkpoints``), with a trimmed sliding-window cache.
    """

    def __init__(self, target: Context, drafts: "list[Context | None] | None", spec: SpecConfig, *,
                 n_seq: int = 1, debug: bool = False, cache_ram: int = 0, checkpoints: int = 32) -> None:
        self.target = target
        self.drafts: list[Context | None] = list(drafts or [])
        self.spec = spec
        self.debug = debug
        self.speculate = spec.mode != "none" and spec.n_max > 0
        live = [d for d in self.drafts if d is not None]
        if self.speculate and not live:
            raise ValueError("speculation needs the draft (MTP) contexts")
        self.n_heads = live[0].model.n_mtp_blocks if live else 0
        self.n_draft = spec.draft_length(self.n_heads) if self.speculate else 0
        self.fused = spec.schedule == "fused"
        # the heads a round can use (the others are never decoded, nor anchored, in the
        # fused schedule); the change's schedule re-anchors every head each round
        self.heads, self.process_heads = Heads.plan(spec, self.n_heads)
        for k in Heads.used(spec, self.n_heads) if self.speculate else []:
            d = self.drafts[k] if k < len(self.drafts) else None
            if d is None or d.mtp_block not in (None, k):
                raise ValueError(f"head {k} needs a draft context bound to block {k}")
            if d.n_seq_max < n_seq:
                raise ValueError(f"head {k}'s draft context has {d.n_seq_max} sequences, {n_seq} needed")
        self.n_embd = target.n_embd
        # a decode's rows per sequence stay within what a trimmed sliding-window cache
        # places by position (see the module's docstring)
        self.n_chunk = min([target.n_batch, target.swa_rows] + [min(d.n_batch, d.swa_rows) for d in live])
        self.n_checkpoints = checkpoints if target.swa_trimmed else 0
        # a prompt is decoded in llama-server's pieces: with context checkpoints on (its
        # --ctx-checkpoints, whatever the cache) the last 4 + n_ubatch and the last 4
        # tokens go apart, and a decode splits into ubatches from its start. llama.cpp's
        # kernels round a row by how many rows its ubatch has (the CPU's attention tiles
        # 64 and more), so other pieces give other last bits and, at temperature 0, other
        # text sooner or later. The checkpoints, when kept, are made there: a next prompt
        # sharing all of this one goes on from the nearer, one leaving it a little
        # earlier (a chat template renders the previous answer's opening otherwise than
        # the generation prompt before it) from the other
        self.split_offsets = (min(target.n_batch, 4 + target.n_ubatch), min(target.n_batch, 4)) \
            if checkpoints > 0 else ()
        # several sequences' prompt chunks share a decode (``shared_prefills``) where
        # llama.cpp's CPU kernels run every row (a GPU's choose by batch size), in one
        # cache stream (several streams split a batch by sequence otherwise)
        # (STEPMTP_SHARED_PROMPTS=0 in the environment: a decode each, for measuring)
        self.share_prompt_decodes = n_seq > 1 and target.kv_unified and cpu_only() and target.model.rpc is None \
            and os.environ.get("STEPMTP_SHARED_PROMPTS", "1") != "0"
        # (patch 0010: 64 rows; kept under flash attention's 64-row tiles)
        self.row_invariant_rows = min(int(os.environ.get("GGML_CPU_ROW_INVARIANT_ROWS", "64")), self.MAX_INVARIANT_ROWS)
        # rows one sequence may put in a shared decode: every sequence's rows must fit
        self.n_rows_seq = self.n_chunk // n_seq
        if self.n_rows_seq <= self.n_draft + 1:
            raise ValueError(f"n_batch ({self.n_chunk}) must exceed {n_seq} x (draft length + 2)")
        self.n_ctx_seq = target.n_ctx_seq
        # shared prompt decodes carry up to a ubatch of rows (one sequence's: n_chunk)
        self.tbatch = Batch(max(self.n_chunk, target.n_ubatch) if self.share_prompt_decodes else self.n_chunk)
        self.dbatch = Batch(self.n_chunk, n_embd=self.n_embd) if live else None
        # unmasked: a hidden row for every batch row (the prompt's rows are not outputs)
        target.set_nextn(self.speculate, masked=False)
        for d in live:
            d.set_nextn(True, masked=True)
        self._zero_h = np.zeros((1, self.n_embd), dtype=np.float32)
        # a verify's rows keep a one-row decode's bits on the CPU up to 63 rows (patch 0010's
        # per-row products up to 64 rows; flash attention tiles 64 query rows and more)
        self.max_verify_rows = min(self.n_chunk, self.MAX_INVARIANT_ROWS) if cpu_only() else self.n_chunk
        # the draft length of each sequence, chosen each round (None: always n_draft, and a
        # context proposal whole: see ``_propose``)
        self.planner = DraftPlanner(self.n_draft) if spec.adaptive and (
            (self.speculate and spec.n_min < self.n_draft) or (spec.ngram and not self.speculate)) else None
        if self.planner is not None:
            self.planner.max_rows = self.max_verify_rows
        #: the drafters: the MTP heads (their draft steps, catching up, the draft
        #: vocabulary), and the context's proposers
        self.H = Heads(self, debug)
        self.C = ContextDrafting(self)
        # rejection sampling: what drafts are drawn from, learned per sampling regime
        self._shapers: dict[tuple[float, bool], DraftShaper] = {}
        #: per slot: what its KV holds since its last sequence ended (prompt caching)
        self.cache: list[_Cache | None] = [None] * n_seq
        self._clock = itertools.count(1)
        #: prompts kept in host memory (cache_ram bytes; None: none kept)
        self.host = HostPromptCache(None if cache_ram < 0 else cache_ram) if cache_ram else None

    #: the most rows a verify carries on the CPU (see ``max_verify_rows``)
    MAX_INVARIANT_ROWS = 63

    #: the heads a driver with these settings decodes (the draft contexts it needs)
    heads_used = staticmethod(Heads.used)

    @property
    def draft_vocab(self) -> int:
        """The heads draft among token ids below this (0: all)."""
        return self.H.draft_vocab

    @property
    def proposers(self) -> list:
        """The context proposers (``drafters.Proposer``)."""
        return self.C.proposers

    @property
    def pools(self) -> dict[object, ContextPool]:
        return self.C.pools

    def pool(self, key: object) -> ContextPool | None:
        """The pool of earlier sequences' tokens under ``key`` (None: none kept)."""
        return self.C.pool(key)



    # -- timing: what runs inside llama.cpp, so the rest is Python's share ------

    def _decode(self, ctx: Context, batch: Batch, seqs: list[SeqState]) -> None:
        """One decode shared by ``seqs``: each is charged the time it waited and the
        decode, and its own rows."""
        t0 = time.perf_counter()
        ctx.decode(batch)
        dt = (time.perf_counter() - t0) * 1e3
        target = ctx is self.target
        if len(seqs) > 1:
            # rows per sequence, once per decode
            per_seq = np.bincount(batch.seq[: batch.n], minlength=max(s.seq_id for s in seqs) + 1)
        for s in seqs:
            st = s.stats
            st.t_llama_ms += dt
            rows = batch.n if len(seqs) == 1 else int(per_seq[s.seq_id])
            if target:
                st.n_target_decodes += 1
                st.n_target_rows += rows
                st.n_prompt_target_decodes += s.prefilling
            else:
                st.n_draft_decodes += 1
                st.t_draft_ms += dt
                st.n_draft_rows += rows
                st.n_prompt_draft_decodes += s.prefilling

    def _decode_evicting(self, ctx: Context, batch: Batch, seqs: list[SeqState]) -> None:
        """A decode that, finding the cache full, first evicts idle slots' cached
        prefixes (least recently used first) and tries again; KVFullError when none
        is left. For the heads (their cells are as many as the target's: they fill up
        with it) the callers are best effort: a round drafts less, a head loses its KV
        and starts over; the target decides who fails."""
        while True:
            try:
                self._decode(ctx, batch, seqs)
                return
            except KVFullError:
                if not self.evict_lru():
                    raise

    # -- bootstrap --------------------------------------------------------------

    def start(self, s: SeqState, prompt: list[int], *, reuse: bool = True) -> None:
        """Make ``s`` a new sequence with this prompt; ``prefill`` decodes it. With
        ``reuse``, the longest prefix the slot's KV already holds (``cache``) is kept,
        in the target and the heads, and only the rest is decoded."""
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.n_ctx_seq:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context ({self.n_ctx_seq})")
        c = self.cache[s.seq_id]
        shared = common_prefix(c.tokens, prompt) if reuse and c is not None and c.adapter == s.adapter else 0
        stashed = False
        if reuse and self.host is not None:
            # the slot keeps at most the prefix it shares with this prompt (often a
            # system prompt or a few tokens): the rest of its own goes out, or the next
            # request of that conversation decodes it again; a prompt kept in host
            # memory that shares more than the slot's own comes back in
            key, n_host = self.host.best(prompt, common_prefix, s.adapter)
            stashed = self._stash(s.seq_id, keep=shared)
            if n_host > shared + self.HOST_MIN_GAIN:
                restored = self._restore(s.seq_id, self.host.take(key))
                c, shared = (self.cache[s.seq_id], n_host) if restored else (None, 0)
                stashed = False  # the slot holds the restored prompt now
        # at least the prompt's last token is decoded (its logits give the first
        # token); and the one before it too, its trunk row anchoring the heads' first
        # new position when speculating (trunk rows are not kept, only the KV). Without
        # speculation too: the prompt is then decoded in the same pieces, and llama.cpp
        # rounds a row by its ubatch's size, so plain and speculative decoding give the
        # same last bits and, at temperature 0, the same text
        redo = 1
        n_keep = min(shared, len(prompt) - 1)
        ck = None
        n_swa = self.target.model.n_swa
        if n_keep >= 2 and n_swa > 0 and \
                max(0, n_keep - redo - n_swa + 1) < self.target.seq_pos_min(s.seq_id):
            # the window before the first position to decode is not all there: a trimmed
            # cache overwrites it, and a prefix restored from host memory or a slot file
            # holds only its last position's window (llama.cpp saves no cell that
            # position's window masks), in a cache of any size. Go on from the
            # checkpoint that reaches furthest, or from the start
            reach, ck = max(((x.reach(n_keep - redo), x) for x in c.checkpoints),
                            key=lambda t: t[0], default=(-1, None))
            n_keep = reach + redo if reach >= 1 else 0
        if n_keep < 2:
            n_keep = 0
            if not stashed:
                self._stash(s.seq_id, keep=0)
            self.release(s.seq_id)
        self.cache[s.seq_id] = None  # the slot's KV is the sequence's now
        redo = redo if n_keep else 0
        s.prompt, s.n_prefilled = list(prompt), n_keep - redo
        s.checkpoints = []
        s.anchor_from = n_keep
        s.tokens = list(prompt)
        self.C.begin(s)
        s.pos, s.id_last = 0, -1
        s.pending_h = self._zero_h[0]
        s.stats.n_prompt_cached = s.n_prefilled
        s.policy = None if self.planner is None else \
            self.planner.policy(regime(s.sampler.greedy, s.sampler.params.temperature, s.rejection), self.spec.n_min)
        s.h_log = {} if self.debug else None
        s.trace = [] if self.debug else None
        s.chain_h = np.zeros((max(1, self.n_draft), self.n_embd), dtype=np.float32)
        s.probs = [0.0] * max(1, self.n_draft)
        s.q = s.q0 = s.shaper = None
        if s.rejection and self.speculate:
            s.q = np.zeros((max(1, self.n_draft), self.target.n_vocab))
            if self.spec.adaptive:
                # learned, like the lengths: a fixed setting keeps a seed's text reproducible
                s.q0 = np.zeros_like(s.q)
                key = regime(s.sampler.greedy, s.sampler.params.temperature, True)
                s.shaper = self._shapers.setdefault(key, DraftShaper(self.n_draft))
        if s.constraint is not None and s.mask_drafts and self.speculate:
            s.draft_bits = np.zeros((max(1, self.n_draft), s.constraint.vocab.n_words), dtype=np.int32)
        if self.fused and self.speculate:
            s.kv_valid = [0] * self.n_heads
            s.kv_end = [0] * self.n_heads
            s.anchors = s.anchors or Anchors(self.n_embd, 2 * self.n_chunk)
            s.anchors.reset()
        if n_keep:
            try:
                self._reuse(s, c, n_keep, ck)
            except LlamaError:
                # a checkpoint's cells find no room in a shared cache: a cache is an
                # optimisation, the prompt is decoded afresh
                self.release(s.seq_id)
                self.start(s, prompt, reuse=False)

    def _reuse(self, s: SeqState, c: _Cache, n_keep: int, ck: Checkpoint | None) -> None:
        """Keep the cached KV of positions [0, n_keep) (the target decodes from
        n_prefilled on, the heads go on from n_keep), the target's sliding-window
        cells from checkpoint ``ck`` if given."""
        p = s.n_prefilled
        self.target.seq_rm(s.seq_id, p)
        if ck is not None:
            self.target.set_seq_state(s.seq_id, ck.data, swa_only=True)
            self.target.seq_rm(s.seq_id, p)
        # those that saw other tokens at p go
        s.checkpoints = [x for x in c.checkpoints if x.q < p]
        if s.h_log is not None and c.h_log is not None:
            s.h_log = {q: h for q, h in c.h_log.items() if q < p}
        for k, d in self._live():
            # a head's sliding-window cells before n_keep may be overwritten: a hole in
            # its KV makes its drafts worse for a window's length, never wrong
            valid = min(c.kv_valid[k], n_keep)
            d.seq_rm(s.seq_id, valid)
            if self.fused and self.speculate:
                s.kv_valid[k] = s.kv_end[k] = valid
        if self.fused and self.speculate and c.anchors is not None:
            # the rows some head has not seen yet: those of the kept prefix stay
            A = c.anchors
            if A.start > n_keep:
                A.reset(n_keep)
            A.n = min(A.n, n_keep - A.start)
            s.anchors = A

    def finish(self, s: SeqState, *, keep: bool = True) -> None:
        """The sequence ended: keep what its slot's KV holds for the next sequence
        (``keep``), or forget it (the sequence failed: its KV is not trusted)."""
        if s.ctx is not None:
            if not s.prefilling:
                self.C.finish(s)
            s.ctx = None
        if not keep:
            self.release(s.seq_id)
            return
        n = s.n_prefilled if s.prefilling else s.pos
        tokens = (s.prompt if s.prefilling else s.tokens)[:n]
        if n < 2:
            self.release(s.seq_id)
            return
        if self.fused and self.speculate:
            kv_valid, anchors = list(s.kv_valid), s.anchors
            s.anchors = None  # the cache owns it now
        else:
            kv_valid, anchors = [n] * self.n_heads, None
        self.cache[s.seq_id] = _Cache(tokens, kv_valid, anchors, s.h_log, next(self._clock),
                                      s.checkpoints, s.adapter)

    # -- a slot's cache out of llama.cpp and back (prompt_cache.py) ------------------

    def export(self, seq_id: int, target: bool = True) -> SlotState:
        """What slot ``seq_id`` holds (its cache), with the target's KV unless the
        caller saves that itself (``target=False``)."""
        c = self.cache[seq_id]
        if c is None:
            raise ValueError(f"slot {seq_id} holds no prompt")
        heads = [d.seq_state(seq_id) if d is not None else b"" for d in self.drafts]
        A = c.anchors
        return SlotState(list(c.tokens), self.target.seq_state(seq_id) if target else None, heads,
                         list(c.kv_valid), (A.start, A.tok[: A.n].copy(), A.h[: A.n].copy()) if A else None,
                         list(c.checkpoints), c.adapter)

    def load(self, seq_id: int, st: SlotState) -> None:
        """Put a state back into slot ``seq_id`` (its target's KV already there when
        ``st.target`` is None): the next request sharing its prefix reuses it."""
        if st.target is not None:
            self.release(seq_id)
            self.target.set_seq_state(seq_id, st.target)
        for k, h in enumerate(st.heads):
            if h and k < len(self.drafts) and self.drafts[k] is not None:
                self.drafts[k].set_seq_state(seq_id, h)
        A = None
        if st.anchors is not None and self.fused and self.speculate:
            start, tok, rows = st.anchors
            A = Anchors(self.n_embd, max(2 * self.n_chunk, len(tok)))
            A.reset(start)
            if len(tok):
                A.append(tok, rows)
        self.cache[seq_id] = _Cache(list(st.tokens), list(st.kv_valid), A, None, next(self._clock),
                                    list(st.checkpoints), st.adapter)

    def _restore(self, seq_id: int, st: SlotState) -> bool:
        """``load`` a state from host memory into slot ``seq_id``. A shared cache short
        of cells for it gives up idle slots' caches (least recently used first) and it
        is tried again; when none is left, the state goes back to host memory and the
        answer is False (the prompt is decoded afresh). A failed load leaves nothing in
        the slot: llama.cpp may have restored the target's full-attention cells and not
        its sliding-window ones, or the target and not a head."""
        while True:
            try:
                self.load(seq_id, st)
                return True
            except LlamaError:
                self.release(seq_id)
                if not self.evict_lru():
                    if self.host is not None:
                        self.host.put(st)
                    return False

    def save_cache(self, seq_id: int, path: Path) -> tuple[int, int]:
        """Slot ``seq_id``'s cache to files: the target's sequence in llama.cpp's
        format, the heads' beside it. (tokens, bytes written)."""
        st = self.export(seq_id, target=False)
        n = self.target.save_seq_file(path, seq_id, st.tokens)
        if self._live() or st.checkpoints:
            n += write_heads(path, st, self.n_embd)
        return len(st.tokens), n

    def restore_cache(self, seq_id: int, path: Path, adapter: tuple[float, ...] = ()) -> tuple[int, int]:
        """Slot files back into slot ``seq_id``, for requests with these LoRA scales
        (a file does not say which it was computed with). (tokens, bytes read)."""
        self.release(seq_id)
        try:
            tokens = self.target.load_seq_file(path, seq_id, self.n_ctx_seq)
            n = path.stat().st_size
            st = SlotState(tokens, None, [], [len(tokens)] * self.n_heads, None)
            if self._live() or heads_path(path).is_file():
                st, size = read_heads(path, tokens, self.n_heads, need_heads=bool(self._live()))
                n += size
            st.adapter = adapter
            self.load(seq_id, st)
        except BaseException:
            self.release(seq_id)
            raise
        return len(tokens), n

    # -- room in a shared cache, host memory (--cache-ram) --------------------------

    #: a kept prompt replaces the slot's own only when it shares this many more tokens
    HOST_MIN_GAIN = 16

    def evict(self, seq_id: int) -> None:
        """Free a slot's KV (a shared cache needs the cells), keeping its prompt in
        host memory when there is a budget for it."""
        self._stash(seq_id, keep=0)
        self.release(seq_id)

    def evict_lru(self) -> bool:
        """Evict the idle slot whose cache was used longest ago; False when no idle
        slot holds anything (the slots generating hold no cache: start takes it)."""
        idle = [i for i, c in enumerate(self.cache) if c is not None]
        if not idle:
            return False
        self.evict(min(idle, key=lambda i: self.cache[i].used))
        return True

    def _stash(self, seq_id: int, keep: int) -> bool:
        """Copy slot ``seq_id``'s cache to host memory if more than HOST_MIN_GAIN of its
        tokens are about to be lost (only ``keep`` of them stay in the slot); True when
        it was kept."""
        c = self.cache[seq_id]
        if self.host is not None and c is not None and len(c.tokens) - keep > self.HOST_MIN_GAIN:
            return self.host.put(self.export(seq_id))
        return False

    def cached_tokens(self, seq_id: int, adapter: tuple[float, ...] | None = None) -> list[int]:
        """What slot ``seq_id`` holds; none of it for a request with other LoRA scales
        (``adapter``; None: whatever they were)."""
        c = self.cache[seq_id]
        return c.tokens if c is not None and (adapter is None or c.adapter == adapter) else []

    def release(self, seq_id: int) -> None:
        """Forget a sequence's KV in both contexts (every head's), and its cache."""
        self.cache[seq_id] = None
        self.target.seq_rm(seq_id)
        for _, d in self._live():
            d.seq_rm(seq_id)

    def _live(self) -> list[tuple[int, Context]]:
        """(head, its draft context) for the heads that have one."""
        return [(k, d) for k, d in enumerate(self.drafts) if d is not None]

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held in llama.cpp, as it accounts them (``Context.memory``): the
        target's, and the draft contexts' together."""
        draft = {"kv": 0, "compute": 0, "output": 0}
        for _, d in self._live():
            for key, v in d.memory().items():
                draft[key] += v
        return {"target": self.target.memory(), "draft": draft}

    def prefill(self, s: SeqState) -> bool:
        """Decode the next chunk of the prompt and anchor the heads on it; after the
        last chunk, sample the first token. True when done."""
        return self.prefill_together([s])[0]

    def prefill_together(self, seqs: list[SeqState]) -> list[bool]:
        """``prefill`` for several sequences, their chunks in one decode of the target
        (``shared_prefills`` says which may share one); per sequence, True when done."""
        t0 = time.perf_counter()
        tb = self.tbatch
        tb.clear()
        chunks = []
        for s in seqs:
            a = s.n_prefilled
            chunk = s.prompt[a : a + self.chunk_size(s)]
            last = a + len(chunk) == len(s.prompt)
            chunks.append((chunk, tb.append(chunk, a, s.seq_id, outputs="last" if last else "none"), last))
        self._decode_evicting(self.target, tb, seqs)
        h_all = self.target.nextn(tb.n) if self.speculate else None
        shared_ms = (time.perf_counter() - t0) * 1e3  # each prompt waited for the whole decode
        done = []
        for s, (chunk, i0, last) in zip(seqs, chunks):
            t1 = time.perf_counter()
            h = h_all[i0 : i0 + len(chunk)] if h_all is not None else None
            self._prefilled(s, chunk, h, i0 + len(chunk) - 1 if last else None)
            s.stats.t_prompt_ms += shared_ms + (time.perf_counter() - t1) * 1e3
            done.append(last)
        return done

    def _prefilled(self, s: SeqState, chunk: list[int], h: np.ndarray | None, out_row: int | None) -> None:
        """After the target decoded ``chunk`` of ``s``'s prompt (``h``: its hidden rows):
        the checkpoint, the heads, and after the last chunk (its logits at batch row
        ``out_row``) the first token."""
        a, n = s.n_prefilled, len(s.prompt)
        end = a + len(chunk)
        if self.n_checkpoints and (n - end in self.split_offsets or end == s.n_before_user) and end >= 2 and \
                not any(x.q == end - 1 for x in s.checkpoints):
            s.checkpoints.append(Checkpoint(end - 1, self.target.seq_state(s.seq_id, swa_only=True)))
            del s.checkpoints[: -self.n_checkpoints]
        if self.speculate:
            self._log_h(s, a, h)
            # a cached prefix's last token is decoded again only for its trunk row:
            # the heads are anchored there already
            skip = s.anchor_from > a
            if self.fused:
                # the heads see these rows in their next decodes; whole chunks go
                # now, so what is left fits a shared decode
                if not skip:
                    s.anchors.append(chunk[:1], s.pending_h[None, :])
                s.anchors.append(chunk[1:], h[:-1])
                if s.policy is not None and self.planner.dormant(s.policy.key):
                    self.H.bound_catch_up(s, end)  # (drafting does not pay where it samples so)
                else:
                    self.H.catch_up(s, keep=self.n_rows_seq - 1 - self.n_draft)
            elif skip:
                if len(chunk) > 1:
                    s.pending_h = h[0]
                    self.H.process([(s, chunk[1:], a + 1, h[1:])])
            else:
                self.H.process([(s, chunk, a, h)])
            s.pending_h = h[-1].copy()
        s.n_prefilled = end
        if out_row is not None:
            raw = self.target.logits(out_row)
            row = _masked(s, raw)
            s.id_last = s.sampler.sample(row, s.tokens)
            if s.n_probs:
                s.token_probs.append(self._probs(s, raw, row, s.id_last))
            if s.constraint is not None:
                s.constraint.advance(s.id_last)
            s.tokens.append(s.id_last)
            s.pos = n
            if self.fused and self.speculate:
                s.anchors.append([s.id_last], s.pending_h[None, :])
            s.stats.n_prompt = n

    #: llama.cpp's CPU kernels choose their path by the rows of the ubatch: products of at
    #: most GGML_CPU_ROW_INVARIANT_ROWS rows (patch 0010: 16) one row at a time, more
    #: through llamafile's gemm; attention in tiles from GGML_FA_TILE_Q (64) query rows.
    #: Each path gives a row the same bits whatever rows it shares the ubatch with (the
    #: one-row kernels per pair; the gemm and the tiles sum each row's products in one
    #: order), but the paths differ from one another. So chunks of this many rows or
    #: more share a decode while they fit one ubatch, and smaller chunks while together
    #: they stay one-row products (as a verify's rows of several sequences do)
    SHARED_CHUNK_MIN_ROWS = 64

    def shared_prefills(self, seqs: list[SeqState]) -> list[list[SeqState]]:
        """``seqs``' next prompt chunks as groups that each go in one decode
        (``prefill_together``), in the order of their first sequences, where every row
        keeps the bits it gets decoded alone (``share_prompt_decodes``; groups of one
        otherwise): a prompt's must be its own, at temperature 0 its text is."""
        if not self.share_prompt_decodes:
            return [[s] for s in seqs]
        cap = min(self.target.n_ubatch, self.tbatch.capacity)
        # one-row products hold per row whatever the ubatch; the batch still bounds them
        small = min(self.row_invariant_rows, self.tbatch.capacity)
        groups = self.chunk_groups([self.chunk_size(s) for s in seqs], small, cap)
        return [[seqs[i] for i in g] for g in groups]

    @classmethod
    def chunk_groups(cls, sizes: list[int], small: int, cap: int) -> list[list[int]]:
        """Chunks of these sizes (rows) as groups of indices that may share a decode:
        chunks of SHARED_CHUNK_MIN_ROWS or more while they fit ``cap`` (one ubatch),
        chunks that together stay within ``small`` rows (one-row products), any other
        chunk alone; each group where its first chunk is."""
        groups: list[list[int]] = []
        open_: dict[str, tuple[list[int], list[int]]] = {}  # kind -> (its group, [rows])
        for i, size in enumerate(sizes):
            if cls.SHARED_CHUNK_MIN_ROWS <= size <= cap:
                kind, limit = "gemm", cap
            elif size <= small:
                kind, limit = "rows", small
            else:
                groups.append([i])
                continue
            g = open_.get(kind)
            if g is not None and g[1][0] + size <= limit:
                g[0].append(i)
                g[1][0] += size
            else:
                groups.append([i])
                open_[kind] = (groups[-1], [size])
        return groups

    def chunk_size(self, s: SeqState) -> int:
        """The tokens of ``s``'s next prompt chunk."""
        a, n = s.n_prefilled, len(s.prompt)
        size = min(self.n_chunk, s.chunk_limit)
        ub = self.target.n_ubatch
        if size < self.target.n_batch and size > ub:
            size -= size % ub  # shorter decodes than llama-server's: its ubatches still
        for end in [n - off for off in self.split_offsets] + [s.n_before_user]:
            if a < end < a + size:
                size = end - a
        return min(size, n - a)

    def shrink_chunk(self, s: SeqState) -> bool:
        """Halve the prompt chunk after a decode found no room (llama-server's retry);
        False when it is one token already."""
        size = min(self.n_chunk, s.chunk_limit, len(s.prompt) - s.n_prefilled)
        if size <= 1:
            return False
        s.chunk_limit = size // 2
        return True

    def begin(self, s: SeqState, prompt: list[int]) -> int:
        """Decode the prompt, anchor the heads on it, and sample the first token."""
        self.start(s, prompt)
        while not self.prefill(s):
            pass
        return s.id_last

    # -- one round ----------------------------------------------------------------

    def round(self, seqs: list[SeqState]) -> list[list[int] | LlamaError]:
        """One draft / verify / (process) / accept round for every sequence in
        ``seqs``; returns, per sequence, the tokens it emits (the accepted drafts and
        the target's own next token), or the KVFullError of a sequence that found no
        room in a shared KV cache (the others go on)."""
        t0 = time.perf_counter()
        for s in seqs:
            if self.debug and self.speculate:
                self._check_invariant(s)
            room = self.n_ctx_seq - 1 - s.pos  # positions left after id_last
            s.n_plan = min(self.n_draft, room)
            s.drafts = []
            s.n_masked = 0
            s.n_point = 0
            s.proposal = None
            if s.constraint is not None:
                s.constraint.begin_round()
        planned = self._plan(seqs)
        steps: list[float | None] = []
        t1 = time.perf_counter()
        if self.speculate and not self.fused:
            steps = self.H.draft(seqs)  # (it also rewinds the heads the last round's process moved)
        elif self.speculate and any(s.n_plan for s in seqs):  # (no drafts planned: nothing to do)
            steps = self.H.draft_fused(seqs)

        t2 = time.perf_counter()
        timed = True
        while True:
            try:
                outs = self._verify(seqs)
            except KVFullError:
                # idle slots' cached prefixes give way first (least recently used), then
                # the drafts: speculation must not fail what plain decoding would serve
                timed = False
                if self.evict_lru() or self._drop_drafts(seqs):
                    continue
                if len(seqs) == 1:
                    raise
                break
            if planned and timed:
                # the round's cost as the plan counts it: the verify part by its rows
                # (every sequence's), each draft step by its depth
                rows = sum(len(s.drafts) + 1 for s in seqs)
                self.planner.observe_round(rows, time.perf_counter() - t2 + (t1 - t0), steps)
            return outs
        # a shared cache without room for every sequence's rows (llama.cpp decoded
        # nothing of the failed batch): each verifies alone, the one holding the most
        # cells first; one that still finds no room fails, and its cells go at once to
        # the others (llama-server's "terminate the largest")
        outs: dict[int, list[int] | LlamaError] = {}
        for s in sorted(seqs, key=lambda s: -s.pos):
            try:
                outs[id(s)] = self._verify([s])[0]
            except KVFullError as e:
                self.target.seq_rm(s.seq_id)
                for _, d in self._live():
                    d.seq_rm(s.seq_id)
                outs[id(s)] = e
        return [outs[id(s)] for s in seqs]

    def _plan(self, seqs: list[SeqState]) -> bool:
        """Who drafts what this round: each sequence's context proposal, then the plan's
        choice per sequence (the heads' drafts: ``n_plan`` steps; a context draft,
        made here; the context's first tokens the heads extend; nothing). True when the
        plan chose (its round is then timed for it)."""
        if self.C.proposers:
            self.C.propose(seqs)
        planned = [s for s in seqs if s.policy is not None]
        if planned:
            if self.fused and self.speculate:
                for s in planned:
                    if s.pos - min(s.kv_valid[k] for k in self.heads) > 2 * Heads.MAX_CATCH_UP:
                        # heads that sat out this long start from the last MAX_CATCH_UP rows
                        # when they draft again: the rows before those are let go now (a
                        # long generation drafting nothing, at temperature 1 on a CPU, kept
                        # every row's hidden state: 16 KB a token at Step-3.5-Flash's width)
                        self.H.bound_catch_up(s, s.pos + 1)
                    # rows the heads missed while the sequence drafted nothing: the cost of
                    # drafting again. Not the prompt's last rows, left to ride along with
                    # the first draft steps: the first drafts of the request pay them
                    # whenever they come, and counted here (up to 3 x 256 rows) they kept
                    # a new request's heads from drafting for tens of rounds once a
                    # catch-up was timed
                    since = s.n_prefilled
                    s.policy.behind = sum(min(Heads.MAX_CATCH_UP, max(0, s.pos - max(s.kv_valid[k], since)))
                                          for k in self.heads)
            plan = self.planner.plan([s.policy for s in planned], [s.n_plan for s in planned])
            for s, n in zip(planned, plan):
                p = s.policy
                s.n_plan = n
                s.n_point = min(p.n_forced, n) if s.proposal is not None else 0
                if p.use == "context" or (n and s.n_point == n):
                    s.n_plan = 0
                    self.C.drafts(s, n)
                elif self.fused and n:
                    self.H.bound_catch_up(s, s.pos + 1)
                p.n_forced = s.n_point
        for s in seqs:
            if s.policy is None and s.proposal is not None and s.n_point:
                s.n_plan = 0
                self.C.drafts(s, s.n_point)
        self.C.fit_rows(seqs)
        return bool(planned)

    @staticmethod
    def _drop_drafts(seqs: list[SeqState]) -> bool:
        """The round verifies id_last alone for every sequence (as if every draft were
        rejected: nothing of them is in the target's KV yet); False when none had drafts."""
        dropped = False
        for s in seqs:
            if s.drafts:
                s.drafts = []
                s.n_masked = 0
                dropped = True
        return dropped

    def _verify(self, seqs: list[SeqState]) -> list[list[int]]:
        """Verify and accept: the target decodes each sequence's id_last and drafts,
        every row an output."""
        tb = self.tbatch
        tb.clear()
        starts = [tb.append([s.id_last, *s.drafts], s.pos, s.seq_id, outputs="all") for s in seqs]
        self._decode(self.target, tb, seqs)
        t0 = time.perf_counter()
        logits = self.target.logits_rows(tb.n)
        verify_h = self.target.nextn(tb.n) if self.speculate else None
        dt = (time.perf_counter() - t0) * 1e3
        if self.speculate and not self.fused:
            # process: re-anchor every head on the trunk rows, right-shifted by one
            self.H.process([(s, [s.id_last, *s.drafts], s.pos, verify_h[i0 : i0 + len(s.drafts) + 1])
                           for s, i0 in zip(seqs, starts)])
        outs = []
        for s, i0 in zip(seqs, starts):
            s.stats.t_llama_ms += dt
            n = len(s.drafts)
            vh = verify_h[i0 : i0 + n + 1] if verify_h is not None else None
            outs.append(self._accept(s, logits[i0 : i0 + n + 1], vh))
        return outs

    def _accept(self, s: SeqState, logits: np.ndarray, verify_h: np.ndarray | None) -> list[int]:
        """The target's samples while they equal the drafts (or rejection sampling);
        moves the sequence past what it accepted."""
        r, drafts = s.pos, s.drafts
        n = len(drafts)
        if self.speculate:
            self._log_h(s, r, verify_h)
        c = s.constraint
        if s.rejection:
            hist = s.tokens
            p_rows: dict[int, np.ndarray] = {}
            advanced = 0  # drafts the constraint went through for rows without a kept mask

            def masked_row(i: int) -> np.ndarray:
                nonlocal advanced
                if c is not None and i >= s.n_masked:  # row i is masked given the drafts before it
                    c.advance_many(drafts[advanced:i])
                    advanced = max(advanced, i)
                return _masked(s, logits[i], i)

            def p_row(i: int) -> np.ndarray:
                p_rows[i] = s.sampler.dense(masked_row(i), hist, drafts[:i])
                return p_rows[i]

            def bonus() -> int:
                if s.n_probs:  # its dense row is what the request's probabilities report
                    return s.sampler.draw(p_row(n))
                return s.sampler.sample(masked_row(n), hist, drafts)

            q_rows = [PointMass(drafts[i]) if i < s.n_point else s.q[i] for i in range(n)]
            out = verify_rejection(s.sampler, p_row, drafts, q_rows, bonus)
            if s.shaper is not None:
                for i in range(s.n_point, min(len(out), n)):  # the heads' rows whose p was computed
                    s.shaper.observe(i, p_rows[i], s.q0[i])
            if c is not None:
                c.rollback(advanced)
                c.advance_many(out)
            if s.n_probs:
                # each token was drawn from the target's row for its position
                s.token_probs += [self._probs(s, logits[i], None, tok, p_rows.get(i)) for i, tok in enumerate(out)]
            s.tokens.extend(out)
        elif c is None and not s.n_probs and s.sampler.plain_argmax:
            # the rows' argmaxes in one call, as sample() takes them one by one: right
            # after a decode each numpy call costs tens of microseconds (performance.md)
            toks = logits.argmax(axis=1).tolist()
            out = []
            for i in range(n + 1):
                out.append(toks[i])
                if i == n or toks[i] != drafts[i]:
                    break
            s.tokens.extend(out)
        else:
            out = []
            for i in range(n + 1):
                # the sampled tokens are the drafts while they match: the constraint
                # advances along the accepted prefix only, nothing to roll back
                row = _masked(s, logits[i], i)
                tok = s.sampler.sample(row, s.tokens)
                if s.n_probs:
                    s.token_probs.append(self._probs(s, logits[i], row, tok))
                if c is not None:
                    c.advance(tok)
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
        self.H.count_draftable(out)
        s.id_last = out[-1]
        s.pos = r + a + 1
        if a < n:
            self.target.seq_rm(s.seq_id, s.pos)  # the rejected drafts' KV
        s.stats.count_round(n, a, min(n, s.n_point))
        if s.policy is not None:
            s.policy.observe(n, a)
        if s.proposal is not None:
            self.C.judge(s, out, min(n, s.n_point))
        if s.trace is not None:
            cells = [(d.seq_pos_min(s.seq_id), d.seq_pos_max(s.seq_id)) if d is not None else (-1, -1)
                     for d in self.drafts]
            s.trace.append(RoundTrace(r, list(drafts), s.probs[:n], a, out, cells, list(s.kv_valid)))
        return out

    def _probs(self, s: SeqState, raw: np.ndarray, row: np.ndarray | None, tok: int,
               dense: np.ndarray | None = None) -> TokenProbs:
        """The reported probabilities of ``tok``, sampled from the target's ``raw``
        row (the row plain decoding samples that position from; ``row``: the same,
        masked by a constraint)."""
        if not s.post_probs:
            return raw_probs(raw, tok, s.n_probs)
        if dense is None:
            dense = s.sampler.dense(raw if row is None else row, s.tokens)
        return chain_probs(dense, tok, s.n_probs)






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
