"""OpenAI chat as agents use it, with MTP drafting on: Step's template, reasoning in
reasoning_content, tool calls (forced by tool_choice, parsed into tool_calls,
streamed as deltas), a two-turn tool loop; the same answers with speculation as
without."""
from __future__ import annotations

import json
import openai
import pytest

from tests.test_server import running

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {
        "days": {"type": "integer"}, "units": {"type": "string", "enum": ["c", "f"]},
        "hourly": {"type": "boolean"}}, "required": ["days", "units"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    # the bundled model, with the template it carries: Step-3.5-Flash's own
    base = ["-c", "4096", "-np", "2", "-t", "1"]
    # a fixed draft length: the tests check that masked drafts are accepted, and on the
    # bundled model (a decode costs less than Python's share of a round) the length the
    # server would choose is often none
    fixed = ["--spec-draft-n-min", "3"]
    with running(base + ["--spec-type", "draft-mtp", *fixed], tmp_path_factory.mktemp("chat-mtp")) as mtp, \
            running(base, tmp_path_factory.mktemp("chat-plain")) as plain:
        yield {"mtp": mtp, "plain": plain}


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-x", timeout=120, max_retries=0)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_forces_a_valid_call(servers, choice):
    outs = {}
    for name, srv in servers.items():
        out = client(srv).chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=200, temperature=0)
        outs[name] = out
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls[:1]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        assert isinstance(args["days"], int) and args["units"] in ("c", "f")
        assert set(args) <= {"days", "units", "hourly"}
    # with MTP drafting: the same call, and drafts were accepted along the way
    a, b = (outs[k].choices[0].message for k in ("mtp", "plain"))
    assert [c.function.model_dump() for c in a.tool_calls] == [c.function.model_dump() for c in b.tool_calls]
    assert outs["mtp"].model_extra["timings"]["draft_n_accepted"] > 0


def test_streamed_tool_call_equals_the_whole(servers):
    c = client(servers["mtp"])
    whole = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                      max_tokens=200, temperature=0).choices[0].message
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            cur = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert cur["id"] is None  # the id and name come once, first
                cur["id"], cur["name"] = d.id, d.function.name
            cur["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    got = [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]
    assert got == [(t.function.name, json.loads(t.function.arguments)) for t in whole.tool_calls]


# -- forced calls held to their schemas (issue 36) ----------------------------------------

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read lines of a file",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["path", "lines"], "properties": {
        "path": {"type": "string", "maxLength": 16},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
READ_ASK = [{"role": "user", "content": "Read the first lines of setup.py"}]


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    """A streamed chat completion's calls (name, arguments), finish reason and content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            cur = calls.setdefault(d.index, {"name": "", "arguments": ""})
            cur["name"] += d.function.name or ""
            cur["arguments"] += d.function.arguments or ""
    return [(v["name"], v["arguments"]) for _, v in sorted(calls.items())], finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "read_file"}}])
def test_forced_call_follows_its_bounded_schema(servers, choice):
    """The issue's call: a path of at most 16 characters and a bounded integer. The
    value of each parameter is held to its schema (the string could not even end
    before), so the call completes and validates, with and without drafting (the
    same call: the heads' drafts are masked too), streamed and not."""
    import jsonschema

    got = {}
    for name, srv in servers.items():
        kw = dict(model="m", messages=READ_ASK, tools=[READ], tool_choice=choice, max_tokens=96, temperature=0)
        out = client(srv).chat.completions.create(**kw)
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content, ch
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), READ["function"]["parameters"])
        calls, finish, content = streamed_calls(client(srv).chat.completions.create(stream=True, **kw))
        assert calls == [("read_file", call.function.arguments)] and finish == "tool_calls" and content == ""
        got[name] = call.function.arguments
    assert got["mtp"] == got["plain"]


