"""OpenAI's Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``),
the API OpenAI's own coding agents speak, as llama-server serves it: the request
becomes a chat request (``instructions``, input messages, function calls and their
outputs, reasoning items, function tools), the answer comes back as output items
(reasoning, message, function calls), streamed as the Responses events.

Where llama-server writes less than OpenAI does, this writes OpenAI's fields too
(``output_index``, ``content_index``, ``sequence_number``, an ``id`` on function-call
items, the ``*.done`` events of reasoning text and arguments, ``text.format`` as a
JSON schema): clients that validate events against OpenAI's shapes work, and a
llama-server client finds every field it reads. As llama-server does, a response cut
by ``max_output_tokens`` still ends ``completed``, and ``previous_response_id`` is
refused (nothing is stored: the client sends the whole conversation).
"""
from __future__ import annotations

import time
from typing import Any

from ..chat.step_format import Delta
from ..engine import Completion
from ..api import formats as F
from ..api.errors import bad_request

__all__ = ["to_openai", "response_json", "Events"]

#: Responses fields with no chat counterpart: accepted, no effect (nothing is stored,
#: nothing is truncated for the client, no service tiers)
_IGNORED = ("store", "include", "truncation", "metadata", "service_tier", "background", "prompt_cache_key",
            "safety_identifier", "user", "top_logprobs", "conversation", "stream_options", "max_tool_calls")


