"""``Engine.create_chat_completion`` / ``create_completion``: llama-cpp-python's calls in
the process, answered by the server's own request handling. The same requests sent to
``python -m stepmtp.server`` and made in the process give the same responses (ids and
timings aside): a forced tool call held to a bounded schema, a json_schema answer,
reasoning, token log-probabilities, whole and streamed."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from stepmtp import Engine
from stepmtp.api.errors import InvalidRequest
from stepmtp.models import default_model_path
from tests.test_server import running

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read lines of a file",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["path", "lines"], "properties": {
        "path": {"type": "string", "maxLength": 16},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Read the first lines of setup.py"}]

#: (name, request): each sent whole and streamed
REQUESTS = [
    ("forced call", dict(messages=ASK, tools=[READ], tool_choice="required", max_tokens=96)),
    ("named call", dict(messages=ASK, tools=[READ], tool_choice={"type": "function", "function": {"name": "read_file"}},
                        max_tokens=96)),
    ("json_schema", dict(messages=[{"role": "user", "content": "A name and a number"}], max_tokens=64,
                         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})),
    ("reasoning", dict(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=24)),
    ("logprobs", dict(messages=[{"role": "user", "content": "hello"}], max_tokens=12, logprobs=True, top_logprobs=3)),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The server and an engine with its settings: the bundled model (Step-3.5-Flash's
    template), MTP drafting with a fixed draft length (the counts then compare too)."""
    model = str(default_model_path())
    args = ["-m", model, "--spec-type", "draft-mtp", "--no-spec-adaptive", "-c", "4096", "-np", "1", "-t", "1"]
    with running(args, tmp_path_factory.mktemp("pyapi")) as srv, \
            Engine(model, mode="chain", adaptive=False, n_ctx=4096, n_threads=1) as eng:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            yield http, eng, model


def _same(d):
    """A response without what differs between two runs: ids (the tool calls' too),
    times, timings."""
    d = json.loads(json.dumps(d))
    for k in ("id", "created", "timings"):
        d.pop(k, None)
    for ch in d.get("choices", []):
        for call in (ch.get("message") or ch.get("delta") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return d


def _server(http, body):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _server_stream(http, body):
    out = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _message(chunks):
    """A stream's deltas added up: content, reasoning, calls (name, arguments), finish reason."""
    msg = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for c in chunks:
        if not c["choices"]:
            continue
        ch = c["choices"][0]
        msg["finish"] = ch["finish_reason"] or msg["finish"]
        d = ch["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning"] += d.get("reasoning_content") or ""
        for t in d.get("tool_calls") or []:
            cur = msg["calls"].setdefault(t["index"], ["", ""])
            cur[0] += t["function"].get("name") or ""
            cur[1] += t["function"].get("arguments") or ""
    return msg


@pytest.mark.parametrize("name, request_", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_in_process_answers_as_the_server(pair, name, request_):
    http, eng, model = pair
    body = {**request_, "temperature": 0, "model": model}
    here = eng.create_chat_completion(**body)
    there = _server(http, body)
    assert _same(here) == _same(there)
    msg = here["choices"][0]["message"]
    if "call" in name:
        (call,) = msg["tool_calls"]
        assert here["choices"][0]["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), READ["function"]["parameters"])
    elif name == "json_schema":
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
    elif name == "reasoning":
        assert msg["reasoning_content"] and msg["content"] == ""
    else:
        assert len(here["choices"][0]["logprobs"]["content"]) == here["usage"]["completion_tokens"]
    assert here["mtp"]["draft_n"] > 0 and here["usage"]["total_tokens"] > 0

    # streamed: chunk for chunk the server's events; the deltas add up to the whole
    opts = {"stream_options": {"include_usage": True}}
    chunks = list(eng.create_chat_completion(**body, stream=True, **opts))
    assert [_same(c) for c in chunks] == [_same(c) for c in _server_stream(http, {**body, **opts})]
    got = _message(chunks)
    assert got["content"] == msg["content"] and got["reasoning"] == (msg.get("reasoning_content") or "")
    assert [tuple(v) for _, v in sorted(got["calls"].items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    assert got["finish"] == here["choices"][0]["finish_reason"]


def test_a_stream_ends_with_usage_and_mtp(pair):
    """Without stream_options the last chunk (the finish) carries usage, timings and mtp:
    a loop over ``chunk["choices"][0]`` never meets an empty chunk."""
    _, eng, _ = pair
    chunks = list(eng.create_chat_completion(ASK, max_tokens=8, temperature=0, stream=True))
    assert all(c["choices"] for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 8 and last["mtp"]["mode"] == "chain" and "timings" in last


def test_completion_answers_as_the_server(pair):
    http, eng, model = pair
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "logprobs": 2, "model": model}
    here = eng.create_completion(**body)
    r = http.post("/v1/completions", json=body)
    assert _same(here) == _same(r.json())
    text = "".join(c["choices"][0]["text"] for c in eng.create_completion(**body, stream=True))
    assert text == here["choices"][0]["text"] and eng(**body)["choices"] == here["choices"]


@pytest.mark.parametrize("kw, message", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"logits_processor": [lambda ids, logits: logits]}, "logits_processor is not supported"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"top_logprobs": 2}, "requires logprobs"),
    ({"mirostat_mode": 2}, "mirostat"),
    ({"max_tokens": "8"}, "max_tokens"),
])
def test_bad_calls_raise_value_errors_naming_the_problem(pair, kw, message):
    _, eng, _ = pair
    with pytest.raises(InvalidRequest, match=message) as e:
        eng.create_chat_completion(ASK, **kw)
    assert isinstance(e.value, ValueError)


def test_an_unknown_keyword_is_a_type_error(pair):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        pair[1].create_chat_completion(ASK, temprature=0)


def test_llama_cpp_python_names(pair):
    """llama-cpp-python's older functions / function_call, and a server field by name."""
    _, eng, _ = pair
    fn = READ["function"]
    out = eng.create_chat_completion(ASK, functions=[fn], function_call={"name": "read_file"}, max_tokens=96,
                                     temperature=0)
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "read_file"
    out = eng.create_chat_completion(ASK, max_tokens=6, temperature=0, reasoning_format="none", ignore_eos=True)
    assert out["choices"][0]["message"]["content"] and "reasoning_content" not in out["choices"][0]["message"]
