"""One sequence, one text: at temperature 0 a prompt's text is the text it gets decoded
alone, whichever slot runs it, whatever shares its decodes, however its prompt is cut
into decodes, and wherever its prefix came from (decoded for it, the slot's cache, host
memory, a slot file).

The randomized test drives engines of 1-4 slots (one cache stream per slot or one shared
cache; small and large batches; host memory on and off; MTP drafting with draft lengths
drawn at random round by round) through requests of several prompts at once, with
cache_prompt on and off, slot files saved and restored between them, and compares each
text, and its token probabilities to the last bit, with the prompt's decoded alone by
plain decoding. Where a prompt's cells were computed is what the CPU's kernels round by
(a ubatch's size picks them): a request without cache_prompt decodes its prompt in the
pieces it gets alone, and is compared in every configuration; one that goes on from a
cached prefix, whose cells another prompt's pieces or a generation's one-row decodes
wrote, is compared where every ubatch takes one-row kernels (-ub 16 or less).
"""
from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from stepmtp import Engine
from stepmtp.tiny import write_agree_model

from test_engine import _random_plans
from test_server import running

N = 24  # tokens generated per prompt


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory) -> dict[str, Path]:
    # the random tiny model (its text turns on every bit of attention) and the agree
    # model (its heads' drafts are partly accepted: verifies of several rows)
    return {"random": tiny["embedded"], "agree": write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]}


