"""OpenAI chat on top of the chat template: messages in (tool calls and results
included), the model's text out as ``reasoning_content``, ``content`` and
``tool_calls`` (``chat.step_format``), whole or as streamed deltas.

The text the parser reads is rendered with the template's marker tokens as text
(``preserved_tokens``): in a tokenizer where ``</think>`` or ``<tool_call>`` is a
special token, the plain rendering would drop it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..budget import ReasoningBudget
from ..chat.step_format import (CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN,
                                REASONING_FORMATS, Delta, StepParser, ToolCallDelta)
from ..grammar import GrammarError, lark_literal, text_value_rules
from .errors import bad_request

__all__ = ["ChatFormat", "normalize_messages", "preserved_tokens", "delta_json", "REASONING_FORMATS"]

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
           "</parameter>")


def is_step_template(source: str) -> bool:
    """A template that writes calls in Step's XML-like format."""
    return "<tool_call>" in source and "<function=" in source


def preserved_tokens(model: Any) -> frozenset[int]:
    """Tokens that are one of the markers on their own: rendered as text for the parser."""
    out = set()
    for m in MARKERS:
        toks = model.tokenize(m, add_special=False, parse_special=True)
        if len(toks) == 1:
            out.add(toks[0])
    return frozenset(out)


def normalize_messages(messages: list[dict[str, Any]], caps: dict[str, bool] | None = None,
                       source: str = "") -> list[dict[str, Any]]:
    """Messages as llama.cpp hands them to a jinja template. Each is rebuilt in
    llama.cpp's shape (``role``, ``content``, then ``reasoning_content``, ``name``,
    ``tool_call_id`` when not empty, ``tool_calls`` as ``type``, ``function`` (``name``,
    ``arguments``), ``id``): a client's other fields never reach the template. Then
    its workarounds, by what the template does (``caps``, ``chat.template_caps``;
    None: as for Step's): ``developer`` becomes ``system`` (but for gpt-oss's template,
    which writes ``<|channel|>`` and knows the role); a system message a template never
    reads goes at the front of the next message (alone, it goes); a call's
    ``arguments``, a JSON string, become the object a template iterates (``|items``)
    where the template reads them so, and stay the string otherwise."""
    object_args = caps is None or caps.get("supports_object_arguments", False)
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" and "<|channel|>" not in source else role,
                               "content": m.get("content") or ""}
        for key in ("reasoning_content", "name", "tool_call_id"):
            v = m.get(key)
            if v is not None and not isinstance(v, str):
                raise bad_request(f"messages[{i}].{key} must be a string")
            if v:
                msg[key] = v
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, c in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
                    raise bad_request(f"{where} must be an object with a 'function'")
                fn = c["function"]
                args = fn.get("arguments")
                if not isinstance(args, str):  # an object: llama.cpp writes it as JSON text
                    args = json.dumps(args if args is not None else {}, ensure_ascii=False, separators=(",", ":"))
                if object_args:
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise bad_request(f"{where}.function.arguments is not JSON") from None
                call: dict[str, Any] = {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}
                if "id" in c:
                    call["id"] = c["id"]
                fixed.append(call)
            if fixed:
                msg["tool_calls"] = fixed
        out.append(msg)
    if caps is not None and not caps.get("supports_system_role", True) and out and out[0]["role"] == "system":
        first = out.pop(0)
        if out:
            out[0] = {**out[0], "content": f"{first['content']}\n{out[0]['content']}"}
    return out


@dataclass
class ChatFormat:
    """How one chat request's output is read back."""

    #: the template writes Step's tool-call format
    step: bool
    #: the rendered prompt ends inside an opened <think>
    thinking: bool
    reasoning_format: str
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    preserved: frozenset[int] = field(default_factory=frozenset)
    #: tool_choice required / a function: the Lark grammar forcing the call(s)
    grammar: str | None = None
    #: llama-server's reasoning budget, for a template that thinks
    reasoning_budget: ReasoningBudget | None = None

    @property
    def name(self) -> str:
        """llama-server's chat_format name, as generation_settings shows it."""
        return "Step-3.5" if self.step else ("Content-only" if not self.thinking else "Generic (reasoning)")

    def parser(self) -> StepParser | ContentOnly:
        if not (self.step or self.thinking or self.grammar):
            return ContentOnly()
        return StepParser(reasoning_format=self.reasoning_format, thinking=self.thinking, tools=self.tools,
                          parse_tools=self.parse_tools)


