"""The MTP3 engine: exactness against plain greedy decoding, statistics, API."""
from __future__ import annotations

import pytest

from stepmtp import Engine, SamplingParams, SpecConfig

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 40


@pytest.fixture(scope="module")
def greedy_reference(tiny):
    """Plain greedy decoding, no speculation: the output every mode must equal."""
    with Engine(tiny["embedded"], mode="none", n_ctx=512) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.stats.n_drafted == 0 and len(out.tokens) == N
    assert len(set(out.tokens)) > 3, "the tiny model should not repeat one token"
    return out


@pytest.mark.parametrize("schedule", ["fused", "reference"])
@pytest.mark.parametrize("mode", ["chain", "single"])
@pytest.mark.parametrize("n_max", [1, 2, 3])
@pytest.mark.parametrize("files", ["embedded", "split"])
def test_speculative_equals_greedy(tiny, greedy_reference, mode, n_max, files, schedule):
    kw = {"mtp_model": tiny["mtp"]} if files == "split" else {}
    model = tiny["trunk"] if files == "split" else tiny["embedded"]
    with Engine(model, mode=mode, n_max=n_max, n_ctx=512, schedule=schedule, debug=True, **kw) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    assert out.text == greedy_reference.text
    st = out.stats
    assert st.n_drafted > 0
    assert st.n_accepted == sum(st.accepted_per_depth)
    assert st.n_drafted == sum(st.drafted_per_depth)
    for d in range(3):
        assert st.accepted_per_depth[d] <= st.drafted_per_depth[d]
    # p_min 0: every round drafts the full length
    depth = min(n_max, 3) if mode == "chain" else n_max
    assert st.drafted_per_depth[depth - 1] == st.n_rounds
    if depth < 3:
        assert st.drafted_per_depth[depth] == 0


@pytest.mark.parametrize("schedule", ["fused", "reference"])
def test_chain_caps_draft_length_at_head_count_and_counts_decodes(tiny, greedy_reference, schedule):
    with Engine(tiny["embedded"], mode="chain", n_max=8, n_ctx=512, schedule=schedule) as eng:
        assert eng.driver.n_draft == 3
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
        # a 512-cell context holds the window plus a ubatch: no checkpoints to keep
        assert not eng.target.swa_trimmed and not eng.driver.n_checkpoints
    st = out.stats
    assert out.tokens == greedy_reference.tokens
    assert st.n_drafted == 3 * st.n_rounds
    # the prompt: its last 4 tokens decoded apart all the same, as llama-server does
    # (where it makes its context checkpoints, whatever the cache)
    n_chunks = st.n_prompt_target_decodes
    assert n_chunks == 2 and st.n_target_decodes == st.n_rounds + n_chunks
    if schedule == "reference":
        # per round: 3 draft decodes, 1 target decode, 3 process decodes; + the prompt's
        assert st.n_draft_decodes == 6 * st.n_rounds + 3 * n_chunks == 6 * st.n_rounds + st.n_prompt_draft_decodes
    else:
        # per round: one decode per head; the prompt rides along with the first ones
        assert st.n_draft_decodes == 3 * st.n_rounds and st.n_prompt_draft_decodes == 0


@pytest.mark.parametrize("schedule", ["fused", "reference"])
def test_single_mode_loops_head_zero(tiny, greedy_reference, schedule):
    with Engine(tiny["embedded"], mode="single", n_max=5, n_ctx=512, schedule=schedule) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    st = out.stats
    assert out.tokens == greedy_reference.tokens
    assert st.n_drafted == 5 * st.n_rounds
    per_round = 6 if schedule == "reference" else 5  # 5 drafts (+ 1 process)
    assert st.n_draft_decodes == per_round * st.n_rounds + (schedule == "reference") * st.n_prompt_target_decodes


def test_p_min_and_n_min(tiny, greedy_reference):
    with Engine(tiny["embedded"], mode="chain", n_max=3, p_min=1.0, n_ctx=512) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    assert out.stats.n_drafted == 0  # no draft is ever that sure
    with Engine(tiny["embedded"], mode="chain", n_max=3, n_min=4, n_ctx=512) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens and out.stats.n_drafted == 0


