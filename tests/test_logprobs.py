"""Token probabilities (n_probs) through the MTP loop: every token has them, accepted
drafts included, equal to what plain decoding reports for the same tokens."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stepmtp import Engine
from tests.test_server import server_fixture
from stepmtp.tiny import write_agree_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 32


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    return write_agree_model(tmp_path_factory.mktemp("agree-probs"), seed=0)[0]


def run(path, n_probs=5, post=False, **kw):
    with Engine(path, n_ctx=512, **kw) as eng:
        return eng.generate(PROMPT, n_predict=N, temperature=0, n_probs=n_probs, post_sampling_probs=post)


@pytest.mark.parametrize("cfg", [dict(mode="chain", n_max=3), dict(mode="single", n_max=2),
                                 dict(mode="chain", n_max=3, schedule="reference")])
def test_probs_equal_plain_decoding(agree, cfg):
    plain = run(agree, mode="none")
    spec = run(agree, **cfg)
    assert spec.stats.n_accepted > 0  # drafts were accepted, and they have probabilities too
    assert spec.tokens == plain.tokens
    assert len(spec.probs) == len(spec.tokens) == N
    for a, b in zip(spec.probs, plain.probs):
        assert a.token == b.token
        assert a.p == pytest.approx(b.p, rel=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert np.allclose([p for _, p in a.top], [p for _, p in b.top], rtol=1e-5)


def test_probs_are_a_distribution(agree):
    out = run(agree, n_probs=3, mode="chain")
    for tp, tok in zip(out.probs, out.tokens):
        assert tp.token == tok and 0 < tp.p <= 1 and len(tp.top) == 3
        ps = [p for _, p in tp.top]
        assert ps == sorted(ps, reverse=True) and sum(ps) <= 1 + 1e-9
        assert tp.top[0][0] == tok  # greedy: the sampled token is the most likely
        assert not math.isnan(tp.p)


def test_post_sampling_probs_greedy(agree):
    out = run(agree, n_probs=3, post=True, mode="chain")
    # at temperature 0 the chain keeps one candidate, the token, with probability 1
    assert all(tp.post and tp.p == 1.0 and tp.top == [(tp.token, 1.0)] for tp in out.probs)


def test_probs_streamed_per_token(agree):
    with Engine(agree, n_ctx=512, mode="chain") as eng:
        chunks = list(eng.stream(PROMPT, n_predict=N, temperature=0, n_probs=2))
    got = [tp for c in chunks for tp in c.probs]
    assert [tp.token for tp in got] == [t for c in chunks for t in c.tokens]
    assert len(got) == N


# -- through the server ---------------------------------------------------------------


server = server_fixture("agree", "-c", "2048", "-np", "1")


def test_server_native_probs_equal_plain(server, agree):
    import httpx

    plain = run(agree, n_probs=3, mode="none")
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                                     "n_probs": 3, "cache_prompt": False}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["timings"]["draft_n_accepted"] > 0
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == plain.tokens
    for got, want in zip(probs, plain.probs):
        assert got["logprob"] == pytest.approx(math.log(want.p), rel=1e-4, abs=1e-6)
        assert [t["id"] for t in got["top_logprobs"]] == [t for t, _ in want.top]
        assert set(got) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    # streamed: the same probabilities, spread over the events
    with httpx.stream("POST", server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                                               "n_probs": 3, "stream": True}, timeout=60) as s:
        import json as _json

        events = [_json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    streamed = [p for e in events for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == plain.tokens
    post = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                        "n_probs": 2, "post_sampling_probs": True}, timeout=60).json()
    assert all(p["prob"] == 1.0 and "top_probs" in p for p in post["completion_probabilities"])


def test_server_openai_chat_logprobs(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=2)
    lp = out.choices[0].logprobs.content
    assert len(lp) == out.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp)
    assert all(t.logprob <= 0 for t in lp)
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "top_logprobs": 2}, timeout=60)
    assert r.status_code == 400 and "requires logprobs" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/completion", json={"prompt": "x", "n_probs": 1000}, timeout=60)
    assert r.status_code == 400
