"""Context drafting: the next tokens proposed from text the sequence has already seen.

An agent's turn often writes what its context holds: a file rewritten with a small
change, a tool's output echoed, a function written two turns ago. There the next tokens
are a copy, and a copy can be drafted without a model: find where the text just written
(its last ``KEY`` tokens, ``id_last`` included) occurred before, and propose what
followed it there.

Where it looks (``ContextDrafter``): the sequence's own tokens (prompt and output), and
a bounded ``ContextPool`` of earlier sequences (their prompts' new parts and their
outputs), so a turn written again is drafted from the first time. Pools are kept per
``pool`` key: the server keeps one per API key, since a shared pool tells, through
timing, that another request wrote a text.

What it proposes (``ContextProposal``): a continuation, and for each of its tokens the
evidence for it: how long the match that proposes it is (the text agreeing backwards
from the current position), and how many of the places that match agree on it. The
plan (``adaptive.DraftPlanner``) turns that evidence into a chance of acceptance with a
record learnt per sampling regime (``ContextRecord``), costs the proposal's rows on the
same verify-cost table as the heads' drafts, and chooses per sequence between the
heads, the context, the context extended by the heads, or nothing.

Matches are followed incrementally: a round that accepts the copied tokens moves each
match along (one comparison per token emitted), and only a broken match costs a lookup
again (a dict access per source). Fresh text, where nothing repeats, costs a dict access
and an insertion per token.
"""
from __future__ import annotations

import bisect
import collections
import functools
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["ContextDrafter", "ContextPool", "ContextProposal", "ContextRecord", "KEY"]

#: tokens a match must share before it proposes anything
KEY = 4
#: a match is measured backwards this far at most (its evidence saturates)
MAX_MATCH = 64
#: places a proposal weighs at most (the longest matches)
MAX_SOURCES = 8


class _Index:
    """Where every ``KEY``-gram of a growing token list ends (positions, ascending)."""

    __slots__ = ("tokens", "ends", "n")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.n = KEY - 1  # positions below this are indexed (the first KEY-gram ends at KEY-1)

    def update(self) -> None:
        t, ends = self.tokens, self.ends
        for i in range(self.n, len(t)):
            key = tuple(t[i - KEY + 1 : i + 1])
            lst = ends.get(key)
            if lst is None:
                ends[key] = [i]
            else:
                lst.append(i)
        self.n = max(self.n, len(t))


@dataclass
class _Doc:
    """A pooled text: its tokens and its index."""

    tokens: list[int]
    index: _Index


class ContextPool:
    """Earlier sequences' tokens, bounded by ``max_tokens`` (oldest dropped first), with
    every ``KEY``-gram indexed. A sequence shares a prefix with the documents before it
    in an agent's conversation (each turn's prompt holds the turns before): only what
    follows the longest prefix it shares with the newest document is stored."""

    #: bytes a pooled token costs, index included (measured: list entry, dict share)
    BYTES_PER_TOKEN = 160

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.docs: collections.deque[_Doc] = collections.deque()
        self.n_tokens = 0
        self._last: list[int] = []

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_tokens <= 0 or len(tokens) <= KEY:
            return
        last, n = self._last, 0
        m = min(len(last), len(tokens))
        while n < m and last[n] == tokens[n]:
            n += 1
        self._last = list(tokens)
        start = max(0, n - MAX_MATCH)  # some text before the new part: its matches' evidence
        if len(tokens) - start <= KEY:
            return
        doc = list(tokens[start:])[-self.max_tokens:]
        idx = _Index(doc)
        idx.update()
        self.docs.append(_Doc(doc, idx))
        self.n_tokens += len(doc)
        while self.n_tokens > self.max_tokens and len(self.docs) > 1:
            self.n_tokens -= len(self.docs.popleft().tokens)

    def clear(self) -> None:
        self.docs.clear()
        self.n_tokens = 0
        self._last = []


@dataclass
class ContextProposal:
    """A continuation and, per token, the evidence for it."""

    tokens: list[int]
    #: per token: the length of the longest match proposing it (capped at MAX_MATCH)
    match: list[int]
    #: per token: the share of the matches still agreeing that propose it
    share: list[float]


@dataclass
class _Source:
    """One place the text just written occurred: the next token aligns with
    ``tokens[j]``; ``match`` tokens agree backwards from there."""

    tokens: list[int]
    j: int
    match: int


@dataclass
class ContextState:
    """A sequence's side of context drafting."""

    index: _Index
    pool: ContextPool | None
    sources: list[_Source] = field(default_factory=list)
    #: the length of the sequence's tokens when the sources were last aligned
    at: int = 0