@pytest.mark.parametrize("n_batch,n_ubatch", [(16, 16), (16, 8), (7, 5)])
def test_long_prompt_in_chunks(tiny, n_batch, n_ubatch):
    prompt = PROMPT * 6
    outs = {}
    for mode, schedule in (("none", "fused"), ("chain", "fused"), ("chain", "reference"), ("single", "fused")):
        with Engine(tiny["embedded"], mode=mode, schedule=schedule, n_ctx=1024, n_batch=n_batch,
                    n_ubatch=n_ubatch, debug=True) as eng:
            assert len(eng.tokenize(prompt)) > 48
            outs[mode, schedule] = eng.generate(prompt, n_predict=24, temperature=0).tokens
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_prompt_near_the_context_limit(tiny):
    with Engine(tiny["embedded"], mode="none", n_ctx=256) as eng:
        n_ctx = eng.n_ctx
        base = eng.tokenize(PROMPT * 40)[: n_ctx - 3]
        want = eng.generate(base, n_predict=-1, temperature=0)
    for mode in ("chain", "single"):
        with Engine(tiny["embedded"], mode=mode, n_ctx=256, debug=True) as eng:
            out = eng.generate(base, n_predict=-1, temperature=0)
        assert out.tokens == want.tokens and out.finish_reason == want.finish_reason


def test_stream_equals_generate_and_stops(tiny):
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        full = eng.generate(PROMPT, n_predict=N, temperature=0)
        gen = eng.stream(PROMPT, n_predict=N, temperature=0)
        pieces = []
        while True:
            try:
                pieces.append(next(gen))
            except StopIteration as done:
                streamed = done.value
                break
        assert "".join(p.text for p in pieces) == full.text == streamed.text
        assert [t for p in pieces for t in p.tokens] == full.tokens
        assert pieces[-1].finish_reason == "length" and full.stop_type == "limit"

        # a stop string cuts the text before it, and is never streamed
        word = full.text[10:13]
        out = eng.generate(PROMPT, n_predict=N, temperature=0, stop=[word])
        assert out.stop_type == "word" and out.finish_reason == "stop"
        assert out.stopping_word == word and word not in out.text
        assert full.text.startswith(out.text)
        streamed = "".join(c.text for c in eng.stream(PROMPT, n_predict=N, temperature=0, stop=[word]))
        assert streamed == out.text


def test_sampling_with_seed_is_reproducible(tiny):
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        a = eng.generate(PROMPT, n_predict=N, temperature=1.0, seed=7, top_k=0, top_p=1.0, min_p=0.0)
        b = eng.generate(PROMPT, n_predict=N, temperature=1.0, seed=7, top_k=0, top_p=1.0, min_p=0.0)
        c = eng.generate(PROMPT, n_predict=N, temperature=1.0, seed=8, top_k=0, top_p=1.0, min_p=0.0)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_bad_requests_leave_the_engine_usable(tiny, greedy_reference):
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        with pytest.raises(ValueError, match="empty"):
            eng.generate([], n_predict=4)
        with pytest.raises(ValueError, match="out of range"):
            eng.generate([eng.model.n_vocab + 1], n_predict=4)
        with pytest.raises(ValueError):
            eng.generate(PROMPT, n_predict=4, top_p=2.0)
        with pytest.raises(ValueError, match="does not fit"):
            eng.generate([1] * 600, n_predict=4)
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens


def test_context_full_stops_with_length(tiny, greedy_reference):
    with Engine(tiny["embedded"], mode="chain", n_ctx=64) as eng:
        n_ctx = eng.n_ctx  # llama.cpp rounds the size up
        n_prompt = len(eng.tokenize(PROMPT))
        eog = [t for t in range(eng.model.n_vocab) if eng.model.is_eog(t)]
        out = eng.generate(PROMPT, n_predict=-1, temperature=0, logit_bias={t: -1e9 for t in eog})
    assert out.finish_reason == "length" and out.stop_type == "limit"
    # every position is used: the last token is sampled but never needs decoding
    assert n_prompt + len(out.tokens) - 1 == n_ctx
    assert out.tokens[:N] == greedy_reference.tokens


