"""Models by name (``hub``): llama-server's rules for ``-hf user/repo[:quant]`` (the
quant tag, split sets, the MTP heads' file beside the model), each failure a message
that says what to do, and the whole way through huggingface_hub against a local
stand-in for the hub (``tests/hub_stub.py``): every shard fetched into the hub's cache,
then found there offline; ``Engine.from_pretrained``; ``python -m stepmtp.server -hf``.
Nothing here reaches the network."""
from __future__ import annotations

import httpx
import pytest

from stepmtp import hub
from stepmtp.hub import HubError, pick_model, pick_mtp, split_info
from stepmtp.models import default_model_path, split_model, write_shards
from tests.hub_stub import Hub
from tests.test_server import ServerProcess, running

SHARDS = [f"Q8_0/Step-3.5-Flash-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
HEADS = "Step-3.5-Flash-mtp-Q8_0.gguf"
FILES = ["README.md", *SHARDS, HEADS, "Step-3.5-Flash-F16.gguf", "mmproj-Step-F16.gguf"]


# -- llama-server's rules, on a listing -------------------------------------------------

def test_split_names_read_as_llama_cpp_reads_them():
    assert split_info("a/Model-q4_k_m-00002-of-00005.gguf") == hub.SplitInfo("a/Model-q4_k_m", "Q4_K_M", 2, 5)
    assert split_info("model.IQ4_XS.gguf") == hub.SplitInfo("model.IQ4_XS", "IQ4_XS", 1, 1)
    assert split_info("README.md") is None


@pytest.mark.parametrize("tag, filename, want", [
    ("q8_0", None, SHARDS),  # case-insensitive, the whole set in order
    ("", None, SHARDS),  # no Q4_K_M: Q8_0
    ("F16", None, ["Step-3.5-Flash-F16.gguf"]),  # never the projector beside it
    ("", SHARDS[1], SHARDS),  # a shard named: its set
    ("", "*F16*", ["Step-3.5-Flash-F16.gguf"]),  # a glob (llama-cpp-python's filename)
    ("", "f16", ["Step-3.5-Flash-F16.gguf"]),  # a quant as the filename
])
def test_the_quant_or_file_picks_the_model(tag, filename, want):
    assert pick_model(FILES, "o/r", tag, filename) == want


def test_without_q4_k_m_or_q8_0_the_first_model():
    assert pick_model(["x.gguf", "mtp-x.gguf", "b-F16.gguf"][1:], "o/r") == ["b-F16.gguf"]


@pytest.mark.parametrize("files, tag, filename, message", [
    (FILES, "IQ4_XS", None, "no IQ4_XS model in o/r; its quants: Q8_0, F16"),
    (FILES, "", "nope.gguf", "no file 'nope.gguf' in o/r; its GGUF files: Q8_0/Step"),
    (FILES, "", "*.gguf", "matches several models"),
    (["README.md", "config.json"], "", None, "holds no GGUF file (README.md, config.json)"),
    (SHARDS[:2], "Q8_0", None, "shard 3 of 3 of Q8_0/Step-3.5-Flash-Q8_0 is missing"),
])
def test_what_matches_nothing_says_what_there_is(files, tag, filename, message):
    with pytest.raises(HubError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        pick_model(files, "o/r", tag, filename)


def test_the_heads_beside_the_model():
    assert pick_mtp(FILES, SHARDS[0]) == HEADS  # one folder up, the same quant
    near = ["Q8_0/m-Q8_0.gguf", "mtp-F16.gguf", "Q8_0/mtp-Q4_0.gguf", "other/mtp-Q8_0.gguf"]
    assert pick_mtp(near, near[0]) == "Q8_0/mtp-Q4_0.gguf"  # the model's own folder first
    assert pick_mtp(["m-Q8_0.gguf"], "m-Q8_0.gguf") is None


@pytest.mark.parametrize("spec", ["repo", "a/b/c", "/b", "a/b:q:x"])
def test_a_bad_repository_name(spec):
    with pytest.raises(HubError, match="expected <user>/<model>"):
        hub.parse_repo(spec)


# -- through huggingface_hub, against a stand-in hub -------------------------------------

@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """The hub: owner/repo holding the bundled model's trunk in 3 shards, its MTP heads
    beside them, the whole model as F16 and a projector; a private, a gated and a
    model-less repository; a split model as plain files (for -mu)."""
    d = tmp_path_factory.mktemp("hubfiles")
    pair = split_model(default_model_path(), d / "pair")
    shards = write_shards(pair["trunk"], d / "shards", 3)
    files = {p: s for p, s in zip(SHARDS, shards)}
    files.update({HEADS: pair["mtp"], "Step-3.5-Flash-F16.gguf": default_model_path(),
                  "mmproj-Step-F16.gguf": pair["mtp"]})
    (d / "README.md").write_text("a model\n")
    h = Hub()
    h.repos["owner/repo"] = {**files, "README.md": d / "README.md"}
    h.repos["owner/private"] = {"m-Q8_0.gguf": default_model_path()}
    h.private["owner/private"] = "hf_good"
    h.repos["owner/gated"] = {"m-Q8_0.gguf": default_model_path()}
    h.gated.add("owner/gated")
    h.repos["owner/docs"] = {"README.md": d / "README.md"}
    h.files.update({p.split("/")[-1]: s for p, s in zip(SHARDS, shards)})
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def hub_env(stand_in, tmp_path, monkeypatch):
    """huggingface_hub pointed at the stand-in, with an empty cache of its own."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", stand_in.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    stand_in.log.clear()
    return stand_in


def test_every_shard_and_the_heads_come_then_stay(hub_env):
    got = hub.resolve("owner/repo:q8_0", mtp=True)
    assert [p.name for p in got.files] == [s.split("/")[-1] for s in SHARDS] and got.model == got.files[0]
    assert got.mtp is not None and got.mtp.name == HEADS and all(p.is_file() for p in got.files)
    assert sorted(hub_env.fetched()) == sorted(f"/owner/repo/resolve/main/{f}" for f in [*SHARDS, HEADS])
    # offline (HF_HUB_OFFLINE), or the hub out of reach: the same files, nothing asked
    hub_env.log.clear()
    assert hub.resolve("owner/repo:Q8_0", mtp=True, offline=True) == got and hub_env.log == []
    from huggingface_hub import constants

    constants.ENDPOINT = "http://127.0.0.1:9"  # nothing listens there (monkeypatch restores both)
    constants.HUGGINGFACE_CO_URL_TEMPLATE = constants.ENDPOINT + "/{repo_id}/resolve/{revision}/{filename}"
    assert hub.resolve("owner/repo:Q8_0", mtp=True).model == got.model


@pytest.mark.parametrize("spec, token, message", [
    ("owner/none", None, "no repository owner/none on the hub at .*check the name.*needs a token"),
    ("owner/private", None, "no repository owner/private .*a private repository needs a token"),
    ("owner/private", "hf_bad", "the hub refused the token for owner/private"),
    ("owner/gated", None, "owner/gated is gated: accept its conditions"),
    ("owner/docs", None, r"owner/docs holds no GGUF file \(README.md\)"),
    ("owner/repo:IQ4_XS", None, "no IQ4_XS model in owner/repo; its quants: Q8_0, F16"),
])
def test_failures_say_what_to_do(hub_env, spec, token, message):
    with pytest.raises(HubError, match=message):
        hub.resolve(spec, token=token)


def test_a_token_opens_a_private_repository(hub_env):
    assert hub.resolve("owner/private", token="hf_good").model.name == "m-Q8_0.gguf"


def test_offline_without_the_files(hub_env):
    with pytest.raises(HubError, match="not in the hub's cache .* run once with the network"):
        hub.resolve("owner/repo:F16", offline=True)
    hub.resolve("owner/repo:Q8_0")
    with pytest.raises(HubError, match="no F16 model .* only the hub's cache was searched"):
        hub.resolve("owner/repo:F16", offline=True)


def test_a_split_model_by_url(hub_env, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    first = hub.fetch_url(f"{hub_env.url}/files/{SHARDS[0].split('/')[-1]}")
    assert first.parent == tmp_path / "llama" and len(list(first.parent.glob("*.gguf"))) == 3
    with pytest.raises(HubError, match="HTTP 404"):
        hub.fetch_url(f"{hub_env.url}/files/missing.gguf")


def test_from_pretrained_loads_the_split_model_and_its_heads(hub_env):
    from stepmtp import Engine

    with Engine.from_pretrained("owner/repo", "Q8_0", n_ctx=512, n_threads=1) as eng:
        assert eng.model.path.name == SHARDS[0].split("/")[-1] and eng.draft_model.path.name == HEADS
        out = eng.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert out["usage"]["completion_tokens"] == 8
    with Engine.from_pretrained("owner/repo", "*F16.gguf", mode="none", n_ctx=512, n_threads=1) as eng:
        assert eng.model.path.name == "Step-3.5-Flash-F16.gguf" and eng.draft_model is None


# -- the server ---------------------------------------------------------------------------

def _env(stand_in, home):
    return {"HF_ENDPOINT": stand_in.url, "HF_HOME": str(home)}


def _answers(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "owner/repo:Q8_0" and r.json()["usage"]["completion_tokens"] == 8
    props = httpx.get(srv.url + "/props", timeout=10).json()
    return props


def test_server_hf_fetches_every_shard_then_starts_offline(stand_in, tmp_path):
    args = ["-hf", "owner/repo:Q8_0", "--spec-type", "draft-mtp", "-c", "512", "-np", "1", "-t", "1"]
    stand_in.log.clear()
    with running(args, tmp_path, extra_env=_env(stand_in, tmp_path / "home")) as srv:
        props = _answers(srv)
        assert props["stepmtp"]["mtp_model"].endswith(HEADS)
    assert sorted(stand_in.fetched()) == sorted(f"/owner/repo/resolve/main/{f}" for f in [*SHARDS, HEADS])
    # the second start: the hub gone from the address, offline
    stand_in.log.clear()
    env = {**_env(stand_in, tmp_path / "home"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    with running(args, tmp_path, extra_env=env) as srv:
        _answers(srv)
    assert stand_in.log == []


def test_server_hf_failure_is_a_message(stand_in, tmp_path):
    srv = ServerProcess(["-hf", "owner/repo:IQ4_XS", "-t", "1"], tmp_path, extra_env=_env(stand_in, tmp_path))
    try:
        assert srv.exit_code(60) == 1
        log = srv.log()
        assert "no IQ4_XS model in owner/repo; its quants: Q8_0, F16" in log and "Traceback" not in log
    finally:
        srv.stop()