class ContextDrafter:
    """Proposes continuations from a sequence's own tokens and a pool (see the module)."""

    name = "context"

    def __init__(self, max_len: int = 62) -> None:
        self.max_len = max_len

    def accepted(self, st: "ContextState", n_drafted: int, n_accepted: int) -> None:
        pass  # (its matches move along the tokens emitted at the next proposal)

    def begin(self, tokens: list[int], pool: ContextPool | None) -> ContextState:
        """A new sequence: ``tokens`` is its token list, which grows as it generates
        (the driver's ``SeqState.tokens``; indexed lazily)."""
        return ContextState(_Index(tokens), pool)

    def finish(self, st: ContextState) -> None:
        """The sequence ended: its tokens go to the pool."""
        if st.pool is not None:
            st.pool.add(st.index.tokens)

    def propose(self, st: ContextState, cap: int) -> ContextProposal | None:
        """The continuation of the sequence's tokens (ending with id_last) that its
        context suggests, at most ``cap`` tokens; None when nothing matches."""
        t = st.index.tokens
        n = len(t)
        if cap <= 0 or n < KEY:
            return None
        self._advance(st, t, n)
        st.at = n
        prop = self._continuation(st.sources, min(cap, self.max_len), n, t) if st.sources else None
        if prop is None:  # no match followed, or the ones followed reached their ends
            self._lookup(st, t, n)
            prop = self._continuation(st.sources, min(cap, self.max_len), n, t) if st.sources else None
        return prop

    # -- matching -----------------------------------------------------------------

    def _advance(self, st: ContextState, t: list[int], n: int) -> None:
        """Move each source along the tokens emitted since it was aligned; those that
        wrote otherwise go."""
        k = n - st.at
        if not st.sources or k <= 0:
            return
        new = t[st.at : n]
        kept = []
        for s in st.sources:
            if s.tokens[s.j : s.j + k] == new and not (s.tokens is t and s.j + k >= n):
                s.j += k
                s.match = min(MAX_MATCH, s.match + k)
                kept.append(s)
        st.sources = kept

    def _lookup(self, st: ContextState, t: list[int], n: int) -> None:
        idx = st.index
        idx.update()
        key = tuple(t[n - KEY :])
        found: list[_Source] = []
        # the sequence itself: every earlier end of the key (not the current one)
        ends = idx.ends.get(key, ())
        for e in reversed(ends[-4 * MAX_SOURCES:]):
            if e < n - 1:
                found.append(_Source(t, e + 1, self._back(t, e, t, n - 1)))
        if st.pool is not None:
            for doc in reversed(st.pool.docs):
                for e in reversed(doc.index.ends.get(key, ())[-MAX_SOURCES:]):
                    if e + 1 < len(doc.tokens):
                        found.append(_Source(doc.tokens, e + 1, self._back(doc.tokens, e, t, n - 1)))
                if len(found) >= 4 * MAX_SOURCES:
                    break
        found.sort(key=lambda s: -s.match)  # stable: the nearest first among equals
        st.sources = found[:MAX_SOURCES]

    @staticmethod
    def _back(a: list[int], i: int, b: list[int], j: int) -> int:
        """How many tokens agree going backwards from a[i] and b[j] (at most MAX_MATCH)."""
        m = 0
        while m < MAX_MATCH and i - m >= 0 and a[i - m] == b[j - m]:
            m += 1
        return m

    @classmethod
    def _continuation(cls, sources: list[_Source], cap: int, n: int, t: list[int]) -> ContextProposal | None:
        """The proposal of ``sources`` (``_walk``): one source alone, as most are (80 of
        116 walks on the agents' turns), by slices: every token its own, with its whole
        weight (share 1), its match growing a token a step. Walked step by step, a
        62-token proposal took ~0.15 ms a round after a decode, with Python's caches
        cold, as much as the rest of the round's planning."""
        if len(sources) != 1 or (sources[0].tokens is t and sources[0].j >= n):
            return cls._walk(sources, cap, n, t)
        s = sources[0]
        if s.tokens is t:
            # reads on into its own proposal: the text from s.j on, repeated with period n - s.j
            head = t[s.j : n]
            toks = (head * (cap // len(head) + 1))[:cap]
        else:
            toks = s.tokens[s.j : s.j + cap]
        if not toks:
            return None
        return ContextProposal(toks, [min(MAX_MATCH, s.match + i) for i in range(len(toks))], [1.0] * len(toks))

    @staticmethod
    def _walk(sources: list[_Source], cap: int, n: int, t: list[int]) -> ContextProposal | None:
        """Walk the sources forward together: at each step the token the longest
        matches propose (weighed by their match lengths), the sources proposing another
        dropping out.

        A source in the sequence itself reads on past its end into the proposal made so
        far (the sequence as the draft would extend it), as a copy in LZ77 may overlap
        its own output: text that repeats with a period of P tokens (a list written
        line after line, a loop the model is in) is then proposed as far as the cap,
        where the source stopped at the sequence's end and proposed P tokens a round
        (an echo on the bench model: 9-token drafts, every token accepted)."""
        alive = list(sources)
        toks: list[int] = []
        match: list[int] = []
        share: list[float] = []

        def at(s: _Source, j: int) -> int | None:
            if s.tokens is t and j >= n:
                return toks[j - n]  # (j - n < len(toks): every source starts before n)
            return s.tokens[j] if j < len(s.tokens) else None

        for step in range(cap):
            votes: dict[int, float] = {}
            best_len: dict[int, int] = {}
            total = 0.0
            for s in alive:
                tok = at(s, s.j + step)
                if tok is None:
                    continue
                w = float(s.match + step)
                votes[tok] = votes.get(tok, 0.0) + w
                best_len[tok] = max(best_len.get(tok, 0), s.match + step)
                total += w
            if not votes:
                break
            tok = max(votes, key=votes.__getitem__)
            toks.append(tok)
            match.append(min(MAX_MATCH, best_len[tok]))
            share.append(votes[tok] / total)
            if len(votes) > 1:
                alive = [s for s in alive if at(s, s.j + step) == tok]
        if not toks:
            return None
        return ContextProposal(toks, match, share)


class ContextRecord:
    """The chance a context draft is accepted given the ones before it were, by its
    evidence: the length of the match proposing it and its place in the draft (a copy
    that held for a while holds on). Learnt per sampling regime from the drafts judged;
    each bin starts with ``PRIOR`` drafts at a prior rate: for a draft's first token,
    one that is optimistic for long matches; for a later place, the rate learnt at
    the place before it (same match length). A fixed prior there kept long drafts out
    for good: a plan of 3 tokens, each accepted at 0.99, never had its 5th-8th places
    judged, and at their prior of 0.9 a longer draft never looked worth its rows (an
    echoed tool output on the bench model: 64 rounds of 3-token drafts, all accepted).
    A token the matches disagree on is taken at its share of them."""

    MATCH_EDGES = (5, 8, 16, 32)  # bins: 4, 5-7, 8-15, 16-31, 32+
    STEP_EDGES = (1, 2, 4, 8, 16, 32)  # bins: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+
    PRIOR = 4.0
    #: the prior rate of a bin: by match length
    PRIOR_RATE = (0.45, 0.55, 0.7, 0.85, 0.9)
    #: per draft judged, how much earlier drafts still count
    DECAY = 0.998

    def __init__(self) -> None:
        nm, ns = len(self.MATCH_EDGES) + 1, len(self.STEP_EDGES) + 1
        self.acc = [[0.0] * ns for _ in range(nm)]
        self.judged = [[0.0] * ns for _ in range(nm)]

    #: the bins of match lengths and places up to 127, looked up (``accepts`` runs every
    #: round, over every token of a proposal of up to 62)
    _MATCH_BIN = tuple(map(functools.partial(bisect.bisect_right, MATCH_EDGES), range(128)))
    _STEP_BIN = tuple(map(functools.partial(bisect.bisect_right, STEP_EDGES), range(128)))

    def _bin(self, match: int, step: int) -> tuple[int, int]:
        if match < 128 and step < 128:
            return self._MATCH_BIN[match], self._STEP_BIN[step]
        return bisect.bisect_right(self.MATCH_EDGES, match), bisect.bisect_right(self.STEP_EDGES, step)

    def _rates(self, a: int) -> list[float]:
        """Match bin ``a``'s rate per place bin, each bin's prior its previous one's rate."""
        out, prior = [], self.PRIOR_RATE[a]
        for acc, judged in zip(self.acc[a], self.judged[a]):
            prior = (acc + self.PRIOR * prior) / (judged + self.PRIOR)
            out.append(prior)
        return out

    def accepts(self, prop: ContextProposal) -> list[float]:
        """Per token of the proposal, its chance of acceptance given the ones before."""
        rates: dict[int, list[float]] = {}
        out = []
        for i, (m, sh) in enumerate(zip(prop.match, prop.share)):
            a, b = self._bin(m, i)
            r = rates.get(a)
            if r is None:
                r = rates[a] = self._rates(a)
            out.append(min(0.995, r[b] * sh))
        return out

    def observe(self, prop: ContextProposal, n_drafted: int, n_accepted: int, first: int = 0) -> None:
        """The proposal's places ``first`` .. judged: the first ``n_drafted`` places
        drafted (or compared), ``n_accepted`` of them accepted (counted from place 0)."""
        end = min(n_drafted, n_accepted + 1)  # later drafts were never judged
        f = self.DECAY ** max(0, end - first)
        if f < 1.0:
            for row_a, row_j in zip(self.acc, self.judged):
                for b in range(len(row_a)):
                    row_a[b] *= f
                    row_j[b] *= f
        for i in range(first, end):
            a, b = self._bin(prop.match[i], i)
            self.acc[a][b] += i < n_accepted
            self.judged[a][b] += 1.0


__all__ += ["ContextState"]
