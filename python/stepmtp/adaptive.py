"""Draft lengths, chosen each round for every sequence of the round together.

A round serves several sequences at once: each drafts n_s tokens, one target decode
verifies all their rows, R = sum(n_s + 1), and draft step i is one decode of head i
for every sequence that drafts that deep. What drafting earns is tokens: sequence s
emits E_s(n) = 1 + a_1 + a_1 a_2 + ... (a_d: the chance its d-th draft is accepted
given the ones before it were). What it costs is the *whole round's* time, so the
plan maximises the round's tokens per second:

    sum_s E_s(n_s) / (T_verify(R) + sum_{i < max n_s} T_step(i))

``RoundCosts`` learns both terms online, from the rounds themselves: the verify part
(the target's decode of R rows, sampling them, the bookkeeping around it) by R, the
draft steps by depth, in the machine's units of the moment (its speed drifts). A
sequence that sat out drafting rounds adds, in the round it drafts again, its heads'
decoding the rows they missed (learnt per row), spread over the rounds it then
drafts at least. Nothing assumes a CPU: where rows are nearly free (a GPU) the
verify cost is flat in R and the plan drafts long; where each row costs (a CPU's
experts) it drafts what pays. A row count not measured yet is read off the segment
joining the nearest measured ones (flat when only one was: optimism makes it try);
now and then a plan of one row more or one fewer runs instead (a probe), so the
estimates next to the plan in use follow the machine.

Given the costs, the best plan is exact and cheap: for a fixed deepest step D the step
costs are fixed, and each extra row r brings the next factor of some sequence's
product a_1 a_2 .. a_d, which only shrinks with d; so the best plans of R rows take the
largest such gains, in order, and the best plan is the best (D, R) of
(n_max + 1) x (rows) candidates.

Acceptance per depth (``SeqPolicy``) is a sequence's own recent record, pulled towards
the engine's long-run rate *for the same sampling settings* (greedy, or the
temperature: at temperature 1 a head's drafts are accepted far less than at 0); the
engine's rate in turn fades towards an optimistic prior where nobody drafts, and a
depth seldom drafted is taken to be accepted as the depth before it, plus half a
standard error of what little is known of it (so a few unlucky drafts cannot keep a
depth that pays from being drafted again). So a few rejections in a row do not stop
drafting, and a sequence that stopped drafting starts again by itself when the
engine's record says it pays: its first drafts then last a few rounds, one draft says
little.

The plan knows a draft's depth, not the draft: once a head has drafted, how sure it was
(its distribution's largest probability) says much more (``ConfidenceRecord``: at
temperature 0 on the bench model, drafts under 0.3 were accepted 0.42-0.48, over 0.5
0.96-1.0). So each draft, as it is made, goes to the verify only while it and the drafts
planned after it may still earn, at the rate the plan expects, what their rows cost
(``SeqPolicy.keep``): an unsure draft where a row costs ends the sequence's drafting for
the round; where rows are nearly free it is verified anyway.

Plain floats, not numpy: this runs every round, on a few numbers.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import math
from typing import Sequence

__all__ = ["RoundCosts", "SeqPolicy", "DraftPlanner", "regime", "ConfidenceRecord", "expected_tokens"]


def regime(greedy: bool, temperature: float, rejection: bool = False) -> tuple[float, bool]:
    """The key of the acceptance a sampling setting gets: greedy, or the temperature to
    a tenth and the verification (rejection sampling accepts more than exact match)."""
    return (0.0, False) if greedy else (max(0.1, round(temperature, 1)), rejection)


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

    def estimate(self, prior: Sequence[float], weight: float) -> list[float]:
        """Per depth, the record with ``weight`` more drafts at the prior rate."""
        return [(a + weight * p) / (j + weight) for a, j, p in zip(self.acc, self.judged, prior)]

    def chained(self, prior: float, weight: float) -> list[float]:
        """Per depth, the record with ``weight`` more drafts at the rate of the depth
        before it (the first depth: at ``prior``): a depth seldom drafted is taken to
        be accepted as the one before it (a head's conditional acceptance varies
        little with depth: 0.87 / 0.86 / 0.92 on the bench model), until its own
        drafts say otherwise; a depth's rate learnt nowhere else would keep a plan
        from ever drafting that deep."""
        out, p = [], prior
        for a, j in zip(self.acc, self.judged):
            p = (a + weight * p) / (j + weight)
            out.append(p)
        return out


def _median(xs: Sequence[float]) -> float:
    """statistics.median, at a third of its cost (it runs a few times every round)."""
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


class _Timings:
    """Seconds by key (rows of a verify, depth of a draft step): the median of the key's
    last WINDOW samples. A shared machine preempts the process now and then (seen: a
    round 100x its usual time, and spikes of 1.5-3x every few dozen rounds on a 2-core
    VM); a mean moved by them misjudged which plan is cheaper by 10-40% on the bench
    model (an inflated 4-row verify made one draft look better than three), a median
    ignores them. A key not measured for STALE_ROUNDS rounds starts its window again
    (the load may have changed), and how much its estimate counts fades meanwhile. A
    key's first sample on an engine is not taken: it pays for llama.cpp setting up that
    batch shape (seen: 2-3x a later one)."""

    WINDOW = 9
    STALE_ROUNDS = 64
    #: per round since a key was last measured, how much its estimate still counts
    STALE_DECAY = 0.98

    def __init__(self) -> None:
        self.t: dict[int, float] = {}
        self.n: dict[int, int] = {}
        self.seen: dict[int, int] = {}
        self.warm: set[int] = set()
        self._samples: dict[int, list[float]] = {}

    def observe(self, key: int, seconds: float, rnd: int) -> None:
        if key not in self.warm:
            self.warm.add(key)
            return
        w = self._samples.setdefault(key, [])
        if rnd - self.seen.get(key, rnd) > self.STALE_ROUNDS:
            # its count starts again with its window: a count trusted for its old
            # samples was otherwise trusted with one new sample, a preempted one at
            # that (a 17-row verify timed at 1.6x its cost on the next agent's turn,
            # and every longer copy's rows read off it twice as dear for the turn: its
            # context drafted 8 tokens a round, every one accepted)
            w.clear()
            self.n[key] = 0
        w.append(seconds)
        del w[: -self.WINDOW]
        self.t[key] = _median(w)
        self.n[key] = self.n.get(key, 0) + 1
        self.seen[key] = rnd

    def weight(self, key: int, rnd: int) -> float:
        """How much the key's own estimate counts: its samples (up to 8), faded by age."""
        if key not in self.t:
            return 0.0
        return min(self.n[key], 8) * self.STALE_DECAY ** (rnd - self.seen[key])


