"""KV memory as llama-server's: a sliding-window cache of the window plus one ubatch,
and one layer per head in the draft contexts. Speculation rolls back rows the target
and the heads wrote; past the window the output must still be plain decoding's."""
from __future__ import annotations

import pytest

from stepmtp import Context, Engine, Model
from stepmtp.models import EVAL_PROMPTS, default_model_path

N_UBATCH = 64  # the bundled model's window is 128: a 256-cell sliding-window cache
N_GEN = 420    # well past the window plus the ubatch, and past the cache's cells


@pytest.fixture(scope="module")
def path():
    return default_model_path()


def _engine(path, **kw) -> Engine:
    return Engine(path, n_ctx=2048, n_ubatch=N_UBATCH, n_batch=256, n_threads=1, **kw)


def test_draft_kv_is_one_layer_per_head(path):
    """The heads' contexts together hold what one MTP stream of all three blocks holds
    (llama-server's draft context), and the target's sliding-window layers hold the
    window plus one ubatch."""
    with Model(path) as m:
        with Context(m, mtp=True, n_ctx=2048, n_ubatch=N_UBATCH) as one_stream:
            want = one_stream.memory()["kv"]
        with Context(m, n_ctx=2048, n_ubatch=N_UBATCH, swa_full=True) as full, \
                Context(m, n_ctx=2048, n_ubatch=N_UBATCH) as trimmed:
            kv_full, kv_trimmed = full.memory()["kv"], trimmed.memory()["kv"]
            assert trimmed.model.n_swa == 128
    assert kv_trimmed < kv_full
    with _engine(path, mode="chain", n_max=3) as eng:
        mem = eng.memory()
        assert [d.mtp_block for d in eng.drafts] == [0, 1, 2]
    assert mem["draft"]["kv"] == want
    assert mem["target"]["kv"] == kv_trimmed
    # chain-2 (fused) decodes two heads: the third has no context at all
    with _engine(path, mode="chain", n_max=2) as eng:
        assert eng.drafts[2] is None and eng.drafts[0].mtp_block == 0
        assert eng.memory()["draft"]["kv"] < want


def test_a_bound_head_context_refuses_other_blocks(path):
    with Model(path) as m, Context(m, mtp=True, mtp_block=1, n_ctx=256) as ctx:
        assert ctx.mtp_offset == 1
        with pytest.raises(ValueError):
            ctx.mtp_offset = 0
        with pytest.raises(ValueError):
            Context(m, mtp=True, mtp_block=3, n_ctx=256)


@pytest.fixture(scope="module")
def plain(path):
    """Plain greedy decoding with the same (trimmed) cache: one slot, and two slots."""
    prompts = list(EVAL_PROMPTS[:2])
    with _engine(path, mode="none") as eng:
        one = eng.generate(prompts[0], n_predict=N_GEN, temperature=0).tokens
        # the trimmed cache did drop cells: the earliest positions are gone
        assert eng.target.seq_pos_min(0) > 0
    with _engine(path, mode="none", n_parallel=2) as eng:
        two = [c.tokens for c in eng.generate_many(prompts, n_predict=N_GEN, temperature=0)]
    assert len(one) == N_GEN
    return prompts, one, two


@pytest.mark.parametrize("schedule", ["fused", "reference"])
@pytest.mark.parametrize("mode,n_max", [("chain", 1), ("chain", 2), ("chain", 3), ("single", 3)])
def test_speculation_past_the_window_is_plain_decoding(path, plain, mode, n_max, schedule):
    prompts, one, two = plain
    with _engine(path, mode=mode, n_max=n_max, schedule=schedule) as eng:
        c = eng.generate(prompts[0], n_predict=N_GEN, temperature=0)
        assert eng.target.seq_pos_min(0) > 0
    assert c.tokens == one
    assert c.stats.n_accepted > 0
    with _engine(path, mode=mode, n_max=n_max, schedule=schedule, n_parallel=2) as eng:
        got = [c.tokens for c in eng.generate_many(prompts, n_predict=N_GEN, temperature=0)]
    assert got == two


def test_adaptive_lengths_past_the_window(path, plain):
    """Row counts differ between slots (adaptive lengths), a KV stream per slot
    (llama.cpp gives each ubatch equal rows per stream: a slot's rows get split)."""
    prompts, _, two = plain
    with _engine(path, mode="chain", n_max=3, adaptive=True, n_parallel=2) as eng:
        assert not eng.target.kv_unified and not eng.drafts[0].kv_unified
        got = [c.tokens for c in eng.generate_many(prompts, n_predict=N_GEN, temperature=0)]
    assert got == two


