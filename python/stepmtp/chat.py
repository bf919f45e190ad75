"""Chat templates: the GGUF's jinja template rendered as the ecosystem does
(a sandboxed jinja2 environment, ``raise_exception``, ``strftime_now``)."""
from __future__ import annotations

import datetime
from functools import lru_cache
from typing import Any, Sequence

from .llama import Model

__all__ = ["render_chat", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template is missing, invalid, or refused the messages."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):  # noqa: ANN202 - a jinja2 Template
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


def render_chat(model: Model, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
                template: str | None = None, **kwargs: Any) -> str:
    """The prompt text for ``messages`` ([{"role": ..., "content": ...}, ...])."""
    from jinja2 import TemplateError

    source = template or model.chat_template
    if not source:
        raise ChatTemplateError(f"{model.path.name} has no chat template (tokenizer.chat_template)")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError("each message needs a 'role'")
    bos = model.token_to_piece(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_to_piece(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    try:
        return _compile(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                       bos_token=bos, eos_token=eos, **kwargs)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
