"""Prompt caching: a request reuses the KV its slot holds from the previous one
(target and heads), decodes only the rest, and its output is the same as without."""
from __future__ import annotations

import threading

import pytest

from stepmtp import Engine
from stepmtp.mtp import common_prefix
from stepmtp.tiny import write_agree_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 24


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    return write_agree_model(tmp_path_factory.mktemp("agree-cache"), seed=0)[0]


def turns(eng: Engine) -> list[list[int]]:
    """A growing conversation: each prompt extends the last prompt and its answer."""
    p1 = eng.tokenize(PROMPT)
    out1 = eng.generate(p1, n_predict=N, temperature=0, cache_prompt=False).tokens
    p2 = p1 + out1 + eng.tokenize("\n    return 0\n", add_special=False)
    return [p1, p2, p2[:-3] + eng.tokenize("\n\nclass A:\n", add_special=False)]


# fixed draft lengths where counts are compared (an adaptive length's follow the timings)
@pytest.mark.parametrize("cfg", [dict(mode="none"), dict(mode="chain", n_max=3, adaptive=False, context=False),
                                 dict(mode="chain", n_max=2, schedule="reference", adaptive=False, context=False),
                                 dict(mode="single", n_max=2, adaptive=False, context=False), dict(mode="chain", n_max=3)],
                         ids=["none", "chain-3", "chain-2-ref", "single-2", "chain-3-adapt"])
@pytest.mark.parametrize("model", ["tiny", "agree"])
def test_cached_prefix_gives_the_same_output(tiny, agree, model, cfg):
    path = tiny["embedded"] if model == "tiny" else agree
    with Engine(path, n_ctx=1024, debug=True, **cfg) as eng:
        prompts = turns(eng)
        fresh = [eng.generate(p, n_predict=N, temperature=0, cache_prompt=False) for p in prompts]
        cached = [eng.generate(p, n_predict=N, temperature=0) for p in prompts]
    for f, c, p in zip(fresh, cached, prompts):
        assert c.tokens == f.tokens
        assert f.stats.n_prompt_cached == 0
        assert c.stats.n_prompt == len(p)
    # each turn reuses what it shares with the slot's last prompt and output (the KV
    # holds all but the last token sampled, perhaps accepted drafts past the end too),
    # but the last shared token, decoded again for its trunk row (without speculation
    # too: the same pieces, the same last bits)
    held = prompts[2] + fresh[2].tokens[:-1]
    for c, p in zip(cached, prompts):
        assert min(common_prefix(held, p), len(p) - 1) - 1 <= c.stats.n_prompt_cached <= len(p) - 2
        held = p + c.tokens[:-1]
    assert cached[1].stats.n_prompt_cached >= len(prompts[0]) + N - 2
    if cfg["mode"] != "none" and cfg.get("adaptive") is False:
        # the heads' state was reused too: they draft and accept what they do after a fresh prompt
        for f, c in zip(fresh, cached):
            assert (c.stats.drafted_per_depth, c.stats.accepted_per_depth) == \
                   (f.stats.drafted_per_depth, f.stats.accepted_per_depth)


def test_nothing_in_common_decodes_everything(tiny):
    with Engine(tiny["embedded"], mode="chain", n_max=3, n_ctx=1024) as eng:
        eng.generate(PROMPT, n_predict=8, temperature=0)
        out = eng.generate("class B:\n    pass\n", n_predict=8, temperature=0)
        assert out.stats.n_prompt_cached == 0
        # the same prompt again: everything but the last two tokens comes from the cache
        again = eng.generate("class B:\n    pass\n", n_predict=8, temperature=0)
        assert again.stats.n_prompt_cached == again.stats.n_prompt - 2  # chain: the last shared token again
        assert again.tokens == out.tokens