@pytest.mark.parametrize("schedule", ["fused", "reference"])
def test_unified_kv_past_the_window(path, plain, schedule):
    """One KV stream for both slots (llama-server's -kvu, its default with -np auto):
    each slot has its region of the sliding-window cache."""
    prompts = plain[0]
    with _engine(path, mode="none", n_parallel=2, kv_unified=True) as eng:
        want = [c.tokens for c in eng.generate_many(prompts, n_predict=N_GEN, temperature=0)]
    with _engine(path, mode="chain", n_max=3, schedule=schedule, n_parallel=2, kv_unified=True) as eng:
        assert eng.target.kv_unified and eng.drafts[0].kv_unified
        got = [c.tokens for c in eng.generate_many(prompts, n_predict=N_GEN, temperature=0)]
    assert got == want


@pytest.mark.parametrize("mode", ["none", "chain"])
def test_cached_prompt_cut_before_the_window(path, mode):
    """A next prompt that leaves the cached tokens long before their end: the window
    before that point was overwritten, so the slot goes on from a context checkpoint
    near the last prompt's end, or from the start; the output is a fresh run's."""
    with _engine(path, mode=mode) as eng:
        far, near = eng.driver.split_offsets  # 4 + n_ubatch, 4: llama-server's
        assert (far, near) == (4 + N_UBATCH, 4)
        p1 = eng.tokenize(EVAL_PROMPTS[2])
        out1 = eng.generate(p1, n_predict=N_GEN, temperature=0).tokens
        tail = eng.tokenize("\n\n\ndef other(x):\n", add_special=False)
        cuts = {  # where the next prompt leaves the cache -> the checkpoint it goes on from
            "in the answer": (p1 + out1[:200] + tail, len(p1) - near),
            "2 before p1's end": (p1[:-2] + tail, len(p1) - near),
            "10 before p1's end": (p1[:-10] + tail, len(p1) - far),
            "100 before p1's end": (p1[:-100] + tail, 0),
        }
        for name, (prompt, cached) in cuts.items():
            fresh = eng.generate(prompt, n_predict=64, temperature=0, cache_prompt=False, n_probs=2)
            eng.generate(p1, n_predict=N_GEN, temperature=0, cache_prompt=False)
            got = eng.generate(prompt, n_predict=64, temperature=0, n_probs=2)
            assert got.stats.n_prompt_cached == cached, name
            _same_up_to_rounding(got, fresh, name)


def _same_up_to_rounding(got, fresh, name: str, tie: float = 0.03, tol: float = 0.04) -> None:
    """``got`` is ``fresh``'s text up to rounding. The two read the prompt in other
    batches (from a checkpoint, from the start), and llama.cpp's CPU kernels round a
    row otherwise in a batch of 4 rows than in one of 64 (so does a fresh run with
    another ``n_ubatch``: top probabilities up to 0.012 apart on the bundled model, and
    0.022 here), and the F16 cache keeps the difference. So: the same tokens, each with
    a probability within ``tol`` of the fresh run's, until a token where the fresh run's
    two best were within ``tie`` (the texts may part there). The window's cells from
    another text (a wrong checkpoint) part the texts at once with the two best far apart."""
    for i, (a, b) in enumerate(zip(got.tokens, fresh.tokens)):
        pg, pf = got.probs[i], fresh.probs[i]
        if a != b:
            (_, p1), (_, p2) = pf.top[:2]
            assert p1 - p2 < tie, (name, i, pf, pg)
            return
        assert abs(pg.p - pf.p) < tol, (name, i, pf, pg)
    assert len(got.tokens) == len(fresh.tokens), name


def test_swa_full_keeps_every_cell(path):
    with _engine(path, mode="chain", n_max=3, swa_full=True) as eng:
        c = eng.generate(EVAL_PROMPTS[0], n_predict=N_GEN, temperature=0)
        assert eng.target.seq_pos_min(0) == 0
        assert eng.memory()["target"]["kv"] > 0
    assert c.stats.n_predicted == N_GEN


def test_two_threads_past_512_cells_speculation_is_plain(path):
    """With two threads and a KV past 512 cells, llama.cpp's CPU attention split a lone
    query row over the cells (patch 0009 turns that off): plain decoding's one-row
    decodes then rounded otherwise than the same rows of a verify, and every one of
    these texts parted from plain decoding's, one at its second token."""
    prompts = list(EVAL_PROMPTS[:4])
    outs = {}
    for mode in ("none", "chain"):
        with Engine(path, n_ctx=2048, n_threads=2, mode=mode, n_max=3) as eng:
            no_eos = {t: float("-inf") for t in range(eng.model.n_vocab) if eng.model.is_eog(t)}
            outs[mode] = [eng.generate(p, n_predict=520, temperature=0, cache_prompt=False, logit_bias=no_eos).tokens
                          for p in prompts]
            assert min(len(eng.tokenize(p)) for p in prompts) + 520 > 512
    assert outs["chain"] == outs["none"]
