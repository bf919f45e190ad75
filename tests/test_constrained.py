"""Constrained decoding through the MTP loop: valid output, the same tokens as
constrained plain decoding at temperature 0, and drafts that follow the grammar."""
from __future__ import annotations

import json

import jsonschema
import pytest

from stepmtp import Engine
from tests.test_server import server_fixture
from stepmtp.models import default_model_path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPT = "def person():\n    return "
N = 200


@pytest.fixture(scope="module")
def bundled():
    return default_model_path()


def run(path, grammar, **kw):
    mask = kw.pop("mask_drafts", True)
    with Engine(path, n_ctx=1024, n_threads=1, **kw) as eng:
        return eng.generate(PROMPT, n_predict=N, temperature=0, grammar=grammar, mask_drafts=mask)


@pytest.mark.parametrize("grammar", [("json_schema", SCHEMA), ("json_object", None),
                                     ("gbnf", 'root ::= "def " [a-z_]{1,20} "(" [a-z, ]{0,30} "):" "\\n"')],
                         ids=["schema", "object", "gbnf"])
def test_constrained_spec_equals_constrained_plain(bundled, grammar):
    plain = run(bundled, grammar, mode="none")
    outs = {name: run(bundled, grammar, **cfg) for name, cfg in (
        ("chain-3", dict(mode="chain", n_max=3)), ("single-2", dict(mode="single", n_max=2)),
        ("chain-3-ref", dict(mode="chain", n_max=3, schedule="reference")),
        ("chain-3-unmasked", dict(mode="chain", n_max=3, mask_drafts=False)))}
    for name, out in outs.items():
        assert out.tokens == plain.tokens, name
    if grammar[0] == "json_schema":
        jsonschema.validate(json.loads(plain.text), SCHEMA)
    elif grammar[0] == "json_object":
        # JSON as far as it goes: a whole object where the grammar ended it (the bundled
        # model writes {} here), the start of one where the length did
        if plain.finish_reason == "stop":
            assert isinstance(json.loads(plain.text), dict), plain.text
        else:
            assert plain.text.startswith("{") and plain.finish_reason == "length"
    else:
        assert plain.text.startswith("def ") and plain.text.endswith("):\n")
    if grammar[0] != "json_object":
        assert plain.finish_reason == "stop"  # the grammar ended it
    assert outs["chain-3"].stats.n_accepted > 0


def test_masked_drafts_accept_more(bundled):
    """Grammar-aware drafting: the heads' rows are masked too, so what the grammar
    forces ({"name": ...) is drafted right, and more drafts are accepted."""
    masked = run(bundled, ("json_schema", SCHEMA), mode="chain", n_max=3)
    unmasked = run(bundled, ("json_schema", SCHEMA), mode="chain", n_max=3, mask_drafts=False)
    assert masked.tokens == unmasked.tokens
    assert masked.stats.accept_rate > unmasked.stats.accept_rate, (masked.stats.accept_rate,
                                                                   unmasked.stats.accept_rate)


def test_sampled_constrained_output_is_valid(bundled):
    with Engine(bundled, n_ctx=1024, n_threads=1, mode="chain", n_max=3) as eng:
        for seed in range(3):
            out = eng.generate(PROMPT, n_predict=N, temperature=1.0, seed=seed, grammar=("json_schema", SCHEMA))
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_bad_grammar_is_a_value_error(bundled):
    with Engine(bundled, n_ctx=256, n_threads=1) as eng:
        with pytest.raises(ValueError):
            eng.generate("x", n_predict=4, grammar=("gbnf", "root ::= foo"))
        with pytest.raises(ValueError):
            eng.generate("x", n_predict=4, grammar=("json_schema", {"type": "nonsense"}))


# -- through the server: response_format, json_schema, grammar ---------------------------


# a fixed draft length: the grammar must hold over drafted rows, and a policy that
# chose not to draft on a busy machine would leave that untested
server = server_fixture("bundled", "-c", "2048", "-np", "2", "--spec-draft-n-min", "3")


def test_server_response_format_json_schema(server, bundled):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=60, max_retries=0)
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a person"}], max_tokens=N, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    # streamed: the same text
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a person"}], max_tokens=N, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content


def test_server_native_json_schema_and_grammar_equal_the_engine(server, bundled):
    import httpx

    plain = run(bundled, ("json_schema", SCHEMA), mode="none")
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0,
                                                     "json_schema": SCHEMA}, timeout=60).json()
    assert r["content"] == plain.text and r["timings"]["draft_n_accepted"] > 0
    g = 'root ::= ("yes" | "no") "!"'
    r = httpx.post(server.url + "/completion", json={"prompt": "x", "n_predict": 8, "grammar": g}, timeout=60).json()
    assert r["content"] in ("yes!", "no!")
    bad = httpx.post(server.url + "/completion", json={"prompt": "x", "grammar": "root ::= nothing"}, timeout=60)
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                "response_format": {"type": "xml"}}, timeout=60)
    assert bad.status_code == 400
