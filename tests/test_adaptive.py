"""The draft-length plan (adaptive.py) against costs and acceptances given by hand.

A simulated engine: each round the planner plans every sequence's length, the round
costs what ``verify(R)`` and the draft steps say, and each draft is accepted with its
depth's probability. No timing of the machine: the tests assert what the plan does
with given costs, which is where it could go wrong."""
from __future__ import annotations

import random

import numpy as np
import math

import pytest

from stepmtp.adaptive import SeqPolicy, ConfidenceRecord, DraftPlanner, RoundCosts, _Timings, regime

# a CPU's costs on the bench model (x a 1-row decode): verify rows cost, heads are cheap
CPU = {1: 1.0, 2: 1.61, 3: 2.06, 4: 2.52}
# temperature 0 on the bench model: acceptance per depth
T0 = (0.87, 0.86, 0.92)


def cpu_verify(rows: int) -> float:
    return CPU.get(rows, 0.55 + 0.49 * rows)


def simulate(planner: DraftPlanner, accepts, rounds: int, verify=cpu_verify, step=0.05, caps=None, seed=0,
             keys=None):
    """Run ``rounds`` rounds of len(accepts) sequences (accepts[s][d]: the chance sequence
    s's draft d is accepted given the ones before); the lengths planned, per round."""
    rng = random.Random(seed)
    n = len(accepts(0) if callable(accepts) else accepts)
    pols = [planner.policy(keys[s] if keys else regime(True, 0.0)) for s in range(n)]
    out = []
    for r in range(rounds):
        acc = accepts(r) if callable(accepts) else accepts
        lens = planner.plan(pols, caps or [planner.n_draft] * n)
        out.append(lens)
        rows = sum(k + 1 for k in lens)
        planner.observe_round(rows, verify(rows), [step] * max(lens, default=0))
        for p, k, a in zip(pols, lens, acc):
            got = 0
            while got < k and rng.random() < a[got]:
                got += 1
            p.observe(k, got)
    return out


def verifies(costs: RoundCosts, timed) -> None:
    """Verifies of (rows, seconds) in turn, a round each."""
    for rows, t in timed:
        costs.rounds += 1
        costs.observe_verify(rows, t)


def share(plans, want) -> float:
    return sum(p == want for p in plans) / len(plans)


def expected(plan, accepts, verify=cpu_verify, step=0.05) -> tuple[float, float]:
    """(expected tokens, cost) of one round of this plan."""
    tokens = 0.0
    for n, a in zip(plan, accepts):
        tokens += 1 + sum(float(np.prod(a[: d + 1])) for d in range(n))
    return tokens, verify(sum(n + 1 for n in plan)) + step * max(plan, default=0)


def efficiency(plans, accepts, verify=cpu_verify, step=0.05, n_max=3) -> float:
    """Tokens per second of the plans made, over the best fixed plan's."""
    import itertools

    got = [expected(p, accepts, verify, step) for p in plans]
    best = max(t / c for t, c in (expected(list(p), accepts, verify, step)
                                  for p in itertools.product(range(n_max + 1), repeat=len(accepts))))
    return sum(t for t, _ in got) / sum(c for _, c in got) / best


def test_one_sequence_drafts_the_length_that_pays_most():
    acc = [(0.87, 0.75, 0.69)]  # E[tokens] / cost for n = 0..3: 1.00, 1.13, 1.17, 1.11
    plans = simulate(DraftPlanner(3), acc, 1000)
    assert share(plans[50:], [2]) > 0.75, plans[-20:]
    assert efficiency(plans[50:], acc) > 0.98


def test_costs_are_learned_by_rows_from_the_rounds():
    p = DraftPlanner(3)
    simulate(p, [T0], 300)
    c = p.costs
    rows = sum(k + 1 for k in simulate(p, [T0], 1)[0])
    assert c.verify(rows) == pytest.approx(cpu_verify(rows), rel=0.02)  # in use: measured
    assert c.verify(1) == pytest.approx(1.0, rel=0.2)  # timed early on, then mostly the line's
    assert c.step(0) == pytest.approx(0.05)


def test_plain_decoding_where_drafts_are_rarely_accepted():
    # at temperature 1 a head's first draft is accepted ~45%: 1.45 tokens for 1.66 decodes
    acc = [(0.45, 0.4, 0.4)]
    plans = simulate(DraftPlanner(3), acc, 1000)
    assert share(plans[50:], [0]) > 0.9
    assert efficiency(plans[50:], acc) > 0.98


