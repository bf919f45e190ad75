"""The MTP3 engine: exactness against plain greedy decoding, statistics, API."""
from __future__ import annotations

import numpy as np
import pytest

from stepmtp import Engine, SamplingParams, SpecConfig
from stepmtp.drafters.heads import Heads

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
    # a fixed draft length (the counts below are a fixed length's; any lengths give the
    # same text: test_any_draft_lengths_give_the_greedy_text)
    with Engine(model, mode=mode, n_max=n_max, n_ctx=512, schedule=schedule, debug=True, adaptive=False,
                **kw) as eng:
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
    with Engine(tiny["embedded"], mode="chain", n_max=8, n_ctx=512, schedule=schedule, adaptive=False) as eng:
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
    with Engine(tiny["embedded"], mode="single", n_max=5, n_ctx=512, schedule=schedule, adaptive=False) as eng:
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


def test_a_seeded_request_samples_plain_samplings_text(tiny, monkeypatch):
    """With a seed (and verify auto) verification is exact match: each token is drawn as
    plain sampling draws it, so the text is plain sampling's for that seed, the same
    every time, whatever lengths the plan drafts (as llama-server's)."""
    kw = dict(n_predict=N, temperature=0.9, seed=11)
    with Engine(tiny["embedded"], mode="none", n_ctx=512) as eng:
        plain = eng.generate(PROMPT, **kw)
    _random_plans(monkeypatch, seed=3)
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        outs = [eng.generate(PROMPT, **kw) for _ in range(3)]
        other = eng.generate(PROMPT, **{**kw, "seed": 12})
    assert all(o.tokens == plain.tokens for o in outs)
    assert all(o.stats.n_drafted > 10 for o in outs)
    assert other.tokens != plain.tokens


def test_sampling_with_seed_is_reproducible(tiny):
    # a fixed draft length: the adaptive one (the default) follows the machine's timings,
    # and what a text's drafts are drawn from with it, so a seed's text with it
    with Engine(tiny["embedded"], mode="chain", n_ctx=512, adaptive=False) as eng:
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
    # as llama-server without context shift: it stops once the next token would take the
    # last cell (prompt + generated + 1 >= n_ctx)
    assert n_prompt + len(out.tokens) == n_ctx
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
    with Engine(path, mode=mode, n_max=n_max, n_ctx=512, adaptive=False) as eng:
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
        with Engine(model, mode=mode, n_max=n_max, n_ctx=512, schedule=schedule, debug=True, adaptive=False,
                    context=False, **kw) as eng:
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


def speculation_samples_as_plain(path, samp: dict, verify: str, n_seeds: int = 250, **engine_kw) -> int:
    """Asserts that the first three tokens' joint counts over many seeds, plain and
    chained, match (chi-square, p > 0.001); returns the drafts accepted. A fixed draft
    length unless ``engine_kw`` say otherwise."""
    p, accepted = joint_counts_p(path, samp, verify, n_seeds, **engine_kw)
    assert p > 1e-3, p
    return accepted


def joint_counts_p(path, samp: dict, verify: str, n_seeds: int = 250, prompt: str = "def f",
                   **engine_kw) -> tuple[float, int]:
    """The chi-square p-value of the first three tokens' joint counts over many seeds,
    plain against chained, and the drafts accepted."""
    from scipy.stats import chi2_contingency

    counts, accepted = {}, 0
    engine_kw = {"adaptive": False, **engine_kw}
    for mode in ("none", "chain"):
        hist: dict[tuple[int, ...], int] = {}
        with Engine(path, mode=mode, n_ctx=256, **engine_kw) as eng:
            toks = eng.tokenize(prompt)
            for seed in range(n_seeds):
                out = eng.generate(toks, n_predict=3, seed=seed, verify=verify, **samp)
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
    return chi2_contingency(table)[1], accepted


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


