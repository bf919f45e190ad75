"""Every llama-server flag (``tests/data/llama_server_flags.txt``, from 0.3.36's
``common/arg.cpp`` by ``tools/llama_server_flags.py``) runs here: implemented, accepted
with a reason, or refused with one; never argparse's "unrecognized arguments". And
each flag implemented past the earlier ones does what it says."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from stepmtp.server import cli
from stepmtp.server.cli import parse_args
from stepmtp.server.flags import ACCEPTED, REFUSED

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ROOT / "tests" / "data" / "llama_server_flags.txt"
TREE = Path(os.environ.get("LLAMA_SERVER_TREE",
                           "/work/sdist/t36/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def rows() -> list[tuple[list[str], list[str], str, str]]:
    out = []
    for line in FLAGS.read_text().splitlines():
        if line.startswith("#"):
            continue
        names, neg, hint, env = line.split("\t")
        out.append((names.split(","), [] if neg == "-" else neg.split(","), "" if hint == "-" else hint,
                    "" if env == "-" else env))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("flags")
    (d / "schema.json").write_text('{"type": "object"}')
    (d / "g.gbnf").write_text('root ::= "a"')
    (d / "keys.txt").write_text("k1\n")
    (d / "ui.json").write_text('{"theme": "dark"}')
    (d / "t.jinja").write_text("{{ messages }}")
    (d / "f.bin").write_text("x")
    return {"dir": str(d), "file": str(d / "f.bin"), "schema": str(d / "schema.json"), "gbnf": str(d / "g.gbnf"),
            "keys": str(d / "keys.txt"), "ui": str(d / "ui.json"), "jinja": str(d / "t.jinja")}


#: a valid value for a flag, by its first spelling (else by its value hint)
def value_for(flag: str, hint: str, f: dict[str, str]) -> list[str]:
    special = {
        "-m": [f["file"]], "--spec-draft-model": [f["file"]], "-lcs": [f["file"]], "-lcd": [f["file"]],
        "--grammar-file": [f["gbnf"]], "-jf": [f["schema"]], "-j": ['{"type": "object"}'], "--grammar": ['root ::= "a"'],
        "--api-key-file": [f["keys"]], "--ui-config-file": [f["ui"]], "--ui-config": ['{"a": 1}'],
        "--chat-template-file": [f["jinja"]], "--chat-template-kwargs": ["{}"], "--slot-save-path": [f["dir"]],
        "--path": [f["dir"]], "--ssl-key-file": [f["file"], "--ssl-cert-file", f["file"]],
        "--ssl-cert-file": [f["file"], "--ssl-key-file", f["file"]],
        "-l": ["15+1"], "--override-kv": ["a.b=int:1"], "-C": ["1"], "-Cr": ["0-0"], "--prio": ["0"],
        "-fa": ["auto"], "--spec-type": ["draft-mtp"], "--rope-scaling": ["yarn"], "-lm": ["mmap"],
        "--reasoning-format": ["auto"], "-rea": ["auto"], "--log-colors": ["off"], "--numa": ["distribute"],
        "-sm": ["layer"], "-ts": ["1"], "-dev": ["none"], "--spec-draft-device": ["none"], "-ot": ["exps=CPU"],
        "--spec-draft-override-tensor": ["exps=CPU"], "-ctk": ["f16"], "-ctv": ["f16"], "--spec-draft-type-k": ["f16"],
        "--spec-draft-type-v": ["f16"], "--rpc": ["127.0.0.1:50052"], "--samplers": ["top_k;temperature"],
        "--sampler-seq": ["kt"], "--spec-mtp-mode": ["chain"], "-hf": ["a/b"], "-hfd": ["a/b"],
        "-mu": ["http://127.0.0.1:1/m.gguf"], "--api-prefix": ["/v2"], "-sps": ["0.5"], "--spec-ngram-shared": ["on"],
        "--port": ["8081"], "--host": ["127.0.0.1"], "--spec-draft-p-min": ["0.5"], "--spec-draft-p-split": ["0.1"],
        "--mirostat": ["0"], "--dry-multiplier": ["0"], "--cpu-strict": ["0"], "--control-vector-layer-range": ["1", "2"],
        "-fit": ["on"], "--kv-unified-per-slot": ["0"], "--sleep-idle-seconds": ["10"], "-lv": ["3"],
        "--pooling": ["mean"], "--spec-ngram-mod-n-min": ["48"], "--spec-ngram-mod-n-max": ["64"],
        "--spec-ngram-mod-n-match": ["24"], "--lora": [f["file"]], "--lora-scaled": [f["file"] + ":0.5"],
        "--control-vector": [f["file"]], "--control-vector-scaled": [f["file"] + ":0.5"],
    }
    if flag in special:
        return special[flag]
    if not hint:
        return []
    return ["1"]


def all_spellings() -> list[tuple[str, str, list[str]]]:
    """(spelling, its option's first spelling, value hint)."""
    return [(s, names[0], hint if s in names else "") for names, neg, hint, _ in rows() for s in names + neg]


REFUSED_NAMES = {n: c.reason for c in REFUSED for n in c.names}
REMOVED = {"--draft", "--draft-n", "--draft-max", "--draft-min", "--draft-n-min", "--spec-ngram-size-n",
           "--spec-ngram-size-m", "--spec-ngram-min-hits"}
EXITS = {"-h", "--help", "--usage", "--version", "-cl", "--cache-list", "--completion-bash", "--list-devices"}


def test_the_list_is_the_tree_s(tmp_path):
    """The committed list is what the extractor reads from the 0.3.36 tree (when it is here)."""
    if not (TREE / "common" / "arg.cpp").is_file():
        pytest.skip(f"no llama.cpp tree at {TREE} (LLAMA_SERVER_TREE)")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import llama_server_flags as tool
    finally:
        sys.path.pop(0)
    src = tool._strip_comments((TREE / "common" / "arg.cpp").read_text())
    fresh = tool.render(tool.parse(src), "x").splitlines()[1:]
    assert fresh == FLAGS.read_text().splitlines()[1:]
    assert sum(len(n) + len(g) for n, g, _, _ in rows()) >= 400


def test_no_flag_is_unrecognized():
    known = set(cli.build_parser()._option_string_actions)
    assert [s for s, _, _ in all_spellings() if s not in known] == []
    assert [env for _, _, _, env in rows() if env and env not in cli.ENV] == []


@pytest.mark.parametrize("spelling,first,hint", all_spellings(), ids=[s for s, _, _ in all_spellings()])
def test_every_flag_parses_or_says_why(spelling, first, hint, files, capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY")):
            monkeypatch.delenv(k)
    if spelling in EXITS:
        return  # they print and exit: tested on their own
    argv = [spelling, *value_for(first, hint, files)]
    if spelling in REFUSED_NAMES or spelling in REMOVED:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "unrecognized" not in err
        assert (REFUSED_NAMES.get(spelling) or "has been removed") in err
        return
    try:
        parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{argv}: {capsys.readouterr().err}") from None


@pytest.mark.parametrize("env", sorted({env for _, _, _, env in rows() if env}))
def test_every_environment_variable(env, files, capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY")):
            monkeypatch.delenv(k)
    names, neg, hint, _ = next(r for r in rows() if r[3] == env)
    vals = value_for(names[0], hint, files)
    monkeypatch.setenv(env, vals[0] if vals else "1")
    if env.startswith("LLAMA_ARG_SSL_"):  # the key and the certificate go together
        monkeypatch.setenv("LLAMA_ARG_SSL_KEY_FILE", files["file"])
        monkeypatch.setenv("LLAMA_ARG_SSL_CERT_FILE", files["file"])
    refused = names[0] in REFUSED_NAMES or names[0] in REMOVED
    if refused:
        with pytest.raises(SystemExit):
            parse_args([])
        assert "unrecognized" not in capsys.readouterr().err
    elif names[0] not in ("-m", "--spec-draft-model") or vals:
        parse_args([])


def test_help_gives_each_accepted_flag_its_reason():
    text = cli.build_parser().format_help()
    for c in ACCEPTED + REFUSED:
        assert c.names[0] in text


def test_exit_flags(capsys):
    for flag, needle in (("--version", "stepmtp"), ("--completion-bash", "--reverse-prompt"),
                         ("--usage", "--reverse-prompt")):
        with pytest.raises(SystemExit) as e:
            parse_args([flag])
        assert e.value.code == 0
        assert needle in capsys.readouterr().out


def test_cache_list(tmp_path, monkeypatch, capsys):
    snap = tmp_path / "models--o--r" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "models--o--r" / "refs").mkdir()
    (tmp_path / "models--o--r" / "refs" / "main").write_text("abc")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit):
        parse_args(["-cl"])
    out = capsys.readouterr().out
    assert "number of models in cache: 1" in out and "o/r:m-Q4_K_M.gguf" in out


# -- what the implemented flags set -------------------------------------------------------


def test_sampling_defaults_parsed(files):
    cfg = parse_args(["-r", "a\\nb", "-r", "User:", "--ignore-eos", "-l", "15+1.5", "-l", "16-inf", "-sp",
                      "--grammar-file", files["gbnf"], "--no-cache-prompt", "--reasoning-effort", "high",
                      "--no-reasoning-preserve", "--skip-chat-parsing", "--no-prefill-assistant"])
    assert cfg.stop == ["a\nb", "User:"]
    assert cfg.ignore_eos and cfg.special and not cfg.cache_prompt and cfg.skip_chat_parsing
    assert not cfg.prefill_assistant
    assert cfg.logit_bias == [(15, 1.5), (16, float("-inf"))]
    assert cfg.grammar == ("gbnf", 'root ::= "a"')
    assert cfg.chat_template_kwargs == {"reasoning_effort": "high", "preserve_reasoning": False}
    assert parse_args(["--no-escape", "-r", "a\\n"]).stop == ["a\\n"]
    # the schema wins over a grammar, as in llama-server
    assert parse_args(["--grammar", "x", "-j", '{"type": "object"}']).grammar == ("json_schema", {"type": "object"})
    assert parse_args(["--reasoning-effort", "default"]).chat_template_kwargs == {}


def test_model_and_context_params_parsed():
    cfg = parse_args(["--override-kv", "a.b=int:3,c=bool:false", "--override-kv", "d=str:x", "-lm", "mlock",
                      "-nr", "--no-host", "--check-tensors", "--rope-scaling", "yarn", "--rope-scale", "4",
                      "--rope-freq-base", "10000", "--yarn-orig-ctx", "4096", "-nkvo", "--no-op-offload"])
    assert cfg.model_params == {"load_mode": 2,  # llama.cpp's LLAMA_LOAD_MODE_MLOCK
                                "use_extra_bufts": False, "no_host": True, "check_tensors": True,
                                "kv_overrides": [("a.b", "int", 3), ("c", "bool", False), ("d", "str", "x")]}
    assert cfg.context_params == {"rope_scaling_type": 2, "rope_freq_scale": 0.25, "rope_freq_base": 10000.0,
                                  "yarn_orig_ctx": 4096, "offload_kqv": False, "op_offload": False}
    with pytest.raises(SystemExit):
        parse_args(["--override-kv", "a=int:x"])


def test_http_and_cpu_flags_parsed(tmp_path):
    cfg = parse_args(["-to", "7", "--threads-http", "3", "--api-prefix", "/v2", "--props", "--no-warmup",
                      "--reuse-port", "--cors-origins", "localhost", "--no-cors-credentials", "-C", "0x5",
                      "-Cr", "8-9", "--prio", "-1", "--sse-ping-interval", "2", "--kv-unified-per-slot", "100",
                      "-np", "3", "--log-file", str(tmp_path / "l.log"), "-lv", "2", "--log-jsonl"])
    assert (cfg.timeout, cfg.threads_http, cfg.api_prefix, cfg.endpoint_props, cfg.warmup, cfg.reuse_port) == \
        (7, 3, "/v2", True, False, True)
    assert cfg.cpus == frozenset({0, 2, 8, 9}) and cfg.prio == -1
    assert cfg.cors.origins == "localhost" and not cfg.cors.credentials
    assert cfg.sse_ping_interval == 2 and cfg.n_ctx == 300
    assert cfg.log.file == str(tmp_path / "l.log") and cfg.log.verbosity == 2 and cfg.log.jsonl
    for bad in (["--api-prefix", "v2/"], ["--ssl-key-file", "k.pem"], ["-C", "xyz"], ["--prio", "7"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_environment_negation(monkeypatch):
    """llama-server: LLAMA_ARG_NO_X turns a switch with a --no- form off."""
    monkeypatch.setenv("LLAMA_ARG_NO_MMAP", "1")
    assert parse_args([]).use_mmap is False
    monkeypatch.setenv("LLAMA_ARG_NO_CACHE_PROMPT", "1")
    assert parse_args([]).cache_prompt is False
    monkeypatch.setenv("LLAMA_ARG_MMPROJ", "x.gguf")
    with pytest.raises(SystemExit):
        parse_args([])


# -- what the implemented flags do ---------------------------------------------------------


def test_cors_rules():
    from stepmtp.server.config import Cors

    assert Cors().allow_origin("https://a.example") == "https://a.example"
    assert Cors("localhost").allow_origin("http://localhost:3000") == "http://localhost:3000"
    assert Cors("localhost").allow_origin("https://evil.example") is None
    assert Cors("https://a.example", credentials=False).allow_origin("https://b.example") == "https://a.example"


def test_logging(tmp_path, capsys):
    from stepmtp.server.config import LogConfig

    try:
        cli.setup_logging(False, LogConfig(file=str(tmp_path / "a.log"), jsonl=True, verbosity=2))
        lg = logging.getLogger("stepmtp.server.test")
        lg.info("not at -lv 2")
        lg.warning("kept")
        for h in logging.getLogger().handlers:
            h.flush()
        lines = (tmp_path / "a.log").read_text().splitlines()
        assert [json.loads(x)["message"] for x in lines] == ["kept"]
        cli.setup_logging(False, LogConfig(disable=True, timestamps=False, prefix=False,
                                           file=str(tmp_path / "b.log")))
        lg.warning("plain")
        for h in logging.getLogger().handlers:
            h.flush()
        assert (tmp_path / "b.log").read_text() == "plain\n"
        assert "plain" not in capsys.readouterr().err
    finally:
        cli.setup_logging(False)


def test_cpu_affinity_and_priority():
    from stepmtp.server.host import place_process

    before = os.sched_getaffinity(0)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        one = min(before)
        place_process(frozenset({one}), 0)
        assert os.sched_getaffinity(0) == {one}
        place_process(None, -1)  # low: nice 5, allowed without privileges
        assert os.getpriority(os.PRIO_PROCESS, 0) >= 5
    finally:
        os.sched_setaffinity(0, before)


def test_reuse_port():
    from stepmtp.server.host import listen_socket

    a = listen_socket("127.0.0.1", 0, reuse_port=True)
    port = a.getsockname()[1]
    b = listen_socket("127.0.0.1", port, reuse_port=True)  # a second server on the same port
    a.close(), b.close()
    c = listen_socket("127.0.0.1", 0, reuse_port=False)
    with pytest.raises(OSError):
        listen_socket("127.0.0.1", c.getsockname()[1], reuse_port=False)
    c.close()


def test_sse_ping():
    from stepmtp.server.web import _pinged

    async def slow():
        await asyncio.sleep(0.35)
        yield "data: 1\n\n"

    async def collect():
        return [x async for x in _pinged(slow(), 0.1)]

    out = asyncio.run(collect())
    assert out[-1] == "data: 1\n\n" and out.count(":\n\n") >= 2


def test_read_timeout():
    from stepmtp.server.middleware import TimeoutMiddleware

    got = []

    async def app(scope, receive, send):
        got.append(await receive())

    async def never():
        await asyncio.sleep(10)

    asyncio.run(TimeoutMiddleware(app, 0.05)({"type": "http", "path": "/"}, never, None))
    assert got == [{"type": "http.disconnect"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stepmtp.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("tiny"))["embedded"]


def test_context_params_reach_llama_cpp(tiny):
    """--rope-freq-base changes the positions' rotation: a decode's logits differ."""
    from stepmtp import Batch, Context, Model

    m = Model(tiny)
    try:
        outs = []
        for extra in (None, {"rope_freq_base": 3.0}):
            ctx = Context(m, n_ctx=64, llama_params=extra)
            b = Batch(8)
            for i, t in enumerate([1, 5, 9, 13, 2, 7]):
                b.add(t, i, 0, i == 5)
            ctx.decode(b)
            outs.append(np.array(ctx.logits(5), copy=True))
            ctx.close()
        assert not np.allclose(outs[0], outs[1])
    finally:
        m.close()


def test_override_kv_reaches_llama_cpp(tiny):
    from stepmtp import Model

    base = Model(tiny, vocab_only=True)
    flip = not base.add_bos
    base.close()
    m = Model(tiny, vocab_only=True, llama_params={
        "kv_overrides": [("tokenizer.ggml.add_bos_token", "bool", flip)], "check_tensors": True})
    try:
        assert m.add_bos == flip
    finally:
        m.close()


def test_request_defaults_apply(tiny):
    """-r, --ignore-eos, -l, --grammar, --no-cache-prompt, -sp: a request that says nothing
    gets them; one that says otherwise keeps its own."""
    from stepmtp import Engine
    from stepmtp.api.schemas import CompletionRequest
    from stepmtp.api.service import API, SpecReport
    from stepmtp.server.config import ServerConfig

    eng = Engine(tiny, mode="none", n_ctx=128, n_parallel=1)
    try:
        cfg = ServerConfig(stop=["\n\n"], ignore_eos=True, logit_bias=[(7, 2.0)], grammar=("gbnf", 'root ::= "a"'),
                           cache_prompt=False, special=True)
        api = API(eng, cfg, model_name="t", spec=SpecReport("none", "chain", 3, 0, 0.0), mtp_mode="none")
        (g,), settings = api.prepare(CompletionRequest.model_validate({"prompt": "x"}), [[1, 2]], stream=False)
        assert g.stop == ["\n\n"] and not g.cache_prompt and g.grammar is not None
        assert g.sampling.logit_bias[7] == 2.0
        assert all(g.sampling.logit_bias[t] == float("-inf") for t in api.eog_tokens) and settings.ignore_eos
        assert len(g.preserved) == eng.model.n_vocab
        own = CompletionRequest.model_validate({"prompt": "x", "stop": ["z"], "ignore_eos": False,
                                                "logit_bias": [[8, 1.0]], "cache_prompt": True})
        (g,), _ = api.prepare(own, [[1, 2]], stream=False)
        assert g.stop == ["z"] and g.cache_prompt and 7 not in g.sampling.logit_bias
        assert not any(t in g.sampling.logit_bias for t in api.eog_tokens)
    finally:
        eng.close()


def test_server_http_flags(tiny, tmp_path):
    """--api-prefix, --path, --props, --ui-config, --cors-*, and the warm-up, on a running server."""
    from test_server import ServerProcess, running

    static = tmp_path / "www"
    static.mkdir()
    (static / "index.html").write_text("<p>mine</p>")
    args = ["-m", str(tiny), "-t", "1", "-c", "128", "--api-prefix", "/v2", "--path", str(static), "--props",
            "--ui-config", '{"theme": "dark"}', "--cors-origins", "https://a.example", "--cors-methods", "GET"]
    srv = ServerProcess(args, tmp_path)
    try:
        srv.url_base, srv.url = srv.url, srv.url + "/v2"  # wait_ready polls the prefixed /health
        srv.wait_ready()
        srv.url = srv.url_base
        assert httpx.get(srv.url + "/health").status_code == 404  # outside the prefix
        r = httpx.get(srv.url + "/v2/props")
        assert r.status_code == 200 and r.json()["endpoint_props"] and r.json()["ui_settings"] == {"theme": "dark"}
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        assert httpx.post(srv.url + "/v2/props", json={}).json() == {"success": True}
        assert httpx.get(srv.url + "/v2/").text == "<p>mine</p>"
        pre = httpx.options(srv.url + "/v2/completion")
        assert pre.headers["access-control-allow-methods"] == "GET"
        assert "warmed up" in srv.log()
    finally:
        srv.stop()
    with running(["-m", str(tiny), "-t", "1", "-c", "128", "--no-warmup"], tmp_path) as srv:
        r = httpx.post(srv.url + "/props", json={})
        assert r.status_code == 501 and "--props" in r.text
        assert "warmed up" not in srv.log()


def test_docs_table_is_generated():
    """docs/server.md's table of differences is tools/server_flags_doc.py's (run it to update)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import server_flags_doc as doc
    finally:
        sys.path.pop(0)
    text = doc.DOC.read_text()
    start, end = text.index(doc.BEGIN) + len(doc.BEGIN), text.index(doc.END)
    assert text[start:end] == "\n" + doc.table()


def test_sleep_idle_seconds(tiny, tmp_path):
    """--sleep-idle-seconds: idle that long, the engine is freed; /health, /props (with
    is_sleeping), /v1/models and /metrics answer without waking it; the next completion
    loads the model again and gives the same text, with the LoRA scales POST
    /lora-adapters set before."""
    from test_server import running

    from stepmtp.tiny import write_tiny_lora

    lora = write_tiny_lora(tmp_path / "lora.gguf", gain=4.0)
    body = {"prompt": [1, 17, 42, 99], "n_predict": 8, "temperature": 0}
    args = ["-m", str(tiny), "-t", "1", "-c", "128", "--no-warmup", "--sleep-idle-seconds", "1",
            "--lora", str(lora), "--lora-init-without-apply"]
    with running(args, tmp_path) as srv:
        def wait_for(needle: str) -> None:
            for _ in range(100):
                if needle in srv.log():
                    return
                time.sleep(0.1)
            raise AssertionError(f"no {needle!r} in the log:\n{srv.log()}")

        plain = httpx.post(srv.url + "/completion", json=body, timeout=60).json()["content"]
        assert httpx.post(srv.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        with_lora = httpx.post(srv.url + "/completion", json=body, timeout=60).json()["content"]
        assert with_lora != plain
        wait_for("entering sleeping state")
        assert httpx.get(srv.url + "/health").status_code == 200
        p = httpx.get(srv.url + "/props").json()
        assert p["is_sleeping"] and p["total_slots"] >= 1 and p["model_path"] == str(tiny)
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["meta"]["n_vocab"] > 0
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert "exiting sleeping state" not in srv.log()
        assert httpx.post(srv.url + "/completion", json=body, timeout=60).json()["content"] == with_lora
        assert "exiting sleeping state" in srv.log()
        assert not httpx.get(srv.url + "/props").json()["is_sleeping"]
        assert [x["scale"] for x in httpx.get(srv.url + "/lora-adapters").json()] == [1.0]


def test_sleep_idle_seconds_values():
    assert parse_args(["--sleep-idle-seconds", "5"]).sleep_idle_seconds == 5
    assert parse_args([]).sleep_idle_seconds == -1
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            parse_args(["--sleep-idle-seconds", bad])


def test_adapter_flags_parsed(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x")
    b.write_bytes(b"x")
    cfg = parse_args(["--lora", f"{a},{b}", "--lora-scaled", f"{b}:0.25", "--lora", str(a),
                      "--control-vector-scaled", f"{a}:-0.5", "--control-vector", str(b),
                      "--control-vector-layer-range", "2", "5", "--lora-init-without-apply"])
    assert cfg.lora == [(str(a), 1.0), (str(b), 1.0), (str(b), 0.25), (str(a), 1.0)]
    assert cfg.control_vectors == [(str(a), -0.5), (str(b), 1.0)] and cfg.control_vector_layers == (2, 5)
    assert cfg.lora_init_without_apply
    for bad in ([f"--lora-scaled", str(a)], ["--lora-scaled", f"{a}:x"], ["--lora", str(tmp_path / "none.gguf")]):
        with pytest.raises(SystemExit):
            parse_args(bad)
