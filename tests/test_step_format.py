"""Step-3.5-Flash's output parsed into reasoning, content and tool calls: every
recorded-looking output is fed whole, one character at a time, cut once at every
boundary and cut at random points, and each way gives the same message, with
deltas that add up to it."""
from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from stepmtp.chat.jinja_render import render
from stepmtp.chat.step_format import Delta, StepParser, convert_value, default_call_id

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
WRITE = {"type": "function", "function": {
    "name": "write_file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"},
        "content": {"type": "string"},
        "overwrite": {"type": "boolean"},
        "options": {"type": "object"},
        "mode": {"type": ["integer", "null"]}}}}}
TOOLS = [WEATHER, WRITE]


def xml_call(name, *params):
    """A call as the model writes it (and the chat template renders it)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(pieces, **kwargs):
    """Feeds the pieces; returns the message and the deltas, checked to add up to it."""
    kwargs.setdefault("id_factory", ids())
    parser = StepParser(**{k: v for k, v in kwargs.items() if k != "complete"})
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    msg = parser.message()
    assert "".join(d.reasoning for d in deltas) == (msg["reasoning_content"] or "")
    assert "".join(d.content for d in deltas) == msg["content"]
    calls: list[dict] = []
    for tc in (tc for d in deltas for tc in d.tool_calls):
        if tc.index == len(calls):  # the first piece of a call announces it
            assert tc.id is not None and tc.name is not None
            calls.append({"id": tc.id, "type": "function",
                          "function": {"name": tc.name, "arguments": tc.arguments}})
        else:
            assert tc.index == len(calls) - 1 and tc.id is None and tc.name is None
            calls[-1]["function"]["arguments"] += tc.arguments
    assert calls == msg["tool_calls"]
    if kwargs.get("complete", True):
        for call in calls:
            json.loads(call["function"]["arguments"])
    return msg, deltas


def chunkings(text, seed=0):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for n in (2, 3, 3):
        cuts = sorted(rng.sample(range(1, len(text)), n)) if len(text) > n else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def check(text, *, content="", reasoning=None, calls=(), **kwargs):
    """The message ``text`` parses to, the same at every chunking."""
    expected = {"content": content, "reasoning_content": reasoning,
                "tool_calls": [{"id": f"call_{i}", "type": "function",
                                "function": {"name": name, "arguments": args}}
                               for i, (name, args) in enumerate(calls)]}
    for pieces in chunkings(text):
        msg, _ = parse(pieces, **kwargs)
        assert msg == expected, pieces


# -- recorded-looking outputs ------------------------------------------------

def test_reasoning_then_content():
    check("The user greets me.\nI should answer briefly.\n</think>\n\nHello! How can I help?",
          reasoning="The user greets me.\nI should answer briefly.", content="Hello! How can I help?")


def test_auto_is_deepseek():
    check("thinking\n</think>\nanswer", reasoning="thinking", content="answer", reasoning_format="auto")


def test_reasoning_then_one_call():
    check("The user wants the weather in Paris.\n</think>\n"
          + xml_call("get_weather", ("city", "Paris"), ("days", "3")),
          tools=TOOLS, reasoning="The user wants the weather in Paris.",
          calls=[("get_weather", '{"city": "Paris", "days": 3}')])


def test_reasoning_then_two_parallel_calls_with_typed_parameters():
    text = ("I'll fetch the weather and write the notes file at once.\n</think>\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=days>\n-2\n</parameter>\n</function>\n</tool_call>\n\n"
            "<tool_call>\n<function=write_file>\n<parameter=path>\nnotes/日本.md\n</parameter>\n"
            "<parameter=content>\n# Notes\n\nline two\n  indented </para\n\n</parameter>\n"
            "<parameter=overwrite>\ntrue\n</parameter>\n"
            "<parameter=options>\n{\"encoding\": \"utf-8\", \"tags\": [\"ü\", 1]}\n</parameter>\n"
            "<parameter=mode>\nnull\n</parameter>\n"
            "</function>\n</tool_call>")
    check(text, tools=TOOLS, reasoning="I'll fetch the weather and write the notes file at once.",
          calls=[("get_weather", '{"city": "São Paulo", "days": -2}'),
                 ("write_file", '{"path": "notes/日本.md", "content": "# Notes\\n\\nline two\\n  indented </para\\n", '
                                '"overwrite": true, "options": {"encoding": "utf-8", "tags": ["ü", 1]}, '
                                '"mode": null}')])


def test_content_around_calls_keeps_its_separation():
    check("ok\n</think>\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
          "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nBergen\n</parameter>\n</function>\n</tool_call>\n\nBoth requested.\n",
          tools=TOOLS, reasoning="ok", content="Let me check.\n\nBoth requested.",
          calls=[("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Bergen"}')])


def test_call_inside_the_reasoning():
    check("I need data first.\n" + xml_call("get_weather", ("city", "Kyiv")) + "\nThat was the call.\n</think>\nDone.",
          tools=TOOLS, reasoning="I need data first.\nThat was the call.", content="Done.",
          calls=[("get_weather", '{"city": "Kyiv"}')])


def test_generation_stopped_inside_thinking_is_all_reasoning():
    check("Hmm, let me think about <tool_call> formats and </thi", reasoning=(
        "Hmm, let me think about <tool_call> formats and </thi"))
    check("Step one.\nStep two: a < b and c </ d\n\n", reasoning="Step one.\nStep two: a < b and c </ d")


def test_model_reopening_think():
    check("<think>\nagain\n</think>\nhi", reasoning="again", content="hi")


def test_reasoning_format_none_leaves_everything_in_content():
    check("thinking é\n</think>\n\nanswer", content="thinking é\n</think>\n\nanswer", reasoning_format="none")
    check("thinking\n</think>\n" + xml_call("get_weather", ("city", "Rome")),
          content="thinking\n</think>", reasoning_format="none", tools=TOOLS,
          calls=[("get_weather", '{"city": "Rome"}')])


def test_thinking_disabled_starts_in_content():
    check("Just the answer.\n</think> stays", content="Just the answer.\n</think> stays", thinking=False)
    check("<think>\nbrief 💭\n</think>\n\nanswer 💬", reasoning="brief 💭", content="answer 💬", thinking=False)
    check("<thinking> is not a think tag", content="<thinking> is not a think tag", thinking=False)
    check(xml_call("get_weather", ("city", "Lima")), thinking=False, tools=TOOLS,
          calls=[("get_weather", '{"city": "Lima"}')])


def test_no_tools_means_calls_are_text():
    text = "r\n</think>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    content = "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    check(text, reasoning="r", content=content)
    check(text, reasoning="r", content=content, tools=[])
    check(text, reasoning="r", content=content, tools=TOOLS, parse_tools=False)


def test_malformed_header_is_content():
    check("r\n</think>\nSee <tool_call> here, then <tool_call>\n<function=bad name>\nand <tool_call>\n"
          "<function=get_weather>\n</function>\n</tool_call>",
          tools=TOOLS, reasoning="r",
          content="See <tool_call> here, then <tool_call>\n<function=bad name>\nand",
          calls=[("get_weather", "{}")])


def test_call_broken_after_its_header_is_closed_and_the_rest_is_content():
    check("r\n</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
          "oops, prose\n</function>\n</tool_call>",
          tools=TOOLS, reasoning="r", content="oops, prose\n</function>\n</tool_call>",
          calls=[("get_weather", '{"city": "Paris"}')])


def test_generation_ending_inside_a_call():
    """Cut by max_tokens: llama-server's arguments (the JSON so far, left open), and
    none of the call's text in the content."""
    head = "r\n</think>\nSo:\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    cut = {"tools": TOOLS, "reasoning": "r", "content": "So:", "complete": False}
    check(head + "<parameter=days>\n4", calls=[("get_weather", '{"city": "Paris", "days": 4')], **cut)
    check(head + "<param", calls=[("get_weather", '{"city": "Paris"')], **cut)
    check(head + "</func", calls=[("get_weather", '{"city": "Paris"')], **cut)
    check(head, calls=[("get_weather", '{"city": "Paris"')], **cut)
    start = "r\n</think>\nSo:\n<tool_call>\n<function=write_file>\n"
    check(start + "<parameter=content>\nline one\n  two \"q\"\n</param",
          calls=[("write_file", '{"content": "line one\\n  two \\"q\\"')], **cut)
    check(start + "<parameter=content>\n", calls=[("write_file", '{"content": "')], **cut)
    check(start, calls=[("write_file", "{")], **cut)
    check(start + "<parameter=path>\na\n</parameter>\n</function>\n</tool_c",
          calls=[("write_file", '{"path": "a"}')], **{**cut, "complete": True})
    check("r\n</think>\nSo:\n<tool_call>\n<function=get_wea", **cut)
    check("r\n</think>\nSo:\n<tool", **cut)
    # a prefix of no marker stays text
    check("r\n</think>\nSo: <b", **{**cut, "content": "So: <b"})


