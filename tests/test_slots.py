"""Slots: several generations batched into the same decodes.

The bar is that batching changes nothing a sequence can see: at temperature 0 each
sequence's tokens, and its drafted / accepted counts per depth, equal what it
produces alone. (They are bit-identical here: the tiny models' batched kernels give
the same logits; a model where batched matmuls round differently could flip a
near-tie, which these tests would catch.)
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from stepmtp import Engine
from stepmtp.slots import Request
from stepmtp.sampling import SamplingParams

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def push(self, x):\n",
    "# a comment\n",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "x = [i * i for i in range(10)]\n",
]
N = 40


def _alone(path, prompts, n_predict=N, **kw):
    with Engine(path, n_ctx=512, **kw) as eng:
        return [eng.generate(p, n_predict=n_predict, temperature=0) for p in prompts]


def _same(a, b):
    # (the heads' per-depth counts are compared: the tests that do turn context drafting
    # off, whose pool of earlier requests depends on the order they ran in)
    assert a.tokens == b.tokens
    assert a.stats.drafted_per_depth == b.stats.drafted_per_depth
    assert a.stats.accepted_per_depth == b.stats.accepted_per_depth
    assert a.finish_reason == b.finish_reason


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    from stepmtp.tiny import write_agree_model

    return write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]


@pytest.mark.parametrize("mode,n_max,schedule", [("chain", 3, "fused"), ("chain", 2, "fused"),
                                                 ("chain", 3, "reference"), ("single", 3, "fused"),
                                                 ("single", 2, "reference"), ("none", 0, "fused")])
@pytest.mark.parametrize("files", ["embedded", "split"])
def test_batched_equals_alone(tiny, mode, n_max, schedule, files):
    kw = dict(mode=mode, n_max=n_max, schedule=schedule, adaptive=False, context=False)
    if files == "split":
        path, kw["mtp_model"] = tiny["trunk"], tiny["mtp"]
    else:
        path = tiny["embedded"]
    alone = _alone(path, PROMPTS, **kw)
    # five prompts on four slots: the fifth joins when the first one leaves
    with Engine(path, n_ctx=4 * 512, n_parallel=4, debug=True, **kw) as eng:
        got = eng.generate_many(PROMPTS, n_predict=N, temperature=0)
        assert eng.n_ctx == 512  # -c split between the slots
    for a, b in zip(got, alone):
        _same(a, b)


def test_unified_kv_batched_equals_alone(agree):
    """-np auto's layout: the target's KV cache shared by the slots (the heads' stays
    per sequence)."""
    kw = dict(mode="chain", n_max=3, adaptive=False, context=False)
    alone = _alone(agree, PROMPTS, n_predict=48, **kw)
    with Engine(agree, n_ctx=1024, n_parallel=4, kv_unified=True, debug=True, **kw) as eng:
        assert eng.n_ctx == 1024 and eng.target.kv_unified and all(d.n_seq_max == 4 and d.kv_unified for d in eng.drafts)
        got = eng.generate_many(PROMPTS, n_predict=48, temperature=0)
    for a, b in zip(got, alone):
        _same(a, b)


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("schedule", ["fused", "reference"])
def test_any_draft_lengths_batched_equal_alone(monkeypatch, unified, schedule):
    """Draft lengths varying round by round and slot by slot (what the plan does with
    the machine's timings, drawn at random here): each slot's text is its text alone,
    in a unified cache too, where the slots' rows land around each other's. (Before
    patch 0014 kept a slot's cells in position order, the bundled model's second text
    parted from its text alone after 50-360 tokens there.)"""
    from stepmtp.models import EVAL_PROMPTS, default_model_path

    from test_engine import _random_plans

    path, prompts = default_model_path(), list(EVAL_PROMPTS[:2])
    kw = dict(n_ubatch=64, n_batch=256, n_threads=1)
    with Engine(path, n_ctx=2048, mode="none", **kw) as eng:
        alone = [eng.generate(p, n_predict=420, temperature=0).tokens for p in prompts]
    _random_plans(monkeypatch, seed=1)
    with Engine(path, n_ctx=2048, n_parallel=2, kv_unified=unified, schedule=schedule, debug=True, **kw) as eng:
        got = eng.generate_many(prompts, n_predict=420, temperature=0)
    assert [g.tokens for g in got] == alone
    assert sum(g.stats.n_drafted for g in got) > 300


def test_different_lengths_and_early_stops_in_one_round(tiny):
    """p-min stops some sequences' drafting early while others go on, lengths and
    stop strings end them at different rounds: each still equals its run alone.
    (The random tiny model: its heads' probabilities spread around p-min.)"""
    kw = dict(mode="chain", n_max=3, p_min=0.3, adaptive=False, context=False)
    agree = tiny["embedded"]
    lengths = [5, 40, 17, 64, 1]
    with Engine(agree, n_ctx=512, **kw) as eng:
        alone = [eng.generate(p, n_predict=n, temperature=0, stop=["\n\n"]) for p, n in zip(PROMPTS, lengths)]
    with Engine(agree, n_ctx=3 * 512, n_parallel=3, **kw) as eng:
        reqs = [eng._request(p, n, ["\n\n"], None, {"temperature": 0}) for p, n in zip(PROMPTS, lengths)]
        for r in reqs:
            eng.slots.submit(r)
        widths = []
        with eng._lock:
            while not all(r.done for r in reqs):
                running = [r for r in eng.slots.slots if r is not None and not r.state.prefilling]
                eng.slots.step()
                if len(running) > 1:
                    widths.append(sorted(len(r.state.drafts) for r in running))
    for r, a in zip(reqs, alone):
        _same(r.completion, a)
    # rounds where the sequences drafted different lengths: p-min at work inside a batch
    assert any(w[0] != w[-1] for w in widths)
    assert max(len(w) for w in widths) == 3


def test_threads_share_rounds(agree):
    """Four threads calling stream() at once are batched together."""
    kw = dict(mode="chain", n_max=3, adaptive=False, context=False)
    alone = _alone(agree, PROMPTS[:4], n_predict=64, **kw)
    with Engine(agree, n_ctx=4 * 512, n_parallel=4, **kw) as eng:
        widest = [0]
        step = eng.slots.step

        def counting_step():
            widest[0] = max(widest[0], eng.slots.n_busy)
            step()

        eng.slots.step = counting_step
        out: dict[int, object] = {}
        texts: dict[int, str] = {}
        barrier = threading.Barrier(4)

        def run(i):
            barrier.wait()
            gen = eng.stream(PROMPTS[i], n_predict=64, temperature=0)
            parts = []
            while True:
                try:
                    parts.append(next(gen).text)
                except StopIteration as done:
                    out[i] = done.value
                    break
            texts[i] = "".join(parts)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i in range(4):
        _same(out[i], alone[i])
        assert texts[i] == alone[i].text
    assert widest[0] >= 3


def test_long_prompt_is_interleaved_with_running_streams(agree):
    """A prompt of several chunks joins while another sequence generates: the running
    one keeps getting tokens between the chunks, and both equal their runs alone."""
    kw = dict(mode="chain", n_max=3, n_batch=64, n_ubatch=64, adaptive=False, context=False)
    long_prompt = "".join(f"value_{i} = compute({i}, {i * 7})\n" for i in range(40))
    with Engine(agree, n_ctx=1024, **kw) as eng:
        want_a = eng.generate(PROMPTS[0], n_predict=80, temperature=0)
        want_b = eng.generate(long_prompt, n_predict=20, temperature=0)
        n_long = len(eng.tokenize(long_prompt))
    assert n_long > 3 * 64
    with Engine(agree, n_ctx=2 * 1024, n_parallel=2, **kw) as eng:
        a = eng._request(PROMPTS[0], 80, [], None, {"temperature": 0})
        b = eng._request(long_prompt, 20, [], None, {"temperature": 0})
        with eng._lock:
            eng.slots.submit(a)
            while a.n_decoded < 5:
                eng.slots.step()
            eng.slots.submit(b)
            progress = []
            while b.state.n_prefilled < n_long or b.state.prefilling:
                before = a.n_decoded
                eng.slots.step()
                progress.append(a.n_decoded - before)
            while not (a.done and b.done):
                eng.slots.step()
    assert len(progress) >= 3 and all(p > 0 for p in progress[:3])
    _same(a.completion, want_a)
    _same(b.completion, want_b)


def test_cancel_frees_the_slot(agree):
    kw = dict(mode="chain", n_max=3, adaptive=False, context=False)
    alone = _alone(agree, PROMPTS[:2], **kw)
    with Engine(agree, n_ctx=2 * 512, n_parallel=2, **kw) as eng:
        gen = eng.stream(PROMPTS[3], n_predict=200, temperature=0)
        next(gen)
        next(gen)
        assert eng.slots.n_busy == 1
        gen.close()  # the consumer goes away: its slot is free again
        assert eng.slots.n_busy == 0
        got = eng.generate_many(PROMPTS[:2], n_predict=N, temperature=0)
    for a, b in zip(got, alone):
        _same(a, b)


def test_seeded_sampling_is_the_same_batched(agree):
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    kw = dict(mode="chain", n_max=3, adaptive=False, context=False)
    with Engine(agree, n_ctx=512, **kw) as eng:
        alone = [eng.generate(p, n_predict=N, sampling=params) for p in PROMPTS[:3]]
    with Engine(agree, n_ctx=3 * 512, n_parallel=3, **kw) as eng:
        got = eng.generate_many(PROMPTS[:3], n_predict=N, sampling=params)
    for a, b in zip(got, alone):
        assert a.tokens == b.tokens


def test_per_slot_context_and_bad_requests(agree):
    with Engine(agree, n_ctx=2 * 256, n_parallel=2, mode="chain") as eng:
        assert eng.n_ctx == 256
        with pytest.raises(ValueError, match="does not fit"):
            eng.generate([5] * 300, n_predict=4)
        # the engine and its other slot keep working
        ok = eng.generate_many([PROMPTS[0], PROMPTS[1]], n_predict=8, temperature=0)
        assert all(len(c.tokens) == 8 for c in ok)
        # a sequence that fills its share stops with "length", the other is unaffected
        long = eng.generate_many([[5] * 240, PROMPTS[1]], n_predict=100, temperature=0)
        assert long[0].finish_reason == "length" and len(long[0].tokens) == 256 - 240
        assert len(long[1].tokens) == 100
    with Engine(agree, n_ctx=2 * 256, n_parallel=2, kv_unified=True, mode="chain") as eng:
        assert eng.n_ctx == 512  # a shared cache: each slot may use all of it
    with pytest.raises(ValueError, match="n_parallel"):
        Engine(agree, n_parallel=0)


def test_request_ids_are_distinct():
    a = Request([1], 1, [], SamplingParams(), False)
    b = Request([1], 1, [], SamplingParams(), False)
    assert a.id != b.id


def test_a_full_shared_cache_drops_the_drafts_before_failing_a_request(agree):
    """A verify needs a cell per draft that plain decoding does not: when a shared
    cache has room for the sequences' next tokens only, the round goes on without its
    drafts (plain decoding's step, the same text) instead of failing the request as
    out of context. Simulated: every decode that carries drafts finds no room."""
    from stepmtp.llama import KVFullError

    with Engine(agree, mode="none", n_ctx=256) as eng:
        plain = eng.generate("def f", n_predict=24, temperature=0).tokens
    with Engine(agree, mode="chain", n_ctx=256, n_parallel=2, kv_unified=True) as eng:
        verify = eng.driver._verify
        refused = []

        def no_room_for_drafts(seqs):
            if any(s.drafts for s in seqs):
                refused.append(len(seqs))
                raise KVFullError("no KV cache slot for the batch (context full)")
            return verify(seqs)

        eng.driver._verify = no_room_for_drafts
        out = eng.generate("def f", n_predict=24, temperature=0)
    assert out.tokens == plain and refused  # drafts were made, refused, and dropped
    assert out.stats.n_accepted == 0


def test_short_prompts_grouped_within_the_batch(tiny):
    """Short chunks share a decode up to the one-row products' limit (63 rows) only while
    the batch holds them: on a sliding-window model whose window bounds the batch below
    -b (48 rows of 64 here; a prompt's last 4 tokens go apart), four prompts of 15-18 tokens made a 50-row group and the
    step raised "exceeds the batch capacity"."""
    path = tiny["embedded"]
    prompts = [[(7 * i + 13 * k) % 500 + 1 for k in range(15 + i)] for i in range(4)]
    with Engine(path, n_ctx=4 * 512, n_parallel=4, n_batch=64, n_ubatch=16, kv_unified=True, mode="none") as eng:
        drv = eng.slots.driver
        together, seen = drv.prefill_together, []

        def spy(seqs):
            seen.append(sum(drv.chunk_size(s) for s in seqs))
            return together(seqs)
        drv.prefill_together = spy
        reqs = [eng.submit(p, n_predict=6, temperature=0) for p in prompts]
        while eng.busy:
            eng.step()
        got = [r.completion.tokens for r in reqs]
        cap = drv.tbatch.capacity
    assert seen and max(seen) <= cap and max(seen) > 16  # shared, within the batch
    assert got == [c.tokens for c in _alone(path, prompts, n_predict=6, mode="none")]


@pytest.mark.parametrize("n_batch", [2048, 12])
def test_prompts_that_arrive_together_start_together(n_batch):
    """As llama-server fills one batch with every waiting prompt: requests queued together
    are prefilled chunk by chunk in the same steps, while their prompts fit the batch (a
    decode each, so each prompt's rows are its own), and their generations then share
    every round. One step prefilled one prompt before, and four clients' slots drafted
    and ended out of step. With a batch too small for two chunks, one goes per step."""
    from stepmtp.models import default_model_path

    with Engine(default_model_path(), n_ctx=4 * 512, n_parallel=4, n_batch=n_batch, n_ubatch=min(n_batch, 512),
                mode="none") as eng:
        reqs = [eng.submit(p, n_predict=8, temperature=0) for p in PROMPTS[:4]]
        started: dict[int, int] = {}
        step = 0
        while eng.busy:
            eng.step()
            step += 1
            for i, r in enumerate(reqs):
                if r.state.seq_id >= 0 and not r.state.prefilling:
                    started.setdefault(i, step)
        assert len(started) == 4
        if n_batch > 100:
            assert set(started.values()) == {started[0]}
        else:
            assert len(set(started.values())) == 4
        got = [r.completion.tokens for r in reqs]
    assert got == [c.tokens for c in _alone(default_model_path(), PROMPTS[:4], n_predict=8, mode="none")]


@pytest.mark.parametrize("gather_s", [0.5, 0.0])
def test_the_server_worker_starts_requests_sent_together_together(gather_s):
    """The server's scheduler, idle, waits a moment after a request for the ones sent
    with it (clients' threads, an agent's parallel calls reach it a few ms apart), so
    their prompts share decodes from the first step; without the wait, the second
    started after the first one's prefill had begun."""
    import asyncio
    import time

    from stepmtp.models import default_model_path
    from stepmtp.server.worker import Channel, GenRequest, Job, Worker

    with Engine(default_model_path(), n_ctx=4 * 512, n_parallel=4, mode="none") as eng:
        steps = [0]
        step = eng.step

        def counting_step():
            steps[0] += 1
            step()

        eng.step = counting_step
        started: list[int] = []
        worker = Worker(eng, on_start=lambda job: started.append(steps[0]))
        worker.GATHER_S = gather_s
        loop = asyncio.new_event_loop()
        try:
            jobs = [Job(GenRequest(eng.tokenize(p), 48, [], SamplingParams(temperature=0), False), Channel(loop))
                    for p in PROMPTS[:2]]
            t0 = time.perf_counter()
            worker.submit(jobs[0])
            time.sleep(0.05)
            worker.submit(jobs[1])
            while len(started) < 2 and time.perf_counter() - t0 < 30:
                time.sleep(0.005)
            if gather_s:
                assert started == [0, 0]
            else:
                assert started[0] == 0 and started[1] > 0
        finally:
            worker.stop()
            loop.close()


def test_prompt_chunks_share_a_decode_and_keep_their_text():
    """Four prompts queued together: their long chunks (64+ rows each: llama.cpp's gemm
    and attention tiles alone or together) go in one decode, then their 4-token tails
    (llama-server's split for checkpoints: one-row kernels alone or together, as a
    verify's rows) in another, as llama-server batches them; chunks of fewer than 64 rows
    share a decode while they stay under 64 rows together (one-row kernels up to 64 rows,
    flash attention's tiles from 64). Every row keeps the bits it
    gets decoded alone, so with MTP drafting at temperature 0 each text equals its text
    alone."""
    from stepmtp.models import default_model_path

    prompts = [(p * 12)[: 300 + 60 * i] for i, p in enumerate(PROMPTS[:4])]
    # the draft length fixed (the plan's, timed, left a sequence undrafted now and then on a
    # busy machine, and this test needs drafts in every one)
    with Engine(default_model_path(), n_ctx=4 * 1024, n_parallel=4, kv_unified=True,
                adaptive=False) as eng:  # -np auto
        drv = eng.driver
        sizes: list[list[int]] = []
        shared = drv.prefill_together

        def spy(seqs):
            sizes.append([drv.chunk_size(s) for s in seqs])
            return shared(seqs)

        drv.prefill_together = spy
        reqs = [eng.submit(p, n_predict=40, temperature=0) for p in prompts]
        while eng.busy:
            eng.step()
        got = [r.completion for r in reqs]
        n_prompt = [len(r.prompt_tokens) for r in reqs]
    assert all(len(x) == 1 or min(x) >= 64 and sum(x) <= 512 or sum(x) <= 63 for x in sizes)
    assert any(len(x) >= 3 and min(x) >= 64 for x in sizes)  # the long chunks shared
    assert any(len(x) >= 2 and sum(x) <= 63 for x in sizes)  # the short ones too
    assert sum(map(sum, sizes)) == sum(n_prompt)
    assert all(sum(g.stats.drafted_per_depth) for g in got)  # MTP drafted in every one
    for g, a in zip(got, _alone(default_model_path(), prompts, n_predict=40)):
        assert g.tokens == a.tokens


def test_chunks_grouped_to_share_a_decode_keep_their_bits():
    """The grouping rule, bit for bit: prompt chunks (each a sequence's, from position 0)
    decoded in one decode give the logits of their last rows, and of a token decoded
    after them, that decoding them one after another gives, for every group the rule
    forms; the mixes it keeps apart do not (a 19- and a 48-row chunk: together they
    reach the attention tiles; three of 30 rows; a long chunk with a short one)."""
    from stepmtp import Batch, Context, Model
    from stepmtp.models import default_model_path
    from stepmtp.mtp import MTPDriver

    m = Model(default_model_path())
    toks = m.tokenize("import os\nimport sys\n\ndef main(argv):\n    for a in argv:\n        print(a, len(a))\n" * 20,
                      add_special=False)

    def rows(sizes, together):
        chunks = [(s, toks[7 * s : 7 * s + n]) for s, n in enumerate(sizes)]
        out = []
        with Context(m, n_ctx=2048, n_seq_max=len(sizes), kv_unified=True) as ctx:
            b = Batch(512)
            if together:
                b.clear()
                last = [b.append(t, 0, s, outputs="last") + len(t) - 1 for s, t in chunks]
                ctx.decode(b)
                out += [ctx.logits(i).copy() for i in last]
            else:
                for s, t in chunks:
                    b.fill(t, 0, s, outputs="last")
                    ctx.decode(b)
                    out.append(ctx.logits(-1).copy())
            for s, t in chunks:  # what each chunk left in the cache
                b.fill(t[:1], len(t), s, outputs="last")
                ctx.decode(b)
                out.append(ctx.logits(-1).copy())
        return out

    def same(sizes):
        return all(np.array_equal(a, b) for a, b in zip(rows(sizes, False), rows(sizes, True)))

    for sizes in ([64, 100, 128], [4, 4, 8], [92, 128, 75, 94]):
        assert MTPDriver.chunk_groups(sizes, 16, 512) == [list(range(len(sizes)))]
        assert same(sizes), sizes
    for sizes in ([19, 48], [30, 30, 30], [4, 100]):
        assert len(MTPDriver.chunk_groups(sizes, 16, 512)) == len(sizes)
        assert not same(sizes), sizes