def test_a_sequence_far_behind_drafts_again_only_when_it_pays_for_the_catch_up():
    """A sequence that sat out drafting has its heads decode every row they missed
    first: a plan that resumes it pays for that (spread over the rounds it then
    drafts), one that drafts on does not; nothing is charged until a catch-up was
    timed."""
    p = DraftPlanner(3, probe_every=10**6)
    simulate(p, [T0], 300)  # drafting 3 pays ~24% here

    def plan(behind: int, drafted_last: bool = False) -> list[int]:
        seq = p.policy(regime(True, 0.0))
        seq.behind = behind
        seq.last = 3 if drafted_last else 0
        return p.plan([seq], [3])

    assert plan(768) == [3]  # three heads x 256 rows behind, no catch-up timed yet: no charge
    p.observe_catch_up(64, 64 * 0.01)  # a row a hundredth of a decode
    p.observe_catch_up(64, 64 * 0.01)  # (the first of a key is a warm-up)
    assert p.costs.catch_up(768) == pytest.approx(7.68)
    assert plan(768) == [0]  # 1.92 a round for 4 rounds: plain pays more
    assert plan(12) == [3]  # a few rows behind: it drafts
    assert plan(768, drafted_last=True) == [3]  # drafting on, caught up as it goes


def test_a_gpu_where_rows_are_nearly_free_drafts_long():
    flat = lambda r: 1.0 + 0.02 * (r - 1)  # noqa: E731
    plans = simulate(DraftPlanner(3), [(0.7, 0.7, 0.7)], 300, verify=flat)
    assert share(plans[50:], [3]) > 0.9


def test_several_sequences_share_the_cost_of_the_rows():
    """Four sequences on a CPU: a verify of R rows costs 0.6 + 0.4 R. Drafting one token
    each pays (7.5 tokens for 3.85 vs 4 for 2.2); deeper drafts cost more than they bring,
    though for one sequence alone n = 2 would pay (its rows cost 1.0, 1.4, 1.8)."""
    rows = lambda r: 0.6 + 0.4 * r  # noqa: E731
    acc = [(0.87, 0.75, 0.69)] * 4
    plans = simulate(DraftPlanner(3), acc, 500, verify=rows)
    assert np.mean([sum(p) for p in plans[100:]]) == pytest.approx(4, abs=1), plans[-10:]
    assert efficiency(plans[100:], acc, rows) > 0.97
    alone = simulate(DraftPlanner(3), acc[:1], 1000, verify=rows)
    assert share(alone[100:], [2]) > 0.5 and efficiency(alone[100:], acc[:1], rows) > 0.98


def test_rows_go_to_the_sequences_whose_drafts_are_accepted():
    good, bad = (0.95, 0.95, 0.95), (0.1, 0.1, 0.1)
    plans = simulate(DraftPlanner(3), [good, bad, good, bad], 500, verify=lambda r: 0.6 + 0.4 * r)
    tail = plans[100:]
    assert np.mean([p[0] + p[2] for p in tail]) > 2.5  # the predictable ones draft
    assert np.mean([p[1] + p[3] for p in tail]) < 0.4  # the others hardly do (of 6)


def test_drafting_stops_in_a_bad_stretch_and_resumes_by_itself():
    def acc(r):
        return [(0.0, 0.0, 0.0)] if 100 <= r < 200 else [(0.95, 0.95, 0.95)]

    plans = simulate(DraftPlanner(3, probe_every=10**6), acc, 400)
    assert share(plans[150:200], [0]) > 0.6  # stopped
    assert share(plans[300:], [0]) < 0.1  # and drafts again, without waiting for a probe


def test_an_engines_first_unlucky_rounds_do_not_settle_it():
    """Every draft of the engine's first rounds (timing the lengths) is rejected; the
    text's drafts are accepted 87% afterwards. Later sequences must draft."""
    p = DraftPlanner(3)
    simulate(p, [(0.0, 0.0, 0.0)], 10)
    plans = simulate(p, [T0], 400, seed=1)
    assert share(plans[100:], [0]) < 0.1


def test_acceptance_is_kept_per_sampling_regime():
    """Greedy sequences draft; sequences sampling at temperature 1 (their drafts rarely
    accepted) do not drag the greedy ones' prior down, nor the other way round."""
    p = DraftPlanner(3)
    keys = [regime(True, 0.0), regime(False, 1.0, True)]
    plans = simulate(p, [T0, (0.2, 0.2, 0.2)], 600, keys=keys, verify=lambda r: 0.6 + 0.4 * r)
    assert p.record_for(keys[0]).estimate(p.rounds)[0] > 0.8
    assert np.mean([x[0] for x in plans[100:]]) > 1.5
    assert np.mean([x[1] > 0 for x in plans[100:]]) < 0.1


