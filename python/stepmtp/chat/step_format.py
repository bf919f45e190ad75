"""Step-3.5-Flash's assistant output, parsed as it streams, into reasoning,
content and tool calls (llama-server's ``reasoning_format`` semantics).

The chat template's generation prompt ends with ``<|im_start|>assistant\\n<think>\\n``,
so the generated text starts inside the reasoning::

    REASONING
    </think>
    CONTENT
    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

``StepParser.feed`` takes the text generated since the last call, cut anywhere,
and returns a ``Delta`` of what is certain. Text that could still turn out to be
the start of a marker (``</th`` of ``</think>``, ``<tool`` of ``<tool_call>``) is
held back until the next characters decide it, and so is whitespace that may be
the template's newline around a marker; a tool call's text is held back until
its header, then each parameter, is complete. Whatever the chunking, the deltas
add up to ``StepParser.message()``: every decision is taken on text, never on
where a chunk ended.

Layout rules (the template writes ``<think>\\n...\\n</think>\\n`` and calls with a
newline around every value):

- the reasoning is stripped of whitespace at both ends;
- content after ``</think>`` loses its leading newlines, and content loses its
  trailing whitespace at the end of generation;
- the whitespace around a run of calls is dropped, except that text before and
  after the calls stays separated by the whitespace that preceded them;
- a string parameter loses exactly one leading and one trailing newline.

A ``<tool_call>`` whose header (``<function=NAME>``) does not follow is text. A
call that goes wrong after its header (text that is neither a parameter nor
``</function>``) has already been announced to the client, so it is closed with
the parameters completed so far, and the raw rest of it goes back to the text it
interrupted. Generation ending inside a call (``max_tokens``) leaves it as
llama-server does: the arguments are the JSON written so far, left open (a string
value cut short is ``"text`` without its closing quote, a marker's first
characters dropped), a call cut before its name is no call, and none of its text
is content. Nothing here raises on what the model wrote.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ToolCallDelta", "Delta", "StepParser", "REASONING_FORMATS"]

#: "auto" is "deepseek" for this model; "none" leaves everything in the content
REASONING_FORMATS = ("deepseek", "auto", "none")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"

WS = " \t\r\n"
#: a name longer than this is not a header: it bounds what a stray "<function=" holds back
MAX_NAME = 256
#: JSON schema types whose values are written as JSON rather than as raw text
JSON_TYPES = frozenset({"integer", "number", "boolean", "null", "object", "array"})
_PY_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
             (type(None), "null"), (dict, "object"), (list, "array"))
_ID_CHARS = string.ascii_letters + string.digits


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, OpenAI's ``delta.tool_calls[i]`` shape."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


def default_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _schema_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema allows, None when it says nothing."""
    if not isinstance(schema, dict):
        return None
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():
            types |= _schema_types(sub) or set()
    if not types and isinstance(schema.get("enum"), list):
        for value in schema["enum"]:
            types.update(name for py, name in _PY_TYPES if type(value) is py)
    return types or None


def _no_constant(name: str) -> Any:
    # NaN and Infinity parse in Python but are not JSON: the arguments must stay JSON
    raise ValueError(name)


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return False, None


def convert_value(raw: str, types: set[str] | None) -> Any:
    """A parameter's text as the value its schema types call for."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    if types is None:
        # no schema to go by: structured-looking values are taken as JSON, but a
        # bare word ("null", a quoted string) is more likely meant literally
        ok, value = _loads(raw)
        return value if ok and isinstance(value, (dict, list, int, float)) else raw
    if types & JSON_TYPES:
        ok, value = _loads(raw)
        return value if ok else raw
    return raw


def _tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """Each tool's name -> its parameters' properties (OpenAI or bare function shape)."""
    out: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that could still grow into a marker
    (every marker starts with "<", so only an end starting with one can)."""
    start = len(text) - max((len(m) for m in markers), default=1) + 1
    at = text.find("<", max(start, 0))
    while at >= 0:
        tail = text[at:]
        if any(m.startswith(tail) for m in markers):
            return len(tail)
        at = text.find("<", at + 1)
    return 0


def _grows_into(text: str, marker: str) -> bool:
    return len(text) < len(marker) and marker.startswith(text)


