"""What a round hands from one step to the next: the speculation settings
(``SpecConfig``), each sequence's state (``SeqState``), and the rows its heads still
have to see (``Anchors``). Plain data: the driver (``mtp``) and the drafters
(``drafters``) both read and write it, neither owns the other's insides."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from .drafters.context import ContextProposal
from .drafters.ngram import NGRAM_TYPES, NgramConfig
from .prompt_cache import Checkpoint
from .sampling import DraftShaper, Sampler, TokenProbs
from .stats import GenStats

if TYPE_CHECKING:
    from .adaptive import SeqPolicy
    from .grammar import ConstraintState

__all__ = ["SpecConfig", "SeqState", "Anchors", "RoundTrace", "Mode", "Schedule", "Verify"]

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
        above temperature 0, exact for a request with a seed (its text is then plain
        sampling's for that seed, whatever the draft lengths). At temperature 0 both
        are greedy exact match.
    adaptive: choose each sequence's draft length every round, between the bounds
        above (0 or n_min .. n_max), from the acceptance it sees under its own sampling
        settings and what rounds cost on this machine (``adaptive.DraftPlanner``); on by
        default. With n_min >= the draft length, or adaptive off, every round drafts
        the draft length.
    draft_vocab: the heads draft among the first this many token ids (0: the whole
        vocabulary; -1, the default: a quarter of it, at least 2048), widened by the
        driver while more than 1% of the target's tokens fall outside. Their LM head
        is most of what a draft step reads, and a BPE vocabulary's first ids are its
        most frequent tokens; drafts are proposals, so only acceptance can change.
    context: draft from the context too (``drafters.context``): continuations of the
        text just written found earlier in the sequence or in the pool of earlier
        sequences, chosen by the same plan as the heads' drafts. On by default
        wherever the heads draft.
    ngram: llama-server's n-gram drafters (``drafters.ngram``), by their ``--spec-type``
        names, with their settings (``NgramConfig``); they draft without the heads too.
    context_max: the most tokens a context draft carries (its verify: one row more).
    pool_tokens: the tokens kept of earlier sequences for context drafting, per pool
        (0: none kept, each sequence drafts from its own tokens alone).
    """

    mode: Mode = "chain"
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    schedule: Schedule = "fused"
    verify: Verify = "auto"
    adaptive: bool = True
    draft_vocab: int = -1
    context: bool = True
    ngram: tuple[str, ...] = ()
    ngram_config: "NgramConfig | None" = None
    context_max: int = 62
    pool_tokens: int = 1 << 18

    def __post_init__(self) -> None:
        for t in self.ngram:
            if t not in NGRAM_TYPES:
                raise ValueError(f"unknown n-gram drafter {t!r} ({', '.join(NGRAM_TYPES)})")
        if self.context_max < 0 or self.pool_tokens < 0:
            raise ValueError("context_max and pool_tokens must be >= 0")
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
        if self.draft_vocab < -1:
            raise ValueError("draft_vocab must be -1 (auto), 0 (the whole vocabulary) or a token count")

    @property
    def drafts_context(self) -> bool:
        """Whether context drafts are made (ours with the heads, or llama-server's types)."""
        return bool(self.ngram) or (self.context and self.mode != "none" and self.n_max > 0 and self.context_max > 0)

    def draft_length(self, n_heads: int) -> int:
        if self.mode == "none":
            return 0
        if self.mode == "chain":
            return min(self.n_max, n_heads)
        return self.n_max


