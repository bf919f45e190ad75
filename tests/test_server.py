"""``python -m stepmtp.server``: llama-server's routes and shapes, run as a real
subprocess on the tiny agree model (drafts partly accepted), and compared with
the engine called directly."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

from stepmtp import Engine
from stepmtp.tiny import write_agree_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 40
N_CTX = 8192
#: -np 2 without -kvu splits -c between the slots; llama-server reports a slot's share
N_CTX_SLOT = N_CTX // 2
KEY = "sk-stepmtp-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


# -- a server subprocess ------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m stepmtp.server ARGS --host 127.0.0.1 --port P``, its log in a file."""

    def __init__(self, args: list[str], log_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.args, self.log_dir = args, log_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY"))}
        self.env.update(extra_env or {})
        self._log = None
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepmtp.server", *self.args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
        )

    def exit_code(self, timeout: float) -> int:
        """Wait for the process to end (it should: a bad start), retrying on a port taken meanwhile."""
        for _ in range(3):
            rc = self.proc.wait(timeout)
            if "address already in use" not in self.log():
                return rc
            self._log.close()
            self._start()
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        retries = 3
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log() and retries:  # another process took the port
                    retries -= 1
                    self._log.close()
                    self._start()
                    continue
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the server was not healthy within {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()


@contextlib.contextmanager
def running(args: list[str], log_dir: Path, extra_env: dict[str, str] | None = None):
    """A ServerProcess with ``args``, ready, stopped on exit."""
    srv = ServerProcess(args, log_dir, extra_env)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def server_fixture(model_fixture: str, *args: str):
    """A module-scoped fixture: ``python -m stepmtp.server`` drafting with the MTP heads
    on the model another fixture gives, with ``args``, on one llama.cpp thread."""

    @pytest.fixture(scope="module")
    def fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
        model = request.getfixturevalue(model_fixture)
        argv = ["-m", str(model), "--spec-type", "draft-mtp", "-t", "1", *args]
        with running(argv, tmp_path_factory.mktemp("server")) as srv:
            yield srv

    return fixture


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]


@pytest.fixture(scope="module")
def server(agree: Path, tmp_path_factory: pytest.TempPathFactory):
    # -t 1: the tests share a small machine; two spinning llama.cpp threads on a busy
    # core are far slower than one
    # a fixed draft length, the heads alone (the drafts context drafting makes depend on
    # the requests before): the tests compare its counts with the engine's
    srv = ServerProcess(["-m", str(agree), "--spec-type", "draft-mtp", "-c", str(N_CTX), "-np", "2", "-t", "1",
                         "--no-spec-adaptive", "--no-spec-context", "--api-key", KEY], tmp_path_factory.mktemp("server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def direct(agree: Path):
    """The engine called directly, with the server's settings, at temperature 0."""
    with Engine(agree, mode="chain", n_ctx=N_CTX, n_threads=1, adaptive=False, context=False) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
        chat = eng.apply_chat_template([{"role": "user", "content": "hello"}])
        yield {"completion": out, "prompt_tokens": eng.tokenize(PROMPT), "chat_prompt": chat,
               "chat": eng.generate(chat, n_predict=N, temperature=0)}


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream (and the "[DONE]" marker as a string)."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_healthy(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/health", timeout=10.0)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# -- the simple routes -----------------------------------------------------------------


def test_health_props_models(server, client, agree):
    assert_healthy(server)
    assert httpx.get(server.url + "/v1/health", timeout=10).json() == {"status": "ok"}
    props = client.get("/props").json()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == N_CTX_SLOT
    assert props["default_generation_settings"]["params"]["speculative.types"] == "draft-mtp"
    assert props["model_path"] == str(agree)
    assert "<|im_start|>" in props["chat_template"]
    assert props["stepmtp"]["mtp_mode"] == "chain" and props["stepmtp"]["n_heads"] == 3
    # llama.cpp's buffers: the target's KV, and the heads' (one layer each, the same cells)
    mem = props["stepmtp"]["memory"]
    assert mem["target"]["kv"] > 0 and 0 < mem["draft"]["kv"] < mem["target"]["kv"]
    assert props["stepmtp"]["swa_full"] is False and props["stepmtp"]["ctx_checkpoints"] == 32
    for route in ("/v1/models", "/models"):
        models = client.get(route).json()
        assert models["object"] == "list"
        (m,) = models["data"]
        assert m["id"] == str(agree) and m["object"] == "model" and m["owned_by"] == "llamacpp"
        assert m["meta"]["n_vocab"] == 512 and m["meta"]["n_ctx"] == N_CTX_SLOT and m["meta"]["vocab_type"] == 2


def test_openapi_spec(client):
    spec = client.get("/openapi.json").json()
    for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                 "/health", "/props", "/v1/models", "/metrics"):
        assert path in spec["paths"], path
    schemas = spec["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    body = spec["paths"]["/completion"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")