def test_slots_pick_the_cache_that_shares_most(agree):
    """Two conversations on two slots, interleaved: each turn goes back to its own slot."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=2 * 1024, n_parallel=2) as eng:
        a = eng.tokenize(PROMPT)
        b = eng.tokenize("def parse(text):\n    '''Parse it.'''\n")
        ra = eng.generate(a, n_predict=N, temperature=0)
        rb = eng.generate(b, n_predict=N, temperature=0)
        ra2 = eng.generate(a + ra.tokens, n_predict=N, temperature=0)
        rb2 = eng.generate(b + rb.tokens, n_predict=N, temperature=0)
        assert ra2.stats.n_prompt_cached >= len(a) + N - 2
        assert rb2.stats.n_prompt_cached >= len(b) + N - 2
        ref = eng.generate(a + ra.tokens, n_predict=N, temperature=0, cache_prompt=False)
        assert ra2.tokens == ref.tokens


@pytest.mark.parametrize("unified", [False, True])
def test_batched_slots_with_cached_prefixes_equal_each_alone(agree, unified):
    """Two requests sharing a long prefix, decoded together on two slots (each with its
    own copy of the prefix's KV): each equals its run alone, and states never mix."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=2 * 1024, n_parallel=2, kv_unified=unified) as eng:
        base = eng.tokenize(PROMPT)
        prompts = [base + eng.tokenize(s, add_special=False) for s in ("    x = 1\n", "    y = [2]\n")]
        alone = [eng.generate(p, n_predict=N, temperature=0, cache_prompt=False).tokens for p in prompts]
        for _ in range(2):  # the second time both slots hold a cached prefix
            outs: list = [None, None]

            def run(i: int) -> None:
                outs[i] = eng.generate(prompts[i], n_predict=N, temperature=0)

            ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert [o.tokens for o in outs] == alone


def test_unified_cache_evicts_idle_prefixes_when_full(agree):
    """With one shared KV cache, idle slots' cached prefixes give way to a prompt
    that needs their cells instead of failing it."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=512, n_parallel=2, kv_unified=True) as eng:
        long = eng.tokenize(PROMPT * 14)[:300]
        eng.generate(long, n_predict=8, temperature=0)
        other = eng.tokenize("class C:\n" * 40)[:300]
        out = eng.generate(other, n_predict=8, temperature=0)  # 300 + 300 > 512 cells
        assert len(out.tokens) == 8


def test_kv_full_preempts_and_resumes(agree):
    """Two generations outgrow one small shared cache: the one whose rows do not fit
    gives up its cells and waits (llama-server fails it, and the other with it), then
    goes on from its prompt and output decoded again: both reach their context's end,
    which one cache could not hold at once, each with the text it has alone."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=256, n_parallel=2, kv_unified=True, n_ubatch=256,
                n_batch=256) as eng:
        no_eos = {t: float("-inf") for t in range(eng.model.n_vocab) if eng.model.is_eog(t)}
        prompts = [eng.tokenize(PROMPT), eng.tokenize("def parse(text):\n")]
        reqs = [eng.submit(p, n_predict=400, temperature=0, logit_bias=no_eos) for p in prompts]
        while eng.busy:
            eng.step()
        assert [r.error for r in reqs] == [None, None]
        out = [r.completion for r in reqs]
        assert all(c.finish_reason == "length" and len(c.prompt_tokens) + len(c.tokens) == eng.n_ctx for c in out)
        for p, c in zip(prompts, out):
            assert c.stats.n_prompt == len(p)  # the prompt's count, whatever was decoded again
            alone = eng.generate(p, n_predict=400, temperature=0, logit_bias=no_eos)
            assert alone.tokens == c.tokens
        # the engine goes on
        assert len(eng.generate("x", n_predict=4, temperature=0).tokens) == 4


def test_kv_full_with_no_slot_to_wait_for_ends_as_length(agree, monkeypatch):
    """When no slot would free cells (every running one found no room), a generation
    ends as one that reached its context: its text so far, "length"."""
    from stepmtp.llama import KVFullError

    with Engine(agree, mode="chain", n_max=3, n_ctx=512, n_parallel=2, kv_unified=True) as eng:
        reqs = [eng.submit(p, n_predict=40, temperature=0) for p in (PROMPT, "def parse(text):\n")]
        while not all(r.n_decoded >= 4 for r in reqs):
            eng.step()
        so_far = [list(r.out_tokens) for r in reqs]
        monkeypatch.setattr(eng.driver, "round", lambda seqs: [KVFullError("no room") for _ in seqs])
        eng.step()
        monkeypatch.undo()
        assert [r.error for r in reqs] == [None, None]
        assert [r.completion.finish_reason for r in reqs] == ["length", "length"]
        assert [r.completion.tokens for r in reqs] == so_far
        assert all(r.completion.text == eng.model.detokenize(r.completion.tokens) for r in reqs)
        assert eng.generate(PROMPT, n_predict=40, temperature=0).tokens[:len(so_far[0])] == so_far[0]