class RoundCosts:
    """What a round costs on this engine, by what it carries (see the module): the
    verify part by its rows, each draft step by its depth. Shared by every sequence
    and every request of an engine (one table per number of sequences in a round,
    ``DraftPlanner.costs_for``): the machine's and the model's, not the text's.

    Costs are kept in the machine's units of the moment, not in seconds: a shared
    machine's speed drifts (10-40% within minutes on a 2-core VM), and the row count
    the plan uses is timed every round while the others are timed only when a probe
    tries them, so seconds compared a fresh 1-row verify with a 4-row one from a
    slower minute and the plan stopped drafting where drafting paid. ``speed`` is the
    trimmed geometric mean of the recent verifies' ratios to a reference of their row
    count's (its first REF_SAMPLES, kept), taken from the row count most recent
    verifies use alone, and a sample is kept divided by it: what a probe or a short
    drafting stretch measures is then its row count's cost relative to the count timed
    around it.
    The references stay fixed while their count leads (a count that takes the lead
    alone has its reference taken again, from its estimate of the moment: one taken
    under another load would make the speed jump), and it is a mean, not a median:
    ratios to the estimates themselves fed back into them, and the median of two row
    counts timed in turn flipped with the last sample; either way a change of one row
    count's cost was taken for the machine's."""

    #: verifies whose ratio to their row count's reference makes the machine's speed
    SPEED_WINDOW = 24
    #: of those, the highest and the lowest left out (preempted rounds, lucky ones): the
    #: interquartile mean
    SPEED_TRIM = 6
    #: samples of a row count that make its reference
    REF_SAMPLES = 3

    def __init__(self, n_draft: int) -> None:
        self.n_draft = n_draft
        self.rounds = 0
        self.explored = 0  # rounds drafted to time the draft steps (a table's first rounds)
        self.verify_t = _Timings()
        self.step_t = _Timings()
        self.catch_up_t = _Timings()  # a row's share of a head's catching up (key 0)
        self.speed = 1.0
        self._ratios: list[float] = []  # logarithms
        self._ref: dict[int, float] = {}
        self._lead: int | None = None  # the row count the speed was last read off
        self._recent: collections.deque[int] = collections.deque(maxlen=self.SPEED_WINDOW)  # recent verifies' rows
        self._counts: collections.Counter[int] = collections.Counter()  # of ``_recent``, kept in step
        self._fit: dict[int, float] | None = None  # the estimates made to rise (``_fitted``)

    def observe_verify(self, rows: int, seconds: float) -> None:
        # a verify of other rows than the last one's pays llama.cpp's building its graph
        # when no graph of that shape is kept (patch 0015 keeps 8; a shape's first
        # verify, one evicted by four sequences' many counts, or the cache turned
        # off): ~2 ms on the bench model, 15% of a 1-row decode. Its ratio is not the
        # machine's speed: taken as such, the 1-row verifies after each short drafting
        # stretch read the machine as slower, and the row count in use drifted against
        # the others (a 3-row verify was taken for cheaper than a 2-row one, and one
        # client drafted 2 at temperature 1 for 50 rounds at a loss)
        switched = bool(self._recent) and rows != self._recent[-1]
        self._fit = None
        # the speed is read off the row count most verifies use, alone: a count
        # timed in short stretches (the drafting ones at temperature 1) has a
        # reference from a few samples of another minute, and its ratios pulled the
        # speed away from the count in use, and every estimate with it (a 2-row
        # verify was costed at 1.45-1.6x a 1-row one where it costs 1.7-1.8x, and one
        # client drafted at a loss)
        if len(self._recent) == self.SPEED_WINDOW:
            gone = self._recent[0]
            self._counts[gone] -= 1
            if not self._counts[gone]:
                del self._counts[gone]  # four sequences try many counts: max() stays short
        self._recent.append(rows)
        self._counts[rows] += 1
        dominant = self._counts[rows] == max(self._counts.values())
        ref = self._ref.get(rows)
        if ref is not None and not switched and dominant:
            if rows != self._lead and rows in self.verify_t.t and \
                    all(k == rows or n < self._counts[rows] for k, n in self._counts.items()):
                # the speed is read off another count from now on (it leads alone: two
                # counts level in turn, each taken again at every turn, fed the speed
                # back into itself and it sank, 0.49 in 160 rounds): its reference is
                # taken again, its estimate of the moment (in the units the speed has
                # kept), so the speed goes on where it was. Its old reference came from
                # another load (four clients' verifies, then one client's): the speed
                # jumped by how far its cost had moved against the count read before,
                # and every count timed since was costed by that jump (after four
                # clients at temperature 0, one client's 2-row verify was costed at
                # 1.65x a 1-row one where it took 1.95x, and it drafted at a loss)
                ref = self._ref[rows] = self.verify_t.t[rows]
                self._lead = rows
            elif self._lead is None:
                self._lead = rows
            self._ratios.append(math.log(seconds / ref))
            del self._ratios[: -self.SPEED_WINDOW]
            r = sorted(self._ratios)
            if len(r) > 2 * self.SPEED_TRIM + 2:
                r = r[self.SPEED_TRIM: -self.SPEED_TRIM]
            self.speed = math.exp(sum(r) / len(r))
        self.verify_t.observe(rows, seconds / self.speed, self.rounds)
        if ref is None and self.verify_t.n.get(rows, 0) >= self.REF_SAMPLES:
            self._ref[rows] = self.verify_t.t[rows]

    def observe_step(self, depth: int, seconds: float) -> None:
        self.step_t.observe(depth, seconds / self.speed, self.rounds)

    #: a head's decode of this many rows or more, caught up on, times a row's share
    #: (fewer: its weights' reading, not the rows, is most of it)
    CATCH_UP_MIN_ROWS = 16

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        """A head decoded ``rows`` rows it had missed, in ``seconds``."""
        if rows >= self.CATCH_UP_MIN_ROWS:
            self.catch_up_t.observe(0, seconds / rows / self.speed, self.rounds)

    def catch_up(self, rows: int) -> float:
        """What the heads' catching up on ``rows`` missed rows costs (all heads' rows
        together); 0 until a catch-up was timed."""
        return rows * self.catch_up_t.t.get(0, 0.0)

    @property
    def known(self) -> bool:
        """Whether plans can be costed: a verify timed at two row counts, a draft step."""
        return len(self.verify_t.t) >= 2 and (bool(self.step_t.t) or not self.n_draft)

    #: samples after which a row count's own estimate is trusted (``_fitted``)
    CREDIBLE_SAMPLES = 3

    #: past the longest row count measured, rows cost at most as on this power law (the
    #: bench model's verifies on a CPU: 0.75 from 1 to 63 rows on F16, 0.80 on Q4_K_M)
    MAX_EXPONENT = 0.8

    def _fitted(self) -> dict[int, float]:
        """The row counts' estimates made to rise with rows: where a count's estimate is
        below a smaller count's, the two are pooled, each weighing by its samples and
        their age (pool-adjacent-violators), so a count timed once long ago yields to
        one timed often, either way."""
        if self._fit is None:
            T = self.verify_t
            est = dict(T.t)
            # a count timed fewer than CREDIBLE_SAMPLES times costs at most what the
            # trusted counts say it does: one sample in a preempted moment (2x, 100x)
            # otherwise priced its row count out for good, since only the plans that use
            # a count time it (a 63-row verify timed once slow kept every long copy out)
            trusted = {r: t for r, t in est.items() if T.n[r] >= self.CREDIBLE_SAMPLES}
            if len(trusted) >= 2:
                for r in est:
                    if r not in trusted:
                        est[r] = min(est[r], self._read_off(trusted, r))
            blocks: list[tuple[float, float, list[int]]] = []  # (weighted sum, weight, row counts)
            for r in sorted(est):
                w = max(T.weight(r, self.rounds), 1e-6)
                blocks.append((est[r] * w, w, [r]))
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    (s1, w1, r1), (s2, w2, r2) = blocks[-2], blocks.pop()
                    blocks[-1] = (s1 + s2, w1 + w2, r1 + r2)
            self._fit = {r: total / w for total, w, rows in blocks for r in rows}
        return self._fit

    def verify(self, rows: int) -> float:
        """Seconds of the verify part of a round of ``rows`` rows: its own estimate, or
        read off the measured row counts (between two: on the segment joining them;
        beyond them: on the nearest segment, never falling; one alone: flat), the
        estimates made to rise with rows (``_fitted``): a row count's estimate below a
        smaller count's is noise (samples from another minute) that had the plan draft
        where it lost."""
        return self._read_off(self._fitted(), rows)

    @classmethod
    def _read_off(cls, T: dict[int, float], rows: int) -> float:
        """``rows``' estimate in the table ``T`` of row counts' estimates (see ``verify``)."""
        if rows in T:
            return T[rows]
        if not T:
            return 1e-9
        below = [r for r in T if r < rows]
        above = [r for r in T if r > rows]
        if below and above:
            a, b = max(below), min(above)
        elif len(below) >= 2:
            # past the longest measured: on the power law through the shortest and the
            # longest (its exponent between 1/2 and MAX_EXPONENT), not on a line. Each
            # row adds less than the one before it where rows share weights (a CPU's
            # experts: 4 rows cost 2.6 one-row decodes on the bench model, 63 rows 22,
            # not 40), and the line through the short verifies the heads make priced a
            # copy's long draft so dear that it was never tried, so never measured (an
            # echoed text, every token accepted, verified 9 tokens at a time). The two
            # longest made the exponent of a noisy step: a 4-row verify timed at 3.4
            # one-row decodes after a 3-row one at 2.05 put it at 1, and the copy of a
            # whole answer went on 2 tokens a round for 85 rounds (F16). An estimate too
            # low is corrected by the one verify that tries it; too high, by none
            a, b = min(below), max(below)
            p = min(cls.MAX_EXPONENT, max(0.5, math.log(max(T[b], 1e-12) / max(T[a], 1e-12)) / math.log(b / a)))
            return T[b] * (rows / b) ** p
        else:
            near = sorted(T, key=lambda r: abs(r - rows))[:2]
            if len(near) < 2:
                return T[near[0]]
            a, b = sorted(near)
        slope = max(0.0, (T[b] - T[a]) / (b - a))
        return max(T[a] + slope * (rows - a), 1e-9)

    def step(self, depth: int) -> float:
        """Seconds of draft step ``depth``; an unmeasured depth as the deepest measured."""
        T = self.step_t.t
        if depth in T:
            return T[depth]
        known = [T[d] for d in sorted(T) if d < depth]
        return known[-1] if known else 0.0