class Anchors:
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
        if k == 1 and self.n < len(self.tok):  # every round's id_last (half the time of slices)
            self.tok[self.n] = tokens[0]
            self.h[self.n] = h_rows[0]
            self.n += 1
            return
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
    #: adaptive draft length (SpecConfig.adaptive): its side of the round's plan
    policy: SeqPolicy | None = None
    #: fused schedule: head k is anchored on positions [0, kv_valid[k]); it holds cells
    #: up to kv_end[k] (exclusive): past kv_valid, the chained rows it last drafted from
    kv_valid: list[int] = field(default_factory=list)
    kv_end: list[int] = field(default_factory=list)
    anchors: Anchors | None = None
    #: prompt processing: the prompt, and how much of it the target has decoded
    prompt: list[int] = field(default_factory=list)
    n_prefilled: int = 0
    #: the heads are anchored on the positions before this one already (a cached prefix)
    anchor_from: int = 0
    #: prompt rows per decode at most (halved when a shared KV cache has no room)
    chunk_limit: int = 1 << 30
    #: a chat prompt's tokens before its latest user message (0: unknown): its decodes
    #: stop there, and a context checkpoint is made there, as llama-server's
    n_before_user: int = 0
    #: the LoRA scales its KV is computed with (adapters.Adapters.key; () without adapters)
    adapter: tuple[float, ...] = ()
    #: debug mode: every trunk hidden row the target produced, by position
    h_log: dict[int, np.ndarray] | None = None
    #: debug mode: one RoundTrace per round
    trace: list["RoundTrace"] | None = None
    #: trimmed sliding-window cache: checkpoints of the target's sliding-window cells,
    #: for a later prompt to go on from further back than the cells reach
    checkpoints: list["Checkpoint"] = field(default_factory=list)
    # the current round: its draft length, drafts, their probabilities, the heads'
    # output rows (out_0 .. out_{n-1}), the distributions drafts were drawn from
    # (rejection), and the batch row of the sequence's output in the last draft decode
    n_plan: int = 0
    drafts: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    chain_h: np.ndarray | None = None
    q: np.ndarray | None = None
    #: rejection sampling: the heads' distributions after the request's sampling chain,
    #: which q (what drafts are drawn from) is shaped from, and who shapes them
    q0: np.ndarray | None = None
    shaper: DraftShaper | None = None
    row: int = -1
    #: token probabilities to report (llama-server's n_probs; post: after the sampling
    #: chain): one TokenProbs per token sampled, in order, drafts accepted included
    n_probs: int = 0
    post_probs: bool = False
    token_probs: list[TokenProbs] = field(default_factory=list)
    #: constrained decoding (a grammar, a JSON schema): every target row is masked
    #: given the tokens before it; drafts too when mask_drafts (grammar-aware drafting)
    constraint: "ConstraintState | None" = None
    mask_drafts: bool = True
    #: the masks the drafting step computed for depths 0..n_masked-1 of this round:
    #: the verifier's rows 0..n_masked-1 have the same ones (same prefix, same drafts)
    draft_bits: np.ndarray | None = None
    n_masked: int = 0
    #: context drafting: each proposer's state for this sequence, the pool it drafts from
    #: and adds to (a key of the driver's pools; None: its own tokens alone), the tokens
    #: still wanted (drafts past them are wasted rows; -1: no limit)
    ctx: list | None = None
    pool_key: object = None
    budget: int = -1
    #: this round's context proposal (and the proposer it came from), and how many of the
    #: round's drafts come from it (the first ones: point proposals, no head distribution)
    proposal: "ContextProposal | None" = None
    proposer: int = -1
    n_point: int = 0
    #: proposals that agreed with every token their round emitted and reach further:
    #: (proposal, where its first token is in ``tokens``, places judged, places known
    #: to agree, its record), judged on as the text gets there (``ContextDrafting.judge``)
    ctx_pending: list = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt)


@dataclass
class RoundTrace:
    """What one round did (debug mode): for comparing schedules round by round."""

    pos: int  # position of id_last at the round's start
    drafts: list[int]
    probs: list[float]
    n_accepted: int
    out: list[int]
    #: each head's cells in the draft context after the round: (seq_pos_min, seq_pos_max)
    draft_cells: list[tuple[int, int]]
    #: fused schedule: each head's anchored prefix after the round
    kv_valid: list[int]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their starts."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