def test_prompt_without_room_waits_for_a_busy_slot(agree):
    """A prompt that finds no room in a shared cache a generation holds (not idle:
    nothing to evict; paused, its client reading behind, so it is not preempted
    either) waits for that slot to end instead of failing (llama-server: a 500);
    both are served as each is alone."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=256, n_parallel=2, kv_unified=True, n_ubatch=256,
                n_batch=256) as eng:
        no_eos = {t: float("-inf") for t in range(eng.model.n_vocab) if eng.model.is_eog(t)}
        text = "def parse(text):\n" * 6
        long = eng.submit(PROMPT, n_predict=400, temperature=0, logit_bias=no_eos)
        while len(long.prompt_tokens) + long.n_decoded < 250:
            eng.step()
        long.paused = True
        late = eng.submit(text, n_predict=8, temperature=0)
        for _ in range(40):  # its prompt finds no room at any size: it waits
            eng.step()
        assert late.error is None and late.completion is None
        assert eng.slots.stalled  # nothing to step for until the client reads on
        long.paused = False
        while eng.busy:
            eng.step()
        assert long.error is None and late.error is None
        assert len(long.prompt_tokens) + len(long.completion.tokens) == eng.n_ctx
        assert late.completion.tokens == eng.generate(text, n_predict=8, temperature=0).tokens
        assert long.completion.tokens == eng.generate(PROMPT, n_predict=400, temperature=0, logit_bias=no_eos).tokens


def test_host_restore_without_room_evicts_then_decodes_afresh(agree):
    """A prompt kept in host memory (--cache-ram) goes back into a full shared cache:
    idle slots' caches make room for it, and when none is idle (the others are
    generating) the prompt is decoded afresh, the state kept for later. Either way the
    request is served, with the output it has without any cache."""
    with Engine(agree, mode="chain", n_max=3, n_ctx=1024, n_parallel=3, kv_unified=True, cache_ram_mib=64,
                n_batch=64, n_ubatch=64) as eng:
        no_eos = {t: float("-inf") for t in range(eng.model.n_vocab) if eng.model.is_eog(t)}
        texts = [PROMPT * 20, "class Parser:\n    '''Parse it.'''\n" * 30, "x = [1, 2, 3]\n" * 60]
        a, b, c = (eng.tokenize(t)[:340] for t in texts)

        def kept(prompt):
            return any(common_prefix(st.tokens, prompt) >= 340 for st in eng.driver.host._items.values())

        first = eng.generate(a, n_predict=8, temperature=0)
        again = a + first.tokens[:-1] + eng.tokenize("\n    x = 1\n", add_special=False)
        ref = eng.generate(again, n_predict=N, temperature=0, cache_prompt=False, logit_bias=no_eos)
        for p in (a, b, c):
            eng.generate(p, n_predict=8, temperature=0)
        # c took the cells a held: a is in host memory, b and c leave too few cells for it
        assert kept(again) and eng.driver.cached_tokens(0) == []
        out = eng.generate(again, n_predict=N, temperature=0, logit_bias=no_eos)
        # it came back: idle b's cells gave way
        assert out.tokens == ref.tokens and out.stats.n_prompt_cached >= 340

        # now with b and c generating: nothing to evict, it is decoded afresh
        eng.generate(b, n_predict=8, temperature=0)
        eng.generate(c, n_predict=8, temperature=0)
        assert kept(again)
        busy = [eng.submit(p + [7] * 20, n_predict=24, temperature=0, logit_bias=no_eos) for p in (b, c)]
        while any(r.state.seq_id < 0 or r.state.prefilling for r in busy):
            eng.step()
        late = eng.submit(again, n_predict=N, temperature=0, logit_bias=no_eos)
        while eng.busy:
            eng.step()
        assert late.error is None and all(r.error is None for r in busy)
        assert late.completion.tokens == ref.tokens and late.completion.stats.n_prompt_cached == 0
        assert kept(again)


@pytest.mark.parametrize("cfg", [dict(mode="chain", n_max=3, adaptive=False, context=False),
                                 dict(mode="chain", n_max=3, schedule="reference", adaptive=False, context=False),
                                 dict(mode="none")], ids=["fused", "reference", "none"])
def test_slot_save_restore_into_another_engine(agree, tmp_path, cfg):
    """A slot's cache saved to a file (target and heads) and restored into a fresh
    engine: the next request reuses it and generates, and drafts, as after a fresh prompt."""
    from stepmtp.engine import SlotBusy

    prompt = PROMPT * 6
    with Engine(agree, n_ctx=1024, debug=True, **cfg) as eng:
        first = eng.generate(prompt, n_predict=N, temperature=0)
        n, size = eng.save_slot(0, tmp_path / "slot.bin")
        assert n >= len(eng.tokenize(prompt)) and size > 0
        assert eng.erase_slot(0) == n and eng.erase_slot(0) == 0
        again = eng.generate(prompt, n_predict=N, temperature=0)
        assert again.stats.n_prompt_cached == 0
        req = eng.submit(prompt, n_predict=4)
        eng.step()
        with pytest.raises(SlotBusy):
            eng.save_slot(0, tmp_path / "busy.bin")
        eng.cancel(req)
    with Engine(agree, n_ctx=1024, debug=True, **cfg) as eng:
        assert eng.restore_slot(0, tmp_path / "slot.bin")[0] == n
        out = eng.generate(prompt, n_predict=N, temperature=0)
        # the file keeps the sliding-window cells of its last position's window (as
        # llama.cpp saves them) and the context checkpoints: the same prompt goes on
        # from the one 4 tokens before its end
        assert out.stats.n_prompt_cached >= len(eng.tokenize(prompt)) - eng.driver.split_offsets[-1]
        assert out.tokens == first.tokens
        assert (out.stats.drafted_per_depth, out.stats.accepted_per_depth) == \
               (first.stats.drafted_per_depth, first.stats.accepted_per_depth)
        with pytest.raises(ValueError):
            eng.save_slot(5, tmp_path / "x.bin")


def test_server_slot_actions(agree, tmp_path):
    import httpx

    from tests.test_server import running

    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    args = ["-m", str(agree), "--spec-type", "draft-mtp", "-c", "2048", "-np", "1", "-t", "1",
            "--slot-save-path", str(save_dir)]
    with running(args, tmp_path) as srv:
        body = {"prompt": PROMPT * 4, "n_predict": 8, "temperature": 0}
        first = httpx.post(srv.url + "/completion", json=body, timeout=60).json()
        r = httpx.post(srv.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=60).json()
        assert r["id_slot"] == 0 and r["filename"] == "a.bin" and r["n_saved"] > 0 and r["n_written"] > 0
        assert "save_ms" in r["timings"] and (save_dir / "a.bin").is_file()
        assert httpx.post(srv.url + "/slots/0?action=erase", timeout=60).json() == {"id_slot": 0,
                                                                                    "n_erased": r["n_saved"]}
        r2 = httpx.post(srv.url + "/slots/0?action=restore", json={"filename": "a.bin"}, timeout=60).json()
        assert r2["n_restored"] == r["n_saved"] and r2["n_read"] == r["n_written"]
        again = httpx.post(srv.url + "/completion", json=body, timeout=60).json()
        assert again["content"] == first["content"] and again["timings"]["cache_n"] > 0
        for bad in ({"filename": "../x"}, {"filename": ""}, {}, {"filename": ".hidden"}):
            r = httpx.post(srv.url + "/slots/0?action=save", json=bad, timeout=60)
            assert r.status_code == 400, bad
        assert httpx.post(srv.url + "/slots/0?action=nope", timeout=60).status_code == 400
        assert httpx.post(srv.url + "/slots/0?action=restore", json={"filename": "missing.bin"},
                          timeout=60).status_code == 400
    with running(args[:-2], tmp_path) as srv:
        r = httpx.post(srv.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=60)
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


@pytest.mark.parametrize("cfg", [dict(mode="chain", n_max=3, adaptive=False, context=False),
                                 dict(mode="chain", n_max=2, schedule="reference", adaptive=False, context=False)],
                         ids=["fused", "reference"])
def test_host_memory_keeps_a_conversation_another_one_displaced(agree, cfg):
    """One slot, two conversations taking turns: with --cache-ram the one that lost the
    slot comes back from host memory (its next turn decodes only what is new), and the
    output is what it is without any cache."""
    a, b = PROMPT * 5, "class Parser:\n    '''Parse it.'''\n" * 5
    with Engine(agree, n_ctx=2048, debug=True, cache_ram_mib=64, **cfg) as eng:
        first_a = eng.generate(a, n_predict=N, temperature=0)
        eng.generate(b, n_predict=N, temperature=0)  # takes the slot: a goes to host memory
        assert len(eng.driver.host) == 1
        follow = eng.tokenize(a) + first_a.tokens[:-1] + eng.tokenize("\n    x = 1\n", add_special=False)
        out = eng.generate(follow, n_predict=N, temperature=0)
        # all of a's turn when the state kept reaches back there, else from the
        # checkpoint 4 tokens before the end of a's prompt
        assert out.stats.n_prompt_cached >= len(eng.tokenize(a)) - eng.driver.split_offsets[-1]
        ref = eng.generate(follow, n_predict=N, temperature=0, cache_prompt=False)
        assert out.tokens == ref.tokens
        assert (out.stats.drafted_per_depth, out.stats.accepted_per_depth) == \
               (ref.stats.drafted_per_depth, ref.stats.accepted_per_depth)
    with Engine(agree, n_ctx=2048, **cfg) as eng:  # without it: b's turn wiped a
        eng.generate(a, n_predict=N, temperature=0)
        eng.generate(b, n_predict=N, temperature=0)
        assert eng.generate(follow, n_predict=N, temperature=0).stats.n_prompt_cached == 0


def test_host_memory_keeps_what_a_shared_prefix_would_lose(agree):
    """Two conversations behind the same system prompt take turns in one slot: the
    slot keeps the shared prefix for the newcomer, and the rest of the conversation
    it displaced goes to host memory, so that conversation's next turn decodes only
    what is new (agents share a long system prompt; llama-server saves the slot's
    prompt before any of it is lost)."""
    system = "# shared instructions for every agent\n" * 4
    a, b = system + PROMPT * 4, system + "class Parser:\n    '''Parse it.'''\n" * 4
    with Engine(agree, n_ctx=2048, cache_ram_mib=64, mode="chain", n_max=3, adaptive=False, context=False) as eng:
        n_system = common_prefix(eng.tokenize(a), eng.tokenize(b))
        assert n_system > 16
        first_a = eng.generate(a, n_predict=N, temperature=0)
        out_b = eng.generate(b, n_predict=N, temperature=0)
        assert out_b.stats.n_prompt_cached >= n_system - 1  # the slot kept the shared prefix
        assert len(eng.driver.host) == 1  # and a's own part went out, not lost
        follow = eng.tokenize(a) + first_a.tokens[:-1] + eng.tokenize("\n    x = 1\n", add_special=False)
        out = eng.generate(follow, n_predict=N, temperature=0)
        assert out.stats.n_prompt_cached >= len(eng.tokenize(a)) - eng.driver.split_offsets[-1]
        assert out.tokens == eng.generate(follow, n_predict=N, temperature=0, cache_prompt=False).tokens


def test_server_full_shared_cache_serves_both(agree, tmp_path):
    """Two answers that outgrow one small shared cache, one streamed: both are 200s
    that go on to their context's end, finish_reason "length" (llama-server fails the
    one that finds no room, and every running slot with it)."""
    import json

    import httpx

    from tests.test_server import running

    args = ["-m", str(agree), "--spec-type", "draft-mtp", "-c", "256", "-np", "2", "--kv-unified", "-b", "256",
            "-ub", "256", "-t", "1"]
    with running(args, tmp_path) as srv:
        results = {}

        def whole():
            r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True})
            results["whole"] = (r.status_code, r.json())

        def streamed():
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json={
                    "prompt": "def parse(text):\n", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
                results["streamed"] = (r.status_code, events)

        ts = [threading.Thread(target=f) for f in (whole, streamed)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        code, body = results["whole"]
        assert code == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 256
        code, events = results["streamed"]
        assert code == 200 and all("error" not in e for e in events), events[-1]
        assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "length"
        assert events[-1]["usage"]["prompt_tokens"] + events[-1]["usage"]["completion_tokens"] == 256