def test_tokenize_detokenize(client, direct):
    r = client.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()
    assert r["tokens"] == direct["prompt_tokens"]
    plain = client.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert plain == direct["prompt_tokens"][1:]  # add_special defaults to false: no BOS
    pieces = client.post("/tokenize", json={"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "hello world"
    assert all(isinstance(p["id"], int) for p in pieces)
    assert client.post("/detokenize", json={"tokens": plain}).json() == {"content": PROMPT}
    assert client.post("/detokenize", json={}).json() == {"content": ""}


# -- /completion -------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/completion", "/completions"])
def test_completion_equals_the_engine(client, direct, route):
    want = direct["completion"]
    r = client.post(route, json={"prompt": PROMPT, "n_predict": N, "temperature": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == want.text
    assert body["tokens"] == want.tokens
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == N
    assert body["tokens_evaluated"] == len(direct["prompt_tokens"])
    assert body["truncated"] is False and isinstance(body["has_new_line"], bool)
    assert body["model"].endswith("tiny-agree.gguf")
    gs = body["generation_settings"]
    assert gs["n_predict"] == N and gs["temperature"] == 0 and gs["seed"] == 4294967295
    t = body["timings"]
    for k in ("prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
              "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert k in t, k
    # the route's first request decodes the whole prompt, a later one reuses its KV
    assert t["prompt_n"] + t["cache_n"] == len(direct["prompt_tokens"]) and t["predicted_n"] == N
    assert t["prompt_n"] >= 1
    assert t["draft_n"] == want.stats.n_drafted and t["draft_n_accepted"] == want.stats.n_accepted
    mtp = body["mtp"]
    assert mtp["mode"] == "chain" and mtp["n_heads"] == 3
    assert mtp["draft_n_per_depth"] == want.stats.drafted_per_depth
    assert mtp["draft_n_accepted_per_depth"] == want.stats.accepted_per_depth
    assert sum(mtp["draft_n_per_depth"]) == t["draft_n"] and 0 < t["draft_n_accepted"] < t["draft_n"]


def test_completion_prompt_as_tokens_and_mixed(client, direct):
    want = direct["completion"].text
    toks = direct["prompt_tokens"]
    for prompt in (toks, [toks], [toks[0], PROMPT]):  # ids; one prompt in a list; an id then text
        r = client.post("/completion", json={"prompt": prompt, "n_predict": N, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == want
    # a list of prompts: one result each, in order
    r = client.post("/completion", json={"prompt": [PROMPT, "hello"], "n_predict": 8, "temperature": 0})
    results = r.json()
    assert isinstance(results, list) and [x["index"] for x in results] == [0, 1]
    assert results[0]["content"] == want[: len(results[0]["content"])]


def test_completion_stream_concatenates_to_the_whole(client, direct):
    want = direct["completion"]
    with client.stream("POST", "/completion",
                       json={"prompt": PROMPT, "n_predict": N, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert "[DONE]" not in events  # llama-server's native stream has no [DONE]
    partial, final = events[:-1], events[-1]
    assert all(e["stop"] is False and e["tokens"] for e in partial)
    assert "".join(e["content"] for e in partial) == want.text
    assert [t for e in partial for t in e["tokens"]] == want.tokens
    assert final["stop"] is True and final["content"] == "" and final["stop_type"] == "limit"
    assert final["timings"]["predicted_n"] == N and final["timings"]["draft_n"] == want.stats.n_drafted
    assert final["generation_settings"]["stream"] is True


@pytest.mark.parametrize("route", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_return_progress(client, direct, route):
    """stream + return_progress: llama-server's prompt_progress reports, one when the
    prompt starts (what the cache held) and one per prompt decode, before the tokens."""
    long = PROMPT * 8
    body = ({"messages": [{"role": "user", "content": long}]} if "chat" in route else {"prompt": long})
    body.update(max_tokens=4, n_predict=4, temperature=0, stream=True, return_progress=True, cache_prompt=False)
    with client.stream("POST", route, json=body) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    reports = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(reports) >= 2
    first, last = reports[0], reports[-1]
    assert first["cache"] == first["processed"] == 0 and first["total"] > 0
    assert last["processed"] == last["total"] == first["total"]
    assert all(b["processed"] > a["processed"] for a, b in zip(reports, reports[1:]))
    # the reports come before any text, and carry none
    n_first_text = next(i for i, e in enumerate(events) if "prompt_progress" not in e)
    assert all("prompt_progress" in e for e in events[:n_first_text])
    assert not any(e.get("content") or (e.get("choices") or [{}])[0].get("text") for e in events[:n_first_text])
    if "chat" in route:
        assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in events[:n_first_text])
    # without it, no reports
    body["return_progress"] = False
    with client.stream("POST", route, json=body) as r:
        assert not any("prompt_progress" in e for e in sse_events(r.iter_lines()) if e != "[DONE]")


@pytest.mark.parametrize("route", ["/completion", "/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_timings_per_token(client, route):
    """stream + timings_per_token: every chunk with text carries the timings so far
    (predicted_n counting up), as llama-server's; without it, none does."""
    body = ({"messages": [{"role": "user", "content": PROMPT}]} if "chat" in route else
            {"input": PROMPT} if "responses" in route else {"prompt": PROMPT})
    body.update(max_tokens=6, n_predict=6, max_output_tokens=6, temperature=0, stream=True, timings_per_token=True)
    def data(r):  # the Responses stream names its events: its data lines alone
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]

    with client.stream("POST", route, json=body) as r:
        events = data(r)

    def has_text(e):
        return bool(e.get("content") or e.get("delta") or
                    ((e.get("choices") or [{}])[0].get("text")) or ((e.get("choices") or [{}])[0].get("delta") or {}).get("content"))

    timed = [e["timings"] for e in events if "timings" in e and has_text(e)]
    assert timed and all("predicted_per_second" in t and "prompt_per_second" in t for t in timed)
    counts = [t["predicted_n"] for t in timed]
    assert counts == sorted(counts) and counts[-1] <= 6
    if "responses" in route:
        assert "timings" in next(e for e in events if e.get("type") == "response.completed")
    body["timings_per_token"] = False
    with client.stream("POST", route, json=body) as r:
        assert not any("timings" in e and has_text(e) for e in data(r))


def test_stop_word(client, direct):
    full = direct["completion"].text
    word = full[10:13]
    body = client.post("/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                            "stop": [word]}).json()
    assert body["stop_type"] == "word" and body["stopping_word"] == word
    assert full.startswith(body["content"]) and word not in body["content"]
    with client.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                                    "stop": word, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["content"] for e in events) == body["content"]
    assert events[-1]["stop_type"] == "word"


def test_sampling_fields(client, direct):
    base = {"prompt": PROMPT, "n_predict": 16, "temperature": 0.9, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = client.post("/completion", json={**base, "seed": 7}).json()
    b = client.post("/completion", json={**base, "seed": 7}).json()
    assert a["content"] == b["content"] and a["generation_settings"]["seed"] == 7
    # logit_bias: forbid the greedy first token, as [[id, false]] and as {"id": -inf-ish}
    first = direct["completion"].tokens[0]
    for bias in ([[first, False]], {str(first): -100.0}):
        r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "temperature": 0,
                                             "logit_bias": bias, "return_tokens": True}).json()
        assert r["tokens"][0] != first
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                         "repeat_penalty": 1.3, "presence_penalty": 0.5,
                                         "frequency_penalty": 0.5, "repeat_last_n": 16, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["generation_settings"]["repeat_penalty"] == 1.3
    # llama.cpp's other samplers and their order: used, and reported as llama-server reports them
    more = {"typical_p": 0.9, "top_n_sigma": 2.0, "xtc_probability": 0.5, "xtc_threshold": 0.2,
            "dynatemp_range": 0.3, "dynatemp_exponent": 1.5, "min_keep": 2}
    a = client.post("/completion", json={**base, **more, "seed": 3, "samplers": "kyxt"}).json()
    b = client.post("/completion", json={**base, **more, "seed": 3, "samplers": ["top_k", "typ_p", "xtc", "temp"]}).json()
    gs = a["generation_settings"]
    assert all(gs[k] == v for k, v in more.items()) and gs["samplers"] == ["top_k", "typ_p", "xtc", "temperature"]
    assert a["content"] == b["content"] and a["tokens_predicted"] == 16
    props = client.get("/props").json()
    assert props["default_generation_settings"]["params"]["samplers"][:3] == ["penalties", "dry", "top_n_sigma"]
    caps = props["chat_template_caps"]  # probed from the template, as llama-server reports them
    assert len(caps) == 8 and all(isinstance(v, bool) for v in caps.values()) and caps["supports_string_content"]


def test_curl_style_form_content_type(server):
    # curl -d sends application/x-www-form-urlencoded; llama-server reads the body as JSON anyway
    r = httpx.post(server.url + "/completion", content=json.dumps({"prompt": "hi", "n_predict": 2}),
                   headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2


# -- OpenAI -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60.0, max_retries=0)


def test_openai_completions(oai, direct):
    want = direct["completion"]
    res = oai.completions.create(model="whatever", prompt=PROMPT, max_tokens=N, temperature=0)
    assert res.object == "text_completion" and res.id.startswith("chatcmpl-")
    assert res.choices[0].text == want.text and res.choices[0].finish_reason == "length"
    assert res.usage.completion_tokens == N and res.usage.prompt_tokens == len(direct["prompt_tokens"])
    assert res.model_extra["timings"]["draft_n"] == want.stats.n_drafted
    stream = oai.completions.create(model="whatever", prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == N


def test_openai_chat(oai, direct):
    want = direct["chat"]
    messages = [{"role": "user", "content": "hello"}]
    res = oai.chat.completions.create(model="x", messages=messages, max_tokens=N, temperature=0)
    assert res.object == "chat.completion"
    msg = res.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == N
    assert res.model_extra["timings"]["predicted_n"] == N
    stream = oai.chat.completions.create(model="x", messages=messages, max_tokens=N, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    # content as text parts, and the rendered prompt sent to /completion, give the same
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    res2 = oai.chat.completions.create(model="x", messages=parts, max_tokens=N, temperature=0)
    assert res2.choices[0].message.content == want.text


def test_chat_is_the_template_plus_completion(client, direct):
    prompt = client.post("/apply-template", json={"messages": [{"role": "user", "content": "hello"}]}).json()
    assert prompt == {"prompt": direct["chat_prompt"]}
    body = client.post("/completion", json={"prompt": prompt["prompt"], "n_predict": N, "temperature": 0}).json()
    assert body["content"] == direct["chat"].text


def test_chat_stream_raw_sse(client, direct):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0,
            "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = sse_events(lines)[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "timings" in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length"


def test_llama_cpp_speed_bench_client(server, monkeypatch):
    """llama.cpp's own SPEED-Bench client (tools/server/bench/speed-bench), two chat turns."""
    path = (Path(__file__).resolve().parents[1] / "vendor" / "llama.cpp" / "tools" / "server" / "bench"
            / "speed-bench" / "speed_bench.py")
    if not path.exists():
        pytest.skip("vendor/llama.cpp is not there")
    requests = pytest.importorskip("requests")
    pytest.importorskip("tqdm")
    datasets = types.ModuleType("datasets")  # the samples come from here instead of the Hub
    datasets.get_dataset_config_names = datasets.load_dataset = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "datasets", datasets)
    spec = importlib.util.spec_from_file_location("speed_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "speed_bench", bench)  # its dataclasses look themselves up there
    spec.loader.exec_module(bench)
    post = requests.post
    monkeypatch.setattr(requests, "post", lambda url, **kw: post(url, headers=AUTH, **kw))  # it sends no key

    sample = bench.Sample(id="q1", category="coding", turns=["Write fib in Python.", "Now in C."])
    result = bench.run_one(sample, bench.normalize_base_url(server.url) + "/chat/completions", None, 32,
                           bench.parse_extra_inputs('{"temperature":0}'), 60)
    assert result.ok, result.error
    assert result.turns == 2 and result.completion_tokens == 64 and result.finish_reason == "length"
    assert 0 < result.draft_n_accepted < result.draft_n and result.predicted_per_second > 0
    summary = bench.summarize_group("overall", [result])
    assert summary["accept_rate"] == result.draft_n_accepted / result.draft_n


# -- metrics ------------------------------------------------------------------------------


def test_metrics(client):
    client.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:prompt_seconds_total",
                 "llamacpp:tokens_predicted_seconds_total", "llamacpp:n_decode_total",
                 "llamacpp:predicted_tokens_seconds", "stepmtp:draft_tokens_total",
                 "stepmtp:draft_tokens_accepted_total", 'stepmtp:draft_tokens_by_depth_total{depth="1"}',
                 'stepmtp:draft_tokens_accepted_by_depth_total{depth="3"}', "stepmtp:requests_total"):
        assert values.get(name, 0) > 0, name
    assert "llamacpp:requests_processing" in values and "llamacpp:requests_deferred" in values
    assert "# TYPE llamacpp:prompt_tokens_total counter" in text
    d = [values[f'stepmtp:draft_tokens_by_depth_total{{depth="{i}"}}'] for i in (1, 2, 3)]
    a = [values[f'stepmtp:draft_tokens_accepted_by_depth_total{{depth="{i}"}}'] for i in (1, 2, 3)]
    # the depths count the heads' drafts; the totals the context's too
    assert sum(d) + values["stepmtp:draft_tokens_context_total"] == values["stepmtp:draft_tokens_total"]
    assert sum(a) + values["stepmtp:draft_tokens_accepted_context_total"] == values["stepmtp:draft_tokens_accepted_total"]


# -- bad requests ---------------------------------------------------------------------------

BAD = [
    ("/completion", b'{"prompt": ', "not valid JSON"),
    ("/completion", b"", "not valid JSON"),
    ("/completion", b"[1, 2]", "JSON object"),
    ("/completion", b"{}", "'prompt' is required"),
    ("/completion", b'{"prompt": "x", "n_predict": "8"}', "n_predict"),
    ("/completion", b'{"prompt": "x", "n_predict": -2}', "n_predict"),
    ("/completion", b'{"prompt": "x", "n_predict": 1.5}', "n_predict"),
    ("/completion", b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    ("/completion", b'{"prompt": "x", "stream": "yes"}', "stream"),
    ("/completion", b'{"prompt": 3.5}', "prompt"),
    ("/completion", b'{"prompt": []}', "prompt"),
    ("/completion", b'{"prompt": [null]}', "prompt"),
    ("/completion", b'{"prompt": [999999]}', "out of range"),
    ("/completion", b'{"prompt": [-1]}', "out of range"),
    ("/completion", b'{"prompt": "x", "stop": 5}', "stop"),
    ("/completion", b'{"prompt": "x", "logit_bias": 5}', "logit_bias"),
    ("/completion", b'{"prompt": "x", "logit_bias": [[1, "a"]]}', "logit_bias"),
    ("/completion", b'{"prompt": "x", "repeat_penalty": 0}', "repeat_penalty"),
    ("/completion", b'{"prompt": "x", "mirostat": 2}', "mirostat"),
    ("/completion", b'{"prompt": "x", "dry_multiplier": 0.8}', "DRY"),
    ("/completion", b'{"prompt": "x", "samplers": ["top_k", "adaptive_p"]}', "adaptive_p"),
    ("/completion", b'{"prompt": "x", "n_probs": -1}', "n_probs"),
    ("/tokenize", b'{"content": ["a", 999999], "with_pieces": true}', "out of range"),
    ("/completion", b'{"prompt": "x", "n": 5}', "n_cmpl"),
    ("/completion", b'{"prompt": ["a", "b"], "stream": true}', "stream"),
    ("/v1/completions", b'{"prompt": "x", "echo": true}', "echo"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -5}', "max_tokens"),
    ("/v1/chat/completions", b'{}', "'messages' is required"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": {"role": "user"}}', "messages"),
    ("/v1/chat/completions", b'{"messages": [5]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', "role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "image_url"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     "tools"),
    ("/tokenize", b"{}", "'content' is required"),
    ("/tokenize", b'{"content": 5}', "prompt"),
    ("/detokenize", b'{"tokens": ["a"]}', "tokens"),
    ("/detokenize", b'{"tokens": [100000]}', "out of range"),
]


@pytest.mark.parametrize("route,body,needle", BAD, ids=[f"{r}:{b[:40]!r}" for r, b, _ in BAD])
def test_bad_request_is_a_400_with_a_message(server, client, route, body, needle):
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert needle.lower() in err["message"].lower(), err["message"]


def test_prompt_beyond_the_context(server, client):
    r = client.post("/completion", json={"prompt": [1] * (N_CTX + 10), "n_predict": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == N_CTX_SLOT
    assert err["n_prompt_tokens"] == N_CTX + 10 and "context" in err["message"]
    huge = "the quick brown fox " * 5000  # ~ 20k tokens as text
    r = client.post("/v1/completions", json={"prompt": huge, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
    assert_healthy(server)
    assert client.post("/completion", json={"prompt": "hi", "n_predict": 2}).status_code == 200


def test_api_key(server):
    body = {"prompt": "hi", "n_predict": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}, {"Authorization": KEY + "x"}):
        r = httpx.post(server.url + "/completion", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert httpx.post(server.url + "/completion", json=body, headers={"X-Api-Key": KEY}, timeout=30).status_code == 200
    assert httpx.get(server.url + "/props", headers={"Authorization": KEY}, timeout=30).status_code == 200
    for public in ("/health", "/v1/health", "/v1/models", "/models", "/", "/sw.js", "/manifest.webmanifest",
                   "/_app/version.json"):
        assert httpx.get(server.url + public, timeout=30).status_code == 200, public
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401
    # the API docs and /slots (other clients' prompts) are not public either
    for private in ("/slots", "/docs", "/redoc", "/openapi.json", "/props"):
        assert httpx.get(server.url + private, timeout=30).status_code == 401, private
    assert httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).status_code == 200


def test_unknown_route_and_method(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/completion")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


# -- concurrency: disconnects, queueing, responsiveness ------------------------------------


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_disconnect_mid_stream_frees_the_engine(server, client, direct):
    cancelled0 = _metric(client, "stepmtp:requests_cancelled_total")
    # n_predict -1: until the context (8192) is full, far longer than the bound below
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as c2:
        with c2.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": -1, "temperature": 0,
                                                    "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(5)]
            assert all(g.startswith("data: ") or g == "" for g in got)
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    body = client.post("/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0}).json()
    took = time.monotonic() - t0
    assert body["content"] == direct["completion"].text
    assert took < 8.0, f"the next request waited {took:.1f} s: the cancelled stream kept the engine"
    deadline = time.monotonic() + 10
    while _metric(client, "stepmtp:requests_cancelled_total") < cancelled0 + 1:
        assert time.monotonic() < deadline, "the stream was not counted as cancelled"
        time.sleep(0.1)
    assert _metric(client, "llamacpp:requests_processing") == 0


def test_disconnect_while_waiting_non_streamed(server, client, direct):
    cancelled0 = _metric(client, "stepmtp:requests_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": -1, "temperature": 0},
                   headers=AUTH, timeout=httpx.Timeout(30.0, read=1.0))
    t0 = time.monotonic()
    body = client.post("/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0}).json()
    assert body["content"] == direct["completion"].text
    assert time.monotonic() - t0 < 8.0
    # the abandoned generation is cancelled (it runs in the other slot meanwhile)
    deadline = time.monotonic() + 10
    while _metric(client, "stepmtp:requests_cancelled_total") < cancelled0 + 1:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.05)


def test_slots_decode_together_and_stay_responsive(server, client, direct):
    """-np 2: a second request runs alongside a long one (it does not wait for it),
    gets the same text as alone, and /health answers throughout."""
    results: dict[str, dict] = {}
    finished: dict[str, float] = {}

    def long_request(name: str, n: int) -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120.0) as c:
            results[name] = c.post("/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0}).json()
            finished[name] = time.monotonic()

    threads = [threading.Thread(target=long_request, args=("long", 1200)),
               threading.Thread(target=long_request, args=("short", N))]
    threads[0].start()
    deadline = time.monotonic() + 30
    while _metric(client, "llamacpp:requests_processing") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threads[1].start()
    worst = 0.0
    for _ in range(40):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        _metric(client, "llamacpp:requests_processing")
        worst = max(worst, time.monotonic() - t0)
        if "long" in results:
            break
        time.sleep(0.05)
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert worst < 2.0, f"/health and /metrics took {worst:.2f} s during a generation"
    # one slot at a time would have kept the short one waiting for the long one
    assert finished["short"] < finished["long"], "the short request waited for the long one"
    assert results["long"]["tokens_predicted"] == 1200
    assert results["short"]["content"] == direct["completion"].text


def test_what_is_not_served_is_llama_servers_not_supported(client):
    """Embeddings, reranking, infill, transcription: llama-server's routes, answered
    with its not-supported error (501) naming what, as llama-server started without
    the feature answers; not a 404."""
    for path, what in (("/v1/embeddings", "embeddings"), ("/embedding", "embeddings"), ("/v1/rerank", "reranking"),
                       ("/infill", "infill"), ("/v1/audio/transcriptions", "audio transcription")):
        r = client.post(path, json={"input": "x"})
        assert r.status_code == 501, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "not_supported_error" and err["code"] == 501 and what in err["message"]
    assert client.post("/v1/nowhere", json={}).status_code == 404


def test_slots_endpoint(server, client):
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["n_ctx"] == N_CTX_SLOT and s["speculative"] and not s["is_processing"] for s in slots)
    served = [s for s in slots if "id_task" in s]
    assert served, "earlier requests left no trace in /slots"
    s = served[0]
    assert s["n_prompt_tokens"] > 0 and s["next_token"][0]["n_decoded"] > 0 and s["generated"]
    assert s["params"]["n_predict"] == s["next_token"][0]["n_decoded"] or s["params"]["n_predict"] == -1 \
        or s["next_token"][0]["n_remain"] >= 0


# -- no client input makes a 500 ------------------------------------------------------------

ODD_VALUES = [None, True, False, -1.5, 0, -(2**63), 2**63, "", "x", "\u0000", [], {}, [[]], [None], [1, "a"],
              {"a": None}, {"type": "text"}, [{"type": "text", "text": 5}]]
COMPLETION_FIELDS = ["prompt", "n_predict", "max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p",
                     "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed",
                     "stop", "ignore_eos", "logit_bias", "stream", "stream_options", "n_cmpl", "n", "return_tokens",
                     "cache_prompt", "timings_per_token", "id_slot", "n_probs", "mirostat", "typical_p", "grammar",
                     "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent",
                     "min_keep", "samplers", "dry_multiplier",
                     "json_schema", "response_fields", "unknown_field"]
CHAT_FIELDS = ["messages", "add_generation_prompt", "chat_template_kwargs", "response_format", "tools", "tool_choice",
               "logprobs", "top_logprobs", "stream", "stream_options", "stop"]
RESPONSES_ITEMS = [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c", "output": "x"},
                   {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                   {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "t"}]},
                   {"role": "user", "content": [{"type": "input_text", "text": "t"}]}]
RESPONSES_FIELDS = ["input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning",
                    "previous_response_id", "temperature", "top_p", "stream", "store", "include", "parallel_tool_calls"]


def test_odd_values_never_make_a_500(server, client):
    n = 0
    for route, base, fields in (
            ("/completion", {"prompt": "hi", "n_predict": 2}, COMPLETION_FIELDS),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, COMPLETION_FIELDS + ["echo", "suffix"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
             CHAT_FIELDS),
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, RESPONSES_FIELDS)):
        for name in fields:
            for value in ODD_VALUES:
                if value is None and name in ("n_predict", "max_tokens", "max_completion_tokens"):
                    continue  # null is "no limit": a valid, long request
                body = {**base, name: value}
                r = client.post(route, json=body)
                n += 1
                assert r.status_code < 500, (route, body, r.text)
                if r.status_code != 200:
                    assert r.json()["error"]["message"], (route, body)
    # each field of each kind of Responses input item
    for item in RESPONSES_ITEMS:
        for key in item:
            for value in ODD_VALUES:
                body = {"input": [{**item, key: value}, {"role": "user", "content": "hi"}], "max_output_tokens": 2}
                r = client.post("/v1/responses", json=body)
                n += 1
                assert r.status_code < 500, (body, r.text)
    for route in ("/tokenize", "/detokenize", "/apply-template"):
        for name in ("content", "tokens", "messages", "add_special", "with_pieces", "add_generation_prompt"):
            for value in ODD_VALUES:
                r = client.post(route, json={name: value})
                assert r.status_code < 500, (route, name, value, r.text)
    assert n > 500
    assert_healthy(server)


def test_chat_prefill_and_its_checks(client):
    """A last assistant message is continued (llama-server's prefill); two trailing
    assistant messages, or continue_final_message with add_generation_prompt, are 400s;
    /chat/completions/input_tokens counts the prompt."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "import o"}]
    text = client.post("/apply-template", json={"messages": msgs, "add_generation_prompt": False}).json()["prompt"]
    continued = text[: text.rfind("import o") + len("import o")]  # the turn left open
    want = client.post("/completion", json={"prompt": continued, "n_predict": 4, "temperature": 0}).json()
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want["content"]
    bad = [{"messages": msgs + [{"role": "assistant", "content": "x"}]},
           {"messages": msgs, "add_generation_prompt": True, "continue_final_message": True}]
    for body in bad:
        assert client.post("/v1/chat/completions", json=body).status_code == 400, body
    n = client.post("/chat/completions/input_tokens", json={"messages": msgs[:1]}).json()["input_tokens"]
    r = client.post("/v1/chat/completions", json={"messages": msgs[:1], "max_tokens": 1}).json()
    assert n == r["usage"]["prompt_tokens"]


def test_cors_as_llama_server(server):
    """A preflight is answered before the API key (browsers send none), with the
    caller's origin, credentials, GET/POST and any header; other responses carry the
    origin back too. Header names as llama-server writes them."""
    import socket

    r = httpx.options(server.url + "/completions", headers={"Origin": "web.mydomain.fr",
                                                            "Access-Control-Request-Method": "POST"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "web.mydomain.fr"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    r = httpx.get(server.url + "/health", headers={"Origin": "localhost"}, timeout=30)
    assert r.headers["access-control-allow-origin"] == "localhost"
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"OPTIONS /completions HTTP/1.1\r\nHost: x\r\nOrigin: o\r\nConnection: close\r\n\r\n")
        raw = b""
        while chunk := s.recv(4096):
            raw += chunk
    assert b"\r\nAccess-Control-Allow-Origin: o\r\n" in raw


def test_chat_page(server, agree, tmp_path):
    """llama-server serves its web UI at / (public); ours is a small chat page over
    /v1/chat/completions; --no-ui turns it off."""
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and r.text.lstrip().lower().startswith("<!doctype html>")
    assert "/v1/chat/completions" in r.text and "reasoning_content" in r.text
    # its files at llama-server's web UI's paths: an installable page
    assert httpx.get(server.url + "/manifest.webmanifest", timeout=30).json()["start_url"] == "/"
    assert "addEventListener" in httpx.get(server.url + "/sw.js", timeout=30).text
    assert httpx.get(server.url + "/_app/version.json", timeout=30).json()["version"]
    with running(["-m", str(agree), "-c", "512", "-np", "1", "-t", "1", "--no-ui"], tmp_path) as srv:
        for path in ("/", "/sw.js", "/manifest.webmanifest"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 404