def test_a_rejected_probe_drafts_one_round():
    """Where drafting does not pay, a probe times the next row count in one round, and
    goes on only when its draft was accepted: held on for four rounds always (as a
    sequence whose plan starts drafting again is), each probe cost four losing rounds,
    1-2% of plain decoding's speed at temperature 1 on the bench model."""
    p = DraftPlanner(1, probe_every=16, max_probe_every=16)
    plans = [x[0] for x in simulate(p, [(0.3,)], 1000)]
    starts = [i for i in range(50, len(plans) - 1) if plans[i] and not plans[i - 1]]
    assert len(starts) > 40  # a probe every 16 rounds...
    one = sum(plans[i + 1] == 0 for i in starts) / len(starts)
    assert 0.55 < one < 0.85  # ...one round when rejected (0.7), four when accepted
    assert share(plans[50:], 0) > 0.9  # and plain decoding otherwise


def test_a_sequence_whose_plan_drafts_again_holds_on_a_few_rounds():
    """No probes: what the sequence drafted fades from the record until drafting looks
    worth it again; then it drafts at least four rounds, its drafts rejected or not (one
    draft after a pause says little)."""
    p = DraftPlanner(1, probe_every=10**6)
    plans = [x[0] for x in simulate(p, lambda r: [(0.95,)] if r < 50 else [(0.0,)], 6000)]
    starts = [i for i in range(60, len(plans) - 4) if plans[i] and not plans[i - 1]]
    assert starts  # it drafts again by itself...
    assert all(plans[i : i + 4] == [1, 1, 1, 1] for i in starts)  # ...for four rounds each time
    assert share(plans[60:], 0) > 0.9


def test_caps_and_n_min_bound_the_plan():
    p = DraftPlanner(3)
    pol = [p.policy(regime(True, 0.0), n_min=2), p.policy(regime(True, 0.0))]
    for _ in range(200):
        lens = p.plan(pol, [3, 1])
        rows = sum(k + 1 for k in lens)
        p.observe_round(rows, 1.0 + 0.01 * rows, [0.01] * max(lens))
        for q, k in zip(pol, lens):
            q.observe(k, k)
        assert lens[0] in (0, 2, 3) and lens[1] <= 1


def test_probes_back_off_while_they_lose():
    p = DraftPlanner(3, probe_every=8, max_probe_every=256)
    simulate(p, [(0.05, 0.05, 0.05)], 1500)
    assert p.gap == 256


def test_a_machine_that_slows_down_keeps_the_costs_ratios():
    """A shared machine's speed drifts; the row count in use is timed every round, the
    others only by probes: in seconds a fresh 4-row verify was compared with a 1-row
    one from a faster minute (and the reverse), and the plan stopped drafting where
    drafting paid."""
    c = RoundCosts(1)
    for rows, t in ((1, 1.0), (2, 2.0)):
        for _ in range(12):  # the first of each is a warm-up, untimed
            c.rounds += 1
            c.observe_verify(rows, t)
    for _ in range(30):  # 1.5x slower, and only 2 rows timed
        c.rounds += 1
        c.observe_verify(2, 3.0)
    assert c.speed == pytest.approx(1.5)
    assert c.verify(2) / c.verify(1) == pytest.approx(2.0)  # seconds would say 3
    c.rounds += 1
    c.observe_verify(1, 1.5)  # a probe at the slower speed agrees
    assert c.verify(2) / c.verify(1) == pytest.approx(2.0)


def test_a_row_count_whose_cost_changes_is_told_from_the_machine():
    """Two row counts timed in turn, one of them now 40% cheaper: the ratio follows
    (a speed taken from them alike would call it the machine's, and keep 2:1)."""
    c = RoundCosts(1)
    verifies(c, [(1, 1.0)] * 12 + [(2, 2.0)] * 12)
    verifies(c, [(1, 1.0), (1, 1.0), (2, 1.2), (2, 1.2)] * 12)
    assert c.verify(2) / c.verify(1) < 1.4
    c.rounds += 100
    c.observe_verify(1, 0.5)  # not timed for 100 rounds: its old samples go (it was 1.0)
    assert c.verify(1) / c.verify(2) < 0.6


def test_more_rows_never_cost_less():
    """A row count's estimate from another minute (or a short stretch's noise) that puts
    it below fewer rows' would have the plan draft where it loses: the estimates used
    rise with rows, an inversion pooled by the samples behind each side (taking the
    larger instead let one sample of a count four sequences pass through now and then
    raise every larger count's cost)."""
    c = RoundCosts(3)
    verifies(c, [(1, 1.0)] * 6 + [(2, 1.6)] * 6 + [(3, 1.3)] * 6 + [(4, 2.5)] * 6)
    assert c.verify(3) == pytest.approx(c.verify(2))
    assert 1.3 < c.verify(3) < 1.6  # pooled: neither count's alone
    assert c.verify(4) > c.verify(3)
    # a count timed once long ago yields to one timed often (four sequences: counts
    # between the plain step's and the plans' come and go as requests do)
    c = RoundCosts(3)
    verifies(c, [(4, 2.5)] * 10 + [(7, 5.0)] * 2)
    c.rounds += 200
    verifies(c, [(8, 3.7)] * 10)
    assert c.verify(8) == pytest.approx(3.7, rel=0.05)
    assert c.verify(7) <= c.verify(8)