def test_missing_tool_call_close_is_tolerated():
    check("r\n</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n"
          "</function>\nand then", tools=TOOLS, reasoning="r", content="and then",
          calls=[("get_weather", '{"city": "Nice"}')])


def test_literal_angle_brackets_are_text():
    check("if a < b and x </y then <tool\n</think>\n1 < 2, </b> and <tool_cal> <tool_call",
          tools=TOOLS, reasoning="if a < b and x </y then <tool", content="1 < 2, </b> and <tool_cal>")
    check("a </think bit\n</think>\n</</think>", reasoning="a </think bit", content="</</think>")


def test_unicode_everywhere():
    check("Ünïcödé 思考 🤔\n</think>\n答案：✓ — “quoted”\n<tool_call>\n<function=write_file>\n"
          "<parameter=path>\n/tmp/ファイル.txt\n</parameter>\n<parameter=content>\nЗдравствуй, 世界 🌍\n"
          "</parameter>\n<parameter=über>\n{\"ключ\": \"значение\"}\n</parameter>\n</function>\n</tool_call>",
          tools=TOOLS, reasoning="Ünïcödé 思考 🤔", content="答案：✓ — “quoted”",
          calls=[("write_file", '{"path": "/tmp/ファイル.txt", "content": "Здравствуй, 世界 🌍", '
                                '"über": {"ключ": "значение"}}')])


