"""llama.cpp's other samplers (typical-p, top-n-sigma, XTC, dynamic temperature), their
order (``samplers``) and the names llama-server reads it from; each checked against a
direct computation of what llama.cpp's stage does."""
from __future__ import annotations

import numpy as np
import pytest

from stepmtp.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams, parse_samplers

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # the default filters out of the way


def dist(logits, **kw) -> dict[int, float]:
    ids, probs = Sampler(SamplingParams(**{**OFF, **kw})).distribution(np.asarray(logits, dtype=np.float32))
    return {int(i): float(p) for i, p in zip(ids, probs) if p > 0}


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def test_sampler_names_letters_and_aliases():
    assert parse_samplers("edskypmxt", chars=True) == DEFAULT_SAMPLERS
    assert parse_samplers("top-k;Temp;nucleus;typ;minp") == ("top_k", "temperature", "top_p", "typ_p", "min_p")
    assert parse_samplers(["top_k", "bogus", "xtc"]) == ("top_k", "xtc")  # unknown names are dropped
    assert parse_samplers("kz t", chars=True) == ("top_k", "temperature")
    with pytest.raises(ValueError, match="infill"):
        SamplingParams(samplers=("top_k", "infill"))


def test_default_chain_is_top_k_top_p_min_p_temperature():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=500) * 3
    got = dist(logits, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05)
    top = np.argsort(-logits, kind="stable")[:40]
    p = softmax(logits[top])
    top = top[: int(np.searchsorted(np.cumsum(p), 0.9) + 1)]
    p = softmax(logits[top])
    top = top[p >= 0.05 * p[0]]
    want = dict(zip(top.tolist(), softmax(logits[top] / 0.7)))
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-6 for k in want)


def test_typical_p_keeps_the_tokens_closest_to_the_entropy():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    p = softmax(logits)
    ent = -(p * np.log(p)).sum()  # 1.14: token 1 (surprise 1.20) is the most typical, then 2 (1.90), 0 (0.69)
    order = np.argsort(np.abs(-np.log(p) - ent), kind="stable")
    assert order.tolist() == [1, 0, 2, 3]
    assert set(dist(logits, temperature=1.0, typical_p=0.5)) == {1, 0}  # 0.3 + 0.5 > 0.5
    assert set(dist(logits, temperature=1.0, typical_p=0.2)) == {1}
    assert set(dist(logits, temperature=1.0, typical_p=0.2, min_keep=3)) == {1, 0, 2}
    # the most likely token can go: temperature 0 is then not the argmax
    assert not SamplingParams(temperature=0, typical_p=0.2).greedy
    assert dist(logits, temperature=0.0, typical_p=0.2) == {1: 1.0}


def test_top_n_sigma_keeps_logits_within_n_deviations_of_the_best():
    logits = np.array([5.0, 4.0, 1.0, 0.0, -1.0, -3.0])
    std = logits.std()  # 2.77
    kept = set(dist(logits, temperature=1.0, top_n_sigma=1.5))
    assert kept == {i for i, v in enumerate(logits) if v >= logits.max() - 1.5 * std} == {0, 1, 2}
    assert set(dist(logits, temperature=1.0, top_n_sigma=1.0)) == {0, 1}
    assert len(dist(logits, temperature=1.0, top_n_sigma=-1.0)) == 6


def test_xtc_drops_all_but_the_least_likely_token_above_the_threshold():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    got = dist(logits, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.2)
    want = dict(zip([1, 2, 3], softmax(logits[1:])))
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-6 for k in want)
    # one token above the threshold: nothing to exclude; a threshold above 0.5: off
    assert len(dist(logits, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.4)) == 4
    assert len(dist(logits, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.6)) == 4
    # min_keep: the cut must leave that many
    assert len(dist(logits, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.2, min_keep=4)) == 4
    # a coin decides (probability 0.5: over many rows, about half are cut)
    s = Sampler(SamplingParams(**OFF, temperature=1.0, xtc_probability=0.5, xtc_threshold=0.2, seed=1))
    cut = sum(0 not in s.distribution(logits.astype(np.float32))[0] for _ in range(400))
    assert 150 < cut < 250
    assert not SamplingParams(temperature=0, xtc_probability=0.5).greedy