def test_a_verify_after_a_change_of_rows_does_not_set_the_speed():
    """llama.cpp builds its graph again for a batch of another shape (~15% of a 1-row
    decode on the bench model): the first verify after a change is slower, but not
    because the machine is. Taken as the machine's speed, a 1-row verify after each
    short drafting stretch made the row count in use look cheaper and cheaper."""
    c = RoundCosts(1)
    verifies(c, [(1, 1.0)] * 6 + [(2, 1.6)] * 6)
    verifies(c, [(2, 1.9), (2, 1.6), (1, 1.3), (1, 1.0)] * 40)  # the first after a change: +0.3
    assert c.speed == pytest.approx(1.0)
    assert 1.6 <= c.verify(2) / c.verify(1) <= 1.9


@pytest.mark.parametrize("ref2", [1.3, 2.2])
def test_the_speed_is_read_off_the_row_count_in_use(ref2):
    """One client at temperature 1 verifies 1 row most rounds and 2 in short stretches:
    the 2-row count's reference, from a few samples of a faster (or slower) minute, pulled
    the machine's speed away from the count in use while it was timed, and its cost came
    out 4-5% off here (1.45-1.6x a 1-row verify on the bench model, where it costs
    1.7-1.8x: one client drafted at a loss)."""
    c = RoundCosts(1)
    verifies(c, [(1, 1.0)] * 6 + [(2, ref2)] * 6)
    verifies(c, ([(1, 1.0)] * 8 + [(2, 1.7)] * 4) * 10)
    assert c.speed == pytest.approx(1.0)
    assert c.verify(2) / c.verify(1) == pytest.approx(1.7, rel=0.02)


def test_a_count_that_leads_again_after_a_change_of_load_keeps_the_speed():
    """Four clients verify 2 rows at 1.3 (a 1-row verify at 1.0); then one client verifies
    1 row most rounds and 2 rows at 1.9 in drafting stretches. When 2 rows lead again,
    its reference from the four clients' minutes read the machine as 1.46x slower and
    costed 2 rows at 1.3x one (the plan drafted at a loss); it costs 1.9x."""
    c = RoundCosts(1)
    verifies(c, [(1, 1.0)] * 6 + [(2, 1.3)] * 30)
    verifies(c, [(1, 1.0)] * 40 + ([(2, 1.9)] * 4 + [(1, 1.0)] * 8) * 3)
    verifies(c, [(2, 1.9)] * 30 + [(1, 1.0)] * 2 + [(2, 1.9)] * 4)
    assert c.speed == pytest.approx(1.0, rel=0.05)
    assert c.verify(2) / c.verify(1) == pytest.approx(1.9, rel=0.05)


def test_preempted_rounds_move_no_estimate():
    """A 2-core VM's spikes (1.5-3x, now and then 100x) must not make a plan look
    dearer than it is: a mean moved by them chose one draft where three paid."""
    c = RoundCosts(1)
    for i in range(80):
        rows = 1 + i % 2
        spike = 500.0 if i == 40 else 3.0 if i % 8 in (5, 6) else 1.0  # sat out 0.5 s; a quarter 3x
        c.rounds += 1
        c.observe_verify(rows, rows * spike)
        if i > 8:
            assert c.verify(2) / c.verify(1) == pytest.approx(2.0, rel=0.1)


def test_unmeasured_row_counts_are_read_off_the_line_through_the_measured():
    """Between two measured row counts, on their line; past the longest, on the power
    law through the shortest and the longest (rows that share weights cost less each:
    on the line through the heads' short verifies, a copy's long draft looked so dear
    that it was never tried, so never measured)."""
    c = RoundCosts(3)
    for rows, t in ((1, 1.0), (5, 3.0)):
        for _ in range(5):
            c.rounds += 1
            c.observe_verify(rows, t)
    assert c.verify(3) == pytest.approx(2.0, rel=0.01)
    p = math.log(3.0) / math.log(5.0)
    assert c.verify(9) == pytest.approx(3.0 * (9 / 5) ** p, rel=0.01)
    assert 3.0 < c.verify(9) < 5.0 and c.verify(20) > c.verify(9)
    # rows that cost alike are taken as cheaper past the longest (a power law of at
    # most MAX_EXPONENT: the verify that tries them corrects it); never below 1/2
    c = RoundCosts(3)
    verifies(c, [(1, 1.0)] * 5 + [(5, 5.0)] * 5)
    assert c.verify(9) == pytest.approx(5.0 * (9 / 5) ** RoundCosts.MAX_EXPONENT, rel=0.01)
    c = RoundCosts(3)
    verifies(c, [(1, 1.0)] * 5 + [(5, 1.05)] * 5)
    assert c.verify(20) == pytest.approx(1.05 * 2.0, rel=0.01)


