"""LoRA adapters and control vectors on the target (llama-server's --lora, --lora-scaled,
--lora-init-without-apply, --control-vector*, /lora-adapters and a request's lora), on
adapter files generated for the tiny model."""
from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from stepmtp import Engine
from stepmtp.llama import ModelLoadError
from stepmtp.tiny import write_agree_model, write_tiny_control_vector, write_tiny_lora

PROMPT = [1, 17, 42, 99, 7, 311, 25, 64]
N = 24


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    # the agree model: the heads' drafts are partly right, so rounds accept some
    model, _ = write_agree_model(d)
    return {
        "model": model,
        # strong enough to move this model's greedy text (its trunk maps tokens firmly)
        "lora": write_tiny_lora(d / "lora.gguf", gain=4.0),
        "lora2": write_tiny_lora(d / "lora2.gguf", seed=7, gain=4.0, targets=("output.weight",)),
        "cvec": write_tiny_control_vector(d / "cvec.gguf", gain=1.0),
        "wrong_arch": write_tiny_lora(d / "llama.gguf", arch="llama"),
    }


def engine(files: dict[str, Path], **kw) -> Engine:
    kw.setdefault("mode", "none")
    return Engine(files["model"], n_ctx=256, n_threads=1, n_gpu_layers=0, **kw)


def greedy(eng: Engine, prompt: list[int] = PROMPT, **kw) -> list[int]:
    return eng.generate(prompt, n_predict=N, temperature=0, **kw).tokens


def first_logits(files: dict[str, Path], **kw) -> np.ndarray:
    """The target's logits after the prompt (the first token's row)."""
    with engine(files, **kw) as eng:
        eng.generate(PROMPT, n_predict=1, temperature=0, cache_prompt=False)
        return np.array(eng.target.logits(-1), copy=True)


def test_lora_changes_the_logits_by_its_scale(files):
    plain = first_logits(files)
    half = first_logits(files, lora=[(files["lora"], 0.5)])
    full = first_logits(files, lora=[(files["lora"], 1.0)])
    assert not np.allclose(plain, half) and not np.allclose(half, full)
    assert np.array_equal(first_logits(files, lora=[(files["lora"], 0.0)]), plain)
    assert np.array_equal(first_logits(files, lora=[(files["lora"], 1.0)], lora_init_without_apply=True), plain)


def test_control_vector_changes_the_text(files):
    with engine(files) as eng:
        plain = greedy(eng)
    with engine(files, control_vectors=[(files["cvec"], 1.0)]) as eng:
        steered = greedy(eng)
    with engine(files, control_vectors=[(files["cvec"], 0.0)]) as eng:
        assert greedy(eng) == plain
    # outside the layers the file gives directions for, the vector adds nothing
    with engine(files, control_vectors=[(files["cvec"], 1.0)], control_vector_layers=(4, 4)) as eng:
        assert greedy(eng) == plain
    assert steered != plain


@pytest.mark.parametrize("extra", [
    dict(lora=[("lora", 1.0)]),
    dict(lora=[("lora", 0.7), ("lora2", 1.0)]),
    dict(control_vectors=[("cvec", 1.0)]),
    dict(lora=[("lora", 1.0)], control_vectors=[("cvec", 0.5)]),
], ids=["lora", "two-loras", "cvec", "lora+cvec"])
def test_mtp_text_is_plain_decoding_s_with_the_adapters(files, extra):
    """The heads draft, the target verifies with the adapters: at temperature 0 the
    text is plain decoding's with the same adapters, and it is not the text without."""
    kw = {k: [(files[p], x) for p, x in v] for k, v in extra.items()}
    with engine(files) as eng:
        bare = greedy(eng)
    with engine(files, **kw) as eng:
        plain = greedy(eng)
    with engine(files, mode="chain", n_max=3, **kw) as eng:
        c = eng.generate(PROMPT, n_predict=N, temperature=0)
    assert c.tokens == plain != bare
    assert c.stats.n_drafted > 0


def test_request_scales_and_set_lora(files):
    """A request's lora (the adapters it does not name off), set_lora (POST
    /lora-adapters): each gives the text of an engine started with those scales."""
    with engine(files, lora=[(files["lora"], 1.0)]) as eng:
        with_lora = greedy(eng)
    with engine(files, lora=[(files["lora"], 0.5)]) as eng:
        half = greedy(eng)
    with engine(files) as eng:
        plain = greedy(eng)
    with engine(files, mode="chain", lora=[(files["lora"], 1.0)], lora_init_without_apply=True) as eng:
        assert eng.adapters.describe()[0]["scale"] == 0.0
        assert greedy(eng) == plain
        assert greedy(eng, lora={0: 1.0}) == with_lora
        assert greedy(eng, lora={0: 0.5}) == half
        assert greedy(eng, lora={5: 1.0}) == plain  # an id no adapter has: ignored, as llama-server does
        eng.set_lora({0: 1.0})
        assert greedy(eng) == with_lora
        eng.set_lora({})
        assert greedy(eng) == plain