def test_dynamic_temperature_follows_the_entropy():
    flat = np.zeros(8)  # entropy at its maximum: the top of the range
    got = dist(flat + np.log(np.arange(1, 9)), temperature=1.0, dynatemp_range=0.5)
    logits = np.log(np.arange(1, 9))
    p = softmax(logits)
    t = 0.5 + 1.0 * (-(p * np.log(p)).sum() / np.log(8)) ** 1.0
    want = softmax(logits / t)
    assert all(abs(got[i] - want[i]) < 1e-6 for i in range(8))
    got2 = dist(logits, temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=2.0)
    t2 = 0.5 + 1.0 * (-(p * np.log(p)).sum() / np.log(8)) ** 2.0
    assert abs(got2[7] - softmax(logits / t2)[7]) < 1e-6
    assert not SamplingParams(temperature=0, dynatemp_range=0.5).greedy  # [0, 0.5]: not greedy


def test_order_is_the_samplers_list():
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # top_p 0.6 before a temperature of 3 keeps 2 tokens; after it (flatter), 3
    assert len(dist(logits, temperature=3.0, top_p=0.6)) == 2
    assert len(dist(logits, temperature=3.0, top_p=0.6, samplers=("temperature", "top_p"))) == 3
    # no temperature stage: temperature 0 samples the raw softmax, not the argmax
    assert not SamplingParams(temperature=0, samplers=("top_k",)).greedy
    assert len(dist(logits, temperature=0.0, samplers=("top_k",))) == 4
    assert SamplingParams(temperature=0).greedy


def test_logit_bias_comes_before_the_penalties():
    """llama.cpp's chain starts with the logit bias: a penalised token's logit is
    (logit + bias) / penalty, not logit / penalty + bias."""
    logits = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0, logit_bias={0: 1.0}))
    out = s.transform(logits, history=[0])
    assert out[0] == pytest.approx((2.0 + 1.0) / 2.0)


def test_new_samplers_under_speculation_are_seed_reproducible(tiny):
    from stepmtp import Engine

    kw = dict(temperature=0.9, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.1, dynatemp_range=0.3,
              top_n_sigma=2.0, n_predict=24)
    with Engine(tiny["embedded"], mode="chain", n_max=3, n_ctx=256, adaptive=False) as eng:
        a = eng.generate("def f(x):", seed=5, **kw)
        b = eng.generate("def f(x):", seed=5, **kw)
    assert a.tokens == b.tokens and len(a.tokens) == 24


def test_new_samplers_are_not_biased_by_rejection_verification(tmp_path_factory):
    """Speculation draws each token from the target's distribution under these samplers
    too: the first three tokens' joint counts over many seeds match plain sampling's
    (chi-square, p > 0.001), with typical-p, dynamic temperature and XTC (whose coin
    makes each row's distribution a mixture), in an order of the request's, at a
    temperature where drafts are accepted about half the time."""
    from stepmtp.tiny import write_agree_model
    from test_engine import speculation_samples_as_plain

    path = write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]
    # the temperature first: the agree model's raw distribution is too peaked for typical-p
    samp = dict(temperature=20.0, top_k=4, top_p=1.0, min_p=0.0, typical_p=0.99, dynatemp_range=5.0,
                xtc_probability=0.5, xtc_threshold=0.2, samplers=("top_k", "temperature", "typ_p", "xtc"))
    assert speculation_samples_as_plain(path, samp, "rejection") > 100


def test_a_draw_is_the_whole_rows_draw():
    """Sampler.draw sums a row's nonzero entries alone: the same index as the cumulative
    sum over the whole row (zeros included) for the same random number, every time."""
    rng = np.random.default_rng(3)
    s, ref = Sampler(SamplingParams(seed=11)), Sampler(SamplingParams(seed=11))
    for trial in range(300):
        row = np.zeros(5000)
        ids = rng.choice(5000, size=int(rng.integers(1, 60)), replace=False)
        row[ids] = rng.random(len(ids)) ** 3  # some tiny, as a sampler's tail
        if trial % 50 == 0:
            row[:] = 0.0  # nothing left: the last index, as a cumulative sum would say
        c = np.cumsum(row)
        want = int(min(np.searchsorted(c, ref.rng.random() * c[-1], side="right"), len(c) - 1))
        assert s.draw(row) == want