def test_sampling_sequences_draft_only_for_a_larger_gain():
    """Drafts accepted 0.82 with a 2-row verify 1.61x a 1-row one: 1.10x plain decoding,
    expected. Greedy sequences draft; sequences that sample (their records stray further
    from their rate, and draft by chance) must expect more than that."""
    def drafting(key):
        p = DraftPlanner(1)
        pol = [p.policy(key)]
        rng = random.Random(0)
        lens = []
        for _ in range(1500):
            k = p.plan(pol, [1])[0]
            lens.append(k)
            p.observe_round(k + 1, cpu_verify(k + 1), [0.05] * k)
            pol[0].observe(k, int(k and rng.random() < 0.82))
        return share(lens[300:], 1)

    greedy, sampled = drafting(regime(True, 0.0)), drafting(regime(False, 1.0, True))
    assert greedy > 0.75 and sampled < 0.5, (greedy, sampled)  # 0.91 and 0.30 (both 0.91 at one edge)


def test_the_heads_confidence_moves_a_drafts_odds_by_its_bin():
    rec = ConfidenceRecord(3)
    rng = random.Random(0)
    for _ in range(400):
        rec.add(0, 0.15, rng.random() < 0.4)
        rec.add(0, 0.95, rng.random() < 0.98)
    assert rec.odds(0, 0.12) < -0.5 and rec.odds(0, 0.93) > 0.5
    assert rec.odds(0, 0.6) == pytest.approx(0.0)  # a bin never drafted: the depth's mean
    assert rec.odds(1, 0.15) == pytest.approx(0.0)  # nor is another depth's record moved


def _gated_round(verify, confident: bool, gate: bool = True):
    """A planner that learnt the CPU's (or another machine's) costs and that its heads'
    unsure drafts (confidence 0.15) are accepted 0.3 of the time, their sure ones
    (0.95) 0.97; one round's plan and the gate's decision at depth 0."""
    p = DraftPlanner(3)
    simulate(p, [T0], 300, verify=verify)
    pol = p.policy(regime(True, 0.0))
    rec = p.record_for(regime(True, 0.0)).confidence
    rng = random.Random(1)
    for _ in range(300):
        rec.add(0, 0.15, rng.random() < 0.3)
        rec.add(0, 0.95, rng.random() < 0.97)
    p.gate = gate
    n = p.plan([pol], [3])[0]
    return n, pol.keep(0, 0.95 if confident else 0.15, n)


def test_a_draft_its_head_was_unsure_of_is_not_verified_where_rows_cost():
    n, kept = _gated_round(cpu_verify, confident=False)
    assert n == 3 and not kept  # planned at the mean, 0.87; this one is a coin of 0.3
    assert _gated_round(cpu_verify, confident=True) == (3, True)
    assert _gated_round(cpu_verify, confident=False, gate=False) == (3, True)


def test_where_rows_are_nearly_free_unsure_drafts_are_verified_too():
    assert _gated_round(lambda rows: 1.0 + 0.01 * rows, confident=False) == (3, True)


def test_a_sampling_sequence_whose_drafts_are_gated_does_not_hold_on():
    """As above, at temperature 1 with the gate on: a start of drafting is not held on
    for four rounds (what drafting lost there was mostly such held rounds); with the
    gate off it is."""
    for gate, held in ((True, False), (False, True)):
        p = DraftPlanner(1, probe_every=10**6)
        p.gate = gate
        plans = [x[0] for x in simulate(p, lambda r: [(0.95,)] if r < 50 else [(0.0,)], 6000,
                                        keys=[regime(False, 1.0, True)])]
        starts = [i for i in range(60, len(plans) - 4) if plans[i] and not plans[i - 1]]
        assert starts
        assert all(plans[i : i + 4] == [1, 1, 1, 1] for i in starts) == held


def test_losing_probes_grow_further_apart_where_every_sequence_samples():
    """Where drafting does not pay, probes back off to every 64 rounds at temperature 0,
    and to four times that where the sequences sample (and drafts are gated)."""
    def starts(key, gate=True):
        p = DraftPlanner(1)
        p.gate = gate
        plans = [x[0] for x in simulate(p, [(0.3,)], 6000, keys=[key])]
        return sum(1 for i in range(1000, len(plans)) if plans[i] and not plans[i - 1])

    greedy, sampled = starts(regime(True, 0.0)), starts(regime(False, 1.0, True))
    assert 50 < greedy < 100  # ~5000 / 64
    assert 10 < sampled < 30  # ~5000 / 256
    assert starts(regime(False, 1.0, True), gate=False) > 50


