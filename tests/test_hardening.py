"""Per-token costs that do not grow with history, stop strings and UTF-8, use after close."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from stepmtp import Engine, LlamaError, SamplingParams
from stepmtp.sampling import Sampler
from stepmtp.slots import TextAssembler


def naive_penalties(p: SamplingParams, logits: np.ndarray, window: list[int]) -> np.ndarray:
    out = logits.copy()
    for t, c in Counter(window).items():
        v = out[t]
        v = v * p.repeat_penalty if v <= 0 else v / p.repeat_penalty
        out[t] = v - c * p.frequency_penalty - p.presence_penalty
    return out


@pytest.mark.parametrize("last_n", [64, 3000, -1])
def test_incremental_penalties_equal_a_recount(last_n):
    rng = np.random.default_rng(0)
    p = SamplingParams(temperature=0, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
                       repeat_last_n=last_n)
    s = Sampler(p)
    hist: list[int] = []
    for step in range(60):
        hist.extend(rng.integers(0, 500, size=int(rng.integers(1, 200))).tolist())
        extra = rng.integers(0, 500, size=int(rng.integers(0, 4))).tolist()
        logits = rng.normal(size=500).astype(np.float32)
        full = hist + extra
        window = full if last_n == -1 else full[-last_n:]
        np.testing.assert_allclose(s.transform(logits, hist, extra), naive_penalties(p, logits, window),
                                   rtol=1e-6, atol=1e-6)


class CountingList(list):
    """A history that counts the entries read from it."""

    reads = 0

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        v = super().__getitem__(i)
        CountingList.reads += len(v) if isinstance(i, slice) else 1
        return v


@pytest.mark.parametrize("last_n", [-1, 50_000])
def test_penalty_work_per_row_does_not_grow_with_history(last_n):
    """A long penalty window (all the history, or 50k tokens) is counted once; after
    that a row reads only the tokens added since the last row (and the window's
    oldest ones for a bounded window), whatever the history's length."""
    rng = np.random.default_rng(1)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, repeat_last_n=last_n))
    logits = rng.normal(size=1000).astype(np.float32)
    hist = CountingList(rng.integers(0, 1000, size=100_000).tolist())
    s.sample(logits, hist)
    for _ in range(20):
        hist.append(int(rng.integers(0, 1000)))
        CountingList.reads = 0
        s.sample(logits, hist, [1, 2, 3])
        assert CountingList.reads <= 2 * (1 + 3), CountingList.reads