def test_forced_call_every_constraint_kind(servers):
    """A tool with every kind of constraint: bounded and enumerated strings, a pattern,
    a date, integer, number and boolean, an object and an array as JSON; the heads'
    drafts are masked too, and accepted."""
    import jsonschema

    from tests.test_grammar import EDIT

    got = {}
    for name, srv in servers.items():
        out = client(srv).chat.completions.create(model="m", messages=READ_ASK, tools=[EDIT, READ],
                                                  tool_choice={"type": "function", "function": {"name": "edit"}},
                                                  max_tokens=400, temperature=0)
        ch = out.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, EDIT["function"]["parameters"], format_checker=jsonschema.FormatChecker())
        assert set(EDIT["function"]["parameters"]["required"]) <= set(args)
        got[name] = (call.function.arguments, out.model_extra["timings"].get("draft_n_accepted", 0))
    assert got["mtp"][0] == got["plain"][0] and got["mtp"][1] > 0


def test_forced_call_cut_by_max_tokens(servers):
    """A call cut by max_tokens ends as llama-server's does: finish_reason "length",
    the arguments written so far (left open), none of the call's text in the
    content; streamed, the same."""
    c = client(servers["mtp"])
    kw = dict(model="m", messages=READ_ASK, tools=[READ], tool_choice="required", temperature=0)
    full = json.loads(c.chat.completions.create(max_tokens=96, **kw).choices[0].message.tool_calls[0]
                      .function.arguments)
    for n in (16, 20):
        ch = c.chat.completions.create(max_tokens=n, **kw).choices[0]
        assert ch.finish_reason == "length" and not ch.message.content, ch
        (call,) = ch.message.tool_calls
        args = call.function.arguments
        assert call.function.name == "read_file" and args.startswith("{")
        # a prefix of the whole call's arguments, the string left open
        assert ('{"path": ' + json.dumps(full["path"])).startswith(args), args
        calls, finish, content = streamed_calls(c.chat.completions.create(max_tokens=n, stream=True, **kw))
        assert calls == [("read_file", args)] and finish == "length" and content == ""


def test_forced_call_on_the_other_apis(servers):
    """Responses and Anthropic's Messages force the same schema-held call, streamed
    and not."""
    import jsonschema

    params = READ["function"]["parameters"]
    c = client(servers["mtp"])
    r_tools = [{"type": "function", **READ["function"]}]
    whole = c.responses.create(model="m", input=READ_ASK, tools=r_tools, tool_choice="required",
                               max_output_tokens=96, temperature=0)
    (call,) = [o for o in whole.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), params)
    events = list(c.responses.create(model="m", input=READ_ASK, tools=r_tools, tool_choice="required",
                                     max_output_tokens=96, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments

    a = anthropic_client(servers["mtp"])
    kw = dict(model="m", max_tokens=96, messages=READ_ASK, extra_body=GREEDY,
              tools=[{"name": "read_file", "input_schema": params}], tool_choice={"type": "tool", "name": "read_file"})
    first = a.messages.create(**kw)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, params)
    with a.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content] == [use.input]


def test_two_turn_tool_loop(servers):
    """call, result, answer: the assistant's call goes back with its arguments as a
    JSON string (as clients send it) and the tool's result as a "tool" message."""
    c = client(servers["mtp"])
    first = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                      max_tokens=200, temperature=0).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": first.content or "",
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'}]
    r = c.chat.completions.with_raw_response.create(model="m", messages=history, tools=TOOLS, max_tokens=16,
                                                     temperature=0)
    answer = r.parse()
    assert answer.choices[0].message.tool_calls is None or answer.choices[0].message.tool_calls == []
    # the template got the call back as an object and the result as a tool response
    prompt = servers["mtp"].url
    import httpx

    text = httpx.post(prompt + "/apply-template", json={"messages": history}, timeout=30).json()["prompt"]
    assert "<function=get_weather>" in text and "<tool_response>" in text
    assert "<parameter=days>" in text  # arguments iterated as an object, not a string


def test_template_sees_tools_as_llama_server_passes_them(servers):
    """/apply-template renders what a chat completion runs on, tools included, each
    tool as llama-server hands it to the template (name, description, parameters):
    a client's "strict" or key order does not change the prompt."""
    import httpx

    url = servers["mtp"].url
    fn = TOOLS[0]["function"]
    shuffled = [{"function": {"strict": True, "parameters": fn["parameters"], "name": fn["name"],
                              "description": fn["description"]}, "type": "function"}]
    prompts = [httpx.post(url + "/apply-template", json={"messages": ASK, "tools": t}, timeout=30).json()["prompt"]
               for t in (TOOLS, shuffled)]
    assert prompts[0] == prompts[1]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", ' \
        '"parameters": ' in prompts[0]
    assert '"strict"' not in prompts[0]
    # and the same prompt a chat completion runs on: its token count
    n = httpx.post(url + "/tokenize", json={"content": prompts[1], "parse_special": True, "add_special": True}, timeout=30).json()
    m = httpx.post(url + "/v1/chat/completions/input_tokens", json={"messages": ASK, "tools": shuffled},
                   timeout=30).json()
    assert m == {"input_tokens": len(n["tokens"]), "object": "response.input_tokens"}


