"""Adaptive draft length: pick, each round, the number of drafts that maximises the
expected accepted tokens per second.

With per-depth acceptance estimates a_d (the chance draft d is accepted given drafts
1..d-1 were) a round of n drafts emits E[n] = 1 + a_1 + a_1 a_2 + ... tokens. Its
cost T[n] is measured, per length, as the wall time from one round's choice to the
next: the draft steps, the verification, the heads catching up, and everything
Python does around them (on a small model that overhead decides whether drafting
pays at all, and a cost model of the decodes alone would miss it). The policy picks
argmax E[n] / T[n] for n in 0..n_max; 0 means a plain decode this round. Every
length is tried at the start (twice: a length's first round on an engine pays for
llama.cpp setting that batch shape up); afterwards the lengths next to the best
one are probed when they have not been tried for a while, so the estimates follow
the text and the machine: after ``probe_every`` rounds, a gap that doubles each
time a probe loses (up to ``max_probe_every``) and resets when one wins, so a
length that never pays is almost never paid for. The gaps are the engine's: a new
request does not start by probing what the ones before it found not to pay. A probe
that drafts again after plain rounds runs a few rounds, since one draft says little.

The acceptance per depth is a sequence's own recent record, pulled towards the
engine's long-run rate: the counts fade by ``accept_decay`` each *round*, drafted
or not, and the engine's rate weighs as ``prior_weight`` drafts. So a few rejections
in a row do not stop drafting (on the bench-size model a one-draft round pays above
a first-draft acceptance of ~0.41, and the text's ~0.64 dips below that for a
handful of rounds all the time; a plain moving average stopped drafting then, and
with no drafts nothing told it to start again until the next probe, 32 rounds on);
and while a sequence does not draft, its estimate drifts back to what drafting
earns on this engine, so it resumes by itself where drafting pays. The engine's
rate itself fades with rounds towards an optimistic prior (0.75): where nobody
drafts, the evidence against drafting ages, and drafting is tried again now and
then (on the random-weight model that costs under 1%; without it, a few unlucky
drafts early in an engine's life could keep it from ever drafting).

A drafting length in use is kept while its expected rate is within 3% of the best
one's; plain rounds are left as soon as drafting looks better (they teach nothing
about the acceptance).

Plain floats, not numpy: this runs every round, and with n_max <= 3 numpy's
per-call overhead would cost more than the arithmetic.
"""
from __future__ import annotations

import time
from typing import Callable

__all__ = ["AdaptiveLength", "RoundCosts"]


class _Record:
    """Accepted and judged drafts per depth, fading with rounds."""

    def __init__(self, n_max: int, round_decay: float) -> None:
        self.round_decay = round_decay
        self.acc = [0.0] * n_max
        self.judged = [0.0] * n_max
        self._at = 0  # the round up to which the counts have faded

    def fade_to(self, rnd: int) -> None:
        k = rnd - self._at
        if k > 0:
            f = self.round_decay ** k
            self.acc = [x * f for x in self.acc]
            self.judged = [x * f for x in self.judged]
            self._at = rnd

    def add(self, depth: int, accepted: bool, decay: float = 1.0) -> None:
        self.acc[depth] = decay * self.acc[depth] + accepted
        self.judged[depth] = decay * self.judged[depth] + 1.0

    def estimate(self, prior: list[float], weight: float) -> list[float]:
        """Per depth, the record with ``weight`` more drafts at the prior rate."""
        return [(a + weight * p) / (j + weight) for a, j, p in zip(self.acc, self.judged, prior)]