def test_chat_template(tiny):
    with Engine(tiny["embedded"], mode="none", n_ctx=256) as eng:
        text = eng.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "hi" in text and "<|im_start|>" in text
        toks = eng.tokenize(text)
        specials = eng.tokenize("<|im_start|>", add_special=False)
        assert len(specials) == 1 and specials[0] in toks


def test_invalid_spec():
    with pytest.raises(ValueError):
        SpecConfig(mode="tree")
    with pytest.raises(ValueError):
        SpecConfig(p_min=2)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-1)


def _simulate(maps, mode: str, n_draft: int, first: int, n_predict: int):
    """What the rounds must do on the agree model, from its token maps alone."""
    f, heads = maps.trunk, maps.heads
    out, x = [first], first
    drafted, accepted = [0, 0, 0], [0, 0, 0]
    while len(out) < n_predict:
        d, prev = [], x
        for i in range(n_draft):
            prev = int((heads[i] if mode == "chain" else heads[0])[prev])
            d.append(prev)
        y, prev = [], x
        for _ in range(n_draft + 1):
            prev = int(f[prev])
            y.append(prev)
        a = 0
        while a < n_draft and d[a] == y[a]:
            a += 1
        for i in range(n_draft):
            drafted[i] += 1
            accepted[i] += i < a
        out += y[: a + 1]
        x = y[a]
    return out[:n_predict], drafted, accepted


@pytest.mark.parametrize("mode,n_max", [("chain", 3), ("chain", 2), ("single", 3)])
def test_acceptance_per_depth_is_what_the_heads_predict(tmp_path_factory, mode, n_max):
    from stepmtp.tiny import write_agree_model

    path, maps = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)
    n = 96
    with Engine(path, mode=mode, n_max=n_max, n_ctx=512) as eng:
        prompt = eng.tokenize("def main():\n")
        out = eng.generate(prompt, n_predict=n, temperature=0)
    want, drafted, accepted = _simulate(maps, mode, n_max, int(maps.trunk[prompt[-1]]), n)
    assert out.tokens == want
    st = out.stats
    assert st.drafted_per_depth == drafted
    assert st.accepted_per_depth == accepted
    assert 0 < st.n_accepted < st.n_drafted  # partial agreement, as the maps say