def _header_name(text: str, opener: str, final: bool) -> tuple[str | None, int]:
    """``opener NAME>`` at the start of ``text``: (name, end) when complete,
    (None, 0) while it may still complete, (None, -1) when it cannot."""
    if not text.startswith(opener):
        return None, (0 if not final and _grows_into(text, opener) else -1)
    end = text.find(">", len(opener))
    name = text[len(opener):end if end >= 0 else len(text)]
    if any(c in WS or c == "<" for c in name) or len(name) > MAX_NAME:
        return None, -1
    if end < 0:
        return None, -1 if final else 0
    return (name, end + 1) if name else (None, -1)


# states of the machine; a call walks HEAD -> BODY (<-> VALUE) -> TAIL -> TEXT
START, TEXT, HEAD, BODY, VALUE, TAIL = "start", "text", "head", "body", "value", "tail"


class StepParser:
    """One generation's incremental parse; see the module docstring."""

    def __init__(self, *, reasoning_format: str = "deepseek", thinking: bool = True,
                 tools: list[dict] | None = None, parse_tools: bool = True,
                 id_factory: Callable[[], str] | None = None):
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {REASONING_FORMATS}, not {reasoning_format!r}")
        self._split = reasoning_format != "none"
        self._thinking = thinking
        self._props = _tool_properties(tools) if parse_tools and tools else None
        self._new_id = id_factory or default_call_id
        self._state = START if self._split else TEXT
        self._buf = ""
        self._channel = "content"
        self._lead: str | None = None    # what to strip before the channel's next text
        self._pending = ""               # trailing whitespace not yet known to be text
        self._call: dict | None = None   # the call being parsed
        self._key = ""                   # its parameter being read
        self._searched = 0               # how much of that value holds no </parameter>
        self._finished = False
        self._out = Delta()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []

    # -- public -------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> Delta:
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            # trailing whitespace of either channel is layout, not text
            self._pending = ""
        return self._take()

    def message(self) -> dict:
        reasoning = "".join(self._reasoning)
        return {
            "content": "".join(self._content),
            "reasoning_content": reasoning or None,
            "tool_calls": [{"id": c["id"], "type": "function",
                            "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                           for c in self._calls],
        }

    # -- output -------------------------------------------------------------
    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    def _put(self, channel: str, text: str) -> None:
        if not text:
            return
        if channel == "reasoning":
            self._out.reasoning += text
            self._reasoning.append(text)
        else:
            self._out.content += text
            self._content.append(text)

    def _put_call(self, piece: str, *, announce: bool = False) -> None:
        call = self._call
        call["arguments"].append(piece)
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last.index == call["index"]:
            last.arguments += piece
        else:
            self._out.tool_calls.append(ToolCallDelta(
                call["index"], call["id"] if announce else None, call["name"] if announce else None, piece))

    def _text(self, text: str) -> None:
        """Text of the current channel, with its layout whitespace held back."""
        if self._lead is not None:
            text = text.lstrip(self._lead)
            if not text:
                return
            self._lead = None
        body = text.rstrip(WS)
        if body:
            self._put(self._channel, self._pending + body)
            self._pending = text[len(body):]
        else:
            self._pending += text

    def _enter(self, channel: str, lead: str | None) -> None:
        self._channel, self._lead, self._pending = channel, lead, ""

    # -- the machine --------------------------------------------------------
    def _advance(self, final: bool) -> None:
        step = {START: self._start, TEXT: self._scan_text, HEAD: self._head,
                BODY: self._body, VALUE: self._value, TAIL: self._tail}
        # each step consumes text or changes state, and returns False when it must wait
        while step[self._state](final):
            pass

    def _start(self, final: bool) -> bool:
        # the model may (re)open <think> itself, after the prompt did or instead of it
        rest = self._buf.lstrip(WS)
        if rest.startswith(THINK_OPEN):
            self._buf = rest[len(THINK_OPEN):]
            self._enter("reasoning", WS)
        elif not final and _grows_into(rest, THINK_OPEN):
            return False
        elif self._thinking:
            self._enter("reasoning", WS)
        else:
            self._enter("content", None)
        self._state = TEXT
        return True

    def _markers(self) -> tuple[str, ...]:
        markers = (THINK_CLOSE,) if self._channel == "reasoning" else ()
        return (markers + (CALL_OPEN,)) if self._props is not None else markers

    def _scan_text(self, final: bool) -> bool:
        markers = self._markers()
        found = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
        if not found:
            keep = _held_suffix(self._buf, markers)
            if final and not (self._props is not None and _grows_into(self._buf[len(self._buf) - keep:], CALL_OPEN)):
                keep = 0  # only a call's first characters are not text at the end
            self._text(self._buf[:len(self._buf) - keep])
            self._buf = "" if final else self._buf[len(self._buf) - keep:]
            return False
        at, marker = min(found)
        self._text(self._buf[:at])
        self._buf = self._buf[at + len(marker):]
        if marker == THINK_CLOSE:
            self._enter("content", "\n")
        else:
            self._state = HEAD
        return True

    def _head(self, final: bool) -> bool:
        rest = self._buf.lstrip(WS)
        name, end = _header_name(rest, FUNCTION_OPEN, final)
        if end == 0:
            return False
        if name is None and final and _header_name(rest, FUNCTION_OPEN, False)[1] == 0:
            self._buf, self._state = "", TEXT  # cut before its name: no call, and not text
            return True
        if name is None:
            # not a call after all: the marker is text, and what follows is scanned again
            self._text(CALL_OPEN)
            self._state = TEXT
            return True
        self._call = {"index": len(self._calls), "id": self._new_id(), "name": name,
                      "arguments": [], "params": 0, "props": self._props.get(name, {})}
        self._calls.append(self._call)
        self._put_call("", announce=True)
        self._buf = rest[end:]
        self._state = BODY
        return True

    def _body(self, final: bool) -> bool:
        rest = self._buf.lstrip(WS)
        if rest.startswith(FUNCTION_CLOSE):
            self._buf = rest[len(FUNCTION_CLOSE):]
            self._close_call(TAIL)
            return True
        key, end = _header_name(rest, PARAM_OPEN, final)
        if key is not None:
            self._key, self._searched = key, 0
            self._buf = rest[end:]
            self._state = VALUE
            return True
        if end == 0 or (not final and _grows_into(rest, FUNCTION_CLOSE)):
            self._buf = rest
            return False
        if final and (_header_name(rest, PARAM_OPEN, False)[1] == 0 or _grows_into(rest, FUNCTION_CLOSE)):
            self._cut_call()
            return True
        self._buf = rest
        self._close_call(TEXT)
        return True

    def _value(self, final: bool) -> bool:
        end = self._buf.find(PARAM_CLOSE, self._searched)
        if end < 0:
            if final:
                self._put_param(self._partial_value())
                self._cut_call()
                return True
            # a value (a whole file, say) arrives token by token: scan each part once
            self._searched = max(0, len(self._buf) - len(PARAM_CLOSE) + 1)
            return False
        value = convert_value(self._buf[:end], _schema_types(self._call["props"].get(self._key)))
        self._put_param(json.dumps(value, ensure_ascii=False))
        self._buf = self._buf[end + len(PARAM_CLOSE):]
        self._state = BODY
        return True

    def _put_param(self, value: str) -> None:
        """The parameter being read, its value as JSON text, into the arguments."""
        call = self._call
        self._put_call(("{" if not call["params"] else ", ") + json.dumps(self._key, ensure_ascii=False) + ": " + value)
        call["params"] += 1

    def _partial_value(self) -> str:
        """The value cut short, as llama-server's arguments hold it: the JSON types'
        text as it is, anything else as a string left open."""
        raw = self._buf[1:] if self._buf.startswith("\n") else self._buf
        close = "\n" + PARAM_CLOSE
        raw = raw[:len(raw) - next((n for n in range(min(len(raw), len(close)), 0, -1)
                                    if close.startswith(raw[-n:])), 0)]
        types = _schema_types(self._call["props"].get(self._key))
        if types and types <= JSON_TYPES:
            return raw
        return json.dumps(raw, ensure_ascii=False)[:-1]

    def _close_call(self, state: str) -> None:
        self._put_call("}" if self._call["params"] else "{}")
        self._call = None
        self._lead = WS
        self._state = state

    def _cut_call(self) -> None:
        """Generation ended inside the call: its arguments stay open, the rest goes."""
        if not self._call["params"]:
            self._put_call("{")
        self._call = None
        self._buf = ""
        self._state = TEXT

    def _tail(self, final: bool) -> bool:
        rest = self._buf.lstrip(WS)
        if rest.startswith(CALL_CLOSE):
            self._buf = rest[len(CALL_CLOSE):]
        elif _grows_into(rest, CALL_CLOSE):
            if not final:
                self._buf = rest
                return False
            self._buf = ""  # cut inside </tool_call>: none of it is text
        else:
            # </tool_call> is missing: the call is complete anyway, the rest is text
            self._buf = rest
        self._state = TEXT
        return True