class RoundCosts:
    """What one engine's sequences share: seconds per round by draft length (the
    machine's and the model's: a new request does not pay to measure them again),
    and the long-run acceptance per depth, the prior of every sequence's estimate:
    accepted and judged drafts fading by ``accept_decay`` per draft judged, plus
    ``prior_weight`` drafts at ``prior_accept`` (so that the few drafts of an
    engine's first rounds cannot settle it: three rejections there once made every
    later sequence believe drafting never pays)."""

    #: per round since a length was last timed, how much its old estimate still counts
    STALE_DECAY = 0.98

    def __init__(self, n_max: int, decay: float = 0.9, accept_decay: float = 0.99, prior_accept: float = 0.75,
                 prior_weight: float = 2.0, round_decay: float = 0.995) -> None:
        self.decay = decay
        self.accept_decay = accept_decay
        self.rounds = 0  # rounds of any sequence: the record also fades with them
        self._prior = [prior_accept] * n_max
        self.prior_weight = prior_weight
        self.t_round: list[float | None] = [None] * (n_max + 1)
        self._n = [0] * (n_max + 1)
        self._seen = [0] * (n_max + 1)  # the round each length was last timed
        self._record = _Record(n_max, round_decay)
        self._warm = [False] * (n_max + 1)
        self.gap: list[int] | None = None  # AdaptiveLength's probe gaps, shared

    def observe(self, n: int, seconds: float) -> None:
        if not self._warm[n]:
            # a length's first round on this engine pays for llama.cpp setting up
            # that batch shape (seen: 2-3x a later round's time): not its cost
            self._warm[n] = True
            return
        # a plain mean over the first rounds, then a moving average (the first samples
        # do not linger); a length not run for a while (a probe) weighs more: its
        # estimate is stale, and the machine's load may have changed since
        self._n[n] += 1
        stale = self.rounds - self._seen[n]
        self._seen[n] = self.rounds
        w = max(1.0 / self._n[n], 1.0 - self.decay, 1.0 - self.STALE_DECAY ** stale)
        v = self.t_round[n]
        self.t_round[n] = seconds if v is None else (1 - w) * v + w * seconds

    def observe_accept(self, depth: int, accepted: bool) -> None:
        self._record.fade_to(self.rounds)
        self._record.add(depth, accepted, self.accept_decay)

    @property
    def accept(self) -> list[float]:
        """The long-run acceptance per depth."""
        self._record.fade_to(self.rounds)
        return self._record.estimate(self._prior, self.prior_weight)