def test_two_copies_in_one_request_write_one_text(tiny, tmp_path):
    """The issue's request: two copies of a prompt in one /completion, two slots with
    small contexts, after the prompt was sent alone. The second copy's slot restored the
    first slot's prompt from host memory (--cache-ram, on by default), whose saved cells
    held only its last position's sliding window: the window of the first position to
    decode again was missing, and the second text parted from the first at its first
    token. It now goes on only from where the window is whole (else from the start)."""
    argv = ["-m", str(tiny["embedded"]), "-np", "2", "-b", "32", "-c", "512", "--temp", "0", "-t", "1"]
    with running(argv, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        toks = c.post("/tokenize", json={"content": "I believe the meaning of life is", "add_special": True}).json()
        toks = toks["tokens"]

        def texts(prompt, **kw):
            r = c.post("/completion", json={"prompt": prompt, "n_predict": 32, **kw})
            assert r.status_code == 200, r.text
            body = r.json()
            return [x["content"] for x in body] if isinstance(body, list) else [body["content"]]

        alone = texts(toks)[0]
        pair = texts([toks, toks])
        assert texts([toks, toks], cache_prompt=False) == [alone, alone]
        assert pair == [alone, alone]
        assert texts(toks) == [alone]


def _prompts(rng: random.Random) -> list[list[int]]:
    """Six prompts of 2-200 tokens: most share a prefix of a common text (cached
    prefixes of every length), one is a copy of another."""
    base = [rng.randrange(500) for _ in range(200)]
    out: list[list[int]] = []
    while len(out) < 6:
        kind = rng.random()
        if kind < 0.25:
            out.append([rng.randrange(500) for _ in range(rng.randrange(2, 200))])
        elif kind < 0.85 or not out:
            k = rng.randrange(1, 180)
            out.append(base[:k] + [rng.randrange(500) for _ in range(rng.randrange(0, 200 - k))])
        else:
            out.append(list(rng.choice(out)))
    return out


#: (slots, -b, -ub, context per slot, one cache for all slots, host memory MiB, drafting, model)
CONFIGS = [
    (1, 512, 16, 512, False, 64, True, "random"),
    (2, 32, 16, 256, False, 64, False, "random"),
    (2, 16, 16, 256, True, 64, True, "random"),
    (2, 512, 512, 256, True, 64, True, "random"),
    (3, 16, 16, 512, True, 0, True, "agree"),
    (3, 512, 512, 512, False, 64, False, "random"),
    (4, 512, 16, 256, False, 64, True, "random"),
    (4, 64, 16, 512, True, 64, False, "random"),
    (4, 100, 100, 512, True, 0, True, "agree"),
]


class _Alone:
    """Each prompt's text decoded alone (plain decoding, nothing cached), by engines of the
    configuration's cache layout: one slot for a cache per slot, the same slots for a
    shared cache (its sliding-window cells are split between the slots)."""

    def __init__(self) -> None:
        self.engines: dict[tuple, Engine] = {}
        self.done: dict[tuple, tuple[list[int], list[float]]] = {}

    def __call__(self, path: Path, n_batch: int, n_ubatch: int, ctx: int, unified: bool, slots: int,
                 prompt: list[int]):
        layout = (str(path), n_batch, n_ubatch, ctx, unified, slots if unified else 1)
        key = layout + (tuple(prompt),)
        if key not in self.done:
            eng = self.engines.get(layout)
            if eng is None:
                n = layout[-1]
                eng = self.engines[layout] = Engine(path, n_ctx=ctx * n, n_parallel=n, kv_unified=unified,
                                                    n_batch=n_batch, n_ubatch=n_ubatch, mode="none")
            c = eng.generate(prompt, n_predict=N, temperature=0, cache_prompt=False, n_probs=1)
            self.done[key] = (c.tokens, [p.p for p in c.probs])
        return self.done[key]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()


@pytest.fixture(scope="module")
def alone():
    a = _Alone()
    yield a
    a.close()


@pytest.mark.parametrize("slots,n_batch,n_ubatch,ctx,unified,cache_ram,mtp,model", CONFIGS)
def test_every_text_is_its_text_alone(models, alone, monkeypatch, tmp_path,
                                      slots, n_batch, n_ubatch, ctx, unified, cache_ram, mtp, model):
    rng = random.Random(repr((slots, n_batch, n_ubatch, ctx, unified, cache_ram, mtp, model)))
    path = models[model]
    prompts = _prompts(rng)
    kw = dict(mode="chain", n_max=3) if mtp else dict(mode="none")
    if mtp:
        _random_plans(monkeypatch, seed=slots)  # every round's draft lengths drawn at random
    wrong: list[str] = []
    n_cached = 0  # the texts compared whose prompt went on from a cached prefix
    with Engine(path, n_ctx=ctx * slots, n_parallel=slots, kv_unified=unified, n_batch=n_batch,
                n_ubatch=n_ubatch, cache_ram_mib=cache_ram, **kw) as eng:
        for r in range(6):
            # a request of several prompts (more than the slots, at times): they start
            # together and share their decodes, as /completion's prompt lists do
            group = [rng.choice(prompts) for _ in range(rng.randint(1, slots + 1))]
            cache = rng.random() < 0.7
            reqs = [eng.submit(p, n_predict=N, temperature=0, cache_prompt=cache, n_probs=1) for p in group]
            while eng.busy:
                eng.step()
            # ubatches of at most 16 rows take one-row kernels throughout (patch 0010; the
            # attention's tiles start at 64): a cached prefix has the bits it has decoded
            # for this prompt. In larger ubatches it has those of the pieces it was decoded
            # in (another prompt's, a generation's rows), and only a prompt decoded whole
            # is bound to its text alone
            exact = n_ubatch <= 16 or not cache
            for p, q in zip(group, reqs):
                got = q.completion
                assert got is not None, q.error
                if not exact:
                    continue
                tokens, probs = alone(path, n_batch, n_ubatch, ctx, unified, slots, p)
                n_cached += got.stats.n_prompt_cached > 0
                where = (f"request {r} (cache_prompt {cache}, {len(group)} prompts): a prompt of {len(p)} "
                         f"tokens in slot {got.slot}, {got.stats.n_prompt_cached} of them cached")
                if got.tokens != tokens:
                    at = next((i for i, (a, b) in enumerate(zip(got.tokens, tokens)) if a != b), None)
                    wrong.append(f"{where}: its text parts from its text alone at token {at}")
                elif [x.p for x in got.probs] != probs:
                    wrong.append(f"{where}: its probabilities are not those alone")
            if r % 2 and slots > 1:
                # a slot's file goes into another slot: the next request sharing its
                # prefix goes on from there
                src, dst = rng.sample(range(slots), 2)
                if eng.driver.cached_tokens(src):
                    eng.save_slot(src, tmp_path / "slot.bin")
                    eng.restore_slot(dst, tmp_path / "slot.bin")
    assert not wrong, "\n".join(wrong)
    assert n_cached or n_ubatch > 16  # cached prefixes were among the texts compared