class ContentOnly:
    """The parser of a format with neither reasoning nor tool calls: all content."""

    def __init__(self) -> None:
        self._text: list[str] = []

    def feed(self, text: str) -> Delta:
        self._text.append(text)
        return Delta(content=text)

    def finish(self) -> Delta:
        return Delta()

    def message(self) -> dict[str, Any]:
        return {"content": "".join(self._text), "reasoning_content": None, "tool_calls": []}


def message_json(parser: StepParser | ContentOnly, text: str) -> dict[str, Any]:
    """The assistant message of a whole (non-streamed) result."""
    parser.feed(text)
    parser.finish()
    m = parser.message()
    msg: dict[str, Any] = {"role": "assistant", "content": m["content"]}
    if m.get("reasoning_content") is not None:
        msg["reasoning_content"] = m["reasoning_content"]
    if m.get("tool_calls"):
        msg["tool_calls"] = m["tool_calls"]
    return msg


def delta_json(d: Delta) -> list[dict[str, Any]]:
    """OpenAI chat deltas for one parser Delta: reasoning, content, then calls."""
    out: list[dict[str, Any]] = []
    if d.reasoning:
        out.append({"reasoning_content": d.reasoning})
    if d.content:
        out.append({"content": d.content})
    if d.tool_calls:
        out.append({"tool_calls": [_call_delta(c) for c in d.tool_calls]})
    return out


def _call_delta(c: ToolCallDelta) -> dict[str, Any]:
    d: dict[str, Any] = {"index": c.index}
    if c.id is not None:
        d["id"] = c.id
        d["type"] = "function"
    fn: dict[str, Any] = {}
    if c.name is not None:
        fn["name"] = c.name
    fn["arguments"] = c.arguments
    d["function"] = fn
    return d


# -- tool_choice "required" or a named function: the call, forced by a grammar ---------

_VALUE_OPEN, _VALUE_CLOSE = "\n", "\n</parameter>\n"  # the newlines Step's template writes around a value


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of one or more Step-format calls of the
    given tools (or of the function ``name``): the required parameters, then any of
    the others, in the schema's order (no other key: as llama.cpp's grammar, whatever
    ``additionalProperties`` says), each value held to its schema
    (``grammar.text_value_rules``)."""
    fns = [t["function"] for t in tools if isinstance(t.get("function"), dict)]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in 'tools'")
    rules = []
    alts = []
    for i, f in enumerate(fns):
        schema = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
        params = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [k for k in schema.get("required") or [] if k in params]
        optional = [k for k in params if k not in required]
        defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
        parts = []
        for j, key in enumerate(required + optional):
            rule = f"p{i}_{j}"
            try:
                rules += text_value_rules(f"v{i}_{j}", params[key], _VALUE_CLOSE, PARAM_CLOSE, defs=defs)
            except GrammarError as e:
                raise bad_request(f"tools: {f['name']}'s parameter {key!r}: {e}") from None
            rules.append(f"{rule}: {lark_literal(PARAM_OPEN + key + '>' + _VALUE_OPEN)} v{i}_{j}")
            parts.append(rule if key in required else f"{rule}?")
        head = lark_literal(f"{CALL_OPEN}\n{FUNCTION_OPEN}{f['name']}>\n")
        tail = lark_literal(f"{FUNCTION_CLOSE}\n{CALL_CLOSE}")
        rules.append(f"call{i}: {head} {' '.join(parts)} {tail}")
        alts.append(f"call{i}")
    if not alts:
        raise bad_request("tool_choice needs at least one function in 'tools'")
    call = " | ".join(alts)
    start = f"start: call (\"\\n\" call)*" if parallel else "start: call"
    return "\n".join([start, f"call: {call}", *rules])