class AdaptiveLength:
    """Per-sequence draft-length policy (acceptance depends on the text; the costs
    are the machine's but cheap to learn again). ``clock``: seconds, for tests."""

    #: a drafting length in use stays while its expected rate is within this share of the best
    HYSTERESIS = 0.97
    #: a probe that drafts again after plain rounds runs this many rounds: one draft
    #: says little about the acceptance (a sequence that stopped drafting learns only
    #: from its probes)
    PROBE_ROUNDS = 4

    def __init__(self, n_max: int, *, decay: float = 0.9, accept_decay: float = 0.97, prior_weight: float = 4.0,
                 probe_every: int = 32, max_probe_every: int = 1024,
                 costs: RoundCosts | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.n_max = n_max
        self.prior_weight = prior_weight
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self._probe: int | None = None  # the length the last round probed
        self._probe_left = 0  # rounds the probe still runs
        self.clock = clock
        self.costs = costs or RoundCosts(n_max, decay)
        # rounds until a length is probed again: the engine's, so that a new sequence
        # does not start by probing what others found not to pay
        if self.costs.gap is None:
            self.costs.gap = [probe_every] * (n_max + 1)
        self.gap = self.costs.gap
        # this sequence's drafts, fading per round (see the module)
        self._record = _Record(n_max, accept_decay)
        # a length whose cost the engine knows counts as just tried: a new sequence
        # starts from the shared estimates instead of probing at once
        self.last_tried = [0 if t is not None else -(10**9) for t in self.costs.t_round]
        self.round = 0
        self._t_start: float | None = None
        self._drafted: int | None = None  # the length the last round really drafted
        self._steady = True
        self._best: int | None = None
        self._recheck = 0

    @property
    def t_round(self) -> list[float | None]:
        return self.costs.t_round

    @property
    def accept(self) -> list[float]:
        """The acceptance estimate per depth: this sequence's recent record, pulled
        towards the engine's long-run rate."""
        self._record.fade_to(self.round)
        return self._record.estimate(self.costs.accept, self.prior_weight)

    def expected_tokens(self, n: int, accept: list[float] | None = None) -> float:
        accept = self.accept if accept is None else accept
        total, p = 1.0, 1.0
        for d in range(n):
            p *= accept[d]
            total += p
        return total

    def expected_rate(self, n: int, accept: list[float] | None = None) -> float | None:
        """Expected tokens per second of a round drafting n tokens (None: not measured)."""
        t = self.t_round[n]
        if t is None:
            return None
        return self.expected_tokens(n, accept) / t if t > 0 else float("inf")

    def choose(self) -> int:
        """The draft length for this round (also closes the timing of the last one)."""
        now = self.clock()
        last, steady = self._drafted, self._steady
        if self._t_start is not None and last is not None and steady:
            self.costs.observe(last, now - self._t_start)
        self._t_start, self._drafted = now, None
        self.round += 1
        self.costs.rounds += 1
        if self._probe_left:
            self._probe_left -= 1
            return self._pick(self._probe)
        # plain rounds in a row change nothing but the cost of a plain round: the
        # rates are looked at again every few rounds (on a small model this runs
        # once per token, and its arithmetic would be a visible share of it)
        if last or self._best is None or self.round >= self._recheck:
            n = self._to_measure(last, steady)
            if n is not None:
                return self._pick(n)
            self._decide()
        best = self._best
        # probe the neighbours of the best length only: a probe pays the heads' catch-up
        # on the rows they skipped, and a longer round only pays if a shorter one does
        for n in (best - 1, best + 1):
            if 0 <= n <= self.n_max and self.round - self.last_tried[n] > self.gap[n]:
                self._probe = n
                if best == 0:
                    # drafting again after a pause: the acceptance is what is in doubt
                    self._probe_left = self.PROBE_ROUNDS - 1
                return self._pick(n)
        return self._pick(best)

    def _to_measure(self, last: int | None, steady: bool) -> int | None:
        """A length to run for its timing: one never measured (longest first), or
        the probe just made, if it was not timed."""
        for n in range(self.n_max, -1, -1):
            if self.t_round[n] is None:
                return n
        if self._probe is not None and not steady and last == self._probe:
            # the probe paid for catching the heads up, so it was not timed: once more,
            # now that they are up to date, to learn what a round of that length costs
            return self._probe
        return None

    def _decide(self) -> None:
        """The best length from the estimates (every length has been timed)."""
        lengths = range(self.n_max + 1)
        accept = self.accept
        rates = [self.expected_rate(n, accept) for n in lengths]
        best = max(lengths, key=lambda n: rates[n])
        cur = self._best
        if cur and rates[cur] >= self.HYSTERESIS * rates[best]:
            # within the estimates' noise a drafting length stays: switching has a
            # price (heads left behind catch up later), and plain rounds teach nothing
            # about the acceptance
            best = cur
        if self._probe is not None:
            # the last round was a probe: back off if that length still loses
            n = self._probe
            self.gap[n] = self.probe_every if n == best else min(2 * self.gap[n], self.max_probe_every)
            self._probe = None
        self._best, self._recheck = best, self.round + 8

    def _pick(self, n: int) -> int:
        self.last_tried[n] = self.round
        return n

    def observe(self, n_drafted: int, n_accepted: int, steady: bool = True) -> None:
        """What the round did: drafts, accepted drafts (fewer drafts than chosen when
        p-min stopped early; the round is timed as the length it really had).
        ``steady``: the heads were up to date before it; a round that first caught
        them up on many skipped rows is not timed (that is the price of switching
        drafting back on, paid once, not the cost of a round of that length)."""
        self._record.fade_to(self.round)
        for d in range(min(n_drafted, self.n_max)):
            ok = d < n_accepted
            self._record.add(d, ok)
            self.costs.observe_accept(d, ok)
            if not ok:
                break  # later drafts were never judged
        self._steady = steady
        self._drafted = min(n_drafted, self.n_max)
        self.last_tried[self._drafted] = self.round