def test_unknown_tool_and_parameters_follow_the_json_rule():
    check("r\n</think>\n" + xml_call("mystery", ("n", "7"), ("s", '"7"'), ("z", "null"), ("w", "plain words")),
          tools=TOOLS, reasoning="r",
          calls=[("mystery", '{"n": 7, "s": "\\"7\\"", "z": "null", "w": "plain words"}')])


def test_what_the_template_renders_parses_back():
    """The template's own rendering of an assistant turn, from after the
    generation prompt to <|im_end|>, is what the model is trained to write."""
    path = (Path(__file__).resolve().parents[1] / "vendor" / "llama.cpp" / "models" / "templates"
            / "stepfun-ai-Step-3.5-Flash.jinja")
    if not path.exists():
        pytest.skip("no vendored llama.cpp templates")
    args = [{"city": "Zürich", "days": 2},
            {"path": "a.py", "content": "def f():\n    return 1 < 2\n", "options": {"k": ["v", 1]}}]
    turn = {"role": "assistant", "reasoning_content": "Two calls.\nBoth now.", "content": "Sure — one moment.",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                           for n, a in zip(("get_weather", "write_file"), args)]}
    prompt = render(path.read_text(), {"messages": [{"role": "user", "content": "hi"}, turn], "tools": TOOLS,
                                       "bos_token": "", "add_generation_prompt": False})
    generated = prompt.split("<|im_start|>assistant\n<think>\n", 1)[1].removesuffix("<|im_end|>\n")
    check(generated, tools=TOOLS, reasoning=turn["reasoning_content"], content=turn["content"],
          calls=[(c["function"]["name"], json.dumps(a, ensure_ascii=False)) for c, a in zip(turn["tool_calls"], args)])


# -- pieces ------------------------------------------------------------------

def test_call_is_announced_once_its_header_is_complete():
    parser = StepParser(tools=TOOLS, id_factory=ids())
    assert parser.feed("r\n</think>\n<tool_call>\n<function=get_weather") == Delta(reasoning="r")
    d = parser.feed(">\n<parameter=city>\nRiga\n</param")
    assert [(t.index, t.id, t.name, t.arguments) for t in d.tool_calls] == [(0, "call_0", "get_weather", "")]
    d = parser.feed("eter>\n")
    assert [(t.index, t.id, t.name, t.arguments) for t in d.tool_calls] == [(0, None, None, '{"city": "Riga"')]
    d = parser.feed("</function>")
    assert [(t.index, t.arguments) for t in d.tool_calls] == [(0, "}")]
    assert parser.finish().empty()


def test_held_back_text_waits_only_as_long_as_it_is_ambiguous():
    parser = StepParser()
    assert parser.feed("a </") == Delta(reasoning="a")
    assert parser.feed("b") == Delta(reasoning=" </b")
    assert parser.feed("\n\n") == Delta()
    assert parser.feed("c") == Delta(reasoning="\n\nc")
    assert parser.feed("\n</think>\n") == Delta()
    assert parser.feed("x<") == Delta(content="x<")  # no tools: "<" cannot start a marker


@pytest.mark.parametrize("raw,types,value", [
    ("\n5123123\n", {"string"}, "5123123"),
    ("\n42\n", {"integer"}, 42),
    ("\n3.5\n", {"number"}, 3.5),
    ("\nfalse\n", {"boolean"}, False),
    ("\nnot json\n", {"integer"}, "not json"),
    ("\nNaN\n", {"number"}, "NaN"),
    ("\n12\n", {"string", "integer"}, 12),
    ("\n\n", {"string"}, ""),
    ("\n\nkept\n\n", {"string"}, "\nkept\n"),
    ("\n[1, 2]\n", None, [1, 2]),
    ("\ntrue\n", None, True),
    ("\nnull\n", None, "null"),
    ("\n\"q\"\n", None, "\"q\""),
])
def test_convert_value(raw, types, value):
    assert convert_value(raw, types) == value and type(convert_value(raw, types)) is type(value)


def test_schema_unions_and_enums_type_values():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "b": {"enum": [1, 2]},
        "c": {"enum": ["1", "2"]}}}}}]
    check("r\n</think>\n" + xml_call("f", ("a", "5"), ("b", "2"), ("c", "2")),
          tools=tools, reasoning="r", calls=[("f", '{"a": 5, "b": 2, "c": "2"}')])


def test_default_ids_and_misuse():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", default_call_id())
    assert default_call_id() != default_call_id()
    with pytest.raises(ValueError):
        StepParser(reasoning_format="deepseek-legacy")
    parser = StepParser()
    assert parser.feed("<th").empty()  # may still be the model's own <think>
    assert parser.finish() == Delta(reasoning="<th")
    assert parser.finish().empty()
    with pytest.raises(RuntimeError):
        parser.feed("y")
    assert StepParser().message() == {"content": "", "reasoning_content": None, "tool_calls": []}