def test_a_cached_prompt_serves_only_its_scales(files):
    """A slot's KV computed with the adapter is not reused without it (nor from host
    memory): the same prompt then gives plain decoding's text, its prompt decoded afresh."""
    prompt = PROMPT * 5  # host memory takes back prompts longer than 16 tokens
    with engine(files) as eng:
        plain = eng.generate(prompt, n_predict=N, temperature=0).tokens
    with engine(files, mode="chain", lora=[(files["lora"], 1.0)], cache_ram_mib=64) as eng:
        first = eng.generate(prompt, n_predict=N, temperature=0)
        again = eng.generate(prompt, n_predict=N, temperature=0)
        assert again.tokens == first.tokens and again.stats.n_prompt_cached > 0
        off = eng.generate(prompt, n_predict=N, temperature=0, lora={0: 0.0})
        assert off.tokens == plain != first.tokens and off.stats.n_prompt_cached == 0
        # the conversation goes on: its prompt comes back from host memory (from its
        # context checkpoint: a restored prefix holds its last position's window only)
        turn = prompt + first.tokens + [7]
        back = eng.generate(turn, n_predict=N, temperature=0)
        assert back.stats.n_prompt_cached >= len(prompt)
    with engine(files, lora=[(files["lora"], 1.0)]) as eng:
        assert back.tokens == greedy(eng, prompt=turn)


def test_slots_with_other_scales_run_side_by_side(files):
    """Two slots, one with the adapter and one without, generating at once: each gets
    its own text (they decode in separate rounds)."""
    with engine(files) as eng:
        plain = greedy(eng)
    with engine(files, lora=[(files["lora"], 1.0)]) as eng:
        with_lora = greedy(eng)
    with engine(files, mode="chain", n_parallel=2, lora=[(files["lora"], 1.0)]) as eng:
        a = eng.submit(PROMPT, n_predict=N, temperature=0)
        b = eng.submit(PROMPT, n_predict=N, temperature=0, lora={0: 0.0})
        while not (a.done and b.done):
            eng.step()
        assert a.completion.tokens == with_lora and b.completion.tokens == plain


def test_bad_adapter_files_are_errors_at_load(files, tmp_path):
    bad_cvec = write_tiny_control_vector(tmp_path / "zero.gguf", layers=(0,))
    from stepmtp.tiny import write_tiny_control_vector as w

    cases = [
        (dict(lora=[(tmp_path / "missing.gguf", 1.0)]), "no such LoRA adapter file"),
        (dict(lora=[(files["wrong_arch"], 1.0)]), "arch"),
        (dict(lora=[(files["cvec"], 1.0)]), "adapter"),  # not an adapter
        (dict(control_vectors=[(bad_cvec, 1.0)]), "direction.<layer>"),
        (dict(control_vectors=[(files["lora"], 1.0)]), "direction.<layer>"),
    ]
    wide = tmp_path / "wide.gguf"
    import dataclasses

    from stepmtp.tiny import CONFIG

    w(wide, dataclasses.replace(CONFIG, n_embd=CONFIG.n_embd + 8))
    cases.append((dict(control_vectors=[(wide, 1.0)]), "hidden rows"))
    for kw, needle in cases:
        with pytest.raises(ModelLoadError, match="(?i)" + needle.replace(".", r"\.").replace("<", "<")):
            engine(files, **kw)


# -- through the server ----------------------------------------------------------------


def test_server_lora_flags_and_routes(files, tmp_path):
    """--lora-scaled, --lora-init-without-apply, GET/POST /lora-adapters and a request's
    lora, as llama-server's; the text each gives is the engine's with those scales."""
    from test_server import running

    with engine(files) as eng:
        plain = eng.generate(PROMPT, n_predict=12, temperature=0).text
    with engine(files, lora=[(files["lora"], 1.0)]) as eng:
        with_lora = eng.generate(PROMPT, n_predict=12, temperature=0).text
    args = ["-m", str(files["model"]), "-t", "1", "-c", "256", "--lora-scaled", f"{files['lora']}:0.5",
            "--lora", str(files["lora2"]), "--lora-init-without-apply", "--no-warmup"]
    with running(args, tmp_path) as srv:
        got = httpx.get(srv.url + "/lora-adapters").json()
        assert [(x["id"], x["path"], x["scale"]) for x in got] == [(0, str(files["lora"]), 0.0),
                                                                   (1, str(files["lora2"]), 0.0)]

        def complete(**extra) -> dict:
            r = httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                                          **extra}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        assert complete()["content"] == plain
        r = complete(lora=[{"id": 0, "scale": 1.0}])
        assert r["content"] == with_lora and r["generation_settings"]["lora"] == [{"id": 0, "scale": 1.0}]
        r = httpx.post(srv.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}])
        assert r.json() == {"success": True}
        assert [x["scale"] for x in httpx.get(srv.url + "/lora-adapters").json()] == [1.0, 0.0]
        assert complete()["content"] == with_lora
        assert httpx.post(srv.url + "/lora-adapters", json={"id": 0}).status_code == 400
        assert httpx.post(srv.url + "/completion", json={"prompt": "x", "lora": {"id": 0}}).status_code == 400
        assert "LoRA adapter 0" in srv.log()


def test_server_bad_adapter_stops_it(files, tmp_path):
    from test_server import ServerProcess

    srv = ServerProcess(["-m", str(files["model"]), "-t", "1", "-c", "128", "--lora", str(files["wrong_arch"])],
                        tmp_path)
    try:
        assert srv.exit_code(60) == 1
        assert "failed to load the model" in srv.log() and "LoRA" in srv.log()
    finally:
        srv.stop()
    srv = ServerProcess(["-m", str(files["model"]), "--lora", str(tmp_path / "nope.gguf")], tmp_path)
    try:
        assert srv.exit_code(60) == 2 and "--lora: no such file" in srv.log()
    finally:
        srv.stop()