def full_plans(planner: DraftPlanner) -> list[int]:
    """The rounds in which ``planner`` plans in full (not a quiet round), as they come."""
    calls: list[int] = []
    best = planner._best_plan

    def counted(seqs, caps, *rest):
        calls.append(planner.rounds)
        return best(seqs, caps, *rest)

    planner._best_plan = counted
    return calls


def test_rounds_after_a_plan_of_no_drafts_skip_planning_a_few_rounds():
    """A full plan that drafts nothing lets the next QUIET_ROUNDS - 1 rounds of the same
    sequences draft nothing unplanned (planning costs ~1% of such a round); a probe
    due, or another set of sequences, plans in full at once; and a sequence whose
    drafting pays again still starts by itself."""
    planner = DraftPlanner(3)
    calls = full_plans(planner)
    bad = [(0.1, 0.1, 0.1)]
    plans = simulate(planner, lambda r: bad if r < 400 else [(0.99, 0.99, 0.99)], 800)
    planned = [r for r in calls if 300 < r <= 400]
    assert share(plans[300:400], [0]) > 0.95
    assert 100 / DraftPlanner.QUIET_ROUNDS <= len(planned) < 100 / DraftPlanner.QUIET_ROUNDS + 10  # (probes)
    assert share(plans[500:], [3]) > 0.9  # drafting started again, and pays
    # a probe that falls due is planned at once
    planner.probe_every = 10**6
    planner._next_probe = planner.rounds + 3
    before = len(calls)
    p = planner.policy(regime(True, 0.0))
    planner._quiet, planner._quiet_seqs = 5, (p,)
    planner.plan([p], [3]); planner.plan([p], [3])
    assert len(calls) == before
    planner.plan([p], [3])
    assert len(calls) == before + 1
    # another sequence in the round: planned in full
    planner._quiet, planner._quiet_seqs = 5, (p,)
    planner.plan([planner.policy(regime(True, 0.0))], [3])
    assert len(calls) == before + 2


def test_a_regime_that_drafts_nothing_for_long_turns_dormant():
    """DORMANT_ROUNDS rounds of a regime without drafts outside probes make it dormant;
    one that drafts is not, and a regime never planned is not."""
    p = DraftPlanner(3)
    hot, cold = regime(False, 1.0, True), regime(True, 0.0)
    simulate(p, [(0.05, 0.05, 0.05)], DraftPlanner.DORMANT_ROUNDS + 300, keys=[hot])
    simulate(p, [T0], DraftPlanner.DORMANT_ROUNDS + 300, keys=[cold])
    assert p.dormant(hot) and not p.dormant(cold)
    assert not p.dormant(regime(False, 0.7, True))


def test_no_quiet_rounds_where_drafting_comes_close():
    """Where drafting nearly pays (within QUIET_BELOW of drafting nothing) every round
    is planned: there a noisy timing flips the plan now and then, and quiet rounds
    turned each flip into eight rounds of no drafts."""
    planner = DraftPlanner(3)
    calls = full_plans(planner)
    plans = simulate(planner, [(0.6, 0.6, 0.6)], 400)  # one draft: 1.6 tokens for 1.66 rounds
    assert share(plans[200:], [0]) > 0.8
    assert sum(1 for r in calls if r > 200) > 120  # (quiet in every round: ~200 / 8 + probes)


def test_a_regime_not_in_use_keeps_its_record():
    """A sampling regime's record fades by its own rounds: thousands of rounds of
    another regime leave what it learnt as it was (it once faded back to the optimistic
    prior meanwhile, and drafting at a loss began again at temperature 1)."""
    p = DraftPlanner(3)
    hot, cold = regime(False, 1.0, True), regime(True, 0.0)
    simulate(p, [(0.3, 0.3, 0.3)], 300, keys=[hot])
    before = p.record_for(hot).estimate(p.regime_rounds(hot))
    simulate(p, [T0], 3000, keys=[cold])
    after = p.record_for(hot).estimate(p.regime_rounds(hot))
    assert after == before and after[0] < 0.6
    assert p.regime_rounds(cold) == 3000


def _copy_costs(planner: DraftPlanner) -> None:
    """A cost table that knows long verifies: the bench model's (~0.26 one-row decodes
    a row past 16 rows, patch 0016's tiles)."""
    long = lambda r: cpu_verify(r) if r <= 4 else 2.52 + 0.3 * (r - 4)  # noqa: E731
    for _ in range(12):
        for rows in (1, 2, 3, 4, 9, 13, 17, 25, 33, 41, 49, 57, 63):
            planner.observe_round(rows, long(rows), [0.05, 0.05, 0.05])