AGREE_HOT = dict(temperature=25.0, top_k=3, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize("power", [0.7, 2.0, float("inf")])
def test_shaped_drafts_of_any_length_keep_the_target_distribution(tmp_path_factory, monkeypatch, power):
    """Drafts drawn from a power of the heads' distribution (DraftShaper), with draft
    lengths varying round by round: each token is still drawn from the target's
    distribution (chi-square against plain sampling, as above)."""
    from stepmtp.sampling import DraftShaper
    from stepmtp.tiny import write_agree_model

    _random_plans(monkeypatch, seed=1)
    monkeypatch.setattr(DraftShaper, "power", lambda self, depth: power)
    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    assert speculation_samples_as_plain(path, AGREE_HOT, "rejection", adaptive=True) > 80


def test_the_distribution_check_fails_a_verifier_given_another_q(tmp_path_factory, monkeypatch):
    """The check above can fail: a verifier that takes the drafts for drawn from a sharper
    distribution than they were (q^3 for q: the bug of shaping the drafts' q and not
    the verifier's) biases the tokens, and the same chi-square test says so."""
    import stepmtp.mtp as M
    from stepmtp.tiny import write_agree_model

    verify = M.verify_rejection

    def wrong_q(sampler, p_row, drafts, q_rows, bonus):
        q = np.power(q_rows, 3.0)
        return verify(sampler, p_row, drafts, q / q.sum(axis=1, keepdims=True), bonus)

    monkeypatch.setattr(M, "verify_rejection", wrong_q)
    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    p, accepted = joint_counts_p(path, AGREE_HOT, "rejection")
    assert accepted > 100 and p < 1e-3, p


def test_rejection_sampling_accepts_more_than_exact_match(tmp_path_factory):
    from stepmtp.tiny import write_agree_model

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    rates = {}
    with Engine(path, mode="chain", n_ctx=512, adaptive=False, context=False) as eng:
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


def test_adaptive_length_is_the_default_and_stays_exact(tiny, greedy_reference, tmp_path_factory):
    from stepmtp.tiny import write_agree_model

    with Engine(tiny["embedded"], mode="chain", n_ctx=512, debug=True) as eng:
        assert eng.driver.planner is not None
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    # which lengths pay on the agree model depends on this machine's timings (on a
    # tiny model plain decoding can win): only exactness is asserted here; the bench
    # compares rates, tests/test_adaptive.py the plans
    agree = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    outs = {}
    for mode in ("none", "chain"):
        with Engine(agree, mode=mode, n_ctx=512) as eng:
            outs[mode] = eng.generate("def f", n_predict=120, temperature=0)
    assert outs["chain"].tokens == outs["none"].tokens
    assert outs["chain"].stats.rounds_by_length[3] >= 2  # the engine's first rounds time the longest


def test_the_prompt_rows_left_to_the_first_draft_steps_are_no_cost_of_drafting(tiny, monkeypatch):
    """The heads decode a prompt's last rows with their first draft steps (the fused
    schedule's ride-along). The plan prices only the rows they missed while the
    sequence drafted nothing: counting the prompt's (up to 3 x 256 rows, at the rate
    catch-ups were timed at) kept a new request's heads from drafting for tens of rounds."""
    from stepmtp import mtp as M
    from stepmtp.adaptive import DraftPlanner

    behind, gaps = [], []
    plan, driver_plan = DraftPlanner.plan, M.MTPDriver._plan

    def idle_plan(self, seqs, caps):
        behind.append([p.behind for p in seqs])
        out = plan(self, seqs, caps)
        if len(behind) <= 4:  # the first rounds draft nothing: the heads fall behind
            for p in seqs:
                p.use, p.n_forced = "heads", 0
            return [0] * len(seqs)
        return out

    def spy(self, seqs):
        gaps.append([s.pos - min(s.kv_valid) for s in seqs])
        return driver_plan(self, seqs)

    monkeypatch.setattr(DraftPlanner, "plan", idle_plan)
    monkeypatch.setattr(M.MTPDriver, "_plan", spy)
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        n_heads = len(eng.driver.heads)
        eng.generate(PROMPT * 4, n_predict=12, temperature=0)
    assert gaps[0][0] > 8  # the prompt's rows do wait for the first draft steps
    assert [b[0] for b in behind[:5]] == [n_heads * i for i in range(5)]


@pytest.mark.parametrize("kw", [dict(n_min=3), dict(adaptive=False)])
def test_a_fixed_draft_length(tiny, kw):
    """n-min = n-max, or adaptive off: every round drafts n-max (p-min 0)."""
    with Engine(tiny["embedded"], mode="chain", n_max=3, n_ctx=512, **kw) as eng:
        assert eng.driver.planner is None
        st = eng.generate(PROMPT, n_predict=N, temperature=0).stats
    assert st.drafted_per_depth[2] == st.n_rounds


def _random_plans(monkeypatch, seed: int = 0):
    """Every round's draft lengths drawn at random (what the plan does with the machine's
    timings, made reproducible)."""
    import random

    from stepmtp.adaptive import DraftPlanner

    rng = random.Random(seed)
    plan = DraftPlanner.plan

    def random_plan(self, seqs, caps, *rest):
        self.gate = False  # the lengths drawn are the lengths drafted
        plan(self, seqs, caps, *rest)
        for p in seqs:  # the heads draft: a context's drafts are drawn below
            p.use, p.n_forced = "heads", 0
        return [rng.randint(0, c) for c in caps]

    monkeypatch.setattr(DraftPlanner, "plan", random_plan)


@pytest.mark.parametrize("schedule", ["fused", "reference"])
@pytest.mark.parametrize("mode", ["chain", "single"])
@pytest.mark.parametrize("files", ["embedded", "split"])
def test_any_draft_lengths_give_the_greedy_text(tiny, greedy_reference, monkeypatch, mode, files, schedule):
    """Whatever lengths the plan picks round by round, temperature 0 gives plain
    decoding's tokens, and the invariant holds every round (debug)."""
    _random_plans(monkeypatch)
    kw = {"mtp_model": tiny["mtp"]} if files == "split" else {}
    model = tiny["trunk"] if files == "split" else tiny["embedded"]
    with Engine(model, mode=mode, n_max=3, n_ctx=512, schedule=schedule, debug=True, **kw) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    assert len([n for n in out.stats.rounds_by_length if n]) >= 3  # the lengths did vary


def _gate_on_confidence(monkeypatch, threshold: float) -> list[bool]:
    """Every draft of a round drafting the most goes to the verify only when its head's
    confidence is above ``threshold`` (the gate's decision, made by hand); the
    decisions, in order."""
    from stepmtp.adaptive import DraftPlanner, SeqPolicy

    decisions: list[bool] = []
    monkeypatch.setattr(DraftPlanner, "plan", lambda self, seqs, caps: list(caps))

    def keep(self, depth, confidence, n_plan):
        decisions.append(confidence > threshold)
        return decisions[-1]

    monkeypatch.setattr(SeqPolicy, "keep", keep)
    return decisions


def test_drafts_kept_out_by_their_heads_confidence_leave_the_greedy_text(tiny, greedy_reference, monkeypatch):
    """A draft its head was unsure of ends the sequence's drafting for the round
    (``SeqPolicy.keep``); the text is plain decoding's, the invariant holds."""
    decisions = _gate_on_confidence(monkeypatch, 0.6)
    with Engine(tiny["embedded"], mode="chain", n_max=3, n_ctx=512, debug=True) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert out.tokens == greedy_reference.tokens
    assert decisions.count(False) > 5 and decisions.count(True) > 5  # the gate did both


def test_gating_on_the_heads_confidence_keeps_the_target_distribution(tmp_path_factory, monkeypatch):
    """At temperature > 0 whether a draft is verified may depend on the distribution it
    was drawn from (its largest probability), not on the token drawn: the tokens are
    still the target's distribution's (chi-square against plain sampling)."""
    from stepmtp.tiny import write_agree_model

    decisions = _gate_on_confidence(monkeypatch, 0.79)  # about the median there
    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    assert speculation_samples_as_plain(path, AGREE_HOT, "rejection", adaptive=True) > 80
    assert decisions.count(False) > 100 and decisions.count(True) > 100


def test_gating_on_the_token_drawn_biases_the_tokens(tmp_path_factory, monkeypatch):
    """The check above can fail: a gate on the drawn token's probability (drafts of
    unlikely tokens never verified) biases the tokens, and the same test says so."""
    import stepmtp.mtp as M
    from stepmtp.tiny import write_agree_model

    pick = Heads._pick

    def drawn_pick(self, d, s, i):
        tok, p, h, _ = pick(self, d, s, i)
        return tok, p, h, p  # the drawn token's own probability

    monkeypatch.setattr(Heads, "_pick", drawn_pick)
    decisions = _gate_on_confidence(monkeypatch, 0.4)
    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    p, accepted = joint_counts_p(path, AGREE_HOT, "rejection", adaptive=True)
    assert decisions.count(False) > 100 and p < 1e-3, p


def _drafts_seen(monkeypatch) -> list[int]:
    import stepmtp.mtp as M

    seen: list[int] = []
    pick = Heads._pick

    def spy(self, d, s, i):
        out = pick(self, d, s, i)
        seen.append(out[0])
        return out

    monkeypatch.setattr(Heads, "_pick", spy)
    return seen


def test_a_draft_vocabulary_drafts_among_its_ids_and_keeps_the_greedy_text(tmp_path_factory, monkeypatch):
    """The heads' logits from their LM head's first rows alone (patch 0017): every draft
    is one of those ids, those the target emits are accepted, the text is plain
    decoding's (the agree model, whose heads predict its target)."""
    import stepmtp.mtp as M
    from stepmtp.adaptive import DraftPlanner
    from stepmtp.tiny import write_agree_model

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    with Engine(path, mode="none", n_ctx=512) as eng:
        plain = eng.generate(PROMPT, n_predict=N, temperature=0)
    monkeypatch.setattr(DraftPlanner, "plan", lambda self, seqs, caps: list(caps))
    monkeypatch.setattr(Heads, "DRAFT_VOCAB_WINDOW", 10**9)
    seen = _drafts_seen(monkeypatch)
    ids = sorted(set(plain.tokens))
    cut = ids[len(ids) // 2] + 1  # about half the text's tokens can be drafted
    with Engine(path, mode="chain", n_ctx=512, draft_vocab=cut, debug=True) as eng:
        assert eng.driver.draft_vocab == cut
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
    with Engine(path, mode="chain", n_ctx=512, draft_vocab=0) as eng:
        assert eng.driver.draft_vocab == 0
        whole = eng.generate(PROMPT, n_predict=N, temperature=0)
    with Engine(path, mode="none", n_ctx=512) as eng:
        assert eng.driver.draft_vocab == 0  # no heads, no vocabulary of theirs
    assert out.tokens == plain.tokens == whole.tokens
    assert len(seen) > 20 and max(seen[: out.stats.n_drafted]) < cut
    assert 5 < out.stats.n_accepted < whole.stats.n_accepted


def test_a_draft_vocabulary_missing_the_targets_tokens_widens(tiny, monkeypatch):
    """Where more than 1% of the target's tokens are beyond the draft vocabulary, it
    doubles, up to the whole vocabulary."""
    import stepmtp.mtp as M

    monkeypatch.setattr(Heads, "DRAFT_VOCAB_WINDOW", 4)
    with Engine(tiny["embedded"], mode="chain", n_ctx=512, draft_vocab=8) as eng:
        eng.generate(PROMPT, n_predict=N, temperature=0)
        assert eng.driver.draft_vocab == 0  # 8 -> 16 -> .. -> 256 -> all 512


def test_a_draft_vocabulary_keeps_the_target_distribution(tmp_path_factory, monkeypatch):
    """Rejection sampling with drafts drawn among fewer ids than the target samples:
    the tokens are still the target's distribution's (chi-square against plain
    sampling), some drafts accepted."""
    import stepmtp.mtp as M
    from stepmtp.tiny import write_agree_model

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    with Engine(path, mode="none", n_ctx=256) as eng:
        ids = sorted(set(eng.generate(eng.tokenize("def f"), n_predict=3, seed=s, **AGREE_HOT).tokens[0]
                         for s in range(40)))
    cut = ids[len(ids) // 2]  # about half the first tokens cannot be drafted
    monkeypatch.setattr(Heads, "DRAFT_VOCAB_WINDOW", 10**9)  # nor is it widened
    seen = _drafts_seen(monkeypatch)
    assert speculation_samples_as_plain(path, AGREE_HOT, "rejection", draft_vocab=cut) > 10
    assert seen and max(seen) < cut


def test_plain_rounds_are_timed_while_the_heads_fall_behind(tiny, monkeypatch):
    """A plain round catches no head up, so it is always timed, however far behind the
    heads are (once it was not: a sequence that still had to time a plain round stayed
    at plain rounds for good, never timing one)."""
    from stepmtp.adaptive import DraftPlanner

    monkeypatch.setattr(DraftPlanner, "_best_plan", lambda self, seqs, caps: [0] * len(seqs))
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        eng.generate("def g", n_predict=60, temperature=0)
        timings = eng.driver.planner.costs.verify_t
    assert timings.n.get(1, 0) > 30


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


def test_heads_sitting_out_keep_a_bounded_window_of_rows(tiny, monkeypatch):
    """Rounds that draft nothing leave the heads behind; the hidden rows kept for their
    catching up stay within 2 x MAX_CATCH_UP (they grew with the whole generation
    once), and when drafting starts again the text is still plain greedy decoding's."""
    import stepmtp.mtp as M
    from stepmtp.adaptive import DraftPlanner

    monkeypatch.setattr(Heads, "MAX_CATCH_UP", 8)
    best = DraftPlanner._best_plan

    def plan(self, seqs, caps):  # drafting nothing for 70 rounds, then as planned
        return [0] * len(seqs) if self.rounds < 70 else best(self, seqs, caps)

    monkeypatch.setattr(DraftPlanner, "_best_plan", plan)
    with Engine(tiny["embedded"], mode="none", n_ctx=512) as eng:
        plain = eng.generate(PROMPT, n_predict=120, temperature=0)
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        sizes: list[int] = []
        rnd = M.MTPDriver.round

        def spy(driver, seqs):
            out = rnd(driver, seqs)
            sizes.extend(s.anchors.n for s in seqs)
            return out

        monkeypatch.setattr(M.MTPDriver, "round", spy)
        out = eng.generate(PROMPT, n_predict=120, temperature=0)
    assert out.tokens == plain.tokens
    assert max(sizes[:60]) <= 2 * 8 + 2 and max(sizes[:60]) > 8  # bounded, and the heads did fall behind
    assert out.stats.n_drafted > 10  # drafting started again


def test_a_dormant_regime_leaves_the_prompt_to_the_target(tiny, monkeypatch):
    """Where a sampling regime has drafted nothing for long (``DraftPlanner.dormant``),
    a new sequence's heads do not read its prompt; should it draft, they start from its
    last rows, and the greedy text is still plain decoding's."""
    import stepmtp.mtp as M
    from stepmtp.adaptive import DraftPlanner

    monkeypatch.setattr(Heads, "MAX_CATCH_UP", 8)
    prompt = PROMPT * 3
    with Engine(tiny["embedded"], mode="none", n_ctx=512, n_batch=16, n_ubatch=16) as eng:
        plain = eng.generate(prompt, n_predict=60, temperature=0)
    runs = {}
    for dormant in (False, True):
        monkeypatch.setattr(DraftPlanner, "dormant", lambda self, key: dormant)
        with Engine(tiny["embedded"], mode="chain", n_ctx=512, n_batch=16, n_ubatch=16) as eng:
            runs[dormant] = eng.generate(prompt, n_predict=60, temperature=0, cache_prompt=False)
    assert runs[True].tokens == runs[False].tokens == plain.tokens
    assert runs[False].stats.n_prompt_draft_decodes > 0 == runs[True].stats.n_prompt_draft_decodes
    assert runs[True].stats.n_drafted > 10


def test_heads_that_sat_out_still_draft_after_a_cached_prompt(tiny, monkeypatch):
    """A follow-up request reusing a prefix whose heads never read it (dormant) decodes
    plain greedy decoding's text."""
    from stepmtp.adaptive import DraftPlanner

    with Engine(tiny["embedded"], mode="none", n_ctx=512) as eng:
        want = [eng.generate(PROMPT + x, n_predict=40, temperature=0).tokens for x in ("", " and more")]
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        monkeypatch.setattr(DraftPlanner, "dormant", lambda self, key: True)
        first = eng.generate(PROMPT, n_predict=40, temperature=0)
        monkeypatch.setattr(DraftPlanner, "dormant", lambda self, key: False)
        second = eng.generate(PROMPT + " and more", n_predict=40, temperature=0)
    assert [first.tokens, second.tokens] == want
    assert second.stats.n_prompt_cached > 0