def test_messages_reach_the_template_as_llama_server_hands_them(servers, tmp_path):
    """llama.cpp's workarounds, by what the template reads: a developer message is a
    system message (Step's template drops the role it does not know); a system message
    a template never reads opens the next message; a call's arguments stay the JSON
    string for a template that writes them as text."""
    import httpx
    from pathlib import Path

    def prompt(url, messages):
        r = httpx.post(url + "/apply-template", json={"messages": messages}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["prompt"]

    hi = [{"role": "user", "content": "hi"}]
    dev = prompt(servers["mtp"].url, [{"role": "developer", "content": "be brief"}] + hi)
    assert dev == prompt(servers["mtp"].url, [{"role": "system", "content": "be brief"}] + hi)
    assert "be brief" in dev

    templates = Path(__file__).resolve().parents[1] / "vendor/llama.cpp/models/templates"
    if not templates.is_dir():
        pytest.skip("the vendored llama.cpp tree is not here")
    base = ["-c", "1024", "-np", "1", "-t", "1"]
    with running(base + ["--chat-template-file", str(templates / "google-gemma-2-2b-it.jinja")],
                 tmp_path) as srv:  # it raises on a system message
        assert "<start_of_turn>user\nbe brief\nhi<end_of_turn>" in prompt(
            srv.url, [{"role": "system", "content": "be brief"}] + hi)
    call = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with running(base + ["--chat-template-file", str(templates / "meetkai-functionary-medium-v3.2.jinja")],
                 tmp_path) as srv:  # writes name + "\n" + arguments
        assert '>>>get_weather\n{"days": 3}' in prompt(srv.url, hi + call)


def test_each_message_reaches_the_template_in_llama_cpps_shape(tmp_path):
    """Rebuilt as llama.cpp rebuilds it: role, content (text parts joined by a
    newline), then reasoning_content, name, tool_call_id when not empty, calls as type,
    function (name, arguments: an object sent as one stays one), id; a client's other
    fields never reach the template."""
    import httpx

    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "extra": 1},
            {"role": "assistant", "content": None, "reasoning_content": "", "tool_calls": [
                {"function": {"arguments": {"x": 1}, "name": "f"}, "id": "c1", "type": "function", "index": 0}]},
            {"tool_call_id": "c1", "role": "tool", "content": "r", "name": "f", "cache_control": {}}]
    with running(["-c", "512", "-np", "1", "-t", "1", "--chat-template", "{{ messages | tojson }}"], tmp_path) as srv:
        r = httpx.post(srv.url + "/apply-template", json={"messages": msgs, "add_generation_prompt": False},
                       timeout=30)
    got = json.loads(r.json()["prompt"])
    assert got == [{"role": "user", "content": "a\nb"},
                   {"role": "assistant", "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}]},
                   {"role": "tool", "content": "r", "name": "f", "tool_call_id": "c1"}]
    assert [list(m) for m in got] == [["role", "content"], ["role", "content", "tool_calls"],
                                      ["role", "content", "name", "tool_call_id"]]
    assert list(got[1]["tool_calls"][0]) == ["type", "function", "id"]


def test_reasoning_goes_to_reasoning_content(servers):
    """The generation prompt opens <think>: what the model writes until </think> is
    reasoning (the bundled model never closes it); --reasoning-format none would
    leave it in content. Streamed deltas add up to the whole."""
    c = client(servers["mtp"])
    out = c.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0)
    msg = out.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    assert reasoning and msg.content == ""
    parts = {"reasoning": "", "content": ""}
    for chunk in c.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0, stream=True):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += d.content or ""
    assert parts == {"reasoning": reasoning, "content": ""}
    raw = c.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0,
                                    extra_body={"reasoning_format": "none"}).choices[0].message
    assert raw.content.strip() == reasoning.strip()