def test_a_new_table_times_the_heads_with_one_sequence_drafting():
    """Four sequences' first rounds (their cost table unknown): one of them drafts the
    most, the one with the least to catch up on, until every draft step was timed; the
    others' rows stay one a sequence (all four drafting made 16-row verifies, each after
    four heads' catching up: a fresh server's four clients at temperature 1 ran at
    0.89-0.93x MTP off)."""
    planner = DraftPlanner(3)
    pols = [planner.policy(regime(False, 1.0)) for _ in range(4)]
    for j, p in enumerate(pols):
        p.behind = (30, 40, 5, 90)[j]
    out = planner.plan(pols, [3] * 4)
    assert out == [0, 0, 3, 0], out
    for _ in range(5):
        assert sum(k > 0 for k in out) <= 1, out
        rows = sum(out) + len(out)
        planner.observe_round(rows, 0.01 * rows, [0.001] * max(out))
        out = planner.plan(pols, [3] * 4)
    # (each row count's and depth's first sample only warms it up)
    assert planner.costs.known and sorted(planner.costs.verify_t.t) == [4, 7]


def test_a_row_count_timed_once_slow_does_not_keep_long_copies_out():
    """A 63-row verify timed once in a preempted moment (3x its cost): until the count
    has CREDIBLE_SAMPLES samples it costs at most what the trusted counts say, so a
    sure copy is still drafted long (and times it again); timed slow every time, it is
    believed and the copy goes shorter."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    costs = planner.costs_for(1)
    true = lambda r: 0.010 * r ** 0.75  # noqa: E731  (F16 on the bench model, ~)
    for rows in (1, 2, 3, 4, 9, 17):
        verifies(costs, [(rows, true(rows))] * 5)
    verifies(costs, [(63, 3 * true(63))] * 2)  # (the first sample only warms it up)
    for d in range(3):
        costs.observe_step(d, 0.0006)
        costs.observe_step(d, 0.0006)
    p = planner.policy(regime(True, 0.0))
    p.context = [0.998] * 62
    n = planner.plan([p], [3])[0]
    assert p.use == "context" and n >= 40, (p.use, n)
    verifies(costs, [(63, 3 * true(63))] * 3)
    n = planner.plan([p], [3])[0]
    assert n < 40, n


def test_a_row_count_timed_again_after_a_pause_is_not_trusted_on_one_sample():
    """A row count not timed for STALE_ROUNDS rounds starts its window again, and its
    sample count with it: one slow sample then costs it at most what the trusted
    counts say, as for a count never timed (its old samples had made it trusted, and
    the one new sample was believed: every longer copy's rows read off it)."""
    costs = DraftPlanner(3).costs_for(1)
    true = lambda r: 0.010 * r ** 0.75  # noqa: E731
    for rows in (1, 2, 3, 4, 9, 17):
        verifies(costs, [(rows, true(rows))] * 5)
    assert costs.verify(17) == pytest.approx(true(17))
    verifies(costs, [(9, true(9))] * (_Timings.STALE_ROUNDS + 1))  # 17 not timed meanwhile
    verifies(costs, [(17, 2 * true(17))])  # preempted
    assert costs.verify(17) < 1.3 * true(17), costs.verify(17) / true(17)
    verifies(costs, [(17, 2 * true(17))] * 2)  # slow every time: believed
    assert costs.verify(17) == pytest.approx(2 * true(17))


def test_copies_are_costed_before_the_heads_ever_drafted():
    """An engine whose first requests were all copies (an agent's summaries) had its
    verify timed at two row counts and no head step: its copies must still be planned
    by what their rows cost, not as while nothing was timed (there: the longest draft
    whenever it looked worth a token and a half, a 63-row verify at 30 decodes' cost)."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    costs = planner.costs_for(1)
    verifies(costs, [(1, 0.010), (63, 0.300), (1, 0.010), (63, 0.300)])
    assert not costs.known  # (no draft step timed)
    p = planner.policy(regime(True, 0.0))
    p.context = [0.4] * 62  # a short match: the copy is unlikely to hold
    n = planner.plan([p], [3])[0]
    assert n <= 3, n
    p.context = [0.995] * 62  # a long one, holding
    n = planner.plan([p], [3])[0]
    assert p.use == "context" and n >= 16 and p.n_forced == n


def test_a_new_tables_copies_are_costed_by_the_nearest_known_table():
    """Two clients left of four (their table new, nothing timed yet): a copy is costed
    by the four clients' table, not drafted whole because it is worth a token and a
    half (a 56-row verify for 1.5 tokens, Q4_K_M); a sure copy is still drafted long."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    planner.costs = planner.costs_for(4)
    long = lambda r: 0.010 * r ** 0.8  # noqa: E731  (a CPU's verifies, ~)
    for _ in range(12):
        for rows in (4, 5, 8, 12, 16, 32, 63):
            planner.observe_round(rows, long(rows), [0.001, 0.001, 0.001])
    assert planner.costs.known
    pols = [planner.policy(regime(True, 0.0)) for _ in range(2)]
    pols[1].context = [0.75] * 3 + [0.5] * 59  # worth ~1.6 tokens, whatever its length
    out = planner.plan(pols, [3, 3])
    assert not planner.costs.known  # (the two clients' own table: nothing timed)
    assert out[1] <= 8, out
    pols[1].context = [0.999] * 62
    out = planner.plan(pols, [3, 3])
    assert pols[1].use == "context" and out[1] >= 24, out


def test_a_new_table_is_planned_by_a_known_one_of_its_kind():
    """Three clients left of four, sampling (their table new): where the four clients'
    table says drafting loses, none of the three drafts to time the heads again (at
    temperature 1 that exploring drafted n-max at 0.6-0.8x plain decoding's rate); a
    table of greedy rounds does not lend to sampled ones (their drafts cost more)."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    planner.costs = planner.costs_for(4, sampled=True)
    for _ in range(12):
        for rows in (4, 5, 8, 12):
            planner.observe_round(rows, cpu_verify(rows), [0.05, 0.05, 0.05])
    assert planner.costs.known
    key = regime(False, 1.0, True)
    pols = [planner.policy(key) for _ in range(3)]
    for p in pols:
        for _ in range(40):
            p.observe(1, 0)  # drafts seldom accepted
    for _ in range(8):
        assert planner.plan(pols, [3] * 3) == [0, 0, 0]
        planner.observe_round(3, cpu_verify(3), [])
    assert not planner.costs.known  # (its own table: no step timed)
    greedy = DraftPlanner(3)
    greedy.costs = greedy.costs_for(4)
    for _ in range(12):
        for rows in (4, 5, 8, 12):
            greedy.observe_round(rows, cpu_verify(rows), [0.05, 0.05, 0.05])
    pols = [greedy.policy(key) for _ in range(3)]
    assert sum(greedy.plan(pols, [3] * 3)) == 3  # explores: one sequence drafts n-max


def test_a_noisy_short_verify_does_not_keep_long_copies_out():
    """Only the heads' short verifies timed, the longest of them in a slow minute (F16,
    ms: 1 row 12.0, 2 rows 19.8, 3 rows 24.6, 4 rows 40.4): a copy every token of which
    is accepted is still drafted long, not 2 tokens a round (the exponent through the
    two longest was 1.7, taken as 1: 63 rows at 637 ms, where they take ~250)."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    costs = planner.costs_for(1)
    for rows, ms in ((1, 12.0), (2, 19.8), (3, 24.6), (4, 40.4)):
        verifies(costs, [(rows, ms / 1e3)] * 4)
    for d in range(3):
        costs.observe_step(d, 0.0006)
        costs.observe_step(d, 0.0006)
    assert costs.known
    p = planner.policy(regime(True, 0.0))
    p.context = [0.998] * 62
    n = planner.plan([p], [3])[0]
    assert p.use == "context" and n >= 16, (p.use, n)