class SeqPolicy:
    """One sequence's side of the plan: its acceptance per depth (its recent record
    pulled towards the engine's long-run rate for its sampling regime), and the rounds
    it still drafts after starting again (a first draft after a pause says little)."""

    #: a sequence that starts drafting again drafts at least this many rounds (after a
    #: probe: when the probe's drafts were accepted)
    HOLD_ROUNDS = 4

    #: how many drafts at the engine's rate a sequence's own record starts with: at 4, a
    #: new request's first three rejected drafts (0.5 at depth 1) stopped its drafting
    #: on the bench model for 20-170 rounds at temperature 0, where the prompts' own
    #: rates differ far less than a few drafts do
    PRIOR_WEIGHT = 12.0

    def __init__(self, planner: "DraftPlanner", key: tuple[float, bool], n_min: int = 0, decay: float = 0.97,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        self.planner = planner
        self.key = key
        self.n_min = max(1, n_min)
        self.prior_weight = prior_weight
        self.record = _Record(planner.n_draft, decay)
        self.engine = planner.record_for(key)
        self.hold = 0
        self.last = 0  # drafts planned last round
        self.probed = False  # last round's drafts started with a probe
        self.rounds = 0
        #: rows its heads decode before it drafts again (all heads'; the driver's, each round)
        self.behind = 0
        #: this round's context proposal (the driver's): each token's chance of acceptance
        #: given the ones before it (``drafters.context.ContextRecord``), or None
        self.context: list[float] | None = None
        #: what the plan chose for this round: the heads' drafts (``heads``), the context's
        #: (``context``: ``n_forced`` of them, no head step), or the context's first
        #: ``n_forced`` tokens extended by the heads (``extend``)
        self.use = "heads"
        self.n_forced = 0
        #: this round: its acceptance per depth as planned, and of the drafts it keeps,
        #: the heads' confidence and the acceptance that makes it (``keep``)
        self._planned: list[float] = []
        self._conf: list[float] = []
        self._kept: list[float] = []

    #: how optimistic a depth's estimate is, in standard errors of the engine's record
    #: there: a depth seldom drafted gets tried, and its estimate sharpens (a few unlucky
    #: drafts of an engine's first rounds otherwise kept a depth that pays from ever
    #: being drafted again)
    OPTIMISM = 0.5

    @property
    def accept(self) -> list[float]:
        self.record.fade_to(self.rounds)
        eng = self.engine.estimate(self.planner.regime_rounds(self.key))
        est = self.record.estimate(eng, self.prior_weight)
        return [min(1.0, a + self.OPTIMISM * math.sqrt(a * (1.0 - a) / (j + 1.0)))
                for a, j in zip(est, self.engine.rec.judged)]

    @property
    def samples(self) -> bool:
        """Whether the sequence samples (temperature above 0)."""
        return self.key[0] > 0

    @property
    def holds(self) -> bool:
        """Whether drafting, started again, goes on for HOLD_ROUNDS whatever the rounds
        look like. Not where the sequence samples and its drafts are gated (``keep``):
        at temperature 1 on the bench model the held rounds were most of what drafting
        lost (a draft or two accepted 0.59, verified by a 2-row decode at 1.7-2x a
        1-row one's time)."""
        return not (self.planner.gate and self.samples)

    def keep(self, depth: int, confidence: float, n_plan: int) -> bool:
        """Whether the round's draft at ``depth`` (the ones before it kept), which its
        head drafted with ``confidence``, goes to the verify: whether it and the drafts
        planned after it can still earn what their rows cost, at the rate the round's
        plan expects (the tokens it and the drafts after it may still bring, against
        that rate times the time their rows and steps add).
        What the plan knew of this draft was its depth's mean acceptance; now its head's
        confidence is known too (``ConfidenceRecord``), and the drafts kept before it
        have been judged by theirs."""
        pl = self.planner
        n = min(n_plan, len(self._planned))
        a = self._planned[depth] if depth < n else 1.0
        if pl.gating and depth < n:
            a = 1.0 / (1.0 + math.exp(-(_logit(a) + self.engine.confidence.odds(depth, confidence))))
            costs, rows = pl.costs, pl.planned_rows
            base = rows - (n - depth)  # the round's rows should this sequence stop here
            reach = math.prod(self._kept)  # the chance the verify gets as far as this draft
            gain, g, steps, best = 0.0, reach * a, 0.0, -1.0
            for m in range(depth, n):  # keep drafts depth .. m
                if m > depth:
                    g *= self._planned[m]
                    if pl.planned_seqs == 1:  # (shared with other sequences' drafts otherwise)
                        steps += costs.step(m)
                gain += g
                best = max(best, gain - pl.planned_rate * (costs.verify(base + m - depth + 1) - costs.verify(base) + steps))
            if best <= 0.0:
                return False
        self._conf.append(confidence)
        self._kept.append(a)
        return True

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        """What the round did: drafts, and how many of them were accepted. The heads'
        record takes their drafts alone (a context's tokens are the context record's:
        the driver's)."""
        first = self.n_forced
        if n_drafted <= first:  # (every round where nothing pays: nothing to record)
            self.probed = False
            return
        self.record.fade_to(self.rounds)
        if self.probed and n_accepted and self.holds:
            self.hold = self.HOLD_ROUNDS - 1  # a probe that drafted well: see if it lasts
        self.probed = False
        if n_accepted < first:
            return  # a context token was rejected before the heads' drafts
        for d in range(first, min(n_drafted, self.planner.n_draft)):
            ok = d < n_accepted
            self.record.add(d, ok)
            self.engine.add(d, ok, self.planner.regime_rounds(self.key))
            if d - first < len(self._conf):
                self.engine.confidence.add(d, self._conf[d - first], ok)
            if not ok:
                break  # later drafts were never judged


def expected_tokens(accepts: Sequence[float], n: int) -> float:
    """1 + a_1 + a_1 a_2 + ... over the first n drafts."""
    e, g = 1.0, 1.0
    for a in accepts[:n]:
        g *= a
        e += g
    return e


def _logit(a: float) -> float:
    a = min(max(a, 1e-3), 1.0 - 1e-3)
    return math.log(a / (1.0 - a))


class ConfidenceRecord:
    """Acceptance per draft depth by how sure the head was of its draft (the largest
    probability of the distribution it drafted from, a function of that distribution
    alone: gating on it keeps rejection sampling exact, the draw is never looked at).
    At temperature 0 it is most of what decides a draft: on the bench model a head's
    drafts it gave under 0.3 were accepted 0.42-0.48, those over 0.5 0.96-1.0, and a
    sequence's plan knows only their mean (0.81). At temperature 1 it says far less
    (0.55-0.71 below 0.95, 0.85 above 0.99). Kept per sampling regime; each bin starts
    with PRIOR drafts at its depth's mean, so a bin seldom drafted (gated) drifts back
    to the mean and is tried again."""

    #: the bins' upper edges
    EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
    PRIOR = 4.0
    #: per draft judged at a depth, how much that depth's earlier drafts still count
    DECAY = 0.995

    def __init__(self, n_max: int) -> None:
        nb = len(self.EDGES) + 1
        self.acc = [[0.0] * nb for _ in range(n_max)]
        self.judged = [[0.0] * nb for _ in range(n_max)]

    def add(self, depth: int, confidence: float, accepted: bool) -> None:
        acc, judged, f = self.acc[depth], self.judged[depth], self.DECAY
        for b in range(len(acc)):
            acc[b] *= f
            judged[b] *= f
        b = bisect.bisect_left(self.EDGES, confidence)
        acc[b] += accepted
        judged[b] += 1.0

    def odds(self, depth: int, confidence: float) -> float:
        """How much more likely (log-odds) a draft of this confidence is accepted than
        its depth's drafts on average."""
        acc, judged = self.acc[depth], self.judged[depth]
        mean = (sum(acc) + 1.0) / (sum(judged) + 2.0)
        b = bisect.bisect_left(self.EDGES, confidence)
        rate = (acc[b] + self.PRIOR * mean) / (judged[b] + self.PRIOR)
        return _logit(rate) - _logit(mean)


class _EngineRecord:
    """The long-run acceptance per depth of one sampling regime: accepted and judged
    drafts fading per draft judged and per round, plus ``weight`` drafts at an
    optimistic prior (a few unlucky drafts early on must not settle it, and where
    nobody drafts the evidence against drafting ages)."""

    def __init__(self, n_max: int, prior: float = 0.75, weight: float = 2.0, decay: float = 0.99,
                 round_decay: float = 0.999) -> None:
        self.decay = decay
        self.prior = prior
        self.weight = weight
        self.rec = _Record(n_max, round_decay)
        #: acceptance by the heads' confidence in each draft (``SeqPolicy.keep``)
        self.confidence = ConfidenceRecord(n_max)

    def add(self, depth: int, ok: bool, rnd: int) -> None:
        self.rec.fade_to(rnd)
        self.rec.add(depth, ok, self.decay)

    def estimate(self, rnd: int) -> list[float]:
        self.rec.fade_to(rnd)
        return self.rec.chained(self.prior, self.weight)


class DraftPlanner:
    """The engine's draft-length policy (see the module). ``plan`` gives each sequence
    of a round its draft length; ``costs`` learns what rounds cost; probes try another
    plan close to the best now and then (every ``probe_every`` rounds, the gap doubling
    up to ``max_probe_every`` while probes lose), so the estimates follow the machine:
    a probe costs a few percent of one round, an estimate left stale for hundreds of
    rounds (a gap of 512 was seen) kept the bench model from drafting for 250 rounds
    after one busy moment."""

    #: a plan in use is kept while its expected rate is within this share of the best
    HYSTERESIS = 0.97
    #: drafting must beat drafting nothing by this much. A sequence drafts when its
    #: record looks good, and a record of a few drafts looks good by chance as often as
    #: by merit, so the acceptance a plan expects is optimistic on average where the
    #: gain is small: at temperature 1 on the bench model drafts planned at 0.67 were
    #: accepted 0.59-0.61, and without this edge (the heads' catch-up charged) one
    #: client ran at 0.86x of plain decoding against 0.99x with it (same machine, an
    #: hour apart); at temperature 0 the two were level
    NO_DRAFT_EDGE = 1.05
    #: the edge where a round's sequences sample (temperature above 0): each draft's
    #: acceptance there is a coin of about even odds, so a sequence's record of its
    #: last few dozen drafts strays further from its rate than at temperature 0, and
    #: drafting it starts by chance more often: at 1.05, one client at temperature 1
    #: (rejection sampling, drafts accepted 0.6, a 2-row verify 1.6-1.8x a 1-row one)
    #: drafted 711 tokens in 2304 at 0.948 ± 0.030 of plain decoding's speed, at 1.12
    #: 224 at 0.985 ± 0.023, at 1.2 236 at 0.982 ± 0.020 (paired, in turns, bench model)
    NO_DRAFT_EDGE_SAMPLED = 1.12

    #: where every sequence samples (and drafts are gated), how much further apart
    #: losing probes may grow: there a probe costs most (a 2-row verify at 1.7-2x a
    #: 1-row one for a draft accepted ~0.6, after its heads caught up on the rounds
    #: they sat out) and seldom wins: at temperature 1 on the bench model one client
    #: probed ~50 times in 3000 rounds, at about a round lost each (~1.5%, estimated)
    SAMPLED_PROBE_STRETCH = 4

    def __init__(self, n_draft: int, *, probe_every: int = 16, max_probe_every: int = 64) -> None:
        self.n_draft = n_draft
        #: what rounds cost, one table per number of sequences in a round and whether one
        #: of them samples (``costs_for``)
        self._tables: dict[tuple[int, bool], RoundCosts] = {}
        #: the table of the round being planned
        self.costs = self.costs_for(1)
        self._rounds = 0
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every)
        self.gap = probe_every
        self._next_probe = probe_every
        self._probe: int | None = None  # the rows the last probe planned
        self._probe_again: tuple[int, int] | None = None  # a probe to repeat next round
        self._records: dict[tuple[float, bool], _EngineRecord] = {}
        self._last: tuple[int, int] | None = None  # (sequences, rows) of the last plan
        self._probing = False  # this round's plan is a probe
        #: whether drafts may be kept out of the verify by their heads' confidence
        self.gate = True
        #: this round's plan, for its sequences' gates (``SeqPolicy.keep``): whether they
        #: gate, how many sequences and rows it has, the rate it expects
        self.gating = False
        self.planned_seqs = 0
        self.planned_rows = 0
        self.planned_rate = 0.0
        self._accepts: list[list[float]] | None = None
        self._quiet = 0  # rounds left that draft nothing unplanned (``_quiet_round``)
        #: per sampling regime: the rounds planned with a sequence of it, and that count
        #: at its sequences' last drafts outside probes (``dormant``)
        self._regime_rounds: dict[tuple[float, bool], int] = {}
        self._regime_drafted: dict[tuple[float, bool], int] = {}
        self._quiet_seqs: tuple[SeqPolicy, ...] = ()  # the sequences of the plan that set it
        #: the most rows a round's verify may carry (the driver's: where rows keep their bits)
        self.max_rows = 1 << 30

    @property
    def rounds(self) -> int:
        return self._rounds

    def costs_for(self, n_seqs: int, sampled: bool = False) -> RoundCosts:
        """The cost table of rounds of ``n_seqs`` sequences, ``sampled`` when one of them
        samples (temperature above 0). One table for all (rows as the key) took the costs
        one load had taught for another's: after one client's rounds (a 4-row verify: one
        sequence's id_last and 3 drafts), four clients' plain 4-row rounds set the speed
        the 8- and 16-row verifies were costed by, and those came out at twice what they
        took: four clients at temperature 0 drafted in 1 round of 5 (bench model,
        in-process, the matrix's order of cells). A sampled draft costs more than a
        greedy one besides its row: the heads' and the target's distributions over the
        whole vocabulary, drawn from and compared (rejection sampling), ~1 ms a draft
        against ~6 ms for the row itself on the bench model; costed by greedy rounds, a
        client at temperature 1 drafted where it lost. Each table explores and probes on
        its own."""
        key = (n_seqs, sampled)
        c = self._tables.get(key)
        if c is None:
            c = self._tables[key] = RoundCosts(self.n_draft)
        return c

    def record_for(self, key: tuple[float, bool]) -> _EngineRecord:
        r = self._records.get(key)
        if r is None:
            r = self._records[key] = _EngineRecord(self.n_draft)
        return r

    def policy(self, key: tuple[float, bool], n_min: int = 0) -> SeqPolicy:
        return SeqPolicy(self, key, n_min)

    def regime_rounds(self, key: tuple[float, bool]) -> int:
        """The rounds planned with a sequence of this sampling regime in them: the clock
        its engine record fades by. Not all rounds: while other regimes' requests ran
        (four clients at temperature 0 for minutes), the record of temperature 1 faded
        back to its optimistic prior, and one client at temperature 1 then drafted 1359
        tokens of 1728 at 0.69x of plain decoding's speed (bench model)."""
        return self._regime_rounds.get(key, 0)

    #: rounds of a sampling regime without a draft, probes aside, that make it dormant
    DORMANT_ROUNDS = 512

    def dormant(self, key: tuple[float, bool]) -> bool:
        """Whether the regime's sequences drafted nothing, probes aside, in its last
        DORMANT_ROUNDS rounds: then a new sequence of it need not have its heads read
        its prompt (~6% of a prompt's decoding on Step-3.5-Flash's shape: 3 head layers
        against 45), since, should it draft, its heads start from the last rows anyway
        (mtp's MAX_CATCH_UP). At temperature 1 on the bench model, on a CPU, that was
        1.5% of a request of 192 tokens."""
        r = self._regime_rounds.get(key, 0)
        return r >= self.DORMANT_ROUNDS and r - self._regime_drafted.get(key, 0) >= self.DORMANT_ROUNDS

    # -- the plan --------------------------------------------------------------------

    def plan(self, seqs: Sequence[SeqPolicy], caps: Sequence[int]) -> list[int]:
        """Draft lengths for this round's sequences (``caps``: the most the heads may
        draft for each; a context proposal, ``SeqPolicy.context``, is as long as it may
        be), the round's verify carrying at most ``max_rows`` rows. Each sequence's
        ``use`` and ``n_forced`` say what its drafts are."""
        self._rounds += 1
        sampled = any(p.samples for p in seqs)
        self.costs = self.costs_for(len(seqs), sampled)
        self.costs.rounds += 1
        for p in seqs:
            p.rounds += 1
        self._probing = False
        self._accepts = None
        for p in seqs:
            p.use, p.n_forced = "heads", 0
        # a new table of a kind of round already costed is planned on that one's costs
        # while it learns its own (``_lender``), as a known one is, with no exploring
        costs = self.costs if self.costs.known else self._lender(len(seqs), sampled, alike=True)
        if costs is None:
            out = self._explore_plan(seqs, caps)
        elif self._quiet_round(seqs):
            out = [0] * len(seqs)
        else:
            with self._costed_by(costs):
                out = self._best_plan(seqs, caps)
        # the drafts go to the verify as planned, or fewer where their heads were unsure
        # (``SeqPolicy.keep``): not while the costs are unknown, nor in a probe (which
        # also tries the drafts a gate would keep out, so its record of them stays current)
        self.gating = self.gate and self._accepts is not None and not self._probing
        self.planned_seqs = len(seqs)
        for j, (p, n) in enumerate(zip(seqs, out)):
            p._planned = self._accepts[j] if self._accepts is not None else []
            p._conf = []
            # the context's tokens before the heads' drafts: the chance the verify gets past them
            p._kept = list(p._planned[: p.n_forced]) if p.use == "extend" else []
        for key in {p.key for p in seqs}:
            self._regime_rounds[key] = self._regime_rounds.get(key, 0) + 1
        for p, n in zip(seqs, out):
            if p.use == "context":
                p.last = 0  # (the heads did not draft: nothing of theirs to hold on to)
                p.hold = 0
                continue
            if n and not self._probing:
                self._regime_drafted[p.key] = self._regime_rounds[p.key]
            # a probe times a row count in one round, and holds on only when its drafts
            # were accepted (``SeqPolicy.observe``): held on always, each probe of a plan
            # that does not pay cost four drafting rounds in 64 (at temperature 1 on
            # the bench model, 1-2% of plain decoding's speed)
            if n and not p.last:
                p.hold = 0 if self._probing or not p.holds else SeqPolicy.HOLD_ROUNDS - 1
                p.probed = self._probing
            elif p.hold:
                p.hold -= 1
            p.last = n
        return out

    #: after a full plan drafted nothing, and no drafting came within QUIET_BELOW of
    #: its rate, the rounds that follow it draft nothing too without planning, this
    #: many at most (the first included). Planning is Python's work on every round
    #: (~0.1 ms for one sequence, ~0.15 for four), 0.6-1% of a round that drafts
    #: nothing on the bench model, which is every round at temperature 1 there: MTP on
    #: ran at 0.98-0.99 of MTP off in-process for it. Drafting starts again these few
    #: rounds later at most. Not where drafting was close: at temperature 0 a plan of
    #: no drafts now and then (a noisy timing) became eight, and one client drafted less
    QUIET_ROUNDS = 8
    QUIET_BELOW = 0.9

    def _quiet_round(self, seqs: Sequence[SeqPolicy]) -> bool:
        """Whether this round drafts nothing without planning (``QUIET_ROUNDS``): the
        last full plan, for the same number of sequences, drafted nothing, none of them
        drafted since nor holds, and no probe is due."""
        if self._quiet <= 0 or len(seqs) != len(self._quiet_seqs) or any(p.context for p in seqs) \
                or any(p is not q or p.last or p.hold for p, q in zip(seqs, self._quiet_seqs)) \
                or self._probe_again is not None or self.rounds >= self._next_probe:
            self._quiet = 0
            return False
        self._quiet -= 1
        return True

    #: rounds an engine drafts at first to time its draft steps, at most
    EXPLORE_DRAFTING = 8

    def _explore_plan(self, seqs: Sequence[SeqPolicy], caps: Sequence[int]) -> list[int]:
        """Before the costs are known (an engine's first table of its kind: a later one
        is planned on a known one's costs, ``_lender``): the copies first (below), then
        one sequence not copying drafts the most, in the rows left, until each draft
        step was timed (a shape's first round is not, nor one where a head first caught
        up on a prompt), then none until a second row count was. One: a step costs the
        heads' weights read, about the same for one sequence's row as for four, and its
        verify times a second row count as well as theirs would; every
        sequence drafting made four clients' first rounds 16-row verifies, each after
        four heads' catching up, and at temperature 1 (drafts accepted 0.36) a fresh
        server's four clients ran at 0.89-0.93x MTP off (bench model, F16)."""
        N = len(seqs)
        costs = self.costs if len(self.costs.verify_t.t) >= 2 else \
            self._lender(N, any(p.samples for p in seqs))
        if costs is not None:
            # the verify is costed: a copy drafts the length its rows are worth. The heads'
            # steps play no part in that, and where only copies drafted they were never
            # timed: such an engine planned its copies as below for good (an agent's
            # summaries on the bench model's Q4_K_M: a 63-row verify, ~300 ms, for an
            # expected 1.4 to 8 tokens, in the first rounds of each turn)
            with self._costed_by(costs):
                out, _, rows = self._choose(seqs, [0] * N, [p.accept for p in seqs], self.max_rows)
        else:
            out, rows = [0] * N, 0
            for j, p in enumerate(seqs):
                # a copy is worth its rows whatever they cost yet: a token and a half a round or more
                m = min(len(p.context or ()), self.max_rows - N - rows)
                if m > 0 and expected_tokens(p.context, m) >= 1.5:
                    rows += m
                    p.use, p.n_forced = "context", m
                    out[j] = m
        room = self.max_rows - N - rows
        if room > 0 and len(self.costs.step_t.t) < self.n_draft and self.costs.explored < self.EXPLORE_DRAFTING:
            able = [j for j, (p, c) in enumerate(zip(seqs, caps)) if not out[j] and c > 0 and c >= p.n_min]
            if able:
                self.costs.explored += 1
                j = min(able, key=lambda j: seqs[j].behind)  # the least to catch up on
                out[j] = min(self.n_draft, caps[j], room)
        return out

    def _lender(self, n_seqs: int, sampled: bool, alike: bool = False) -> RoundCosts | None:
        """The known table a new one is planned by until it knows its own costs: the one
        nearest in sequences (a round's cost is its rows', whoever they are: on the bench
        model, 16 rows cost the same as one sequence's or as 13 of one and 1 of three
        others, Q4_K_M and F16), of rounds that sample where this one does (``alike``:
        only such a one; a sampled draft costs more than a greedy one's row). Planned as
        if nothing were timed, the first rounds of two or three clients (four clients'
        requests ending one by one) copied the whole proposal, a 56-row verify for the
        1.5 tokens it was worth: in-process, eight requests at four clients (Q4_K_M,
        t=0) lost ~0.8 s of ~12 s so, and ran at 0.92-0.95x plain decoding's speed,
        1.02x costed by their nearest table (rounds priced at the runs' median cost of
        their shape, the machine's drift left out); and at temperature 1 one sequence
        drafted n-max to time the heads, again (F16: 12 rounds in 3 runs at 0.6-0.8x
        plain decoding's rate)."""
        known = [(abs(k[0] - n_seqs), k[1] != sampled, c) for k, c in self._tables.items()
                 if c.known and c is not self.costs and (not alike or k[1] == sampled)]
        return min(known, key=lambda x: x[:2])[2] if known else None

    @contextlib.contextmanager
    def _costed_by(self, costs: RoundCosts):  # noqa: ANN202 - a context manager
        """Plans made inside are costed by ``costs`` (the round's own table, or a
        lender's); the round's timings still go to its own table."""
        own, self.costs = self.costs, costs
        try:
            yield
        finally:
            self.costs = own

    #: the lengths a context draft is planned at (and any shorter whole proposal): few
    #: row counts, each timed often enough to be costed (and few graph shapes to keep)
    CONTEXT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 62)

    def _choose(self, seqs: Sequence[SeqPolicy], caps: Sequence[int], accepts: list[list[float]],
                max_rows: int) -> tuple[list[int], float, int]:
        """Per sequence with a context proposal, what it drafts from: the heads (left to
        the plan below), the context (its length fixed here: returned), or the context
        extended by the heads (``accepts`` takes the context's first chances). Each
        choice by the rate it would give the round alone with the other sequences
        drafting nothing, on the same verify-cost table as the heads'. Returns the fixed
        lengths (0 where the plan chooses) and the tokens and rows they add."""
        costs, N = self.costs, len(seqs)
        fixed = [0] * N
        tokens, rows = 0.0, 0
        steps = [0.0]
        for d in range(self.n_draft):
            steps.append(steps[-1] + costs.step(d))
        plain = N / costs.verify(N)
        others = N - 1.0  # the tokens the other sequences' rows bring, drafting nothing
        edge = self.NO_DRAFT_EDGE_SAMPLED if all(p.samples for p in seqs) else self.NO_DRAFT_EDGE
        for j, p in enumerate(seqs):
            ctx = p.context
            if not ctx:
                continue
            room = max(0, min(len(ctx), max_rows - N - rows))
            # the heads: their best depth (caught up first if they sat out)
            resume = self.costs.catch_up(p.behind) / SeqPolicy.HOLD_ROUNDS if p.behind and not p.last else 0.0
            best, kind, m_best = plain * edge, "none", 0
            for n in range(1, min(caps[j], self.n_draft) + 1):
                r = (others + expected_tokens(accepts[j], n)) / (costs.verify(N + n) + steps[n] + resume)
                if r > best:
                    best, kind, m_best = r, "heads", n
            for m in self.CONTEXT_LENGTHS + (room,):
                if 1 <= m <= room:
                    r = (others + expected_tokens(ctx, m)) / costs.verify(N + m)
                    if r > best:
                        best, kind, m_best = r, "context", m
            # the context's first m tokens, then the heads' drafts from depth m on
            for m in range(1, min(room, caps[j], self.n_draft)):
                chain = ctx[:m] + accepts[j][m:]
                for n in range(m + 1, min(caps[j], self.n_draft) + 1):
                    r = (others + expected_tokens(chain, n)) / (costs.verify(N + n) + steps[n] + resume)
                    if r > best:
                        best, kind, m_best = r, "extend", m
            if kind == "context":
                p.use, p.n_forced = "context", m_best
                fixed[j] = m_best
                tokens += expected_tokens(ctx, m_best) - 1.0
                rows += m_best
            elif kind == "extend":
                p.use, p.n_forced = "extend", m_best
                accepts[j] = ctx[:m_best] + accepts[j][m_best:]
        return fixed, tokens, rows

    def _best_plan(self, seqs: Sequence[SeqPolicy], caps: Sequence[int]) -> list[int]:
        costs = self.costs
        N = len(seqs)
        accepts = [p.accept for p in seqs]
        fixed, fixed_tokens, fixed_rows = self._choose(seqs, caps, accepts, self.max_rows)
        if fixed_rows:
            caps = [0 if f else c for c, f in zip(caps, fixed)]
            # the heads' rows must fit beside the context's
            caps = [min(c, max(0, self.max_rows - N - fixed_rows)) for c in caps]
        best: tuple[float, int, int] | None = None  # (rate, D, rows)
        options: dict[tuple[int, int], tuple[float, list[int]]] = {}
        step_sum = 0.0
        resume = self._resume_costs(seqs)
        # (a round with a greedy sequence in it keeps the greedy edge: its gains count)
        edge = self.NO_DRAFT_EDGE_SAMPLED if all(p.samples for p in seqs) else self.NO_DRAFT_EDGE
        for D in range(self.n_draft + 1):
            if D:
                step_sum += costs.step(D - 1)
            forced, gains = self._gains(seqs, caps, accepts, D)
            if forced is None:
                continue
            n = [max(k, f) for k, f in zip(forced, fixed)]
            tokens = N + fixed_tokens + sum(sum(g for g, _ in chain[:k]) for chain, k in zip(gains, forced))
            rows = N + fixed_rows + sum(forced)
            extra = sum(c for c, k in zip(resume, forced) if k)
            # the next gains in order: largest first across sequences (each sequence's
            # gains shrink with depth, so taking them in order keeps each one a prefix)
            heads = [(chain[k][0], s) for s, (chain, k) in enumerate(zip(gains, forced)) if k < len(chain)]
            while True:
                rate = tokens / (costs.verify(rows) + step_sum + extra)
                if D == 0 and not fixed_rows:
                    rate *= edge
                options[(D, rows)] = (rate, list(n))
                if best is None or rate > best[0]:
                    best = (rate, D, rows)
                if not heads:
                    break
                g, s = max(heads)
                heads.remove((g, s))
                k = n[s]
                step = max(1, seqs[s].n_min - k) if k == 0 else 1
                if k == 0:
                    extra += resume[s]
                for j in range(k, min(k + step, len(gains[s]))):
                    tokens += gains[s][j][0]
                rows += min(step, len(gains[s]) - k)
                n[s] = min(k + step, len(gains[s]))
                if n[s] < len(gains[s]):
                    heads.append((gains[s][n[s]][0], s))
        if best is None:
            return [0] * N
        # no drafts, and drafting not even close to paying: the next rounds need no plan
        plain = options.get((0, N), (0.0,))[0] / edge if not fixed_rows else 0.0
        drafting = max((o[0] for k, o in options.items() if k[1] > N), default=0.0)
        quiet = best[2] == N and plain > 0 and drafting < self.QUIET_BELOW * plain
        _, D, rows = best
        # hysteresis: the rows planned last round stay while they are within a few
        # percent (switching is not free: heads left behind catch up later)
        if self._last is not None and self._last[0] == N:
            keep = [(o[0], k) for k, o in options.items() if k[1] == self._last[1]]
            if keep:
                r, k = max(keep)
                if r >= self.HYSTERESIS * best[0]:
                    D, rows = k
        chosen = (D, rows)
        if self._probe_again is not None:
            # a probe of a row count never decoded before: its first round only warmed it up
            chosen, self._probe_again = self._probe_again, None
            if chosen not in options:
                chosen = (D, rows)
            self._probing = True
        elif self.rounds >= self._next_probe:
            chosen = self._probe_plan(options, chosen)
            self._probing = True
            if chosen[1] not in self.costs.verify_t.warm:
                self._probe_again = chosen
        elif self._probe is not None and not any(p.hold for p in seqs):
            # the first round after a probe (and the drafting it started): did it win?
            cap = self.max_probe_every
            if self.gate and all(p.samples for p in seqs):
                cap *= self.SAMPLED_PROBE_STRETCH
            self.gap = self.probe_every if rows == self._probe else min(2 * self.gap, cap)
            self._probe = None
        self._last = (N, chosen[1])
        self._quiet = self.QUIET_ROUNDS - 1 if quiet and chosen[1] == N and not self._probing else 0
        self._quiet_seqs = tuple(seqs)
        self._accepts = accepts
        self.planned_rate, self.planned_rows = options[chosen][0], chosen[1]
        return options[chosen][1]

    def _resume_costs(self, seqs: Sequence[SeqPolicy]) -> list[float]:
        """Per sequence, what drafting this round adds besides its rows and steps: a
        sequence that sat out drafting rounds first has its heads decode the rows they
        missed (up to mtp's MAX_CATCH_UP each), a cost the round's timings leave out
        (that step is untimed), spread over the HOLD_ROUNDS rounds it then drafts at
        least. Up to 768 rows at ~0.05 ms each: a quarter of a round for four rounds."""
        return [self.costs.catch_up(p.behind) / SeqPolicy.HOLD_ROUNDS if p.behind and not p.last else 0.0
                for p in seqs]

    #: a probe tries plans whose estimated rate is within this share of the best
    PROBE_WITHIN = 0.85

    def _probe_plan(self, options: dict[tuple[int, int], tuple[float, list[int]]],
                    chosen: tuple[int, int]) -> tuple[int, int]:
        """Another row count than the chosen plan's, among the plans estimated close to
        the best (one row more or fewer when none is): the one whose own estimate is the
        oldest, at the best depth for it. A row count is timed only when a plan uses
        it, so without probes an estimate made in a busy moment (too dear) would keep
        its plan out for good; one row either side alone never reaches the plans two
        rows away (one draft against three)."""
        self._next_probe = self.rounds + self.gap
        rows = chosen[1]
        top = max(o[0] for o in options.values())
        near = {k[1] for k, o in options.items() if k[1] != rows and o[0] >= self.PROBE_WITHIN * top}
        cands = sorted(near) or [r for r in (rows - 1, rows + 1) if any(k[1] == r for k in options)]
        if not cands:
            return chosen
        T = self.costs.verify_t
        r = min(cands, key=lambda x: T.weight(x, self.costs.rounds))
        self._probe = r
        return max((k for k in options if k[1] == r), key=lambda k: options[k][0])

    @staticmethod
    def _gains(seqs: Sequence[SeqPolicy], caps: Sequence[int], accepts: Sequence[list[float]],
               D: int) -> tuple[list[int] | None, list[list[tuple[float, int]]]]:
        """Per sequence, what each draft up to depth D adds to its expected tokens
        (a_1, a_1 a_2, ...), and the drafts it must make (a sequence that started
        drafting again holds on); None when no plan of depth D exists."""
        forced: list[int] = []
        gains: list[list[tuple[float, int]]] = []
        for p, cap, acc in zip(seqs, caps, accepts):
            m = min(cap, D)
            if m < p.n_min:
                m = 0
            chain, g = [], 1.0
            for d in range(m):
                g *= acc[d]
                chain.append((g, d))
            gains.append(chain)
            if p.hold and cap >= p.n_min and not m:
                return None, gains  # it must draft: a plan this shallow cannot have it
            forced.append(min(p.n_min, m) if p.hold else 0)
        return forced, gains

    # -- what rounds cost --------------------------------------------------------------

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        """A head caught up on ``rows`` rows it missed, in ``seconds``."""
        self.costs.observe_catch_up(rows, seconds)

    def observe_round(self, rows: int, verify_s: float, steps_s: Sequence[float | None]) -> None:
        """A round's timings: its verify part (``rows`` rows) and each draft step
        (None: not timed, e.g. a head caught up on rows it had skipped)."""
        if rows > 0 and math.isfinite(verify_s):
            self.costs.observe_verify(rows, verify_s)
        for i, t in enumerate(steps_s):
            if t is not None:
                self.costs.observe_step(i, t)
