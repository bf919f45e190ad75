"""Constrained decoding (stepmtp.grammar) on the tiny models' and the bundled model's vocabularies."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from stepmtp import Model
from stepmtp.grammar import (
    Constraint,
    ConstraintState,
    DisallowedToken,
    GrammarError,
    bitmasks_along_many,
    text_value_rules,
    vocabulary,
)
from stepmtp.models import default_model_path

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tiny_vocab(tiny):
    m = Model(tiny["embedded"], vocab_only=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def stdlib_vocab():
    m = Model(default_model_path(), vocab_only=True)
    yield m
    m.close()


@pytest.fixture(params=["tiny", "stdlib"])
def model(request, tiny_vocab, stdlib_vocab):
    return tiny_vocab if request.param == "tiny" else stdlib_vocab


def decode(model: Model, state: ConstraintState, seed: int, max_tokens: int = 4000) -> str:
    """Greedy decoding of random logits under the constraint, until it is complete."""
    rng = np.random.default_rng(seed)
    while not state.done:
        assert len(state.tokens) < max_tokens, "the grammar never completed"
        logits = rng.standard_normal(model.n_vocab).astype(np.float32)
        state.mask_into(logits)
        tok = int(np.argmax(logits))
        assert np.isfinite(logits[tok])
        state.advance(tok)
        if model.is_eog(tok):
            break
    return model.detokenize([t for t in state.tokens if not model.is_eog(t)])


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(model, seed):
    state = Constraint.compile(model, "json_schema", PERSON).start()
    text = decode(model, state, seed)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_as_text(tiny_vocab):
    state = Constraint.compile(tiny_vocab, "json_schema", json.dumps(PERSON)).start()
    jsonschema.validate(json.loads(decode(tiny_vocab, state, 7)), PERSON)


@pytest.mark.parametrize("seed", range(4))
def test_json_object(model, seed):
    c = Constraint.compile(model, "json_object")
    state = c.start()
    assert model.detokenize(state.forced()) == "{"
    assert isinstance(json.loads(decode(model, state, seed)), dict)


@pytest.mark.parametrize("schema, want", [
    ({"items": [{"type": "integer"}]}, list),                # llama-server's suite: "[ -3000 ]"
    ({"prefixItems": [{"type": "integer"}]}, list),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, dict),
    ({"additionalProperties": {"type": "integer"}}, dict),
    ({"pattern": "^[a-z]{3}$"}, str),
    ({"format": "date"}, str),
    ({}, dict),
    ({"type": "array", "items": {"properties": {"x": {"type": "string"}}}}, list),
])
def test_untyped_schemas_are_typed_as_llama_cpp_does(tiny_vocab, schema, want):
    """A schema without ``type`` gets the one llama.cpp's converter infers from its
    keywords, where JSON Schema alone would allow any value; each seed's output is
    valid and of that type (nested subschemas too)."""
    for seed in range(4):
        text = decode(tiny_vocab, Constraint.compile(tiny_vocab, "json_schema", schema).start(), seed)
        value = json.loads(text)
        assert isinstance(value, want), (schema, text)
        # a list of item schemas is draft 7's tuple form (2020-12 calls it prefixItems)
        draft = jsonschema.Draft7Validator if isinstance(schema.get("items"), list) else jsonschema.Draft202012Validator
        draft(schema).validate(value)
        if schema.get("type") == "array":
            assert all(isinstance(v, dict) for v in value), text


@pytest.mark.parametrize("seed", range(6))
def test_gbnf(model, seed):
    state = Constraint.compile(model, "gbnf", 'root ::= ("yes" | "no") "!"').start()
    assert decode(model, state, seed) in ("yes!", "no!")
    assert state.done


def test_gbnf_with_rules_and_classes(tiny_vocab):
    gbnf = 'root ::= item ("," item)*\nitem ::= [a-c]{1,3}\n'
    for seed in range(4):
        state = Constraint.compile(tiny_vocab, "gbnf", gbnf).start()
        text = decode(tiny_vocab, state, seed)
        assert all(1 <= len(x) <= 3 and set(x) <= set("abc") for x in text.split(",")), text


def test_regex_and_lark(tiny_vocab):
    import re

    for seed in range(4):
        state = Constraint.compile(tiny_vocab, "regex", r"[0-9]{3}-[a-z]{2}").start()
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", decode(tiny_vocab, state, seed))
        state = Constraint.compile(tiny_vocab, "lark", 'start: "x" NUM\nNUM: /[1-9]/').start()
        assert re.fullmatch(r"x[1-9]", decode(tiny_vocab, state, seed))


@pytest.mark.parametrize(
    "kind, spec, words",
    [
        ("json_schema", {"type": "nosuchtype"}, "type"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", [1, 2], "object or a boolean"),
        ("gbnf", 'root ::= ("yes" | "no" "!"', "Expected ')'"),
        ("gbnf", "root ::= undefined-rule", "undefined"),
        ("lark", "start: foo", "unknown name"),
        ("regex", "a(b", "unclosed group"),
        ("yaml", "x", "unknown grammar kind"),
    ],
)
def test_invalid_grammar(tiny_vocab, kind, spec, words):
    with pytest.raises(GrammarError) as err:
        Constraint.compile(tiny_vocab, kind, spec)
    assert isinstance(err.value, ValueError)
    assert words.lower() in str(err.value).lower()


def test_disallowed_token(tiny_vocab):
    state = Constraint.compile(tiny_vocab, "gbnf", 'root ::= ("yes" | "no") "!"').start()
    bang = tiny_vocab.tokenize("!", add_special=False)[0]
    assert not state.allowed(bang)
    with pytest.raises(DisallowedToken) as err:
        state.advance(bang)
    assert isinstance(err.value, ValueError) and err.value.token == bang
    assert state.tokens == [] and not state.done
    # the state is still usable: a rejected token leaves llguidance's matcher intact
    state.advance_many(tiny_vocab.tokenize("no", add_special=False))
    assert not state.accepting
    assert state.allowed(bang) and not state.allowed(tiny_vocab.eos)
    state.advance(bang)
    assert state.accepting and state.done
    assert state.allowed(tiny_vocab.eos) and not state.allowed(bang)
    with pytest.raises(DisallowedToken):
        state.advance(bang)
    assert not state.allowed(-1) and not state.allowed(tiny_vocab.n_vocab)


def test_control_tokens_are_not_text(tiny_vocab):
    """<|im_start|> inside a JSON string would be its bytes for a grammar over text;
    the token itself is not output text and the grammar must never pick it."""
    state = Constraint.compile(tiny_vocab, "json_schema", {"type": "string"}).start()
    state.advance_many(tiny_vocab.tokenize('"', add_special=False))
    mask = state.mask()
    im_start = tiny_vocab.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and not mask[im_start[0]]
    assert mask[tiny_vocab.tokenize("a", add_special=False)[0]]
    assert not any(mask[t] for t in range(tiny_vocab.n_vocab) if tiny_vocab.is_eog(t))


def test_every_eog_token_ends(tiny_vocab):
    eog = [t for t in range(tiny_vocab.n_vocab) if tiny_vocab.is_eog(t)]
    assert len(eog) > 1
    for t in eog:
        state = Constraint.compile(tiny_vocab, "regex", "a+").start()
        state.advance(tiny_vocab.tokenize("a", add_special=False)[0])
        assert state.accepting and not state.done
        assert all(state.allowed(e) for e in eog)  # asked before the mask is computed
        assert all(state.mask()[e] for e in eog)
        state.advance(t)
        assert state.done and state.stop_reason == "EndOfSentence"


def test_allowed_matches_the_mask(tiny_vocab):
    c = Constraint.compile(tiny_vocab, "json_schema", PERSON)
    ref = c.start()
    decode(tiny_vocab, ref, 3)
    state = c.start()
    for tok in ref.tokens:
        allowed = [state.allowed(t) for t in range(tiny_vocab.n_vocab)]
        assert allowed == state.mask().tolist()
        state.advance(tok)


def test_forced_text_keeps_the_models_tokenization(tiny_vocab):
    """After '{"n' only "name" fits; llguidance forces its rest in the model's own
    tokens, so a split of it the tokenizer would not make is refused."""
    state = Constraint.compile(tiny_vocab, "json_schema", PERSON).start()
    state.advance_many(tiny_vocab.tokenize('{"n', add_special=False))
    a = tiny_vocab.tokenize("a", add_special=False)[0]
    rest = tiny_vocab.tokenize('ame', add_special=False)
    assert len(rest) == 1 and state.allowed(rest[0])
    assert not state.allowed(a)
    with pytest.raises(DisallowedToken):
        state.advance(a)
    assert state.valid_prefix([a]) == 0 and state.valid_prefix(rest) == 1


@pytest.mark.parametrize("prefix", ["", "{", '{"a', '{"a": 1'])
def test_mask_into_matches_mask(tiny_vocab, prefix):
    """Rows where few tokens are allowed (the start of an object) and rows where
    most are (inside a key) take different paths in mask_into."""
    state = Constraint.compile(tiny_vocab, "json_object").start()
    state.advance_many(tiny_vocab.tokenize(prefix, add_special=False))
    # a row wider than the vocabulary: the padding is forbidden too
    logits = np.random.default_rng(0).standard_normal(tiny_vocab.n_vocab + 40).astype(np.float32)
    before = logits.copy()
    state.mask_into(logits)
    mask = state.mask()
    assert np.array_equal(np.isfinite(logits[: tiny_vocab.n_vocab]), mask)
    assert np.array_equal(logits[: tiny_vocab.n_vocab][mask], before[: tiny_vocab.n_vocab][mask])
    assert np.all(np.isneginf(logits[tiny_vocab.n_vocab:]))
    bits = np.zeros(vocabulary(tiny_vocab).n_words, dtype=np.int32)
    state.fill_bitmask(bits)
    assert np.array_equal(bits, state.fill_bitmask())


def masks_of(state: ConstraintState, tokens) -> list[np.ndarray]:
    """The mask before each token and after the last, advancing through them."""
    out = []
    for t in tokens:
        out.append(state.mask().copy())
        state.advance(t)
    out.append(state.mask().copy())
    return out


def decoded_run(model: Model, seed: int) -> tuple[ConstraintState, list[int], list[np.ndarray]]:
    """A state advanced through a whole decode under PERSON, its tokens and the
    mask before each."""
    c = Constraint.compile(model, "json_schema", PERSON)
    ref = c.start()
    decode(model, ref, seed)
    state = c.start()
    return state, list(ref.tokens), masks_of(state, ref.tokens)


@pytest.mark.parametrize("seed", range(3))
def test_rollback_then_readvance(model, seed):
    state, tokens, masks = decoded_run(model, seed)
    done = state.done
    assert done or model.is_eog(tokens[-1])
    rng = np.random.default_rng(seed)
    for _ in range(8):
        n = int(rng.integers(0, len(tokens) + 1))
        state.rollback(n)
        k = len(tokens) - n
        assert state.tokens == tokens[:k]
        assert np.array_equal(state.mask(), masks[k])
        again = masks_of(state, tokens[k:])
        for a, b in zip(again, masks[k:]):
            assert np.array_equal(a, b)
        assert state.done == done
    state.reset()
    assert state.tokens == [] and np.array_equal(state.mask(), masks[0])
    with pytest.raises(ValueError):
        state.rollback(1)


def test_rollback_past_end_of_generation(tiny_vocab):
    """EOS consumed after the grammar stopped (llguidance does not record it) and an
    EOS that completes an open grammar (it does) both roll back as one token."""
    yes = tiny_vocab.tokenize("yes!", add_special=False)
    state = Constraint.compile(tiny_vocab, "gbnf", 'root ::= "yes" "!"').start()
    state.advance_many(yes)
    assert state.done
    state.advance(tiny_vocab.eos)
    state.rollback(1)
    assert state.done and state.tokens == yes
    state.rollback(1)
    assert not state.done and state.allowed(yes[-1])
    state.advance(yes[-1])
    assert state.done

    a = tiny_vocab.tokenize("a", add_special=False)[0]
    state = Constraint.compile(tiny_vocab, "regex", "a+").start()
    state.advance_many([a, a, tiny_vocab.eos])
    assert state.done
    state.rollback(1)
    assert not state.done and state.allowed(a)
    state.advance(a)
    assert state.tokens == [a, a, a]


@pytest.mark.parametrize("seed", range(3))
def test_masks_along_drafts(model, seed):
    state, tokens, masks = decoded_run(model, seed)
    rng = np.random.default_rng(seed)
    state.reset()
    pos = 0
    while pos < len(tokens):
        # the verifier's view: the accepted prefix, then n drafts
        n = int(rng.integers(0, 5))
        drafts = tokens[pos:pos + n]
        along = state.masks_along(drafts)
        assert along.shape == (len(drafts) + 1, model.n_vocab)
        assert state.tokens == tokens[:pos]  # untouched
        for i in range(len(drafts) + 1):
            assert np.array_equal(along[i], masks[pos + i])
        # accept some of them, as a verify step would
        k = int(rng.integers(0, len(drafts) + 1)) if drafts else 1
        state.advance_many(tokens[pos:pos + k])
        pos += k


def test_masks_along_rejected_draft(tiny_vocab):
    c = Constraint.compile(tiny_vocab, "json_schema", PERSON)
    state = c.start()
    good = tiny_vocab.tokenize('{"name":"x"', add_special=False)
    x = tiny_vocab.tokenize("x", add_special=False)[0]
    drafts = good[:3] + [x] + good[4:]
    assert state.valid_prefix(drafts) == 3
    along = state.masks_along(drafts)
    expect = masks_of(c.start(), good[:3])
    for i in range(4):
        assert np.array_equal(along[i], expect[i])
    assert not along[3][x]
    assert not along[4:].any()
    assert state.tokens == [] and state.allowed(good[0])

    # an end of generation among the drafts: the rows after it can never be reached
    yes = tiny_vocab.tokenize("yes!", add_special=False)
    st = Constraint.compile(tiny_vocab, "gbnf", 'root ::= "yes" "!"').start()
    along = st.masks_along(yes + [tiny_vocab.eos, yes[0]])
    assert along[len(yes)].tolist() == [tiny_vocab.is_eog(t) for t in range(tiny_vocab.n_vocab)]
    assert not along[len(yes) + 2].any()


def test_mask_rows_into_and_batched(tiny_vocab):
    c = Constraint.compile(tiny_vocab, "json_object")
    a, b = c.start(), c.start()
    b.advance_many(tiny_vocab.tokenize('{"k": ', add_special=False))
    da = tiny_vocab.tokenize('{"a', add_special=False)
    db = tiny_vocab.tokenize('[1, 2', add_special=False)
    va, vb = bitmasks_along_many([(a, da), (b, db)])
    assert np.array_equal(va, a.bitmasks_along(da)) and np.array_equal(vb, b.bitmasks_along(db))
    logits = np.zeros((len(db) + 1, tiny_vocab.n_vocab), dtype=np.float32)
    b.mask_rows_into(logits, db)
    assert np.array_equal(np.isfinite(logits), b.masks_along(db))
    with pytest.raises(ValueError):
        b.mask_rows_into(np.zeros((1, tiny_vocab.n_vocab), dtype=np.float32), db)


def test_copy_is_independent(tiny_vocab):
    state = Constraint.compile(tiny_vocab, "gbnf", 'root ::= ("yes" | "no") "!"').start()
    state.advance_many(tiny_vocab.tokenize("yes", add_special=False))
    fork = state.copy()
    fork.advance_many(tiny_vocab.tokenize("!", add_special=False))
    assert fork.done and not state.done and state.tokens == fork.tokens[:len(state.tokens)]


def test_vocabulary_is_cached_per_model(tiny_vocab, stdlib_vocab):
    v = vocabulary(tiny_vocab)
    assert vocabulary(tiny_vocab) is v and vocabulary(stdlib_vocab) is not v
    assert v.n_vocab == tiny_vocab.n_vocab and v.n_words == (tiny_vocab.n_vocab + 31) // 32
    assert Constraint.compile(tiny_vocab, "json_object").vocab is v
    assert Constraint.compile(v, "json_object").vocab is v


# -- a value written as text (Step's XML-like tool calls) ----------------------------

CLOSE, MARK = "\n</parameter>\n", "</parameter>"


def fits(model: Model, c: Constraint, text: str) -> bool:
    """Whether ``text`` then the value's close is what the grammar allows, whole."""
    state = c.start()
    for tok in model.tokenize((text + CLOSE).encode(), add_special=False, parse_special=False):
        if not state.allowed(tok):
            return False
        state.advance(tok)
    return state.accepting


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "maxLength": 4}, ["", "abcd", "é<>\n"], ["abcde"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc"], ["a", "abcd"]),
    ({"type": "string", "enum": ["c", "f"]}, ["c", "f"], ["x", "cf", ""]),
    ({"const": "fixed"}, ["fixed"], ["fix"]),
    ({"enum": [1, "two", None]}, ["1", "two", "null"], ["2"]),
    ({"type": "string", "pattern": "^[a-z]+\\.py$"}, ["setup.py"], ["Setup.py", "setup.pyc"]),
    ({"type": "string", "pattern": "\\d{2}"}, ["a12b", "12"], ["a1b"]),  # JSON schema searches
    ({"type": "string", "format": "date"}, ["2024-05-01"], ["2024-13-01", "May 1"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567"]),
    ({"type": "string", "format": "date-time"}, ["2024-05-01T10:20:30Z"], ["2024-05-01"]),
    ({"type": "string", "format": "made-up"}, ["anything"], []),  # unknown: any text, as llama.cpp
    ({"type": "string", "pattern": "^(?=a)a+$", "maxLength": 2}, ["b"], ["bbb"]),  # a look-around: not enforced
    ({"type": "string"}, ["a < b </b>\n\nc", ""], ["a</parameter>b"]),
    ({}, ["{\"x\": 1}", "plain"], ["a</parameter>"]),
    ({"type": ["string", "integer"]}, ["12", "text"], []),
    ({"type": "integer", "minimum": 0, "maximum": 999}, ["0", "999", "12"], ["1000", "-1", "1.5", "x", ""]),
    ({"type": "number"}, ["3.25", "-1", "2e3"], ["x", "1."]),
    ({"type": "boolean"}, ["true", "false"], ["yes", "True"]),
    ({"type": ["integer", "null"]}, ["4", "null"], ["none"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
     ['{"a": 1}', '{"a":2}'], ['{"b": 1}', "{}", '{"a": "1"}']),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, ["[1, 2]", "[]"], ["[1, 2, 3]", '["a"]']),
    ({"$ref": "#/$defs/mode"}, ["r"], []),  # a reference: untyped here, any text
    ({"type": "object", "properties": {"m": {"$ref": "#/$defs/mode"}}}, ['{"m": "r"}'], ['{"m": "x"}']),
])
def test_text_values_follow_their_schema(stdlib_vocab, schema, good, bad):
    """Each constraint kind of a parameter's schema, on the value as Step writes it:
    a string as its own characters, anything else as JSON."""
    rules = text_value_rules("v", schema, CLOSE, MARK, defs={"$defs": {"mode": {"enum": ["r", "w"]}}})
    c = Constraint.compile(stdlib_vocab, "lark", "\n".join(["start: v", *rules]))
    assert [t for t in good if not fits(stdlib_vocab, c, t)] == []
    assert [t for t in bad if fits(stdlib_vocab, c, t)] == []


def test_text_value_ends_at_its_close(stdlib_vocab):
    """The value and its close are one lexeme: with a string that may hold newlines and
    "<", the close can still end it (a string lexeme of its own never ended: the
    lexer is greedy), and only once."""
    rules = text_value_rules("v", {"type": "string"}, CLOSE, MARK)
    c = Constraint.compile(stdlib_vocab, "lark", "\n".join(['start: v "next"', *rules]))
    state = c.start()
    state.advance_many(stdlib_vocab.tokenize(("line\n<b>\n" + CLOSE).encode(), add_special=False))
    assert stdlib_vocab.detokenize(state.forced()) == "next"


def test_empty_enum_is_an_error():
    with pytest.raises(GrammarError, match="empty enum"):
        text_value_rules("v", {"enum": []}, CLOSE, MARK)


EDIT = {"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "additionalProperties": False,
    "required": ["path", "mode", "line", "when", "tag", "ratio", "range", "ids"],
    "properties": {
        "path": {"type": "string", "maxLength": 16},
        "mode": {"type": "string", "enum": ["read", "write"]},
        "line": {"type": "integer", "minimum": 0, "maximum": 999},
        "when": {"type": "string", "format": "date"},
        "tag": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "force": {"type": "boolean"},
        "range": {"type": "object", "additionalProperties": False, "required": ["from"],
                  "properties": {"from": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "to": {"type": "integer", "minimum": 0, "maximum": 99}}},
        "ids": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}}}


@pytest.mark.parametrize("seed", range(6))
def test_forced_call_arguments_validate(stdlib_vocab, seed):
    """A forced Step call decoded from random logits parses into arguments that
    validate against the tool's schema (every constraint kind at once)."""
    from stepmtp.chat.step_format import StepParser
    from stepmtp.api.chat import tool_call_grammar

    state = Constraint.compile(stdlib_vocab, "lark", tool_call_grammar([EDIT], "edit", parallel=False)).start()
    text = decode(stdlib_vocab, state, seed)
    parser = StepParser(thinking=False, tools=[EDIT])
    parser.feed(text)
    parser.finish()
    msg = parser.message()
    assert msg["content"] == "" and len(msg["tool_calls"]) == 1, text
    jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]), EDIT["function"]["parameters"],
                        format_checker=jsonschema.FormatChecker())