# -- Anthropic's Messages API, with the official client ----------------------------------

A_TOOLS = [{"name": "get_weather", "description": "Weather forecast",
            "input_schema": TOOLS[0]["function"]["parameters"]}]


#: this client version has no temperature argument: sent as an extra field
GREEDY = {"temperature": 0}


def anthropic_client(srv):
    import anthropic

    return anthropic.Anthropic(base_url=srv.url, api_key="sk-x", timeout=120, max_retries=0)


def test_anthropic_tool_loop(servers):
    c = anthropic_client(servers["mtp"])
    first = c.messages.create(model="m", max_tokens=200, messages=ASK, tools=A_TOOLS,
                              tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["days"], int) and use.id
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = c.messages.create(model="m", max_tokens=16, extra_body=GREEDY, tools=A_TOOLS, messages=ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, clear"}]}])
    assert second.stop_reason in ("end_turn", "max_tokens")
    # the second turn starts where the first prompt did: its KV was reused
    assert second.usage.cache_read_input_tokens > 0
    n = c.messages.count_tokens(model="m", messages=ASK, tools=A_TOOLS).input_tokens
    # the forced call's prompt also closed the <think> block the template opened
    assert 0 < n < first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_anthropic_streaming_events(servers):
    c = anthropic_client(servers["mtp"])
    whole = c.messages.create(model="m", max_tokens=40, messages=ASK, extra_body=GREEDY)
    with c.messages.stream(model="m", max_tokens=40, messages=ASK, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.content[0].type == "thinking"  # the reasoning, as a thinking block
    # a forced call, streamed: the tool_use block's input arrives as JSON deltas
    with c.messages.stream(model="m", max_tokens=200, messages=ASK, tools=A_TOOLS, extra_body=GREEDY,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input["units"] in ("c", "f")


def test_reasoning_ended_while_it_runs(servers):
    """llama-server's reasoning_control: a streamed chat completion's thinking is ended
    by POST /v1/chat/completions/control {"id", "action": "reasoning_end"} (the bundled
    model never ends it by itself); the answer follows, drafted by the heads. Asked of
    a completion that did not arm it, or one that is over, it says so."""
    import httpx

    url = servers["mtp"].url
    body = {"messages": ASK, "max_tokens": 800, "temperature": 0, "stream": True, "reasoning_control": True}
    parts = {"reasoning": "", "content": ""}
    cmpl_id, answer = None, None
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            cmpl_id = chunk["id"]
            for ch in chunk.get("choices") or []:
                parts["reasoning"] += ch["delta"].get("reasoning_content") or ""
                parts["content"] += ch["delta"].get("content") or ""
            if answer is None and parts["reasoning"]:
                answer = http.post(url + "/v1/chat/completions/control",
                                   json={"id": cmpl_id, "action": "reasoning_end"}).json()
    assert answer == {"success": True}
    assert parts["reasoning"] and parts["content"], parts
    over = httpx.post(url + "/v1/chat/completions/control", json={"id": cmpl_id, "action": "reasoning_end"}).json()
    assert over == {"success": False, "message": "no active completion for this id"}
    for bad, why in (({"action": "reasoning_end"}, "missing completion id"), ({"id": cmpl_id}, "unknown control")):
        r = httpx.post(url + "/v1/chat/completions/control", json=bad)
        assert r.status_code == 400 and why in r.json()["error"]["message"]

    # a completion that did not ask for the control
    seen = {}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions",
                                                       json={**body, "reasoning_control": False}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not seen:
                seen = http.post(url + "/v1/chat/completions/control",
                                 json={"id": json.loads(line[6:])["id"], "action": "reasoning_end"}).json()
    assert seen == {"success": False, "message": "reasoning control not enabled for this completion"}


def test_claude_codes_billing_stamp_keeps_the_prompt_cache(servers):
    """Claude Code's system prompt opens with a billing header whose cch stamp changes
    with every request; as in llama-server it reads the same to the model, so the next
    turn reuses the cached prompt instead of decoding it all again."""
    from stepmtp.server.anthropic import to_openai

    header = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={};"
    system = [{"type": "text", "text": header.format("a5145")},
              {"type": "text", "text": "You are a coding agent working in a Python repository. " * 8}]
    assert to_openai({"messages": ASK, "system": system})["messages"][0]["content"].startswith(
        header.format("fffff") + "You are")
    c = anthropic_client(servers["mtp"])
    first = c.messages.create(model="m", max_tokens=4, system=system, messages=ASK, extra_body=GREEDY)
    system[0]["text"] = header.format("9c0d2")
    second = c.messages.create(model="m", max_tokens=4, system=system, messages=ASK, extra_body=GREEDY)
    again = c.messages.create(model="m", max_tokens=4, system=system, messages=ASK, extra_body=GREEDY)
    # a new stamp reuses as much as the very same request sent again: all but the last tokens
    n = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert n > 100 and second.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens >= n - 2
    assert [b.model_dump() for b in second.content] == [b.model_dump() for b in first.content]


def test_thinking_budget_ends_the_reasoning(servers):
    """llama-server's thinking_budget_tokens (and Anthropic's thinking.budget_tokens):
    after the budget the end of thinking is forced and the answer follows, the same
    with speculation as without."""
    msgs = {}
    for name in ("mtp", "plain"):
        out = client(servers[name]).chat.completions.create(
            model="m", messages=ASK, max_tokens=40, temperature=0, extra_body={"thinking_budget_tokens": 6})
        msgs[name] = out.choices[0].message
    m = msgs["mtp"]
    assert m.content == msgs["plain"].content and m.content  # the bundled model never ends thinking by itself
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning == msgs["plain"].model_extra["reasoning_content"]
    free = client(servers["mtp"]).chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0)
    assert free.choices[0].message.content == "" and free.choices[0].message.model_extra["reasoning_content"]
    a = anthropic_client(servers["mtp"]).messages.create(
        model="m", max_tokens=40, messages=ASK, extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 6})
    assert [b.type for b in a.content] == ["thinking", "text"] and a.content[1].text == m.content


# -- OpenAI's Responses API, with the official client ------------------------------------

R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast",
            "parameters": TOOLS[0]["function"]["parameters"]}]


