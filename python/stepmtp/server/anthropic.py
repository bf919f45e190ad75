"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
as llama-server serves it: the request becomes an OpenAI chat request (system
prompt, text, ``tool_use`` / ``tool_result`` and ``thinking`` blocks, tools,
tool_choice), the answer comes back as content blocks (thinking, text, tool_use),
streamed as Anthropic's events in their order.
"""
from __future__ import annotations

import json
from typing import Any

from ..chat.step_format import Delta
from ..engine import Completion
from ..api.errors import bad_request

__all__ = ["to_openai", "message_json", "Events"]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b["text"] for b in content
                       if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))
    return ""


_BILLING = "x-anthropic-billing-header:"


def _steady_billing_header(text: str) -> str:
    """Claude Code opens its system prompt with a billing header whose ``cch=XXXXX;``
    stamp changes with every request: left as it is, no request shares a cached prefix
    past it and every turn re-reads the whole conversation. As llama-server does, the
    stamp reads ``fffff`` for the model (the header is nothing the model needs)."""
    if not text.startswith(_BILLING):
        return text
    i = text.find("cch=", len(_BILLING))
    if i < 0:
        return text
    j = i + len("cch=")
    if j + 5 < len(text) and text[j + 5] == ";":
        return text[:j] + "fffff" + text[j + 5:]
    return text


def to_openai(body: Any) -> dict[str, Any]:
    """The OpenAI chat request an Anthropic Messages request stands for."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "messages" not in body:
        raise bad_request("'messages' is required")
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _steady_billing_header(_text_of(system))})
    if not isinstance(body["messages"], list):
        raise bad_request("'messages' must be a list")
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if not isinstance(content, list):
            if content is not None or m["role"] != "assistant":
                msgs.append({"role": m["role"], "content": content if content is not None else ""})
            continue
        text, calls, results, thinking = [], [], [], ""
        for b in content:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append({"type": "text", "text": str(b.get("text", ""))})
            elif kind == "thinking":
                thinking += str(b.get("thinking", ""))
            elif kind == "tool_use":
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": str(b.get("name", "")),
                                           # compact, as llama-server writes it
                                           "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False,
                                                                   separators=(",", ":"))}})
            elif kind == "tool_result":
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": _text_of(b.get("content"))})
            else:
                raise bad_request(f"messages[{i}]: content blocks of type {kind!r} are not supported")
        if text or calls or thinking:
            out: dict[str, Any] = {"role": m["role"], "content": text if text else ""}
            if calls:
                out["tool_calls"] = calls
            if thinking:
                out["reasoning_content"] = thinking
            msgs.append(out)
        msgs.extend(results)
    oai: dict[str, Any] = {"messages": msgs, "max_tokens": body.get("max_tokens", 4096)}
    tools = body.get("tools")
    if isinstance(tools, list):
        oai["tools"] = [{"type": "function", "function": {"name": t.get("name", ""),
                                                          "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema") or {}}}
                        for t in tools if isinstance(t, dict)]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind == "auto":
            oai["tool_choice"] = "auto"
        elif kind == "any":
            oai["tool_choice"] = "required"
        elif kind == "tool":
            oai["tool_choice"] = {"type": "function", "function": {"name": tc.get("name", "")}}
        elif kind == "none":
            oai["tool_choice"] = "none"
    if "stop_sequences" in body:
        oai["stop"] = body["stop_sequences"]
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs", "seed"):
        if key in body:
            oai[key] = body[key]
    # extended thinking's budget: llama-server's reasoning budget (10000 when not given)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens", 10000)
        oai["thinking_budget_tokens"] = budget
    return oai


def stop_reason(c: Completion, message: dict[str, Any]) -> str:
    if c.stop_type in ("eos", "word"):
        return "tool_use" if message.get("tool_calls") else "end_turn"
    return "max_tokens"


def usage(c: Completion) -> dict[str, int]:
    st = c.stats
    return {"cache_read_input_tokens": st.n_prompt_cached, "input_tokens": st.n_prompt - st.n_prompt_cached,
            "output_tokens": c.stats.n_predicted or len(c.tokens)}


def message_json(c: Completion, message: dict[str, Any], model: str, msg_id: str) -> dict[str, Any]:
    """to_json_anthropic(): thinking, text, then tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args})
    return {"id": msg_id, "type": "message", "role": "assistant", "content": blocks, "model": model,
            "stop_reason": stop_reason(c, message),
            "stop_sequence": c.stopping_word or None, "usage": usage(c)}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Events:
    """Anthropic's stream for one message: message_start, then a block at a time
    (content_block_start, deltas, content_block_stop), message_delta, message_stop."""

    def __init__(self, model: str, msg_id: str, n_prompt: int) -> None:
        self.model, self.id, self.n_prompt = model, msg_id, n_prompt
        self.index = -1
        self.open: str | None = None  # the kind of the block being written, or the call's id
        self.started = False

    def start(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        return [sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}})]

    def _block(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        # a local model signs nothing: an empty signature, as in the whole message
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, d: Delta) -> list[str]:
        out = self.start()
        if d.reasoning:
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.tool_calls:
            if c.id is not None:
                out += self._block("tool:" + c.id, {"type": "tool_use", "id": c.id, "name": c.name or "",
                                                    "input": {}})
            if c.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def finish(self, c: Completion, message: dict[str, Any]) -> list[str]:
        out = self.start() + self._close()
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason(c, message),
                                                   "stop_sequence": c.stopping_word or None},
                                         "usage": {"output_tokens": usage(c)["output_tokens"]}}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out
