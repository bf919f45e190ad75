"""A chat request's prompt: its tools, tool_choice, prefill and reasoning settings
checked and turned into the template's variables, its messages rendered by the chat
template (in the server's sandbox, or right here in the process) (``chat_prompt``), and
how to read the model's text back (``ChatFormat``). Client errors are llama-server's 400s.

Rendering waits for the sandbox's worker process: the server calls this off its event loop.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..budget import ReasoningBudget
from ..chat import render_builtin, render_chat as render_chat_text, template_caps, template_source
from ..chat.step_format import REASONING_FORMATS
from .chat import ChatFormat, is_step_template, normalize_messages, tool_call_grammar
from .defaults import RequestDefaults
from .errors import bad_request

if TYPE_CHECKING:
    from ..chat.sandbox import TemplateSandbox
    from ..llama import Model
    from .schemas import ChatCompletionRequest, ChatMessage

__all__ = ["chat_prompt", "render_messages"]


def chat_prompt(model: Model, req: ChatCompletionRequest, cfg: RequestDefaults, templates: TemplateSandbox | None,
                preserved: frozenset[int]) -> tuple[ChatFormat, str]:
    """The prompt for a chat request, and how to read its output back."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice must be auto, none, required or a function, not {choice!r}")
    if req.tools is not None and not isinstance(req.tools, list):
        raise bad_request("'tools' must be a list")
    for i, t in enumerate(req.tools or []):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    # the template sees each tool as llama-server passes it: name, description and
    # parameters alone, in that order (a client's "strict" or key order would
    # otherwise change the prompt)
    tools = [{"type": "function", "function": {"name": t["function"]["name"],
                                               "description": t["function"].get("description", ""),
                                               "parameters": t["function"].get("parameters", {})}}
             for t in req.tools] if req.tools and choice != "none" else None
    forced: str | None = None  # the grammar of the call(s) tool_choice demands
    if choice not in ("auto", "none"):
        if not tools:
            raise bad_request("tool_choice 'required' or a function needs 'tools'")
        if isinstance(choice, dict):
            fn = choice.get("function") if isinstance(choice.get("function"), dict) else {}
            if not fn.get("name"):
                raise bad_request("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
            forced = tool_call_grammar(tools, fn["name"], parallel=False)
        else:
            # llama-server: parallel_tool_calls is off unless asked for
            forced = tool_call_grammar(tools, parallel=req.parallel_tool_calls is True)
    variables: dict[str, Any] = {}
    if tools:
        variables["tools"] = tools
    if req.reasoning_effort is not None:
        variables["reasoning_effort"] = req.reasoning_effort
    variables.update(req.chat_template_kwargs or {})
    msgs = req.messages
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise bad_request("Cannot set both add_generation_prompt and continue_final_message")
    if len(msgs) >= 2 and msgs[-1].role == "assistant" and msgs[-2].role == "assistant":
        raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
    # a last assistant message is a prefill (llama-server): the answer continues it
    # (--no-prefill-assistant: a whole message, the answer a new one)
    try:
        prefill = msgs[-1].text("\n\n") if cfg.prefill_assistant and msgs and msgs[-1].role == "assistant" and not (
            msgs[-1].model_extra or {}).get("tool_calls") else None
    except ValueError as e:
        raise bad_request(str(e)) from None
    text = render_messages(model, msgs, req.add_generation_prompt and prefill is None, variables, cfg, templates,
                                 last_content=prefill)
    if prefill:
        cut = text.rfind(prefill)
        if cut >= 0:
            text = text[: cut + len(prefill)]
    rf = req.reasoning_format or cfg.reasoning_format
    if rf not in REASONING_FORMATS:
        raise bad_request(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {rf!r}")
    thinking = req.add_generation_prompt and prefill is None and text.rstrip().endswith("<think>")
    try:
        constrained = forced is not None or req.requested_grammar() is not None
    except ValueError as e:
        raise bad_request(str(e)) from None
    # llama-server: a request's thinking_budget_tokens, else --reasoning-budget
    budget = req.thinking_budget_tokens
    if budget is None or budget == -1:
        budget = cfg.reasoning_budget
    # no thinking when asked, and none under a grammar: the format is the answer, in content
    if thinking and (budget == 0 or constrained):
        # no thinking: the think block the template opened is closed right away
        text += "\n</think>\n" if not text.endswith("\n") else "</think>\n"
        thinking = False
    source = template_source(model, cfg.chat_template_source())
    step = is_step_template(source)
    # llama-server's reasoning_control: a budget (none, -1, unless one is set) whose
    # think block a /v1/chat/completions/control request can end
    control = threading.Event() if req.reasoning_control else None
    thinks = (budget > 0 or control is not None) and (thinking or step) and not constrained
    # --skip-chat-parsing: llama-server's pure content parser, the output all in content
    fmt = ChatFormat(step=step, thinking=thinking, reasoning_format="none" if cfg.skip_chat_parsing else rf,
                     tools=tools, parse_tools=bool(tools) and not cfg.skip_chat_parsing, preserved=preserved,
                     grammar=forced,
                     reasoning_budget=ReasoningBudget(budget, cfg.reasoning_budget_message, control=control)
                     if thinks else None)
    return fmt, text


def render_messages(model: Model, messages: list[ChatMessage], add_generation_prompt: bool,
                    kwargs: dict[str, Any] | None, cfg: RequestDefaults, templates: TemplateSandbox | None,
                    last_content: str | None = None) -> str:
    _check_messages(messages)
    source = cfg.chat_template_source()
    # llama.cpp's workarounds, by what the template reads (probed once per template);
    # its built-in templates (--no-jinja) take the messages as they are
    caps = template_caps(model, source, sandbox=templates) if cfg.use_jinja else None
    try:
        msgs = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in messages]
        if last_content is not None:  # a prefill, its parts joined as llama.cpp does
            msgs[-1]["content"] = last_content
        msgs = normalize_messages(msgs, caps, template_source(model, source) if caps is not None else "")
    except ValueError as e:
        raise bad_request(str(e)) from None
    variables = {**cfg.chat_template_kwargs, **(kwargs or {})}
    try:
        if not cfg.use_jinja:
            return render_builtin(model, msgs, add_generation_prompt, cfg.chat_template)
        return render_chat_text(model, msgs, add_generation_prompt=add_generation_prompt, template=source,
                                variables=variables, sandbox=templates)
    except (ValueError, TypeError) as e:  # ChatTemplateError is a ValueError
        raise bad_request(f"chat template: {e}") from None


def _check_messages(messages: list[ChatMessage]) -> None:
    """llama-server's checks on ``messages``."""
    for i, m in enumerate(messages):
        fields = m.model_fields_set | set(m.model_extra or {})
        if m.role != "assistant" and "content" not in fields:
            raise bad_request(f"messages[{i}]: all non-assistant messages must contain 'content'")
        if m.role == "assistant" and "content" not in fields and "tool_calls" not in fields:
            raise bad_request(f"messages[{i}]: assistant message must contain either 'content' or 'tool_calls'")