def test_responses_tool_loop(servers):
    """A forced call as a function_call item, the same as chat's with and without
    drafting; the call and its output sent back as input items, as Codex does."""
    args = {}
    for name, srv in servers.items():
        first = client(srv).responses.create(model="m", input=ASK, tools=R_TOOLS, tool_choice="required",
                                             max_output_tokens=200, temperature=0)
        assert first.id.startswith("resp_") and first.status == "completed"
        (call,) = [o for o in first.output if o.type == "function_call"]
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        args[name] = json.loads(call.arguments)
    chat = client(servers["mtp"]).chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                                          tool_choice="required", max_tokens=200, temperature=0)
    assert args["mtp"] == args["plain"] == json.loads(chat.choices[0].message.tool_calls[0].function.arguments)
    assert isinstance(args["mtp"]["days"], int) and args["mtp"]["units"] in ("c", "f")

    # a function forced by name, Responses' flat form
    c = client(servers["mtp"])
    named = c.responses.create(model="m", input=ASK, tools=R_TOOLS, max_output_tokens=200, temperature=0,
                               tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in named.output][-1] == "function_call"

    history = ASK + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, clear"}]
    second = c.responses.create(model="m", input=history, tools=R_TOOLS, max_output_tokens=16, temperature=0)
    assert second.status == "completed" and second.usage.output_tokens > 0
    # the second turn starts where the first prompt did: its KV was reused
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.total_tokens == second.usage.input_tokens + second.usage.output_tokens
    import httpx

    url = servers["mtp"].url
    n = httpx.post(url + "/v1/responses/input_tokens", json={"input": history, "tools": R_TOOLS}, timeout=30).json()
    assert n["object"] == "response.input_tokens"
    # the items became the chat turns they stand for: the prompt (and its tokens) chat's
    chat_history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, clear"}]
    m = httpx.post(url + "/v1/chat/completions/input_tokens", json={"messages": chat_history, "tools": TOOLS},
                   timeout=30).json()
    assert n["input_tokens"] == m["input_tokens"] > 0