@pytest.mark.parametrize("mode,n_max", [("chain", 1), ("chain", 2), ("chain", 3), ("single", 2), ("single", 3)])
@pytest.mark.parametrize("files", ["embedded", "split"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_fused_schedule_drafts_what_the_reference_drafts(tmp_path_factory, tiny, mode, n_max, files, sampling):
    """Round by round: same drafts, same draft probabilities (to 1e-4 absolute or 1e-3
    relative; seen: 2e-5 greedy, 1.1e-4 when the temperature scales the logits: the fused
    decodes carry more rows, so float32 sums may differ in the last bits), same accepted counts,
    same output. Uses the agree model (real acceptance) and the random split pair."""
    from stepmtp.tiny import CONFIG, write_agree_model

    if files == "split":
        model, kw = tiny["trunk"], {"mtp_model": tiny["mtp"]}
    else:
        model, kw = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0], {}
    samp = dict(temperature=0) if sampling == "greedy" else dict(temperature=0.9, seed=3, top_k=8)
    runs = {}
    for schedule in ("reference", "fused"):
        with Engine(model, mode=mode, n_max=n_max, n_ctx=512, schedule=schedule, debug=True, **kw) as eng:
            runs[schedule] = eng.generate(PROMPT, n_predict=64, **samp)
    ref, fused = runs["reference"].trace, runs["fused"].trace
    assert len(ref) == len(fused) > 0
    for a, b in zip(ref, fused):
        assert (a.pos, a.drafts, a.n_accepted, a.out) == (b.pos, b.drafts, b.n_accepted, b.out)
        assert a.probs == pytest.approx(b.probs, rel=1e-3, abs=1e-4)
        # the change's schedule leaves every head's cells through r+n (its process);
        # the fused one anchors each head used through r and leaves at most the last
        # head's chained rows beyond (removed before any head reads them)
        heads = range(min(n_max, 3)) if mode == "chain" else range(1)
        for k in range(3 if mode == "chain" else 1):
            assert a.draft_cells[k] == (0, a.pos + len(a.drafts))
        # the fused one anchors each head used through r; head k also holds its chained
        # rows r+1 .. r+k (removed before it next reads them)
        assert all(b.kv_valid[k] == b.pos + 1 for k in heads)
        for k in heads:
            lo, hi = b.draft_cells[k]
            assert b.pos <= hi <= b.pos + (k if mode == "chain" else max(len(b.drafts) - 1, 0))
            # the memory API reports the sliding-window half of the cache, where
            # llama.cpp reuses a cell once its position is out of the window of its
            # sequence's last position (+1): cells below hi + 2 - n_swa may be gone
            assert lo <= max(0, hi + 2 - CONFIG.n_swa)
    assert runs["reference"].tokens == runs["fused"].tokens
    sr, sf = runs["reference"].stats, runs["fused"].stats
    assert sr.accepted_per_depth == sf.accepted_per_depth
    assert sf.n_draft_decodes < sr.n_draft_decodes


def test_statistics_add_up(tiny):
    from stepmtp.tiny import write_agree_model

    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    st = out.stats
    assert st.n_accepted <= st.n_drafted
    # the first token comes from the prompt, each round emits its accepted drafts and
    # one more; the last round may emit past n_predict (cut)
    emitted = 1 + st.n_accepted + st.n_rounds
    assert emitted - 3 <= st.n_predicted <= emitted
    assert st.n_prompt == len(out.prompt_tokens)
    assert st.t_llama_ms > 0 and 0 <= st.t_python_ms < st.t_prompt_ms + st.t_gen_ms


def test_mismatched_mtp_files_and_missing_heads(tmp_path, tiny):
    from dataclasses import replace

    from stepmtp import LlamaError
    from stepmtp.tiny import CONFIG, write_tiny_models

    narrow = write_tiny_models(tmp_path / "narrow", seed=1, cfg=replace(CONFIG, n_embd=32))
    with pytest.raises(ValueError, match="width 32"):
        Engine(tiny["trunk"], mtp_model=narrow["mtp"], n_ctx=256)
    with pytest.raises(LlamaError, match="no MTP blocks"):
        Engine(tiny["nomtp"], mode="chain", n_ctx=256)
    with pytest.raises(LlamaError, match="trunk-only"):
        Engine(tiny["trunk"], mode="chain", n_ctx=256)
    with Engine(tiny["nomtp"], mode="none", n_ctx=256) as eng:  # plain decoding still works
        assert len(eng.generate(PROMPT, n_predict=8, temperature=0).tokens) == 8
    with pytest.raises(ValueError, match="n_predict"):
        with Engine(tiny["embedded"], n_ctx=256) as eng:
            eng.generate(PROMPT, n_predict=-5)


def speculation_samples_as_plain(path, samp: dict, verify: str, n_seeds: int = 250) -> int:
    """Asserts that the first three tokens' joint counts over many seeds, plain and
    chained, match (chi-square, p > 0.001); returns the drafts accepted."""
    from scipy.stats import chi2_contingency

    counts, accepted = {}, 0
    for mode in ("none", "chain"):
        hist: dict[tuple[int, ...], int] = {}
        with Engine(path, mode=mode, n_ctx=256) as eng:
            prompt = eng.tokenize("def f")
            for seed in range(n_seeds):
                out = eng.generate(prompt, n_predict=3, seed=seed, verify=verify, **samp)
                hist[tuple(out.tokens)] = hist.get(tuple(out.tokens), 0) + 1
                accepted += out.stats.n_accepted
        counts[mode] = hist
    keys = sorted(set(counts["none"]) | set(counts["chain"]))
    # pool rare outcomes so every cell has a usable expectation
    big = [k for k in keys if counts["none"].get(k, 0) + counts["chain"].get(k, 0) >= 10]
    table = [[counts[m].get(k, 0) for k in big] for m in ("none", "chain")]
    rest = [sum(counts[m].get(k, 0) for k in keys if k not in big) for m in ("none", "chain")]
    if sum(rest):
        for row, r in zip(table, rest):
            row.append(r)
    assert len(big) >= 4
    p = chi2_contingency(table)[1]
    assert p > 1e-3, (p, table)
    return accepted


@pytest.mark.parametrize("verify", ["exact", "rejection"])
def test_sampling_is_not_biased_by_verification(tmp_path_factory, verify):
    """At temperature > 0 each emitted token is drawn from the target's distribution:
    the first three tokens' joint counts over many seeds match plain sampling
    (chi-square, p > 0.001). On the agree model at a high temperature, with 3
    candidates per step, drafts are accepted about half the time, so both the
    accepting and the rejecting paths are exercised."""
    from stepmtp.tiny import write_agree_model

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    accepted = speculation_samples_as_plain(path, dict(temperature=25.0, top_k=3, top_p=1.0, min_p=0.0), verify)
    assert accepted > 150


def test_rejection_sampling_accepts_more_than_exact_match(tmp_path_factory):
    from stepmtp.tiny import write_agree_model

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    rates = {}
    with Engine(path, mode="chain", n_ctx=512) as eng:
        for verify in ("exact", "rejection"):
            acc = drafted = 0
            for seed in range(4):
                st = eng.generate("def f", n_predict=48, temperature=25.0, top_k=3, top_p=1.0,
                                  min_p=0.0, seed=seed, verify=verify).stats
                acc, drafted = acc + st.n_accepted, drafted + st.n_drafted
            rates[verify] = acc / drafted
        # at temperature 0 both are greedy exact match
        a = eng.generate("def f", n_predict=32, temperature=0, verify="rejection")
        b = eng.generate("def f", n_predict=32, temperature=0, verify="exact")
    assert a.tokens == b.tokens and a.stats.accepted_per_depth == b.stats.accepted_per_depth
    assert rates["rejection"] > rates["exact"] + 0.05, rates


def test_adaptive_length_stays_exact_and_backs_off_when_drafts_fail(tiny, greedy_reference, tmp_path_factory):
    from stepmtp.tiny import write_agree_model

    with Engine(tiny["embedded"], mode="chain", adaptive=True, n_ctx=512, debug=True) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    # which lengths pay on the agree model depends on this machine's timings (on a
    # tiny model plain decoding can win): only exactness is asserted here; the bench
    # compares rates
    agree = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    outs = {}
    for adaptive in (False, True):
        with Engine(agree, mode="chain" if adaptive else "none", adaptive=adaptive, n_ctx=512) as eng:
            outs[adaptive] = eng.generate("def f", n_predict=120, temperature=0)
    assert outs[True].tokens == outs[False].tokens
    assert sum(outs[True].stats.rounds_by_length[1:]) >= 4  # every length was measured



def test_adaptive_length_times_plain_rounds_while_the_heads_fall_behind(tiny, monkeypatch):
    """A plain round catches no head up, so it is always timed ("steady"), however far
    behind the heads are (once it was not: a sequence that still had to time a plain
    round stayed at plain rounds for good, never timing one)."""
    from stepmtp.adaptive import AdaptiveLength

    seen = []
    monkeypatch.setattr(AdaptiveLength, "choose", lambda self: 0)
    monkeypatch.setattr(AdaptiveLength, "observe", lambda self, n, a, steady=True: seen.append((n, steady)))
    with Engine(tiny["embedded"], mode="chain", adaptive=True, n_ctx=512) as eng:
        eng.generate("def g", n_predict=40, temperature=0)
    assert len(seen) > 30 and all(n == 0 and steady for n, steady in seen), seen

class _Clock:
    """A fake clock the tests advance by each round's cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_adaptive_policy_picks_the_best_rate():
    from stepmtp.adaptive import AdaptiveLength

    clock = _Clock()
    pol = AdaptiveLength(3, probe_every=1000, clock=clock)
    # every length measured once: a round of n drafts costs 2 + n (verification 2,
    # drafts 1 each); the first two drafts are always accepted, the third never
    for _ in range(9):  # each length twice: its first round is a warm-up, not timed
        n = pol.choose()
        pol.observe(n, min(n, 2))
        clock.t += 2 + n
    # E[tokens] = 1, 2, 3, 3 for n = 0..3; costs 2, 3, 4, 5
    # the estimates are this sequence's record pulled towards the engine's long-run
    # rate (the same drafts, plus its prior): near the exact 0.5, 0.667, 0.75, 0.6
    rates = [pol.expected_rate(n) for n in range(4)]
    assert rates == pytest.approx([0.5, 0.667, 0.75, 0.6], abs=0.05)
    assert pol.choose() == 2


def test_adaptive_policy_backs_off_and_probes():
    from stepmtp.adaptive import AdaptiveLength

    clock = _Clock()
    pol = AdaptiveLength(3, probe_every=32, clock=clock)
    # nothing is ever accepted; a draft costs 0.3, verifying m rows 1 + 0.05 m
    chosen = _run_policy(pol, clock, [False] * 600, lambda n: 0.3 * n + 1.0 + 0.05 * (n + 1))
    assert chosen[:8] == [3, 3, 2, 2, 1, 1, 0, 0]  # every length measured first (its first round warms up)
    assert chosen.count(0) > 0.95 * len(chosen)  # then plain decoding...
    # ...probing the next length (once in a long while the long-run estimate, drifting
    # back to its prior without evidence, tries a longer one once),
    assert chosen[8:].count(1) >= 10 and chosen[8:].count(2) + chosen[8:].count(3) <= 2
    probes = [i for i in range(8, len(chosen)) if chosen[i] == 1 and chosen[i - 1] != 1]  # (a probe runs a few rounds)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]  # less and less often


def test_adaptive_policy_times_a_round_by_what_it_drafted():
    """p-min cut a round chosen at 3 to 1 draft: its time is a 1-draft round's."""
    from stepmtp.adaptive import AdaptiveLength

    clock = _Clock()
    pol = AdaptiveLength(3, clock=clock)
    for _ in range(2):  # the first is a warm-up
        assert pol.choose() == 3
        pol.observe(1, 1)
        clock.t += 7.0
    pol.choose()
    assert pol.t_round[1] == 7.0 and pol.t_round[3] is None


def test_adaptive_policy_times_a_probe_again_once_the_heads_caught_up():
    from stepmtp.adaptive import AdaptiveLength

    clock = _Clock()
    pol = AdaptiveLength(3, probe_every=4, clock=clock)
    chosen = []
    for _ in range(40):
        n = pol.choose()
        chosen.append(n)
        # drafting never pays; a round after a pause first catches the heads up
        pol.observe(n, 0, steady=not (n and chosen[-2:-1] == [0]))
        clock.t += 1.0 + n
    probes = [i for i, n in enumerate(chosen) if n and i >= 8]
    assert probes and all(chosen[i + 1] == chosen[i] for i in probes[::2])


def _run_policy(pol, clock, accepted, cost):
    """Drive ``pol`` for len(accepted) rounds: round i's first draft is accepted when
    accepted[i]; a round of n drafts costs cost(n). Returns the lengths chosen."""
    chosen = []
    for ok in accepted:
        n = pol.choose()
        chosen.append(n)
        pol.observe(n, 1 if (n and ok) else 0)
        clock.t += cost(n)
    return chosen


def test_adaptive_policy_keeps_drafting_through_short_runs_of_rejections():
    """First drafts accepted 60% of the time, in runs: 6 accepted, 4 rejected. A
    one-draft round costs 1.5 plain ones, so drafting pays (1.6 tokens for 1.5) and
    only a sustained acceptance below 0.5 would say otherwise."""
    from stepmtp.adaptive import AdaptiveLength

    clock = _Clock()
    pol = AdaptiveLength(1, clock=clock)
    accepted = ([True] * 6 + [False] * 4) * 40
    chosen = _run_policy(pol, clock, accepted, lambda n: 1.0 + 0.5 * n)
    assert chosen[4:].count(1) > 0.95 * len(chosen[4:]), chosen


def test_adaptive_policy_resumes_drafting_after_a_bad_stretch():
    """30 rounds in which nothing is accepted stop drafting; once the text is
    predictable again the policy drafts again within a few dozen rounds, without
    waiting for the probe back-off (the estimate drifts back to the engine's rate)."""
    from stepmtp.adaptive import AdaptiveLength, RoundCosts

    clock = _Clock()
    costs = RoundCosts(1)
    # the engine's record: drafting has paid well so far
    warm = AdaptiveLength(1, costs=costs, clock=clock)
    _run_policy(warm, clock, [True] * 200, lambda n: 1.0 + 0.5 * n)
    pol = AdaptiveLength(1, costs=costs, clock=clock, probe_every=1000)
    bad, good = [False] * 30, [True] * 150
    chosen = _run_policy(pol, clock, bad + good, lambda n: 1.0 + 0.5 * n)
    assert 0 in chosen[:30]  # it stopped...
    assert chosen[-80:].count(1) >= 76  # ...and resumed (a probe of 0 now and then)


def test_adaptive_policy_is_not_settled_by_an_engines_first_rounds():
    """The engine's first rounds (measuring every length) happen to reject every
    draft; afterwards the text's first drafts are accepted 64% of the time, and a
    one-draft round costs 1.41 plain ones (the bench-size model's figures): drafting
    pays. Later requests must still draft (a long-run rate made of those first few
    drafts once kept every later request at 0)."""
    import random

    from stepmtp.adaptive import AdaptiveLength, RoundCosts

    clock = _Clock()
    costs = RoundCosts(3)
    cost = lambda n: 1.0 + 0.41 * n  # noqa: E731
    _run_policy(AdaptiveLength(3, costs=costs, clock=clock), clock, [False] * 8, cost)
    rng = random.Random(0)
    chosen = []
    for _ in range(5):  # five requests of 200 rounds
        pol = AdaptiveLength(3, costs=costs, clock=clock)
        chosen += _run_policy(pol, clock, [rng.random() < 0.64 for _ in range(200)], cost)
    assert chosen[600:].count(1) > 0.8 * len(chosen[600:]), [chosen.count(n) for n in range(4)]


def test_adaptive_costs_trust_a_fresh_timing_of_a_length_left_alone():
    """A length timed again after a long pause (a probe) replaces most of its old
    estimate: the machine's load may have changed meanwhile. One timed every round
    moves slowly (one noisy round says little)."""
    from stepmtp.adaptive import RoundCosts

    costs = RoundCosts(1)
    for n in (0, 1):
        for _ in range(12):  # the first is a warm-up, untimed
            costs.rounds += 1
            costs.observe(n, 1.0)
    costs.rounds += 1
    costs.observe(1, 0.5)  # timed the round before too: a small step
    assert 0.9 <= costs.t_round[1] < 1.0
    costs.rounds += 100
    costs.observe(0, 0.5)  # not timed for 113 rounds: mostly replaced
    assert costs.t_round[0] < 0.6


@pytest.mark.parametrize("mode", ["none", "chain"])
def test_prompt_decodes_stop_where_llama_server_stops(tiny, mode):
    """A prompt's decodes stop as llama-server's: before the latest user message of a
    chat prompt (n_before_user), 4 + n_ubatch and 4 tokens before the end; within a
    piece, at ubatch multiples when a decode holds fewer rows than n_batch."""
    import stepmtp.llama as L

    seen: list[tuple[int, int]] = []
    decode = L.Context.decode

    def spy(ctx, batch):
        if ctx.mtp_block is None and batch.n and batch.seq[0] == 0 and batch.n_outputs <= 1:
            seen.append((int(batch.pos[0]), batch.n))
        return decode(ctx, batch)

    with Engine(tiny["embedded"], mode=mode, n_max=2, n_ctx=1024, n_batch=64, n_ubatch=16) as eng:
        toks = eng.tokenize(PROMPT * 6)
        n = len(toks)
        assert n > 64 + 20
        L.Context.decode = spy
        try:
            req = eng.submit(toks, n_predict=1, temperature=0, cache_prompt=False, n_before_user=7)
            while eng.busy:
                eng.step()
        finally:
            L.Context.decode = decode
        assert req.completion is not None
    pieces = [(p, k) for p, k in seen if p < n]
    cuts = sorted({7, n - 20, n - 4} | set(range(7 + 64, n - 20, 64)))
    assert [p for p, _ in pieces] == [0] + cuts and sum(k for _, k in pieces) == n
