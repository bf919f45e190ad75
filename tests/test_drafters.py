"""Context drafting (stepmtp.drafters): the proposers, point proposals under rejection
sampling, and drafting from the context in the engine, exact at temperature 0."""
from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from stepmtp import Engine
from stepmtp.drafters import PointMass
from stepmtp.models import default_model_path
from stepmtp.adaptive import expected_tokens
from stepmtp.drafters.context import ContextDrafter, ContextPool, ContextProposal, ContextRecord
from stepmtp.drafters.ngram import NgramCache, NgramConfig, NgramMap, NgramMod, NgramSimple, make_ngram, read_lookup_cache
from stepmtp.sampling import Sampler, SamplingParams, verify_rejection

from test_engine import AGREE_HOT, joint_counts_p

COPY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


def _text(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


# -- our proposer ---------------------------------------------------------------------

def test_context_proposes_what_followed_the_text_before():
    doc = _text(400)
    toks = doc + [1001, 1002] + doc[:20]
    d = ContextDrafter()
    st = d.begin(toks, None)
    p = d.propose(st, 30)
    assert p.tokens == doc[20:50] and all(m >= 20 for m in p.match) and p.share == [1.0] * 30
    # the tokens a round emits move the match along; a token that breaks it ends it
    toks += doc[20:25]
    assert d.propose(st, 5).tokens == doc[25:30]
    toks.append(5000)
    assert d.propose(st, 5) is None


def test_context_weighs_the_places_that_match():
    # the key occurs twice before: followed by A once (a long match) and B once (short)
    a, b = _text(40, 1), _text(40, 2)
    lead = _text(30, 3)
    toks = lead + [7, 7, 7, 7] + a + _text(10, 4) + [7, 7, 7, 7] + b + _text(5, 5) + lead[-6:] + [7, 7, 7, 7]
    st = ContextDrafter().begin(toks, None)
    p = ContextDrafter().propose(st, 8)
    assert p.tokens[0] == a[0] and p.share[0] < 1.0  # the longer match wins, its share said


def test_the_pool_drafts_a_turn_written_again_and_stays_bounded():
    d = ContextDrafter()
    pool = ContextPool(max_tokens=1000)
    first = _text(300, 7)
    pool.add(first)
    st = d.begin(first[:50], pool)
    assert d.propose(st, 62).tokens == first[50:112]
    for s in range(10):  # other texts push the first out
        pool.add(_text(300, 100 + s))
    assert pool.n_tokens <= 1000 + 300
    assert d.propose(d.begin(first[:50], pool), 62) is None
    # a conversation's next prompt shares the last one's prefix: only the new part is kept
    p2 = ContextPool(max_tokens=10_000)
    p2.add(first)
    p2.add(first + _text(100, 8))
    assert p2.n_tokens < 300 + 100 + 70


def test_the_record_learns_acceptance_by_evidence():
    rec = ContextRecord()
    prop = ContextDrafter().propose(ContextDrafter().begin(_text(100) + _text(100)[:40], None), 20)
    before = rec.accepts(prop)
    for _ in range(50):
        rec.observe(prop, 20, 3)  # the fourth draft keeps being rejected
    after = rec.accepts(prop)
    assert after[3] < before[3] and after[0] > 0.9
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_a_text_that_repeats_itself_is_proposed_through_its_own_end():
    """A source in the sequence itself reads on into the proposal (a copy that overlaps
    its output): a text with a period of 5 tokens is proposed as far as the cap, not 5
    tokens a round."""
    period = [7, 8, 9, 10, 11]
    seq = [1, 2, 3] + period * 4
    d = ContextDrafter()
    prop = d.propose(d.begin(seq, None), 23)
    assert prop.tokens == (period * 6)[:23]
    assert prop.match == sorted(prop.match)  # its evidence grows as it goes
    # a source in another text stops at that text's end
    pool = ContextPool(max_tokens=1000)
    pool.add([1, 2, 3] + period + [4, 5, 6, 12, 13])
    prop = d.propose(d.begin([20, 21] + period, pool), 23)
    assert prop.tokens == [4, 5, 6, 12, 13]


def test_a_place_never_judged_takes_the_rate_of_the_place_before():
    """Short drafts all accepted: the places after them, never drafted, are taken at
    the rate learnt before them, not at a fixed prior (which kept long drafts from ever
    being tried)."""
    rec = ContextRecord()
    prop = ContextProposal(tokens=[5] * 12, match=[40] * 12, share=[1.0] * 12)
    before = rec.accepts(prop)
    for _ in range(60):
        rec.observe(prop, 3, 3)
    after = rec.accepts(prop)
    assert after[2] > before[2] and after[2] > 0.98
    assert after[8] > before[8] and after[8] > 0.97
    for _ in range(60):
        rec.observe(prop, 12, 8)  # the ninth keeps being rejected: its place learns it
    assert rec.accepts(prop)[8] < 0.5 < 0.9 < rec.accepts(prop)[7]


def test_a_proposal_not_drafted_is_judged_by_the_tokens_emitted():
    """The rounds that draft the heads' tokens judge the context's proposal too, against
    what the target emitted: one long draft rejected at its first token no longer keeps
    a loop the heads write 3 tokens a round out of context drafts for good."""
    from types import SimpleNamespace

    from stepmtp.drafters.drafting import ContextDrafting
    from stepmtp.sequence import SpecConfig

    cd = ContextDrafting(SimpleNamespace(spec=SpecConfig(), speculate=True))
    assert len(cd.proposers) == 1  # ours, beside the heads
    prop = ContextProposal(tokens=[5] * 62, match=[64] * 62, share=[1.0] * 62)
    s = SimpleNamespace(proposal=prop, proposer=0, rejection=False, ctx=[None], tokens=[], ctx_pending=[],
                        sampler=SimpleNamespace(greedy=True, params=SimpleNamespace(temperature=0.0)))
    cd.judge(s, [6], 24)  # the long draft, rejected at once
    low = cd.record(s).accepts(prop)
    assert low[0] < 0.75 and expected_tokens(low, 62) < 5
    for _ in range(20):
        cd.judge(s, [5, 5, 5, 5], 0)  # the heads' three drafts and the bonus: all the proposal's
    high = cd.record(s).accepts(prop)
    assert min(high[:4]) > 0.9 and expected_tokens(high, 62) > 3 * expected_tokens(low, 62)
    # a round whose second token is another: the first place accepted, the second rejected
    rec = cd.record(s)
    before = [row[:] for row in rec.judged]
    s.ctx_pending = []  # (this round's own places alone: test_later_places_are_judged_...)
    cd.judge(s, [5, 6, 7], 0)
    judged = sum(map(sum, rec.judged)) - sum(x * ContextRecord.DECAY ** 2 for row in before for x in row)
    assert judged == pytest.approx(2.0)
    assert cd.record(s).accepts(prop)[1] < high[1]


def test_later_places_are_judged_when_the_text_gets_there():
    """A proposal that agreed with every token its round emitted is judged on at the
    places past them as later rounds emit the text (as far as it agrees, and the first
    token that differs): judged only as far as a round emitted, places past the drafts
    the plan dared kept their prior, and a copy held for 50 tokens went 2-16 a round."""
    from types import SimpleNamespace

    from stepmtp.drafters.drafting import ContextDrafting
    from stepmtp.sequence import SpecConfig

    cd = ContextDrafting(SimpleNamespace(spec=SpecConfig(), speculate=True))
    prop = ContextProposal(tokens=list(range(1, 21)), match=[64] * 20, share=[1.0] * 20)
    s = SimpleNamespace(proposal=prop, proposer=0, rejection=False, ctx=[None], tokens=[90, 91], ctx_pending=[],
                        sampler=SimpleNamespace(greedy=True, params=SimpleNamespace(temperature=0.0)))
    rec = cd.record(s)

    def totals():
        return sum(map(sum, rec.acc)), sum(map(sum, rec.judged))

    s.tokens += [1, 2, 3]  # (the driver extends the tokens first)
    cd.judge(s, [1, 2, 3], 2)  # two drafted, both accepted, and the bonus: the proposal's
    assert totals() == pytest.approx((3.0, 3.0), abs=0.02)
    s.tokens += [4, 5]  # agreeing so far: undecided, it waits
    ContextDrafting._judge_on(s)
    assert len(s.ctx_pending) == 1 and totals() == pytest.approx((3.0, 3.0), abs=0.02)
    s.tokens += [6, 7, 8, 9, 10, 11, 12, 99, 100]  # the text parts from it at place 12
    ContextDrafting._judge_on(s)
    assert not s.ctx_pending
    assert totals() == pytest.approx((3.0 + 9.0, 3.0 + 10.0), abs=0.1)  # places 3-11 accepted, 12 not
    # a proposal the round's tokens already parted from waits for nothing
    s.proposal = ContextProposal(tokens=[7, 7, 7, 7], match=[64] * 4, share=[1.0] * 4)
    s.tokens += [7, 8]
    cd.judge(s, [7, 8], 1)
    assert not s.ctx_pending


# -- point proposals ------------------------------------------------------------------

def test_a_point_proposal_is_accepted_with_the_targets_probability():
    """verify_rejection with q a point mass: the emitted token is distributed as p (a
    draft accepted with p(x), else a draw from p without x), chi-square."""
    from scipy.stats import chisquare

    p = np.array([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    counts = np.zeros(4)
    for _ in range(6000):
        out = verify_rejection(sampler, lambda i: p, [1], [PointMass(1)], lambda: 0)
        counts[out[0]] += 1
    assert chisquare(counts, 6000 * p).pvalue > 1e-3
    # and a wrong verifier (the draft always accepted) fails the same test
    wrong = np.zeros(4)
    wrong[1] = 6000
    assert chisquare(wrong, 6000 * p).pvalue < 1e-3


def test_context_drafts_keep_the_target_distribution(tmp_path_factory, monkeypatch):
    """Sampling with the context's drafts (a prompt that repeats, the plan made to take
    them): the first three tokens' joint counts match plain sampling's."""
    from stepmtp.tiny import write_agree_model

    monkeypatch.setattr(ContextRecord, "accepts", lambda self, prop: [0.99] * len(prop.tokens))
    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    p, accepted = joint_counts_p(path, AGREE_HOT, "rejection", n_seeds=200, prompt=COPY + COPY[:30])
    assert p > 1e-3, p
    assert accepted > 30


# -- in the engine ----------------------------------------------------------------------

def test_context_drafting_writes_plain_decodings_text():
    """Temperature 0: the heads and the context's drafts give plain decoding's tokens,
    the first time and the second (drafted from the pool), and the context drafted
    (the bundled model: it writes what its context suggests)."""
    prompt = COPY * 3 + COPY[:20]
    with Engine(default_model_path(), mode="none", n_ctx=512) as eng:
        want = eng.generate(prompt, n_predict=96, temperature=0).tokens
    with Engine(default_model_path(), mode="chain", n_ctx=512, debug=True) as eng:
        outs = [eng.generate(prompt, n_predict=96, temperature=0) for _ in range(2)]
    assert [o.tokens for o in outs] == [want, want]
    assert outs[1].stats.n_drafted_context > 0
    assert outs[1].stats.n_accepted_context <= outs[1].stats.n_drafted_context


@pytest.mark.parametrize("ngram", ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"])
def test_llama_servers_ngram_drafters_alone_write_plain_decodings_text(ngram):
    cfg = NgramConfig(simple_size_n=3, simple_size_m=8, map_k_size_n=3, map_k_size_m=8, map_k4v_size_n=3,
                      map_k4v_size_m=8, mod_n_match=4, mod_n_min=2, mod_n_max=16)
    prompt = COPY * 4 + COPY[:10]
    with Engine(default_model_path(), mode="none", n_ctx=512) as eng:
        want = eng.generate(prompt, n_predict=64, temperature=0).tokens
    with Engine(default_model_path(), mode="none", ngram=[ngram], ngram_config=cfg, n_ctx=512) as eng:
        outs = [eng.generate(prompt, n_predict=64, temperature=0) for _ in range(2)]
    assert [o.tokens for o in outs] == [want, want]
    assert sum(o.stats.n_drafted_context for o in outs) > 0 and all(o.stats.n_drafted == o.stats.n_drafted_context
                                                                    for o in outs)


def test_a_grammar_masks_the_contexts_drafts(tiny):
    """A schema's output, drafted from a context that holds text the schema forbids:
    the same tokens as plain decoding under the schema."""
    schema = ("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    prompt = '{"n": "text"} {"n": "text"} {"n": "text"} {"n": '
    with Engine(tiny["embedded"], mode="none", n_ctx=512) as eng:
        want = eng.generate(prompt, n_predict=24, temperature=0, grammar=schema)
    with Engine(tiny["embedded"], mode="chain", n_ctx=512) as eng:
        got = [eng.generate(prompt, n_predict=24, temperature=0, grammar=schema) for _ in range(2)]
    assert [g.tokens for g in got] == [want.tokens, want.tokens]


def test_pools_are_kept_apart():
    """A request drafts from the earlier requests of its own pool alone."""
    prompt = COPY * 2 + COPY[:20]
    with Engine(default_model_path(), mode="chain", n_ctx=512, adaptive=False) as eng:
        a1 = eng.generate(prompt, n_predict=64, temperature=0, pool="a")
        eng.generate(prompt, n_predict=64, temperature=0, pool="a")
        b1 = eng.generate(COPY[:40], n_predict=32, temperature=0, pool="b")
        pools = eng.driver.pools
        assert set(pools) == {"a", "b"}
        # pool b holds b's request alone, pool a a's (the second one's new part)
        # (a sequence's tokens: prompt, output, and what its last round accepted past the end)
        want_b, want_a = b1.prompt_tokens + b1.tokens, a1.prompt_tokens + a1.tokens
        assert len(pools["b"].docs) == 1 and pools["b"].docs[0].tokens[: len(want_b)] == want_b
        assert pools["a"].docs[0].tokens[: len(want_a)] == want_a
        st = eng.driver.proposers[-1].begin(list(b1.prompt_tokens[:8]), pools["b"])
        assert all(s.tokens is not d.tokens for s in st.sources for d in pools["a"].docs)
    with Engine(default_model_path(), mode="chain", n_ctx=512, adaptive=False, pool_tokens=0) as eng:
        eng.generate(prompt, n_predict=16, temperature=0)
        assert not eng.driver.pools


# -- llama-server's n-gram drafters ------------------------------------------------------

def test_ngram_simple_takes_the_most_recent_occurrence():
    n, m = 3, 5
    key = [1, 2, 3]
    toks = _text(20, 1) + key + [10, 11, 12, 13, 14, 15] + _text(20, 2) + key + [20, 21, 22, 23, 24, 25] + \
        _text(10, 3) + key
    d = NgramSimple(n, m)
    assert d.propose(d.begin(toks, None), 64).tokens == [20, 21, 22, 23, 24]


def test_ngram_map_k_takes_the_first_and_adapts_its_length():
    key = [1, 2, 3]
    toks = _text(20, 1) + key + list(range(100, 110)) + _text(20, 2) + key + list(range(200, 210)) + \
        _text(30, 3) + key
    d = NgramMap("ngram-map-k", 3, 8, 1, values=False)
    st = d.begin(toks, None)
    assert d.propose(st, 64).tokens == list(range(100, 108))
    d.accepted(st, 8, 2)
    assert d.propose(st, 64).tokens == [100, 101]


def test_ngram_map_k4v_needs_hits_and_a_dominant_continuation():
    key = [1, 2, 3]
    a, b = list(range(100, 104)), list(range(200, 204))
    toks = _text(10, 1) + key + a + _text(10, 2) + key + b + _text(20, 3) + key
    d = NgramMap("ngram-map-k4v", 3, 4, 2, values=True)
    st = d.begin(toks, None)
    assert d.propose(st, 64) is None  # one lookup of the key so far (min_hits 2)
    assert d.propose(st, 64) is None  # a once, b once: neither twice the others
    toks2 = _text(10, 1) + key + a + _text(10, 2) + key + b + _text(5, 4) + key + a + _text(5, 5) + key + a + \
        _text(20, 6) + key
    st2 = d.begin(toks2, None)
    d.propose(st2, 64)
    assert d.propose(st2, 64).tokens == a  # a three times, b once


def test_ngram_mod_chains_lookups_and_keeps_n_min():
    # a sequence's tokens end with id_last, whose continuation is drafted
    doc = _text(200, 9)
    d = NgramMod(n_match=4, n_min=10, n_max=30)
    pool = ContextPool(100)
    d.begin(doc, pool)  # another sequence of the pool indexed it
    assert d.propose(d.begin(doc[:51], pool), 64).tokens == doc[51:81]
    assert d.propose(d.begin(_text(50, 10), pool), 64) is None  # nothing found: no draft
    short = NgramMod(n_match=4, n_min=10, n_max=30)
    short.begin(doc[:61], pool)
    assert short.propose(short.begin(doc[:53], pool), 64) is None  # fewer than n_min resolve
    assert short.propose(short.begin(doc[:53], None), 64) is None  # no pool: its own tokens alone


def test_ngram_cache_reads_llama_cpps_files(tmp_path):
    f = tmp_path / "static.bin"
    # the 2-gram (5, 6) followed by 7 three times, by 8 once
    f.write_bytes(struct.pack("=4i", 5, 6, -1, -1) + struct.pack("=i", 2) + struct.pack("=4i", 7, 3, 8, 1))
    cache = read_lookup_cache(f)
    assert cache == {(5, 6): {7: 3, 8: 1}}
    d = NgramCache(str(f), None)
    assert d.propose(d.begin([1, 2, 5, 6], None), 8).tokens[0] == 7
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="bad.bin"):
        read_lookup_cache(bad)
    with pytest.raises(ValueError, match="unknown"):
        make_ngram("ngram-nope", None)


def test_one_sequence_drafts_the_context_as_far_as_a_verify_carries():
    """With llama-server's slots (4, one cache), a sequence's context draft may fill the
    whole verify (63 rows on the CPU), not its share of a decode's rows were every slot
    busy (the rows one sliding-window region takes, over 4: 31 drafts, where the C++
    server's n-gram drafts 64): the round's rows are what the plan bounds. Plain
    decoding's text still, drafts and all. (A ubatch of 128 rows: with llama-server's
    512, patch 0024's regions give each sequence 128 rows, past any verify.)"""
    prompt = COPY * 12 + COPY[:20]
    kw = dict(n_ctx=4096, n_parallel=4, kv_unified=True, n_batch=128, n_ubatch=128)
    with Engine(default_model_path(), mode="none", **kw) as eng:
        want = eng.generate(prompt, n_predict=192, temperature=0).tokens
    with Engine(default_model_path(), mode="chain", debug=True, **kw) as eng:
        drv = eng.driver
        assert drv.n_rows_seq - 1 < drv.max_verify_rows - 1  # (the case: a region's rows over the slots)
        outs = [eng.generate(prompt, n_predict=192, temperature=0) for _ in range(3)]
    assert [o.tokens for o in outs] == [want] * 3
    longest = max(len(r.drafts) for o in outs for r in o.trace)
    assert drv.n_rows_seq - 1 < longest <= drv.max_verify_rows - 1


def test_one_sources_proposal_by_slices_is_the_walks():
    """A proposal from one source is taken by slices (``_continuation``), not walked step
    by step (``_walk``, which several sources take): the same tokens, match lengths and
    shares, for a source in another text (ending before the cap or not) and for one in
    the sequence itself that reads on into its own proposal."""
    from stepmtp.drafters.context import MAX_MATCH, _Source

    rng = random.Random(3)
    for trial in range(400):
        t = _text(rng.randrange(8, 200), seed=trial, vocab=rng.choice([3, 50, 1000]))
        n = len(t)
        if trial % 2:
            other = _text(rng.randrange(1, 120), seed=1000 + trial)
            s = _Source(other, rng.randrange(0, len(other) + 1), rng.randrange(1, MAX_MATCH + 1))
        else:
            s = _Source(t, rng.randrange(0, n), rng.randrange(1, MAX_MATCH + 1))
        cap = rng.randrange(1, 70)
        got = ContextDrafter._continuation([s], cap, n, t)
        want = ContextDrafter._walk([_Source(s.tokens, s.j, s.match)], cap, n, t)
        if want is None:
            assert got is None
        else:
            assert (got.tokens, got.match, got.share) == (want.tokens, want.match, want.share)