def test_largest_is_a_full_partitions_top_k():
    """sampling.largest reads a threshold off a strided sketch and partitions only what
    passes it: the same k entries as a partition of the whole row, on rows shaped like
    logits, flat ones, masked ones (-inf), with NaN, ties at the k-th value, and k from
    1 to most of the row."""
    from stepmtp.sampling import largest

    rng = np.random.default_rng(7)
    rows = [rng.normal(size=128_896).astype(np.float32) * 3,
            rng.normal(size=50_000) * 0.01,  # nearly flat
            np.zeros(70_000, dtype=np.float32),  # flat: every entry ties
            np.round(rng.normal(size=128_896) * 2).astype(np.float32),  # many ties at each value
            rng.normal(size=300).astype(np.float32)]  # a small vocabulary: partitioned whole
    masked = rng.normal(size=128_896).astype(np.float32)
    masked[rng.random(128_896) < 0.99] = -np.inf  # a grammar's mask: ~1,300 left
    rows.append(masked)
    nan = rng.normal(size=128_896).astype(np.float32) * 3
    nan[rng.choice(128_896, 50, replace=False)] = np.nan
    nan[int(np.nanargmax(nan)) + 1] = np.nan  # beside the largest
    rows.append(nan)
    for row in rows:
        order = np.sort(row[~np.isnan(row)])[::-1]
        for k in sorted({min(k, order.shape[0]) for k in (1, 2, 10, 40, 100, 1000, row.shape[0] // 3)}):
            got = largest(row, k)
            assert got.shape == (k,) and len(set(got.tolist())) == k
            assert not np.isnan(row[got]).any()
            # the values are the k largest (which of equal ones at the k-th is free)
            assert np.array_equal(np.sort(row[got])[::-1], order[:k])


def test_top_k_stage_orders_by_value_then_token_id():
    """The top-k stage keeps the k largest logits, most likely first, equal logits by
    token id: the distribution after it is the one computed directly."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=128_896).astype(np.float32) * 3
    logits[[17, 90_001, 4_242]] = logits.max() + 1.0  # a three-way tie for the best
    ids, probs = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)).distribution(logits)
    want = np.lexsort((np.arange(logits.shape[0]), -logits.astype(np.float64)))[:40]
    assert ids.tolist() == want.tolist()
    assert ids[:3].tolist() == [17, 4_242, 90_001]
    assert np.allclose(probs, softmax(logits[want]))


@pytest.mark.parametrize("kw", [
    dict(),  # llama-server's defaults: top-k 40, top-p 0.95, min-p 0.05
    dict(top_p=1.0), dict(min_p=0.0), dict(top_p=1.0, min_p=0.0), dict(top_p=0.3, min_p=0.2),
    dict(top_k=5, top_p=0.5, min_keep=3), dict(top_k=100, min_p=0.9, min_keep=7), dict(temperature=0.3),
    dict(logit_bias={3: 5.0, 77: -100.0}), dict(samplers=("top_k", "min_p", "top_p", "temperature")),
    dict(samplers=("temperature", "top_k", "top_p", "min_p")),  # (these two: the general chain)
])
def test_the_default_chains_short_path_is_the_general_chains_numbers(kw):
    """Sampler.distribution takes a short path for llama-server's default chain (top-k,
    top-p, min-p, temperature): the same candidates in the same order and the same
    probabilities, bit for bit, as the general chain's stages, so a seed draws the same
    tokens either way; rows shaped like logits, tied ones and masked ones."""
    rng = np.random.default_rng(11)
    p = SamplingParams(**{"temperature": 0.8, "seed": 5, **kw})
    fast, general = Sampler(p), Sampler(p)
    assert fast._short == ("samplers" not in kw)  # (the short path taken where it applies)
    general._short = False
    for trial in range(60):
        n = (8_064, 128_896, 300)[trial % 3]
        row = (rng.normal(size=n) * rng.uniform(0.5, 4)).astype(np.float32)
        if trial % 5 == 1:
            row = np.round(row)  # ties everywhere
        if trial % 7 == 2:
            row[rng.random(n) < 0.995] = -np.inf  # a grammar's mask: a few candidates left
        ids_f, pr_f = fast.distribution(row)
        ids_g, pr_g = general.distribution(row)
        assert ids_f.tolist() == ids_g.tolist()
        assert pr_f.dtype == pr_g.dtype and np.array_equal(pr_f, pr_g)
        assert fast.sample(row) == general.sample(row)