def _input_parts(item: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A user / system / developer message's content as chat content parts."""
    parts = []
    for j, p in enumerate(item["content"]):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "input_text" or kind == "output_text":
            if not isinstance(p.get("text"), str):
                raise bad_request(f"{where}.content[{j}]: 'input_text' requires a string 'text'")
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "input_image":
            if "image_url" not in p:
                raise bad_request(f"{where}.content[{j}]: 'input_image' requires 'image_url'")
            parts.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        elif kind == "input_file":
            raise bad_request(f"{where}.content[{j}]: 'input_file' is not supported")
        else:
            raise bad_request(f"{where}.content[{j}]: 'type' must be one of 'input_text', 'input_image' "
                              f"or 'input_file', not {kind!r}")
    return parts


def _output_parts(item: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An earlier assistant message's content as chat content parts (a refusal is text)."""
    content = item.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if content is None:
        return []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("output_text", "input_text", "refusal"):
            raise bad_request(f"{where}.content[{j}]: 'type' must be 'output_text' or 'refusal', not {kind!r}")
        if not isinstance(p.get(key), str):
            raise bad_request(f"{where}.content[{j}]: {kind!r} requires a string {key!r}")
        parts.append({"type": "text", "text": p[key]})
    return parts


def _tool_output(item: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    out = item["output"]
    if isinstance(out, str):
        return out
    parts = []
    for j, p in enumerate(out):
        if not (isinstance(p, dict) and p.get("type") == "input_text" and isinstance(p.get("text"), str)):
            raise bad_request(f"{where}.output[{j}]: a tool's output parts must be 'input_text'")
        parts.append({"type": "text", "text": p["text"]})
    return parts


def _texts(parts: Any) -> str:
    if not isinstance(parts, list):
        return ""
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string")
        msgs.append({"role": "system", "content": instructions})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        return msgs
    if not isinstance(inp, list):
        raise bad_request("'input' must be a string or a list of items")

    def assistant() -> dict[str, Any]:
        # consecutive output items (reasoning, text, calls) are one assistant turn
        if msgs and msgs[-1]["role"] == "assistant":
            return msgs[-1]
        msgs.append({"role": "assistant", "content": []})
        return msgs[-1]

    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object")
        kind, role = item.get("type"), item.get("role")
        if role in ("user", "system", "developer") and kind in (None, "message"):
            content = item.get("content")
            if isinstance(content, str):
                msgs.append({"role": role, "content": content})
            elif isinstance(content, list):
                msgs.append({"role": role, "content": _input_parts(item, where)})
            else:
                raise bad_request(f"{where}.content must be a string or a list")
        elif role == "assistant" and kind in (None, "message"):
            assistant()["content"].extend(_output_parts(item, where))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}: a function_call requires a string {key!r}")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), (str, list)):
                raise bad_request(f"{where}: a function_call_output requires a string 'call_id' and an 'output'")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"], "content": _tool_output(item, where)})
        elif kind == "reasoning":
            # the text of the model's own reasoning (reasoning_text), else its summary
            text = _texts(item.get("content")) or _texts(item.get("summary"))
            if text:
                turn = assistant()
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        else:
            raise bad_request(f"{where}: cannot tell what the item is (type {kind!r}, role {role!r})")
    return msgs


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{i}] must be an object")
        if t.get("type") != "function":
            continue  # built-in tools (web search, file search, ...) run on OpenAI's side: none here
        fn = {k: v for k, v in t.items() if k != "type"}
        fn.setdefault("strict", True)
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> Any:
    # Responses names a forced function flat ({"type": "function", "name": ...})
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    raise bad_request(f"text.format.type must be text, json_schema or json_object, not {fmt['type']!r}")


def to_openai(body: Any) -> dict[str, Any]:
    """The chat request a Responses request stands for."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "input" not in body:
        raise bad_request("'input' is required")
    if body.get("previous_response_id"):
        raise bad_request("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items()
            if k not in ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning",
                         "previous_response_id") + _IGNORED}
    chat["messages"] = _messages(body)
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if "tool_choice" in body and "tools" in chat:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    rf = _response_format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


# -- output items ---------------------------------------------------------------------


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": "",
            "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def usage(c: Completion) -> dict[str, Any]:
    st = c.stats
    n_out = st.n_predicted or len(c.tokens)
    return {"input_tokens": st.n_prompt, "output_tokens": n_out, "total_tokens": st.n_prompt + n_out,
            "input_tokens_details": {"cached_tokens": st.n_prompt_cached}}


def _response(resp_id: str, model: str, created: int, status: str, output: list[dict[str, Any]],
              c: Completion | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": resp_id, "object": "response", "created_at": created, "status": status,
                           "model": model, "output": output}
    if c is not None:
        out["completed_at"] = int(time.time())
        out["usage"] = usage(c)
    return out


def response_json(c: Completion, message: dict[str, Any], model: str, resp_id: str) -> dict[str, Any]:
    """The whole response: reasoning, message, then function-call items."""
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(F.random_id("rs_"), message["reasoning_content"], "completed"))
    if message.get("content"):
        output.append(_message_item(F.random_id("msg_"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    return _response(resp_id, model, int(time.time()), "completed", output, c)


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {F.dumps(data)}\n\n"


class Events:
    """The Responses stream of one response: response.created and .in_progress, then
    an output item at a time (output_item.added, its deltas, its ``*.done`` events,
    output_item.done), then response.completed with every item."""

    def __init__(self, model: str, resp_id: str) -> None:
        self.model, self.id = model, resp_id
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items, in order
        self.open: dict[str, Any] | None = None  # the item being written, as output_item.added showed it
        self.acc = ""  # its text (reasoning, message) or arguments (a call) so far
        self.started = False
        #: the timings so far, put on the text's delta events (timings_per_token); the
        #: caller sets them, and the completed event then carries the final ones
        self.timings: dict[str, Any] | None = None

    def _sse(self, event: str, data: dict[str, Any]) -> str:
        out = sse(event, {"type": event, **data, "sequence_number": self.seq})
        self.seq += 1
        return out

    def start(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        head = _response(self.id, self.model, self.created, "in_progress", [], None)
        return [self._sse("response.created", {"response": head}),
                self._sse("response.in_progress", {"response": head})]

    def progress(self, p: dict[str, int]) -> list[str]:
        """A prompt-progress report (return_progress), on a response.in_progress event as
        llama-server sends it."""
        out = self.start()
        head = _response(self.id, self.model, self.created, "in_progress", [], None)
        out.append(self._sse("response.in_progress", {"response": head, "prompt_progress": p}))
        return out

    def _timed(self, data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "timings": self.timings} if self.timings is not None else data

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _begin(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.open, self.acc = item, ""
        out.append(self._sse("response.output_item.added", {"output_index": len(self.items), "item": item}))
        if item["type"] == "message":
            out.append(self._sse("response.content_part.added",
                                 {**self._where(), "content_index": 0, "part": _text_part("")}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        where, item, text = self._where(), self.open, self.acc
        self.open = None
        out = []
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text, "completed")
            out.append(self._sse("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
        elif item["type"] == "message":
            done = _message_item(item["id"], text, "completed")
            out.append(self._sse("response.output_text.done", {**where, "content_index": 0, "text": text}))
            out.append(self._sse("response.content_part.done", {**where, "content_index": 0, "part": _text_part(text)}))
        else:
            done = _call_item(item["call_id"], item["name"], text, "completed")
            out.append(self._sse("response.function_call_arguments.done", {**where, "arguments": text}))
        out.append(self._sse("response.output_item.done", {"output_index": len(self.items), "item": done}))
        self.items.append(done)
        return out

    def feed(self, d: Delta) -> list[str]:
        out = self.start()
        if d.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._begin(_reasoning_item(F.random_id("rs_"), "", "in_progress"))
            self.acc += d.reasoning
            out.append(self._sse("response.reasoning_text.delta",
                                 self._timed({**self._where(), "content_index": 0, "delta": d.reasoning})))
        if d.content:
            if self.open is None or self.open["type"] != "message":
                out += self._begin(_message_item(F.random_id("msg_"), None, "in_progress"))
            self.acc += d.content
            out.append(self._sse("response.output_text.delta",
                                 self._timed({**self._where(), "content_index": 0, "delta": d.content})))
        for c in d.tool_calls:
            if c.id is not None:
                out += self._begin(_call_item(c.id, c.name or "", "", "in_progress"))
            if c.arguments and self.open is not None and self.open["type"] == "function_call":
                self.acc += c.arguments
                out.append(self._sse("response.function_call_arguments.delta", {**self._where(), "delta": c.arguments}))
        return out

    def finish(self, c: Completion, message: dict[str, Any] | None = None) -> list[str]:
        # ``message`` (the parsed whole) is not needed: the items were built from the deltas
        out = self.start() + self._close()
        done = _response(self.id, self.model, self.created, "completed", self.items, c)
        data: dict[str, Any] = {"response": done}
        if self.timings is not None:
            data["timings"] = F.timings(c.stats, F.n_decoded(c))
        out.append(self._sse("response.completed", data))
        return out
