"""The chat templates' error, raised by the renderer in this process and by the
sandbox (its own module: the package imports the sandbox, the sandbox the error)."""
from __future__ import annotations

__all__ = ["ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template is missing, invalid, refused the messages or went past a bound."""