def test_responses_stream_adds_up_to_the_whole(servers):
    """The reasoning and the answer (a thinking budget ends the reasoning) streamed as
    Responses events, in order, adding up to the non-streamed output; a streamed call's
    arguments too."""
    c = client(servers["mtp"])
    kw = dict(model="m", input=ASK, instructions="Answer briefly.", max_output_tokens=40, temperature=0,
              extra_body={"thinking_budget_tokens": 6})
    whole = c.responses.create(**kw)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    chat = c.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer briefly."}] + ASK,
                                     max_tokens=40, temperature=0, extra_body={"thinking_budget_tokens": 6})
    assert whole.output_text == chat.choices[0].message.content
    assert whole.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]

    events = list(c.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ids = {e.item.id for e in events if e.type == "response.output_item.added"}
    assert len(ids) == 2 and all(e.item_id in ids for e in events if hasattr(e, "item_id"))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert reasoning == whole.output[0].content[0].text and text == whole.output_text == done.output_text
    assert [o.type for o in done.output] == ["reasoning", "message"] and done.usage.output_tokens == 40
    # each item is done before the next begins
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    # the SDK's own accumulator (it places each delta by output_index / content_index)
    with c.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert final.output_text == whole.output_text and final.output[0].content[0].text == reasoning

    calls = list(c.responses.create(model="m", input=ASK, tools=R_TOOLS, tool_choice="required", stream=True,
                                    max_output_tokens=200, temperature=0))
    added = [e.item for e in calls if e.type == "response.output_item.added" and e.item.type == "function_call"]
    (item,) = [e.item for e in calls if e.type == "response.output_item.done" and e.item.type == "function_call"]
    deltas = "".join(e.delta for e in calls if e.type == "response.function_call_arguments.delta")
    assert len(added) == 1 and added[0].call_id == item.call_id and item.name == "get_weather"
    assert json.loads(deltas) == json.loads(item.arguments) and json.loads(item.arguments)["units"] in ("c", "f")


def test_responses_json_schema(servers):
    """text.format as a JSON schema: the answer is that JSON, drafts masked too."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    out = client(servers["mtp"]).responses.create(
        model="m", input=ASK, max_output_tokens=120, temperature=0, extra_body={"thinking_budget_tokens": 4},
        text={"format": {"type": "json_schema", "name": "ask", "schema": schema, "strict": True}})
    got = json.loads(out.output_text)
    assert set(got) == {"city", "days"} and isinstance(got["days"], int)


@pytest.mark.parametrize("payload, message", [
    ({"model": "m"}, "'input' is required"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "frobnicate"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "'name'"),
    ({"input": 3}, "'input' must be"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_responses_bad_requests(servers, payload, message):
    import httpx

    url = servers["mtp"].url
    r = httpx.post(url + "/v1/responses", json=payload, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    # and the server goes on
    ok = httpx.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def test_no_messages_is_the_generation_prompt_alone(servers):
    """llama-server takes an empty conversation on every chat route (its template
    engine reads a member of a missing message as undefined): the prompt is the
    generation prompt alone."""
    import httpx

    url = servers["mtp"].url
    prompt = httpx.post(url + "/apply-template", json={"messages": []}, timeout=30).json()["prompt"]
    assert prompt == "<|im_start|>assistant\n<think>\n"
    for route, body in (("/v1/chat/completions", {"messages": [], "max_tokens": 3}),
                        ("/v1/messages", {"model": "m", "messages": [], "max_tokens": 3}),
                        ("/v1/responses", {"input": [], "max_output_tokens": 3})):
        r = httpx.post(url + route, json=body, timeout=60)
        assert r.status_code == 200, (route, r.text)
        usage = r.json()["usage"]
        assert usage.get("completion_tokens", usage.get("output_tokens")) == 3


def test_detokenize_joins_the_pieces(servers):
    """/detokenize is llama-server's: the pieces joined, not llama_detokenize, whose
    clean-up of spaces (on for the bundled model's GPT-2-style vocabulary) wrote
    "France?" (llama-server's suite, test_tokenize_detokenize)."""
    import httpx

    url = servers["mtp"].url
    text = "What is the capital of France ? It's <|im_end|> isn't it ?"
    toks = httpx.post(url + "/tokenize", json={"content": text, "parse_special": True}, timeout=30).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": toks}, timeout=30).json() == {"content": text}