def test_the_plan_takes_a_copy_that_pays_and_leaves_one_that_does_not():
    """A sequence whose context proposes a copy: accepted 0.99 a token, the plan drafts it
    long from the context (no head step); accepted 0.3, the heads' drafts win; a context
    sure of its first token alone is extended by the heads."""
    planner = DraftPlanner(3)
    planner.max_rows = 63
    _copy_costs(planner)
    p = planner.policy(regime(True, 0.0))
    for _ in range(30):
        p.observe(3, 3)  # the heads do well too
    p.context = [0.99] * 62
    n = planner.plan([p], [3])[0]
    assert p.use == "context" and n >= 16 and p.n_forced == n
    p.context = [0.3] * 62
    n = planner.plan([p], [3])[0]
    assert p.use == "heads" and 1 <= n <= 3
    # heads unsure of their first draft, sure of the next ones given it: the context's
    # first token, then the heads
    class Unsure(SeqPolicy):
        accept = property(lambda self: [0.2, 0.97, 0.97])

    u = Unsure(planner, regime(True, 0.0))
    u.context = [0.999, 0.05, 0.05]
    n = planner.plan([u], [3])[0]
    assert u.use == "extend" and u.n_forced == 1 and n >= 2
    # several sequences (their own table, costed alike): the copies fill the round's
    # rows, within max_rows
    planner.costs = planner.costs_for(2)
    _copy_costs(planner)
    q = planner.policy(regime(True, 0.0))
    p.context, q.context = [0.99] * 62, [0.99] * 62
    lens = planner.plan([p, q], [3, 3])
    assert 48 <= sum(lens) and sum(lens) + 2 <= 63 and "context" in (p.use, q.use), lens
