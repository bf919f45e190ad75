"""``python -m stepmtp.server``'s command line: llama-server's flags, the reference
command from the PR description, errors, the default model, and the loading state."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from stepmtp import Engine
from stepmtp.server.cli import parse_args
from stepmtp.tiny import write_agree_model, write_tiny_models
from test_server import ServerProcess

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def run_cli(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stepmtp.server", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_lists_the_flags():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("-m", "--spec-type", "--spec-draft-model", "-ngl", "--spec-draft-ngl", "--ctx-size", "-np",
                 "--batch-size", "--ubatch-size", "--threads", "--temp", "--spec-draft-n-max", "--spec-draft-n-min",
                 "--spec-draft-p-min", "--seed", "--host", "--port", "--api-key", "--alias", "--spec-mtp-mode",
                 "--n-gpu-layers", "--gpu-layers", "--parallel"):
        assert flag in r.stdout, flag


@pytest.mark.parametrize("args,needle", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--port"], "--port"),
    (["-c", "lots"], "-c/--ctx-size"),
    (["-np", "0"], "-np/--parallel"),
    (["--spec-type", "draft-eagle3"], "not supported"),
    (["--spec-ngram-mod-n-match", "0"], "ngram size N must be between 1 and 1024 inclusive"),
    (["--spec-ngram-simple-min-hits", "0"], "ngram min hits must be at least 1"),
    (["--spec-ngram-size-n", "3"], "the argument has been removed. use the respective --spec-ngram-*-size-n"),
    (["--spec-ngram-shared", "maybe"], "on or off"),
    (["-lcs", "/nonexistent/cache.bin"], "-lcs"),
    (["--spec-type", "magic"], "unknown speculative"),
    (["--spec-mtp-mode", "tree"], "--spec-mtp-mode"),
    (["--spec-draft-p-min", "2"], "p-min"),
    (["--spec-draft-vocab", "-5"], "--spec-draft-vocab"),
    (["-m", "/nonexistent/model.gguf"], "not found"),
    (["-fa", "maybe"], "on, off or auto"),
    (["--draft-max", "3"], "--draft-max"),  # removed in llama-server too
    (["--mirostat", "2"], "mirostat is not supported"),
    (["--dry-multiplier", "0.8"], "DRY is not supported"),
    (["--samplers", "top_k;infill"], "infill"),
])
def test_bad_flags_exit_non_zero_with_a_message(args, needle):
    r = run_cli(*args, timeout=60)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "error" in r.stderr


REFERENCE = ("--spec-type draft-mtp --spec-draft-model {mtp} -ngl all --spec-draft-ngl all -c 35000 -np 1 "
             "-b 2048 -ub 1024 --temp 0 --spec-draft-n-max {n} --spec-draft-p-min 0.0")


def test_ngram_flags_as_llama_server_spells_them():
    cfg = parse_args(["--spec-type", "ngram-mod,draft-mtp", "--spec-ngram-mod-n-min", "8",
                      "--spec-ngram-map-k4v-size-m", "16", "--spec-ngram-shared", "off"])
    assert cfg.speculative and cfg.ngram_types == ("ngram-mod",) and cfg.spec_types == "ngram-mod,draft-mtp"
    assert cfg.ngram.mod_n_min == 8 and cfg.ngram.mod_n_max == 64 and cfg.ngram.map_k4v_size_m == 16
    assert cfg.context_pool == 0 and cfg.spec_context
    # context drafting comes with draft-mtp, and a flag turns it off
    assert parse_args(["--spec-type", "draft-mtp"]).spec_context
    assert not parse_args(["--spec-type", "draft-mtp", "--no-spec-context"]).spec_context
    cfg = parse_args(["--spec-default"])
    assert cfg.ngram_types == ("ngram-mod",) and (cfg.ngram.mod_n_match, cfg.ngram.mod_n_min) == (24, 48)


def test_ngram_drafting_through_the_server_one_pool_per_key(tmp_path):
    """A server with llama-server's n-gram line and two API keys: the same request
    sent again with a key drafts from the context of that key's first; the other key's
    first request does not see it."""
    from stepmtp.models import default_model_path

    text = "def add(a, b):\n    return a + b\n\n\n" * 3
    args = ["-m", str(default_model_path()), "--spec-type", "ngram-mod,draft-mtp", "--spec-ngram-mod-n-match", "4",
            "--spec-ngram-mod-n-min", "2", "-t", "1", "-np", "1", "--api-key", "k1,k2", "--no-spec-adaptive"]
    from test_server import running

    with running(args, tmp_path) as srv:

        def ask(key: str) -> dict:
            r = httpx.post(srv.url + "/completion", json={"prompt": text, "n_predict": 48, "temperature": 0,
                                                           "cache_prompt": False},
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        first, again, other = ask("k1"), ask("k1"), ask("k2")
        props = httpx.get(srv.url + "/props", headers={"Authorization": "Bearer k1"}, timeout=30).json()
    assert first["content"] == again["content"] == other["content"]
    assert props["default_generation_settings"]["params"]["speculative.types"] == "ngram-mod,draft-mtp"
    assert again["mtp"]["draft_n_context"] > first["mtp"]["draft_n_context"]
    assert other["mtp"]["draft_n_context"] == first["mtp"]["draft_n_context"]


def test_reference_command_line_parses(tmp_path):
    model, mtp = tmp_path / "Step-3.7-IQ4_XS.gguf", tmp_path / "Step3.7-flash-mtp-Q8_0.gguf"
    model.write_bytes(b"")
    mtp.write_bytes(b"")
    args = ["-m", str(model), *REFERENCE.format(mtp=mtp, n=3).split(), "--host", "127.0.0.1", "--port", "8080"]
    cfg = parse_args(args)
    assert cfg.model == str(model) and cfg.mtp_model == str(mtp)
    assert cfg.spec_type == "draft-mtp" and cfg.mtp_mode == "chain" and cfg.speculative
    assert cfg.n_gpu_layers == "all" and cfg.n_gpu_layers_draft == "all"
    assert (cfg.n_ctx, cfg.n_parallel, cfg.n_batch, cfg.n_ubatch) == (35000, 1, 2048, 1024)
    assert cfg.sampling.temperature == 0.0 and cfg.n_max == 3 and cfg.p_min == 0.0
    assert (cfg.host, cfg.port) == ("127.0.0.1", 8080)
    # long spellings, llama-server's --long_option form, aliases, keys
    cfg = parse_args(["--model", str(model), "--ctx_size", "4096", "--parallel", "4", "--batch-size", "512",
                      "--ubatch-size", "256", "--threads", "3", "--n-gpu-layers", "12", "--gpu-layers-draft", "7",
                      "--model-draft", str(mtp), "--spec-type", "none", "--temperature", "0.5", "-s", "42",
                      "-a", "step,flash", "--api-key", "k1,k2", "--spec-mtp-mode", "single"])
    assert (cfg.n_ctx, cfg.n_parallel, cfg.n_batch, cfg.n_ubatch, cfg.n_threads) == (4096, 4, 512, 256, 3)
    assert cfg.n_gpu_layers == 12 and cfg.n_gpu_layers_draft == 7 and not cfg.speculative
    assert cfg.sampling.temperature == 0.5 and cfg.seed == 42
    assert cfg.aliases == ["step", "flash"] and cfg.model_name() == "flash" and cfg.api_keys == ["k1", "k2"]
    assert cfg.mtp_mode == "single" and cfg.engine_mode == "none"
    assert not cfg.batch_invariant and parse_args(["--spec-batch-invariant"]).batch_invariant
    # defaults are llama-server's
    cfg = parse_args([])
    assert cfg.model is None and cfg.spec_type == "none" and cfg.n_ctx == 0 and cfg.n_batch == 2048
    assert cfg.n_ubatch == 512 and cfg.port == 8080 and cfg.host == "127.0.0.1" and cfg.n_max == 3
    assert cfg.sampling.temperature == 0.8 and cfg.seed_u32 == 4294967295


def test_llama_servers_sampler_flags():
    cfg = parse_args(["--typical", "0.9", "--top-n-sigma", "1.5", "--xtc-probability", "0.3", "--xtc-threshold",
                      "0.2", "--dynatemp-range", "0.4", "--dynatemp-exp", "2", "--samplers", "top-k;temp;typical_p",
                      "--mirostat", "0", "--mirostat-lr", "0.2", "--dry-multiplier", "0", "--dry-base", "2",
                      "--dry-sequence-breaker", "none"])
    p = cfg.sampling
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold, p.dynatemp_range,
            p.dynatemp_exponent) == (0.9, 1.5, 0.3, 0.2, 0.4, 2.0)
    assert p.samplers == ("top_k", "temperature")  # typical_p is no sampler name: dropped, as llama.cpp does
    assert parse_args(["--sampler-seq", "kyt"]).sampling.samplers == ("top_k", "typ_p", "temperature")
    assert parse_args([]).sampling.samplers == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                                                "min_p", "xtc", "temperature")


def test_auto_slots_fit_a_small_batch():
    """-np auto is 4 slots, as llama-server's, unless -b is too small for 4 slots' verify
    rows (n-max + 2 each) in one decode: then as many as fit (llama-server runs with any
    -b); a -np given is kept."""
    assert parse_args(["--spec-type", "draft-mtp"]).total_slots == 4
    assert parse_args(["--spec-type", "draft-mtp", "-b", "16"]).total_slots == 3  # 16 // (3 + 2)
    assert parse_args(["--spec-type", "draft-mtp", "-b", "16", "--spec-draft-n-max", "1"]).total_slots == 4
    assert parse_args(["-b", "16"]).total_slots == 4  # no drafting: one row a slot
    assert parse_args(["--spec-type", "draft-mtp", "-b", "16", "-np", "2"]).total_slots == 2


def test_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "1234")
    monkeypatch.setenv("LLAMA_ARG_PORT", "9999")
    monkeypatch.setenv("LLAMA_API_KEY", "secret")
    cfg = parse_args([])
    assert cfg.n_ctx == 1234 and cfg.port == 9999 and cfg.api_keys == ["secret"]
    cfg = parse_args(["--port", "7777"])  # the command line wins
    assert cfg.port == 7777


@pytest.fixture(scope="module")
def split_pair(tmp_path_factory):
    return write_tiny_models(tmp_path_factory.mktemp("tiny"), seed=0)


def test_reference_command_runs(split_pair, tmp_path):
    """The PR's llama-server command, llama-server replaced: a trunk file plus the MTP file."""
    args = ["-m", str(split_pair["trunk"]), *REFERENCE.format(mtp=split_pair["mtp"], n=2).split(), "-t", "1"]
    srv = ServerProcess(args, tmp_path)
    try:
        srv.wait_ready()
        props = httpx.get(srv.url + "/props", timeout=30).json()
        assert props["stepmtp"]["mtp_model"] == str(split_pair["mtp"]) and props["stepmtp"]["n_draft"] == 2
        assert props["default_generation_settings"]["n_ctx"] >= 35000
        # --temp 0: a request that names no temperature is greedy
        body = httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 24}, timeout=60).json()
        # stopped (SIGTERM) in the middle of a stream: the stream ends with an error event, promptly
        with httpx.stream("POST", srv.url + "/completion", json={"prompt": PROMPT, "n_predict": -1, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.terminate()
            rest = [ln for ln in lines if ln]
        srv.proc.wait(15)  # raises if it does not end
        assert json.loads(rest[-1][len("data: "):])["error"]["type"] == "unavailable_error"
        log = srv.log()
    finally:
        srv.stop()
    with Engine(split_pair["trunk"], mtp_model=split_pair["mtp"], mode="chain", n_max=2, n_ctx=512,
                n_threads=1) as eng:
        want = eng.generate(PROMPT, n_predict=24, temperature=0)
    assert body["content"] == want.text and body["generation_settings"]["temperature"] == 0
    # the draft length is chosen round by round (the default): the counts follow the
    # machine's timings, n-max bounds them
    assert body["timings"]["draft_n"] == sum(body["mtp"]["draft_n_per_depth"])
    assert body["mtp"]["draft_n_per_depth"][2] == 0  # n-max 2: no third draft
    for needle in ("MTP heads: 3", "mode chain", "n_max 2", "n_ctx 35", "listening"):
        assert needle in log, needle


def test_default_model_and_single_mode(tmp_path):
    """No -m: the bundled trained model."""
    from stepmtp.models import default_model_path

    srv = ServerProcess(["--spec-type", "draft-mtp", "--spec-mtp-mode", "single", "--spec-draft-n-max", "2",
                         "--spec-draft-n-min", "2", "-np", "3", "-t", "1"], tmp_path)
    try:
        srv.wait_ready()
        props = httpx.get(srv.url + "/props", timeout=30).json()
        body = httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0},
                          timeout=60).json()
        log = srv.log()
    finally:
        srv.stop()
    assert props["model_path"] == str(default_model_path())
    assert props["stepmtp"]["mtp_mode"] == "single" and props["total_slots"] == 3
    depth = body["mtp"]["draft_n_per_depth"]
    assert depth[0] == depth[1] > 0 and depth[2] == 0
    with Engine(default_model_path(), mode="single", n_max=2, n_ctx=512, n_threads=1) as eng:
        assert body["content"] == eng.generate(PROMPT, n_predict=24, temperature=0).text
    assert "no -m given" in log and "slots: 3, decoded together" in log


