"""The Responses API's request as the chat request it stands for, and the output
items and events written back (``stepmtp.server.responses``), without a model."""
from __future__ import annotations

import json

import pytest

from stepmtp.chat.step_format import Delta, ToolCallDelta
from stepmtp.server import responses as R
from stepmtp.api.errors import APIError


def test_a_codex_turn_becomes_chat_messages():
    """instructions, a developer message, the user's, then the model's reasoning, text
    and two calls (one assistant turn), the calls' outputs, and the next user turn."""
    chat = R.to_openai({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 64, "temperature": 0.2,
        "store": False, "include": ["reasoning.encrypted_content"], "parallel_tool_calls": True,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Repo: x"}]},
            {"role": "user", "content": "list files"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use ls."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
            {"type": "function_call", "call_id": "call_1", "name": "sh", "arguments": '{"cmd": "ls"}'},
            {"type": "function_call", "call_id": "call_2", "name": "sh", "arguments": '{"cmd": "pwd"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "/x"}]},
            {"role": "user", "content": "thanks"},
        ]})
    assert chat["max_tokens"] == 64 and chat["temperature"] == 0.2 and chat["parallel_tool_calls"] is True
    assert "store" not in chat and "include" not in chat and "input" not in chat
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Repo: x"}]},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "text", "text": "Listing."}], "reasoning_content": "Use ls.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}},
                        {"id": "call_2", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "pwd"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "/x"}]},
        {"role": "user", "content": "thanks"},
    ]


def test_tools_tool_choice_and_formats():
    chat = R.to_openai({
        "input": "hi",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                  {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}})
    # built-in tools run on OpenAI's side: left out; a function tool is strict unless told
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                               "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"},
                                                                              "strict": True}}
    assert chat["reasoning_effort"] == "low" and "text" not in chat and "reasoning" not in chat
    assert R.to_openai({"input": "hi", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    # only built-in tools: none at all, and no tool_choice for them
    only = R.to_openai({"input": "hi", "tools": [{"type": "file_search"}], "tool_choice": "auto"})
    assert "tools" not in only and "tool_choice" not in only


@pytest.mark.parametrize("body, message", [
    ([], "JSON object"),
    ({"instructions": "x"}, "'input' is required"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "instructions": 3}, "'instructions' must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "'input_audio'"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": 1}]}]}, "string 'text'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input_text"),
    ({"input": ["hi"]}, "input[0] must be an object"),
    ({"input": "x", "tools": {"type": "function"}}, "'tools' must be a list"),
])
def test_bad_requests_name_the_problem(body, message):
    with pytest.raises(APIError) as e:
        R.to_openai(body)
    assert message in str(e.value)


class _Stats:
    n_prompt, n_prompt_cached, n_predicted = 30, 20, 7


class _Completion:
    stats, tokens = _Stats(), []


def _events(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for text in chunks:
        head, data = text.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and text.endswith("\n\n")
        body = json.loads(data[len("data: "):])
        assert body["type"] == head[len("event: "):]
        out.append((body["type"], body))
    return out


def test_stream_events_build_the_items_in_order():
    ev = R.Events("m", "resp_x")
    chunks = ev.feed(Delta(reasoning="Think"))
    chunks += ev.feed(Delta(reasoning="ing."))
    chunks += ev.feed(Delta(content="Calling."))
    chunks += ev.feed(Delta(tool_calls=[ToolCallDelta(0, id="call_ab", name="f", arguments='{"a"')]))
    chunks += ev.feed(Delta(tool_calls=[ToolCallDelta(0, arguments=": 1}")]))
    chunks += ev.finish(_Completion())
    events = _events(chunks)
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [b["sequence_number"] for _, b in events] == list(range(len(events)))
    done = events[-1][1]["response"]
    assert done["id"] == "resp_x" and done["status"] == "completed"
    assert done["usage"] == {"input_tokens": 30, "output_tokens": 7, "total_tokens": 37,
                             "input_tokens_details": {"cached_tokens": 20}}
    rs, msg, fc = done["output"]
    assert rs["type"] == "reasoning" and rs["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert msg["type"] == "message" and msg["content"][0]["text"] == "Calling." and msg["status"] == "completed"
    assert fc == {"id": "fc_ab", "type": "function_call", "call_id": "call_ab", "name": "f", "arguments": '{"a": 1}',
                  "status": "completed"}
    # every event of an item names it and its place in the output
    for _, b in events:
        if "item_id" in b:
            assert b["item_id"] == done["output"][b["output_index"]]["id"]
    # the whole response has the same items
    whole = R.response_json(_Completion(), {"reasoning_content": "Thinking.", "content": "Calling.", "tool_calls": [
        {"id": "call_ab", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "m", "resp_y")
    strip = [{k: v for k, v in o.items() if k != "id"} for o in whole["output"]]
    assert strip == [{k: v for k, v in o.items() if k != "id"} for o in done["output"]]
