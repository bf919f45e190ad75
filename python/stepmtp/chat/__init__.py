"""Chat templates: the GGUF's jinja template rendered as the ecosystem does (a
sandboxed jinja2 environment, ``raise_exception``, ``strftime_now``), with
llama-server's chatml fallback for a model that has none.

A template's *variables* (``chat_template_kwargs``) are data: they can add names
for the template to read, never replace the template nor the messages. In the
server, rendering runs in ``sandbox.TemplateSandbox`` (bounded in time, output and
memory); in-process, ``render_chat`` runs it directly.
"""
from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .errors import ChatTemplateError
from .jinja_render import TemplateFailure, render

if TYPE_CHECKING:
    from ..llama import Model
    from .sandbox import TemplateSandbox

__all__ = ["render_chat", "render_builtin", "template_context", "template_caps", "user_turn_start",
           "ChatTemplateError", "CHATML_TEMPLATE"]

#: llama-server's fallback for a model without a template
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

#: names the renderer sets itself; a variable of the same name does not replace them
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def template_source(model: "Model", template: str | None = None) -> str:
    """The template to render: ``template``, else the model's, else chatml."""
    return template or model.chat_template or CHATML_TEMPLATE


def template_context(model: "Model", messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                     variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the template sees: the variables first, then the names it must get right."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError("each message needs a 'role'")
    bos = model.token_to_piece(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_to_piece(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    now = datetime.datetime.now()
    # what llama.cpp's template engine gives every template besides the messages
    ctx: dict[str, Any] = {"enable_thinking": True, "date_string": now.strftime("%d %b %Y"),
                           "datetime": now.strftime("%b %d %Y")}
    ctx.update({str(k): v for k, v in (variables or {}).items() if str(k) not in RESERVED})
    # templates that take the tools as one string (firefunction's): llama.cpp's JSON
    tools = ctx.get("tools")
    ctx.setdefault("functions", json.dumps(tools, indent=2) if tools else "")
    ctx.update(messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)
    return ctx


def render_chat(model: "Model", messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                template: str | None = None, variables: Mapping[str, Any] | None = None,
                sandbox: "TemplateSandbox | None" = None) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...]);
    ``variables`` are extra names for the template (e.g. ``enable_thinking``)."""
    source = template_source(model, template)
    ctx = template_context(model, messages, add_generation_prompt=add_generation_prompt, variables=variables)
    if sandbox is not None:
        text = sandbox.render(source, ctx)
    else:
        try:
            text = render(source, ctx)
        except TemplateFailure as e:
            raise ChatTemplateError(str(e)) from None
    # as llama.cpp: the BOS (EOS) a template writes goes when tokenizing adds it anyway;
    # kept, the prompt would start with two
    bos, eos = ctx["bos_token"], ctx["eos_token"]
    if bos and text.startswith(bos) and model.add_bos:
        text = text[len(bos):]
    if eos and text.endswith(eos) and model.add_eos:
        text = text[: -len(eos)]
    return text


_PROBES = ("stepmtp-probe-a", "stepmtp-probe-b", "stepmtp-probe-c")
_user_starts: dict[tuple[str, int, int], str] = {}


def user_turn_start(model: "Model", template: str | None = None, *,
                    sandbox: "TemplateSandbox | None" = None) -> str:
    """The text a template opens a user message with (``<|im_start|>user\n`` for
    chatml), as seen in two rendered probe conversations: what precedes a first user
    message and what follows an assistant message before the next one end alike in
    it. '' when they share nothing (or the template refuses the probes). llama-server
    splits a chat prompt there (its message spans), before the latest user message."""
    source = template_source(model, template)
    key = (source, model.bos, model.eos)
    if key not in _user_starts:
        a, b, c = _PROBES
        try:
            one = render_chat(model, [{"role": "user", "content": a}], add_generation_prompt=False,
                              template=template, sandbox=sandbox)
            three = render_chat(model, [{"role": "user", "content": a}, {"role": "assistant", "content": b},
                                        {"role": "user", "content": c}], add_generation_prompt=False,
                                template=template, sandbox=sandbox)
            first, between = one[: one.index(a)], three[three.index(b) + len(b) : three.index(c)]
        except ValueError:  # a template that refuses the probes, or drops their text
            first = between = ""
        n = 0
        while n < min(len(first), len(between)) and first[-1 - n] == between[-1 - n]:
            n += 1
        _user_starts[key] = first[len(first) - n :] if n else ""
    return _user_starts[key]


_TOOL = {"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}


def _call_probe(*arguments: Any) -> list[dict[str, Any]]:
    calls = [{"id": f"call0000{i + 1}", "type": "function", "function": {"name": f"tool{i + 1}", "arguments": a}}
             for i, a in enumerate(arguments)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


_caps: dict[tuple[str, int, int], dict[str, bool]] = {}


def template_caps(model: "Model", template: str | None = None, *,
                  sandbox: "TemplateSandbox | None" = None) -> dict[str, bool]:
    """llama-server's ``chat_template_caps``: what the template does with the parts of
    a conversation, found as llama.cpp finds it, by rendering probe conversations and
    seeing which of their values the template reads (a template that fails a probe
    lacks what it probes)."""
    source = template_source(model, template)
    key = (source, model.bos, model.eos)
    if key in _caps:
        return dict(_caps[key])

    def probe(messages: list[dict[str, Any]], tools: Any = None) -> tuple[bool, set[str]]:
        ctx = template_context(model, messages, add_generation_prompt=False,
                               variables={"tools": tools} if tools is not None else None)
        if sandbox is not None:
            return sandbox.probe(source, ctx)
        used: set[str] = set()
        try:
            render(source, ctx, used=used)
        except TemplateFailure:
            return False, used
        return True, used

    # llama.cpp's checks, in its order, each on what the probe's template read
    c = {"supports_tools": True, "supports_tool_calls": True, "supports_system_role": True,
         "supports_parallel_tool_calls": True, "supports_preserve_reasoning": False,
         "supports_string_content": True, "supports_typed_content": False, "supports_object_arguments": False}
    ok, used = probe([{"role": "user", "content": "content"}])
    if {"messages[0].content#selectattr", "messages[0].content#array_access"} & used:
        c["supports_typed_content"] = True
    if not ok:
        c["supports_string_content"] = False
    ok, used = probe([{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}])
    if "messages[0].content" not in used:
        c["supports_system_role"] = False
    ok, used = probe(_call_probe({"arg": "value"}), [_TOOL])
    if ok:  # a failed probe tells nothing here
        c["supports_tools"] = "tools[0].function.name" in used
        c["supports_tool_calls"] = "messages[1].tool_calls" in used
        c["supports_object_arguments"] = c["supports_tool_calls"] and (
            "messages[1].tool_calls[0].function.arguments.arg" in used)
    if not c["supports_object_arguments"]:
        ok, used = probe(_call_probe('{"arg": "value"}'), [_TOOL])
        if not ok:
            c["supports_tools"] = c["supports_tool_calls"] = False
        else:
            c["supports_tools"] &= "tools[0].function.name" in used
            c["supports_tool_calls"] &= "messages[1].tool_calls" in used
    args = {"arg": "value"} if c["supports_object_arguments"] else '{"arg": "value"}'
    ok, used = probe(_call_probe(args, args), [_TOOL])
    c["supports_parallel_tool_calls"] = ok and "messages[1].tool_calls[1].function" in used
    ok, used = probe([{"role": "user", "content": "User message"},
                      {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
                      {"role": "user", "content": "User message"}])
    c["supports_preserve_reasoning"] = "messages[1].reasoning_content" in used
    _caps[key] = c
    return dict(c)


def render_builtin(model: "Model", messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                   template: str | None = None) -> str:
    """llama-server's ``--no-jinja``: llama.cpp's built-in formatting (a known name,
    or the model's template recognised as one), text content only."""
    pairs = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError("each message needs a 'role'")
        content = m.get("content")
        pairs.append((str(m["role"]), content if isinstance(content, str) else ""))
    try:
        return model.apply_builtin_template(pairs, add_generation_prompt, template)
    except ValueError as e:
        raise ChatTemplateError(str(e)) from None