def test_a_model_that_does_not_load_exits_non_zero(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    srv = ServerProcess(["-m", str(bad)], tmp_path)
    try:
        rc = srv.exit_code(60)
    finally:
        srv.stop()
    assert rc != 0
    assert "failed to load the model" in srv.log(), srv.log()


def test_503_while_loading_then_ready(tmp_path):
    """In-process (the tiny model loads too fast to catch from outside): the engine
    factory waits, /health answers 503 in llama-server's shape, then 200."""
    from starlette.testclient import TestClient

    from stepmtp.server import ServerConfig, create_app

    agree = write_agree_model(tmp_path, seed=0)[0]
    go = threading.Event()

    def factory(path: Path) -> Engine:
        assert go.wait(30)
        return Engine(path, mode="chain", n_ctx=512, n_threads=1)

    app = create_app(ServerConfig(model=str(agree), spec_type="draft-mtp"), engine_factory=factory)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert c.post("/completion", json={"prompt": "x"}).status_code == 503
        assert c.get("/openapi.json").status_code == 200
        go.set()
        st = app.state.stepmtp
        assert st.ready.wait(30)
        assert c.get("/health").json() == {"status": "ok"}
        body = c.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0}).json()
        assert body["tokens_predicted"] == 8


def test_the_draft_vocabulary_flag_reaches_the_engine_config():
    assert parse_args(["--spec-type", "draft-mtp"]).draft_vocab == -1
    assert parse_args(["--spec-type", "draft-mtp", "--spec-draft-vocab", "1024"]).draft_vocab == 1024