def feed(asm: TextAssembler, pieces: list[bytes]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        if asm.push(piece):
            out.append(asm.take(final=True))
            return "".join(out), True
        out.append(asm.take())
    out.append(asm.take(final=True))
    return "".join(out), False


def test_stop_string_with_a_half_decoded_character_after_it():
    # "é" is two bytes; the stop string matches while its first byte is pending
    asm = TextAssembler(["END"])
    text, stopped = feed(asm, [b"ab", b"EN", b"D\xc3", b"\xa9"])
    assert stopped and text == "ab" and "\ufffd" not in asm.text and asm.stopping_word == "END"


@pytest.mark.parametrize("stops", [["</s>"], ["xx", "</s>"], ["</s>", "s>"]])
def test_stop_strings_at_every_chunking(stops):
    data = "hello </s> world".encode()
    want = "hello "
    for cut in range(1, len(data)):
        pieces = [data[:cut], data[cut:]]
        text, stopped = feed(TextAssembler(stops), pieces)
        assert stopped and text == want, (cut, text)
    # a partial stop string at the end is held back, then sent when it does not complete
    asm = TextAssembler(["</s>"])
    assert asm.push(b"a</") is False and asm.take() == "a"
    assert asm.push(b"x") is False and asm.take() == "</x"


def test_stop_strings_leftmost_first_given_wins():
    asm = TextAssembler(["bc", "abc", "b"])
    assert asm.push(b"xabcd")
    assert asm.text == "x" and asm.stopping_word == "abc"
    asm = TextAssembler(["b", "bc"])
    assert asm.push(b"abc") and asm.stopping_word == "b"


def test_stop_scan_looks_only_at_unsent_text():
    """What a token's stop check searches (the unsent text) stays as short as the
    longest stop string, however long the output: 100 stop strings cost the same per
    token at the 100th token and at the 20,000th."""
    stops = [f"<stop-{i:03d}-{'x' * 90}>" for i in range(100)]
    asm = TextAssembler(stops)
    longest = max(map(len, stops))
    for i in range(20_000):
        asm.push(b"<stop-0" if i % 3 == 0 else b"word ")
        asm.take()
        assert len(asm.pending) < longest
    assert len(asm.text) > 100_000


def test_engine_after_close_raises(tiny):
    eng = Engine(tiny["embedded"], mode="chain", n_ctx=256)
    gen = eng.stream("def f():", n_predict=8, temperature=0)
    next(gen)
    eng.close()
    gen.close()  # its cleanup must not touch the freed KV
    for call in (lambda: eng.tokenize("x"), lambda: eng.detokenize([1]),
                 lambda: eng.generate("x", n_predict=1), lambda: eng.model.tokenize("x")):
        with pytest.raises(LlamaError, match="closed"):
            call()
    eng.close()  # twice is fine


# -- request limits, through a server ---------------------------------------------------


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    from stepmtp.tiny import write_agree_model
    from tests.test_server import ServerProcess

    agree = write_agree_model(tmp_path_factory.mktemp("agree-limits"), seed=0)[0]
    srv = ServerProcess(["-m", str(agree), "--spec-type", "draft-mtp", "-c", "8192", "-np", "1", "-t", "1",
                         "--max-body-size", "4000", "--max-stop", "2", "--max-stop-length", "8", "--max-prompts", "2",
                         "--max-logit-bias", "3", "--max-queue", "1"], tmp_path_factory.mktemp("limits"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_limits_answer_4xx(limited):
    import httpx

    url = limited.url + "/completion"
    cases = [
        ({"prompt": "x" * 5000}, 413),
        ({"prompt": "x", "stop": ["a", "b", "c"]}, 400),
        ({"prompt": "x", "stop": ["a" * 9]}, 400),
        ({"prompt": ["a", "b", "c"]}, 400),
        ({"prompt": "x", "logit_bias": [[1, 0.5], [2, 0.5], [3, 0.5], [4, 0.5]]}, 400),
        ({"prompt": "x", "n_probs": 101}, 400),
    ]
    for body, code in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == code, (body, r.text)
        err = r.json()["error"]
        assert err["code"] == code and err["message"]
    # a body that claims to be small but is not is cut at the limit too
    r = httpx.post(url, content=b'{"prompt": "' + b"x" * 6000 + b'"}', headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413
    assert httpx.post(url, json={"prompt": "x", "n_predict": 2}, timeout=30).status_code == 200


def test_full_queue_answers_503(limited):
    """One slot, busy; room for one waiting request: of three more sent at once, two
    get a 503 at once, the third waits, and is served once the slot frees up."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    import httpx

    url = limited.url + "/completion"
    long = {"prompt": "def f():\n", "n_predict": 6000, "temperature": 0, "stream": True, "ignore_eos": True}
    with ThreadPoolExecutor(3) as ex:
        with httpx.Client(timeout=60) as c, c.stream("POST", url, json=long) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # it holds the only slot now
            futs = {ex.submit(lambda i=i: httpx.post(url, json={"prompt": f"x{i}", "n_predict": 1}, timeout=60))
                    for i in range(3)}
            done: set = set()
            while len(done) < 2:
                new, _ = wait(futs - done, timeout=30, return_when=FIRST_COMPLETED)
                assert new, "no answer within 30 s"
                done |= new
            assert [f.result().status_code for f in done] == [503, 503]
            assert "busy" in next(iter(done)).result().json()["error"]["message"]
        # the long stream is closed: its slot frees, the waiting request is served
        (last,) = futs - done
        assert last.result(timeout=60).status_code == 200
    assert httpx.get(limited.url + "/health", timeout=10).status_code == 200


def test_a_stream_nobody_reads_is_paused(tiny):
    """Back-pressure: the scheduler stops generating for a stream whose consumer has
    not taken MAX_BACKLOG chunks (the kernel's socket buffers hold megabytes before a
    server notices, so this is checked at the channel); it resumes, and ends whole,
    once the consumer catches up."""
    import asyncio

    from stepmtp.sampling import SamplingParams
    from stepmtp.server.worker import MAX_BACKLOG, Channel, GenRequest, Job, Worker

    with Engine(tiny["embedded"], mode="chain", n_ctx=4096) as eng:
        no_eos = {t: float("-inf") for t in range(eng.model.n_vocab) if eng.model.is_eog(t)}
        worker = Worker(eng)
        loop = asyncio.new_event_loop()
        try:
            job = Job(GenRequest(eng.tokenize("def f():"), 1000, [], SamplingParams(temperature=0,
                                                                                  logit_bias=no_eos), True),
                      Channel(loop))
            worker.submit(job)
            deadline = time.monotonic() + 30
            while job.channel.backlog <= MAX_BACKLOG and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            held = job.channel.backlog
            time.sleep(0.3)
            assert job.channel.backlog == held, "it kept generating for nobody"
            assert MAX_BACKLOG < held < MAX_BACKLOG + 8  # one round past the bound at most
            items = []
            while not items or items[-1][0] != "done":
                items += job.channel.get_nowait()  # the consumer catches up
                time.sleep(0.001)
            assert sum(len(p.tokens) for k, p in items if k == "chunk") == 1000
        finally:
            worker.stop()
            loop.close()


def test_cancel_during_prefill_frees_the_slot_within_a_chunk(tiny):
    """A long prompt is decoded a chunk per step; a request dropped meanwhile (its
    client left) stops at the next step and its slot is free for the next request."""
    from stepmtp.slots import Cancelled

    with Engine(tiny["embedded"], mode="chain", n_ctx=4096, n_batch=64, n_ubatch=64) as eng:
        prompt = eng.tokenize("def f():\n    return 1\n" * 200)
        assert len(prompt) > 20 * 64
        req = eng.submit(prompt, n_predict=8, temperature=0)
        eng.step()
        eng.step()
        assert req.state.prefilling and 0 < req.state.n_prefilled < len(prompt)
        eng.cancel(req)
        assert req.done and isinstance(req.error, Cancelled)
        assert eng.slots.n_busy == 0 and not eng.busy
        # the slot serves the next request at once
        assert len(eng.generate("x", n_predict=3, temperature=0).tokens) == 3
